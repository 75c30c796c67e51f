//! How often the indexer's predicted hit equals what the engine then reported (`cached_tokens`),
//! read from the indexer's own counters at the end of a line.

use anyhow::Result;
use serde::{Deserialize, Serialize};

use kvroute_testkit::prom::{counter_sum, metrics_text};

/// The indexer's hit predictions over one line.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct HitPrediction {
    /// Completions whose reported cached tokens equal the prediction.
    pub exact: u64,
    /// Completions with more cached tokens than predicted.
    pub under: u64,
    /// Completions with fewer cached tokens than predicted.
    pub over: u64,
}

impl HitPrediction {
    /// Reads the counters from an indexer's `/metrics` text.
    pub fn from_metrics(text: &str) -> Self {
        let n = |name: &str| counter_sum(text, name) as u64;
        HitPrediction {
            exact: n("kvroute_indexer_hit_prediction_exact"),
            under: n("kvroute_indexer_hit_prediction_under"),
            over: n("kvroute_indexer_hit_prediction_over"),
        }
    }

    /// Scrapes the indexer at `addr`.
    pub fn scrape(addr: &str) -> Result<Self> {
        Ok(Self::from_metrics(&metrics_text(addr)?))
    }

    /// Adds another indexer's counts (several gateways: each predicted what it routed).
    pub fn add(&mut self, other: &HitPrediction) {
        self.exact += other.exact;
        self.under += other.under;
        self.over += other.over;
    }

    /// Completions compared.
    pub fn compared(&self) -> u64 {
        self.exact + self.under + self.over
    }

    /// Share of compared completions predicted exactly; `None` when none was compared.
    pub fn exact_share(&self) -> Option<f64> {
        let n = self.compared();
        (n > 0).then(|| self.exact as f64 / n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_three_counters_and_the_exact_share() {
        let text = "# TYPE kvroute_indexer_hit_prediction_exact_total counter\n\
                    kvroute_indexer_hit_prediction_exact_total 97\n\
                    kvroute_indexer_hit_prediction_under_total 1\n\
                    kvroute_indexer_hit_prediction_over_total 2\n";
        let p = HitPrediction::from_metrics(text);
        assert_eq!((p.exact, p.under, p.over), (97, 1, 2));
        assert_eq!(p.exact_share(), Some(0.97));
        let mut sum = p;
        sum.add(&HitPrediction {
            exact: 3,
            under: 0,
            over: 0,
        });
        assert_eq!((sum.exact, sum.compared()), (100, 103));
        assert_eq!(HitPrediction::default().exact_share(), None);
    }
}
