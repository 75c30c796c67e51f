//! One run's metrics: the replicas' own counters and the client's measurements, summarised.

use std::time::Duration;

use serde::Serialize;

use super::replay::RequestOutcome;
use crate::replica_counters::ReplicaCounters;
use crate::stats::percentile;

/// Everything the report shows about one (workload, load, fleet, policy) run.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Workload name.
    pub workload: String,
    /// Load point label (`4 req/s`, `trace`).
    pub load: String,
    /// Offered rate, requests per model second.
    pub offered_rate: f64,
    /// Replicas.
    pub replicas: usize,
    /// KV blocks per replica.
    pub gpu_blocks: usize,
    /// Policy name.
    pub policy: String,
    /// Requests in the workload.
    pub requests: usize,
    /// Requests that failed or were not sent.
    pub errors: usize,
    /// First error message, if any.
    pub first_error: Option<String>,
    /// Prefix-cache hit rate from the replicas' counters (hit tokens / queried tokens).
    pub hit_rate: f64,
    /// Single-replica infinite-cache bound for the workload.
    pub ceiling: f64,
    /// Hit rate from the responses' `cached_tokens` (cross-check of the counters).
    pub hit_rate_from_usage: f64,
    /// TTFT percentiles, model ms (engine TTFT + measured proxy overhead).
    pub ttft_p50_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    pub ttft_p90_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: Option<f64>,
    /// Mean inter-token latency per request, p50 over requests, model ms.
    pub itl_p50_ms: Option<f64>,
    /// Same, p90.
    pub itl_p90_ms: Option<f64>,
    /// Output tokens per model second (all replicas).
    pub output_tokens_per_s: f64,
    /// Requests per model second that met the TTFT SLO.
    pub goodput_rps: f64,
    /// Fraction of requests that met the TTFT SLO (failed requests count as missed).
    pub slo_attainment: f64,
    /// The TTFT SLO, model ms.
    pub slo_ms: f64,
    /// Busiest replica's prompt tokens over the mean (1.0 = perfectly even).
    pub imbalance: f64,
    /// Requests served per replica.
    pub per_replica_requests: Vec<u64>,
    /// Preemptions over all replicas.
    pub preemptions: u64,
    /// Median overhead outside the engine (client, Envoy, filter, indexer, HTTP), wall ms.
    pub overhead_p50_wall_ms: Option<f64>,
    /// Largest delay between a request's arrival time and its sending, wall ms.
    pub max_send_lag_ms: f64,
    /// Wall time of the replay, s.
    pub wall_s: f64,
    /// The router's CPU (Envoy + indexer, user + system) per 1,000 requests and peak memory,
    /// sampled from `/proc` around the replay; `None` when not sampled.
    pub router_cost: Option<crate::router_usage::RouterCost>,
    /// Prompt tokens each replica computed (queried minus hit): its prefill work.
    pub per_replica_computed: Vec<u64>,
    /// Each replica's share of requests and prefill work against its share of capacity, when
    /// the fleet's speeds were given (`--replica-speeds`).
    pub replica_shares: Option<Vec<super::fleet::ReplicaShare>>,
    /// The workload's ideal TTFT bound (same for every policy).
    pub ideal: Option<super::ideal::IdealBound>,
    /// The same bound with the fleet's real KV capacity as one LRU cache
    /// ([`super::policies::fleet_cache_hits`]): what no router beats on this fleet.
    #[serde(default)]
    pub ideal_fleet_kv: Option<super::ideal::IdealBound>,
    /// The greedy oracle's TTFTs on the fleet's separate caches ([`super::oracle`]; none with
    /// a replica joining late).
    #[serde(default)]
    pub greedy_oracle: Option<super::oracle::GreedyOracle>,
    /// The late replica's uptake (`--scale-out-at`).
    pub scale_out: Option<super::scaleout::ScaleOut>,
    /// What `kvroute-indexer assess` reported over the run (the `shadow` line only).
    pub assess: Option<super::assess::AssessFigures>,
    /// The gateways of a line run behind more than one (`--gateways`); absent for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateways: Option<super::gateways::GatewayFacts>,
    /// The indexer's hit predictions against the engines' `cached_tokens` (lines routed by the
    /// indexer).
    #[serde(default)]
    pub hit_prediction: Option<super::prediction::HitPrediction>,
    /// Decisions per reason (lines routed by the indexer; every gateway's summed).
    #[serde(default)]
    pub decisions: Option<super::decision_counts::DecisionCounts>,
}

