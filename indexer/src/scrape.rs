//! Scrapes every replica's Prometheus `/metrics` at a fixed interval for its queue, running
//! requests and KV usage (scoring inputs), for the counters and histograms that calibrate its
//! rates (`kvroute_core::calibration`), and for `process_start_time_seconds`: a change means
//! the engine restarted, which sequence numbers alone cannot always tell (a new engine's seq can
//! pass the old one's), so that replica's entries are dropped and its streams resynchronised.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::calibration::{EngineTotals, RatePool, ReplicaCalibration};
use kvroute_core::prometheus;

pub use crate::membership::EngineReuse;
use crate::membership::{lock, Replica};
use crate::state::AppState;

/// The values kvroute reads from an engine's `/metrics`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct EngineMetrics {
    /// Sum of `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// Sum of `vllm:num_requests_running`.
    pub running: f64,
    /// Max of `vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`).
    pub kv_usage: f64,
    /// `process_start_time_seconds`.
    pub process_start: Option<f64>,
    /// Running + waiting per `engine` label (vLLM labels each data-parallel engine by its rank).
    pub busy_by_engine: std::collections::BTreeMap<u32, f64>,
    /// Calibration inputs, summed over engines.
    pub totals: EngineTotals,
    /// Prefix-cache and preemption counters, summed over engines.
    pub reuse: EngineReuse,
}

/// The engine series [`parse_metrics`] reads.
#[derive(Debug, Clone, Copy)]
enum Series {
    Waiting,
    Running,
    KvUsage,
    ProcessStart,
    PrefillTokens,
    PrefillTimeSum,
    PrefillTimeCount,
    CacheHits,
    CacheQueries,
    Preemptions,
    ItlSum,
    ItlCount,
    CacheConfig,
}

impl Series {
    /// The series a sample named `name` belongs to, `None` for the many kvroute does not read
    /// (their lines are then skipped before their value is parsed).
    fn named(name: &str) -> Option<Self> {
        Some(match name {
            "vllm:num_requests_waiting" => Self::Waiting,
            "vllm:num_requests_running" => Self::Running,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => Self::KvUsage,
            "process_start_time_seconds" => Self::ProcessStart,
            "vllm:request_prefill_kv_computed_tokens_sum" => Self::PrefillTokens,
            "vllm:request_prefill_time_seconds_sum" => Self::PrefillTimeSum,
            "vllm:request_prefill_time_seconds_count" => Self::PrefillTimeCount,
            "vllm:prefix_cache_hits_total" => Self::CacheHits,
            "vllm:prefix_cache_queries_total" => Self::CacheQueries,
            "vllm:num_preemptions_total" => Self::Preemptions,
            "vllm:inter_token_latency_seconds_sum" => Self::ItlSum,
            "vllm:inter_token_latency_seconds_count" => Self::ItlCount,
            "vllm:cache_config_info" => Self::CacheConfig,
            _ => return None,
        })
    }
}

/// Parses Prometheus text exposition (only the series kvroute needs).
pub fn parse_metrics(text: &str) -> EngineMetrics {
    let mut m = EngineMetrics::default();
    let mut prefill_engines = std::collections::BTreeSet::new();
    for (series, sample) in prometheus::picked(text, Series::named) {
        let (labels, value) = (sample.labels, sample.value);
        if !value.is_finite() {
            continue;
        }
        match series {
            Series::Waiting | Series::Running => {
                if matches!(series, Series::Waiting) {
                    m.waiting += value;
                } else {
                    m.running += value;
                }
                if let Some(engine) = engine_label(labels) {
                    *m.busy_by_engine.entry(engine).or_default() += value;
                }
            }
            Series::KvUsage => m.kv_usage = m.kv_usage.max(value),
            Series::ProcessStart => {
                m.process_start = Some(m.process_start.map_or(value, |p: f64| p.min(value)))
            }
            Series::PrefillTokens => m.totals.prefill_tokens += value,
            Series::PrefillTimeSum => {
                m.totals.prefill_time_s += value;
                prefill_engines.insert(engine_label(labels));
            }
            Series::PrefillTimeCount => m.totals.prefills += value,
            Series::CacheHits => m.reuse.cache_hit_tokens += value,
            Series::CacheQueries => m.reuse.cache_query_tokens += value,
            Series::Preemptions => m.reuse.preemptions += value,
            Series::ItlSum => m.totals.itl_sum_s += value,
            Series::ItlCount => m.totals.itl_count += value,
            Series::CacheConfig => {
                if let Some(blocks) =
                    prometheus::label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok())
                {
                    m.totals.kv_capacity_blocks = Some(blocks);
                }
            }
        }
    }
    m.totals.engines = u32::try_from(prefill_engines.len()).unwrap_or(u32::MAX);
    m
}

/// The value of an `engine="N"` label, if present and numeric.
fn engine_label(labels: &str) -> Option<u32> {
    prometheus::label(labels, "engine")?.parse().ok()
}

