//! Summaries of a run: latency percentiles, throughput, and the replicas' own prefix-cache
//! counters read from their Prometheus `/metrics`.

use std::time::Duration;

use serde::Serialize;

use crate::chat_traffic::RequestRecord;

pub use kvroute_testkit::prom::{counter_sum as metric_sum, CacheCounters};

/// The `p`-th percentile (0..=100) by linear interpolation between closest ranks.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let low = rank.floor() as usize;
    let high = rank.ceil() as usize;
    let weight = rank - low as f64;
    Some(sorted[low] * (1.0 - weight) + sorted[high] * weight)
}

/// One policy's results, as written to `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    /// Prefix-cache hit rate over all replicas (hit tokens / queried tokens).
    pub hit_rate: f64,
    /// Median time to first token, ms (client-side, streaming).
    pub ttft_p50_ms: Option<f64>,
    /// 90th percentile time to first token, ms.
    pub ttft_p90_ms: Option<f64>,
    /// Output tokens of successful requests per second of wall time.
    pub output_tokens_per_s: f64,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Wall time of the run, s.
    pub wall_s: f64,
}

impl PolicySummary {
    /// Summarises a run.
    pub fn new(records: &[RequestRecord], wall: Duration, cache: CacheCounters) -> Self {
        let mut ttfts: Vec<f64> = records
            .iter()
            .filter(|r| r.error.is_none())
            .filter_map(|r| r.ttft)
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let output: u64 = records
            .iter()
            .filter(|r| r.error.is_none())
            .map(|r| r.output_tokens)
            .sum();
        let wall_s = wall.as_secs_f64();
        Self {
            hit_rate: cache.hit_rate(),
            ttft_p50_ms: percentile(&ttfts, 50.0),
            ttft_p90_ms: percentile(&ttfts, 90.0),
            output_tokens_per_s: if wall_s > 0.0 {
                output as f64 / wall_s
            } else {
                0.0
            },
            requests: records.len(),
            errors: records.iter().filter(|r| r.error.is_some()).count(),
            wall_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let v = [10.0, 20.0, 30.0, 40.0, 50.0];
        assert_eq!(percentile(&v, 50.0), Some(30.0));
        assert_eq!(percentile(&v, 90.0), Some(46.0));
        assert_eq!(percentile(&v, 0.0), Some(10.0));
        assert_eq!(percentile(&v, 100.0), Some(50.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn counters_are_summed_over_labels_with_or_without_total() {
        let text = "# HELP vllm:prefix_cache_hits Prefix cache hits.\n\
                    # TYPE vllm:prefix_cache_hits counter\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"qwen3\"} 120.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"qwen3\"} 30\n\
                    vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n\
                    vllm:prefix_cache_queries 400\n";
        assert_eq!(metric_sum(text, "vllm:prefix_cache_hits"), 150.0);
        assert_eq!(metric_sum(text, "vllm:prefix_cache_queries"), 400.0);
        assert_eq!(metric_sum(text, "vllm:missing"), 0.0);
    }

    #[test]
    fn counter_deltas_handle_restarts() {
        let before = CacheCounters {
            queries: 100.0,
            hits: 50.0,
        };
        let after = CacheCounters {
            queries: 300.0,
            hits: 200.0,
        };
        assert_eq!(
            after.since(&before),
            CacheCounters {
                queries: 200.0,
                hits: 150.0
            }
        );
        assert_eq!(before.since(&after), before);
        assert_eq!(after.since(&before).hit_rate(), 0.75);
        assert_eq!(CacheCounters::default().hit_rate(), 0.0);
    }
}