/// Inputs of [`RunSummary::new`] besides the outcomes.
#[derive(Debug, Clone)]
pub struct RunContext {
    /// Workload name.
    pub workload: String,
    /// Load label.
    pub load: String,
    /// Offered rate.
    pub offered_rate: f64,
    /// Replicas.
    pub replicas: usize,
    /// KV blocks per replica.
    pub gpu_blocks: usize,
    /// Policy name.
    pub policy: String,
    /// Ceiling hit rate.
    pub ceiling: f64,
    /// Simulator time scale.
    pub time_scale: f64,
    /// TTFT SLO, model ms.
    pub slo_ms: f64,
}

impl RunSummary {
    /// Summarises a run from the request outcomes and per-replica counter deltas.
    pub fn new(
        ctx: &RunContext,
        outcomes: &[RequestOutcome],
        wall: Duration,
        replicas: &[ReplicaCounters],
    ) -> Self {
        let scale = ctx.time_scale;
        let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let sorted = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v
        };
        let ttfts = sorted(ok.iter().filter_map(|o| o.ttft_model_ms(scale)).collect());
        let itls = sorted(ok.iter().filter_map(|o| o.itl_model_ms(scale)).collect());
        let overheads = sorted(
            ok.iter()
                .filter_map(|o| Some(o.ttft_wall_ms? - o.engine_ttft_model_ms? / scale))
                .collect(),
        );
        let model_s = wall.as_secs_f64() * scale;
        let per_second = |n: f64| if model_s > 0.0 { n / model_s } else { 0.0 };
        let output: u64 = ok.iter().map(|o| o.output_tokens).sum();
        let met = ok
            .iter()
            .filter(|o| o.ttft_model_ms(scale).is_some_and(|t| t <= ctx.slo_ms))
            .count();
        let queries: f64 = replicas.iter().map(|r| r.queries).sum();
        let hits: f64 = replicas.iter().map(|r| r.hits).sum();
        let usage_prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let usage_cached: u64 = ok.iter().filter_map(|o| o.cached_tokens).sum();
        let mean_queries = queries / replicas.len().max(1) as f64;
        let busiest = replicas.iter().map(|r| r.queries).fold(0.0, f64::max);
        Self {
            workload: ctx.workload.clone(),
            load: ctx.load.clone(),
            offered_rate: ctx.offered_rate,
            replicas: ctx.replicas,
            gpu_blocks: ctx.gpu_blocks,
            policy: ctx.policy.clone(),
            requests: outcomes.len(),
            errors: outcomes.len() - ok.len(),
            first_error: outcomes.iter().find_map(|o| o.error.clone()),
            hit_rate: if queries > 0.0 { hits / queries } else { 0.0 },
            ceiling: ctx.ceiling,
            hit_rate_from_usage: if usage_prompt > 0 {
                usage_cached as f64 / usage_prompt as f64
            } else {
                0.0
            },
            ttft_p50_ms: percentile(&ttfts, 50.0),
            ttft_p90_ms: percentile(&ttfts, 90.0),
            ttft_p99_ms: percentile(&ttfts, 99.0),
            itl_p50_ms: percentile(&itls, 50.0),
            itl_p90_ms: percentile(&itls, 90.0),
            output_tokens_per_s: per_second(output as f64),
            goodput_rps: per_second(met as f64),
            slo_attainment: if outcomes.is_empty() {
                0.0
            } else {
                met as f64 / outcomes.len() as f64
            },
            slo_ms: ctx.slo_ms,
            imbalance: if mean_queries > 0.0 {
                busiest / mean_queries
            } else {
                0.0
            },
            per_replica_requests: replicas.iter().map(|r| r.requests as u64).collect(),
            preemptions: replicas.iter().map(|r| r.preemptions as u64).sum(),
            overhead_p50_wall_ms: percentile(&overheads, 50.0),
            max_send_lag_ms: outcomes.iter().map(|o| o.send_lag_ms).fold(0.0, f64::max),
            wall_s: wall.as_secs_f64(),
            router_cost: None,
            per_replica_computed: replicas
                .iter()
                .map(|r| (r.queries - r.hits).max(0.0) as u64)
                .collect(),
            replica_shares: None,
            ideal: None,
            ideal_fleet_kv: None,
            greedy_oracle: None,
            scale_out: None,
            assess: None,
            gateways: None,
            hit_prediction: None,
            decisions: None,
        }
    }

    /// A run that could not happen (a process failed to start, ...).
    pub fn failed(ctx: &RunContext, requests: usize, error: String) -> Self {
        let mut s = Self::new(ctx, &[], Duration::ZERO, &[]);
        s.requests = requests;
        s.errors = requests;
        s.first_error = Some(error);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> RunContext {
        RunContext {
            workload: "w".into(),
            load: "trace".into(),
            offered_rate: 1.0,
            replicas: 2,
            gpu_blocks: 100,
            policy: "kv".into(),
            ceiling: 0.5,
            time_scale: 10.0,
            slo_ms: 500.0,
        }
    }

    #[test]
    fn summary_uses_counters_slo_and_model_time() {
        let ok = |ttft_wall: f64, engine: f64, cached: u64| RequestOutcome {
            ttft_wall_ms: Some(ttft_wall),
            engine_ttft_model_ms: Some(engine),
            itl_wall_ms: Some(1.0),
            output_tokens: 10,
            prompt_tokens: 100,
            cached_tokens: Some(cached),
            ..RequestOutcome::default()
        };
        let outcomes = vec![
            ok(12.0, 100.0, 50),  // 100 + 2 = 102 model ms
            ok(101.0, 1000.0, 0), // 1000 + 1 = 1001 model ms: misses the 500 ms SLO
            RequestOutcome {
                error: Some("HTTP 503".into()),
                ..RequestOutcome::default()
            },
        ];
        let replicas = [
            ReplicaCounters {
                queries: 150.0,
                hits: 50.0,
                requests: 2.0,
                preemptions: 0.0,
            },
            ReplicaCounters {
                queries: 50.0,
                hits: 0.0,
                requests: 0.0,
                preemptions: 0.0,
            },
        ];
        let s = RunSummary::new(&ctx(), &outcomes, Duration::from_secs(2), &replicas);
        assert_eq!((s.requests, s.errors), (3, 1));
        assert_eq!(s.first_error.as_deref(), Some("HTTP 503"));
        assert_eq!(s.hit_rate, 0.25);
        assert_eq!(s.hit_rate_from_usage, 0.25);
        assert_eq!(s.ttft_p50_ms, Some(551.5));
        assert_eq!(s.itl_p50_ms, Some(10.0));
        // 20 output tokens over 2 wall s = 20 model s.
        assert_eq!(s.output_tokens_per_s, 1.0);
        assert_eq!(s.goodput_rps, 0.05);
        assert!((s.slo_attainment - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.imbalance, 1.5);
        assert_eq!(s.per_replica_requests, [2, 0]);
        assert_eq!(s.per_replica_computed, [100, 50]);
        assert_eq!(s.overhead_p50_wall_ms, Some(1.5));
    }
}
