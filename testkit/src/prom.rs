//! The Prometheus metrics of running processes, read with kvroute-core's one parser: the sums
//! tests, xtask and the benchmark ask for, and the replicas' prefix-cache counters.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::http;

pub use kvroute_core::prometheus::{label, sample, samples, sum, Sample};

/// Sum of every sample of a counter, whatever its labels, named `name` or `name_total`; 0 when
/// absent.
pub fn counter_sum(text: &str, name: &str) -> f64 {
    let total = format!("{name}_total");
    samples(text)
        .filter(|s| s.name == name || s.name == total)
        .map(|s| s.value)
        .sum()
}

/// The value of the sample written exactly `series` (`name` or `name{labels}` as exposed).
pub fn series_value(text: &str, series: &str) -> Option<f64> {
    samples(text).find(|s| s.is_series(series)).map(|s| s.value)
}

/// The value of the first sample of `name` whose label list contains `part` (`replica="r1"`).
pub fn value_with_label(text: &str, name: &str, part: &str) -> Option<f64> {
    samples(text)
        .find(|s| s.name == name && s.labels.contains(part))
        .map(|s| s.value)
}

/// `GET http://addr/metrics` as text.
pub fn metrics_text(addr: &str) -> Result<String> {
    let (status, text) = http::get(addr, "/metrics", Duration::from_secs(5))
        .with_context(|| format!("scraping http://{addr}/metrics"))?;
    if status != 200 {
        bail!("http://{addr}/metrics answered HTTP {status}");
    }
    Ok(text)
}

/// The replicas' prefix-cache counters (vLLM's `vllm:prefix_cache_{queries,hits}_total`, in tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheCounters {
    /// Prompt tokens looked up in the prefix cache.
    pub queries: f64,
    /// Prompt tokens found there.
    pub hits: f64,
}

impl CacheCounters {
    /// Counters summed over replicas.
    pub fn sum(all: &[CacheCounters]) -> CacheCounters {
        all.iter()
            .fold(CacheCounters::default(), |acc, c| CacheCounters {
                queries: acc.queries + c.queries,
                hits: acc.hits + c.hits,
            })
    }

    /// The increase from `before` to `self` (a replica that restarted counts from zero).
    pub fn since(&self, before: &CacheCounters) -> CacheCounters {
        if self.queries < before.queries {
            return *self;
        }
        CacheCounters {
            queries: self.queries - before.queries,
            hits: self.hits - before.hits,
        }
    }

    /// hits / queries, or 0 when nothing was queried.
    pub fn hit_rate(&self) -> f64 {
        if self.queries > 0.0 {
            self.hits / self.queries
        } else {
            0.0
        }
    }

    /// Reads one replica's counters from `GET http://addr/metrics`.
    pub fn scrape(addr: &str) -> Result<CacheCounters> {
        let text = metrics_text(addr)?;
        Ok(CacheCounters {
            queries: counter_sum(&text, "vllm:prefix_cache_queries"),
            hits: counter_sum(&text, "vllm:prefix_cache_hits"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_summed_with_or_without_total() {
        let text = "a_total{x=\"1\"} 2\na_total{x=\"2\"} 3\na 1\nab_total 9\n";
        assert_eq!(counter_sum(text, "a"), 6.0);
        assert_eq!(series_value(text, "a_total{x=\"2\"}"), Some(3.0));
        assert_eq!(value_with_label(text, "a_total", "x=\"1\""), Some(2.0));
        assert_eq!(counter_sum(text, "b"), 0.0);
    }
}
