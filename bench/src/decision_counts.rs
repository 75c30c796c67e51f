//! Routing decisions per reason over one line (`prefix_hit`, `load`, `load_over_prefix`, ...),
//! read from the indexers' own counters (`kvroute_indexer_decisions_total{reason}`) at the end of
//! the line and summed over every gateway.

use std::collections::BTreeMap;
use std::fmt;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use kvroute_core::scoring::DecisionReason;
use kvroute_testkit::prom::{metrics_text, value_with_label};

/// Decisions per reason (the reason's snake_case name); reasons never counted are left out.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DecisionCounts(pub BTreeMap<String, u64>);

/// The indexer's counter of decisions, labelled by reason.
const DECISIONS: &str = "kvroute_indexer_decisions_total";

impl DecisionCounts {
    /// Reads the counters from an indexer's `/metrics` text.
    pub fn from_metrics(text: &str) -> Self {
        let mut counts = BTreeMap::new();
        for reason in DecisionReason::ALL {
            let label = format!("reason=\"{}\"", reason.as_str());
            if let Some(n) = value_with_label(text, DECISIONS, &label) {
                if n > 0.0 {
                    counts.insert(reason.as_str().to_string(), n as u64);
                }
            }
        }
        DecisionCounts(counts)
    }

    /// Scrapes the indexer at `addr`.
    pub fn scrape(addr: &str) -> Result<Self> {
        Ok(Self::from_metrics(&metrics_text(addr)?))
    }

    /// Adds another indexer's counts (several gateways: each counted what it routed).
    pub fn add(&mut self, other: &DecisionCounts) {
        for (reason, n) in &other.0 {
            *self.0.entry(reason.clone()).or_default() += n;
        }
    }

    /// Decisions counted over every reason.
    #[cfg(test)]
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }
}

/// `prefix_hit 287, load 179, load_over_prefix 32` (most frequent first).
impl fmt::Display for DecisionCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rows: Vec<(&String, &u64)> = self.0.iter().collect();
        rows.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (i, (reason, n)) in rows.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{reason} {n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_reason_sums_gateways_and_prints_the_most_frequent_first() {
        let text = "# TYPE kvroute_indexer_decisions_total counter\n\
                    kvroute_indexer_decisions_total{reason=\"prefix_hit\",policy=\"kv\"} 287\n\
                    kvroute_indexer_decisions_total{reason=\"load\",policy=\"kv\"} 179\n\
                    kvroute_indexer_decisions_total{reason=\"load_over_prefix\",policy=\"kv\"} 32\n\
                    kvroute_indexer_decisions_total{reason=\"random\",policy=\"kv\"} 0\n";
        let mut counts = DecisionCounts::from_metrics(text);
        assert_eq!(counts.total(), 498);
        assert_eq!(counts.0.get("random"), None);
        assert_eq!(
            counts.to_string(),
            "prefix_hit 287, load 179, load_over_prefix 32"
        );
        counts.add(&DecisionCounts::from_metrics(
            "kvroute_indexer_decisions_total{reason=\"load_over_prefix\",policy=\"kv\"} 8\n",
        ));
        assert_eq!(counts.0.get("load_over_prefix"), Some(&40));
        assert_eq!(DecisionCounts::from_metrics("").total(), 0);
    }
}