/// Runs forever: scrapes every replica every `scrape_interval_ms`.
pub async fn run(state: Arc<AppState>) {
    let interval_ms = state.config.scrape_interval_ms;
    if interval_ms == 0 {
        return;
    }
    let interval = Duration::from_millis(interval_ms);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let replicas = state.fleet.all();
        let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(2));
        let futs = replicas
            .into_iter()
            .map(|r| scrape_one(state.clone(), r, timeout));
        futures::future::join_all(futs).await;
    }
}

async fn scrape_one(state: Arc<AppState>, replica: Arc<Replica>, timeout: Duration) {
    let http = replica
        .config
        .read()
        .map(|c| c.http.clone())
        .unwrap_or_default();
    let url = format!("http://{http}/metrics");
    let result = async {
        let resp = state.http.get(&url).timeout(timeout).send().await?;
        let resp = resp.error_for_status()?;
        resp.bytes().await
    }
    .await;
    match result {
        Ok(body) => {
            // Engines send UTF-8: validated in one pass, copied only if it is not.
            let m = match std::str::from_utf8(&body) {
                Ok(text) => parse_metrics(text),
                Err(_) => parse_metrics(&String::from_utf8_lossy(&body)),
            };
            let now = Instant::now();
            let restarted = {
                let mut s = lock(&replica.scraped);
                let restarted = matches!((s.process_start, m.process_start), (Some(a), Some(b)) if (a - b).abs() > 0.5);
                let elapsed = s
                    .last_ok
                    .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
                calibrate(&state, &replica, &m.totals, elapsed, restarted);
                s.totals = m.totals;
                s.reuse = m.reuse;
                s.waiting = m.waiting;
                s.running = m.running;
                s.kv_usage = m.kv_usage;
                s.busy_by_engine = m.busy_by_engine;
                if m.process_start.is_some() {
                    s.process_start = m.process_start;
                }
                s.last_ok = Some(now);
                s.failures = 0;
                restarted
            };
            if restarted {
                state
                    .metrics
                    .restarts_detected
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(replica = %replica.name, "engine restart detected (process_start_time_seconds changed); resynchronising its streams");
                for s in &replica.streams() {
                    s.resync.store(true, Ordering::Relaxed);
                }
            }
        }
        Err(e) => {
            state
                .metrics
                .scrape_failures
                .fetch_add(1, Ordering::Relaxed);
            let failures = {
                let mut s = lock(&replica.scraped);
                s.failures = s.failures.saturating_add(1);
                s.failures
            };
            if failures == crate::membership::UNHEALTHY_AFTER_FAILURES {
                tracing::warn!(replica = %replica.name, %url, error = %e, "replica metrics unreachable; marked unhealthy");
            }
        }
    }
}

/// Feeds one scrape to the replica's calibration (a restart starts it again from the priors),
/// then sums its model's replicas again (the prior of each one's rates).
fn calibrate(
    state: &AppState,
    replica: &Replica,
    totals: &EngineTotals,
    elapsed_s: f64,
    restarted: bool,
) {
    let cfg = &state.config.calibration;
    {
        let mut cal = lock(&replica.calibration);
        let cal =
            cal.get_or_insert_with(|| ReplicaCalibration::new(state.config.scoring.prior_rates()));
        if restarted {
            cal.reset();
        }
        cal.observe(cfg, totals, elapsed_s);
    }
    let Some(model) = state.models.get(&replica.model) else {
        return;
    };
    // One calibration lock at a time: a scrape of a sibling may hold its own.
    let mut pool = RatePool::default();
    for r in state.fleet.of_model(&replica.model) {
        if let Some(c) = lock(&r.calibration).as_ref() {
            pool.add(cfg, c);
        }
    }
    *lock(&model.rates) = pool;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_metrics_with_labels_and_sums_engines() {
        let text = r#"
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen3"} 3.0
vllm:num_requests_waiting{engine="1",model_name="qwen3"} 2.0
vllm:num_requests_running{engine="0",model_name="qwen3"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen3"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="qwen3"} 0.5
process_start_time_seconds 1.7e+09
vllm:num_requests_waiting_bogus 99
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="qwen3"} 3700.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="qwen3"} 4.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="qwen3"} 0.125
vllm:request_prefill_time_seconds_count{engine="0",model_name="qwen3"} 4.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="qwen3"} 1.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="qwen3"} 200.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="32768"} 1.0
"#;
        let m = parse_metrics(text);
        assert_eq!(m.waiting, 5.0);
        assert_eq!(m.running, 7.0);
        assert_eq!(m.kv_usage, 0.5);
        assert_eq!(m.process_start, Some(1.7e9));
        assert_eq!(
            m.busy_by_engine.into_iter().collect::<Vec<_>>(),
            [(0, 10.0), (1, 2.0)]
        );
        assert_eq!(
            m.totals,
            EngineTotals {
                prefill_tokens: 3700.0,
                prefill_time_s: 0.125,
                prefills: 4.0,
                itl_sum_s: 1.5,
                itl_count: 200.0,
                kv_capacity_blocks: Some(32768),
                engines: 1,
            }
        );
    }

    #[test]
    fn garbage_is_ignored() {
        let m =
            parse_metrics("vllm:num_requests_running{ 1\nfoo bar\nvllm:num_requests_running NaN\n");
        assert_eq!(m, EngineMetrics::default());
    }
}
