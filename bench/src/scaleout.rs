//! `--scale-out-at FRACTION`: the fleet's last replica starts cold part-way through the replay.
//! The replicas' counters are sampled during the replay; this module turns the samples into the
//! new replica's share of the requests over time and the fleet's hit rate before and after.

use serde::Serialize;

use crate::replica_counters::ReplicaCounters;

/// Width of a share bin, model s.
pub const BIN_S: f64 = 10.0;
/// The goal: the new replica serves this fraction of the mean per-replica rate ...
pub const SHARE_GOAL: f64 = 0.7;
/// ... within this many model seconds of joining ...
pub const WITHIN_S: f64 = 60.0;
/// ... and the fleet's hit rate after joining stays at this fraction of the ceiling.
pub const HIT_GOAL: f64 = 0.97;

/// Counter deltas of every replica (since the run began) at one moment.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Model seconds since the replay began.
    pub model_s: f64,
    /// Per replica (a replica not running yet counts zero).
    pub counters: Vec<ReplicaCounters>,
}

/// One bin after joining.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShareBin {
    /// Start, model s after joining.
    pub from_s: f64,
    /// End, model s after joining.
    pub to_s: f64,
    /// Requests the new replica finished in the bin.
    pub new_requests: u64,
    /// Requests the fleet finished in the bin, divided by the fleet size.
    pub mean_requests: f64,
    /// new / mean (1.0 = a full share).
    pub share: f64,
}

/// What the report shows about a scale-out.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScaleOut {
    /// The replica that joined.
    pub replica: usize,
    /// When it answered `/health`, model s after the replay began.
    pub joined_s: f64,
    /// Its share of the requests, per [`BIN_S`] bin.
    pub bins: Vec<ShareBin>,
    /// Model s after joining at which a bin first reached [`SHARE_GOAL`] (its end).
    pub reached_goal_after_s: Option<f64>,
    /// The fleet's hit rate before joining (counters).
    pub hit_before: f64,
    /// After joining.
    pub hit_after: f64,
    /// The ceiling of the requests that arrived before joining.
    pub ceiling_before: f64,
    /// After.
    pub ceiling_after: f64,
}

impl ScaleOut {
    /// Whether the new replica reached its share within [`WITHIN_S`].
    pub fn share_met(&self) -> bool {
        self.reached_goal_after_s.is_some_and(|s| s <= WITHIN_S)
    }

    /// Whether the hit rate after joining stayed at [`HIT_GOAL`] of its ceiling.
    pub fn hit_met(&self) -> bool {
        self.ceiling_after <= 0.0 || self.hit_after >= HIT_GOAL * self.ceiling_after
    }
}

/// The latest sample at or before `t` (the first if none).
fn at(samples: &[Sample], t: f64) -> Option<&Sample> {
    samples
        .iter()
        .rev()
        .find(|s| s.model_s <= t)
        .or(samples.first())
}

/// Analyses `samples` (in time order) for `replica` joining at `joined_s`; `ceiling_before` and
/// `ceiling_after` are the workload's ceilings split at the same moment.
pub fn analyse(
    samples: &[Sample],
    replica: usize,
    joined_s: f64,
    ceiling_before: f64,
    ceiling_after: f64,
) -> ScaleOut {
    let fleet = samples.first().map_or(1, |s| s.counters.len()).max(1) as f64;
    let end_s = samples.last().map_or(joined_s, |s| s.model_s);
    let total = |s: &Sample, f: fn(&ReplicaCounters) -> f64| s.counters.iter().map(f).sum::<f64>();
    let mine = |s: &Sample| s.counters.get(replica).map_or(0.0, |c| c.requests);
    let mut bins = Vec::new();
    let mut from = joined_s;
    while from + BIN_S <= end_s + 1e-9 {
        let (Some(a), Some(b)) = (at(samples, from), at(samples, from + BIN_S)) else {
            break;
        };
        let new = (mine(b) - mine(a)).max(0.0);
        let mean = (total(b, |c| c.requests) - total(a, |c| c.requests)).max(0.0) / fleet;
        bins.push(ShareBin {
            from_s: from - joined_s,
            to_s: from + BIN_S - joined_s,
            new_requests: new as u64,
            mean_requests: mean,
            share: if mean > 0.0 { new / mean } else { 0.0 },
        });
        from += BIN_S;
    }
    let rate = |hits: f64, queries: f64| if queries > 0.0 { hits / queries } else { 0.0 };
    let (join, last) = (at(samples, joined_s), samples.last());
    let sum = |s: Option<&Sample>, f: fn(&ReplicaCounters) -> f64| s.map_or(0.0, |s| total(s, f));
    let (hits0, queries0) = (sum(join, |c| c.hits), sum(join, |c| c.queries));
    ScaleOut {
        replica,
        joined_s,
        reached_goal_after_s: bins.iter().find(|b| b.share >= SHARE_GOAL).map(|b| b.to_s),
        bins,
        hit_before: rate(hits0, queries0),
        hit_after: rate(
            sum(last, |c| c.hits) - hits0,
            sum(last, |c| c.queries) - queries0,
        ),
        ceiling_before,
        ceiling_after,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, per: [(f64, f64, f64); 2]) -> Sample {
        Sample {
            model_s: t,
            counters: per
                .iter()
                .map(|&(queries, hits, requests)| ReplicaCounters {
                    queries,
                    hits,
                    requests,
                    preemptions: 0.0,
                })
                .collect(),
        }
    }

    #[test]
    fn the_new_replicas_share_and_the_hit_rates_split_at_joining() {
        // Replica 1 joins at 20 s; it takes 2 of 10 requests in 20..30 s, 5 of 10 in 30..40.
        let samples = vec![
            sample(0.0, [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]),
            sample(20.0, [(100.0, 50.0, 10.0), (0.0, 0.0, 0.0)]),
            sample(30.0, [(150.0, 80.0, 18.0), (50.0, 0.0, 2.0)]),
            sample(40.0, [(200.0, 110.0, 23.0), (100.0, 40.0, 7.0)]),
            sample(45.0, [(200.0, 110.0, 23.0), (100.0, 40.0, 7.0)]),
        ];
        let s = analyse(&samples, 1, 20.0, 0.6, 0.5);
        assert_eq!(s.bins.len(), 2);
        assert_eq!((s.bins[0].new_requests, s.bins[0].mean_requests), (2, 5.0));
        assert!((s.bins[0].share - 0.4).abs() < 1e-12);
        assert!((s.bins[1].share - 1.0).abs() < 1e-12);
        assert_eq!(s.reached_goal_after_s, Some(20.0));
        assert!(s.share_met());
        assert_eq!(s.hit_before, 0.5);
        // After: 100 hits of 200 queries.
        assert_eq!(s.hit_after, 0.5);
        assert!(s.hit_met(), "0.5 >= 0.97 x 0.5");
        let strict = analyse(&samples, 1, 20.0, 0.6, 0.6);
        assert!(!strict.hit_met());
        // Never reaching 70 %: not met.
        let slow = analyse(&samples[..3], 1, 20.0, 0.6, 0.5);
        assert_eq!(slow.reached_goal_after_s, None);
        assert!(!slow.share_met());
    }
}
