//! The counters of one replica that a run is judged by, read from its Prometheus `/metrics`.

use anyhow::Result;
use serde::Serialize;

use crate::stats::metric_sum;

/// Counters of one replica, read from its Prometheus `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ReplicaCounters {
    /// `vllm:prefix_cache_queries` (prompt tokens looked up).
    pub queries: f64,
    /// `vllm:prefix_cache_hits` (prompt tokens found).
    pub hits: f64,
    /// `vllm:request_success` (finished requests).
    pub requests: f64,
    /// `vllm:num_preemptions`.
    pub preemptions: f64,
}

impl ReplicaCounters {
    /// Reads `GET http://addr/metrics`.
    pub fn scrape(addr: &str) -> Result<Self> {
        Ok(Self::parse(&kvroute_testkit::prom::metrics_text(addr)?))
    }

    /// From Prometheus text.
    pub fn parse(text: &str) -> Self {
        Self {
            queries: metric_sum(text, "vllm:prefix_cache_queries"),
            hits: metric_sum(text, "vllm:prefix_cache_hits"),
            requests: metric_sum(text, "vllm:request_success"),
            preemptions: metric_sum(text, "vllm:num_preemptions"),
        }
    }

    /// The increase since `before` (a restarted replica counts from zero).
    pub fn since(&self, before: &Self) -> Self {
        if self.queries < before.queries || self.requests < before.requests {
            return *self;
        }
        Self {
            queries: self.queries - before.queries,
            hits: self.hits - before.hits,
            requests: self.requests - before.requests,
            preemptions: (self.preemptions - before.preemptions).max(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse_and_subtract() {
        let text = "vllm:prefix_cache_queries_total{engine=\"0\"} 100\n\
                    vllm:prefix_cache_hits_total{engine=\"0\"} 40\n\
                    vllm:request_success_total{engine=\"0\",finished_reason=\"length\"} 3\n\
                    vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 2\n\
                    vllm:num_preemptions_total{engine=\"0\"} 1\n";
        let c = ReplicaCounters::parse(text);
        assert_eq!(
            c,
            ReplicaCounters {
                queries: 100.0,
                hits: 40.0,
                requests: 5.0,
                preemptions: 1.0
            }
        );
        let later = ReplicaCounters {
            queries: 150.0,
            hits: 50.0,
            requests: 6.0,
            preemptions: 1.0,
        };
        assert_eq!(later.since(&c).queries, 50.0);
        assert_eq!(c.since(&later), c, "restart: counts from zero");
    }
}
