//! Reuse accounting from the event streams, for `assess` and the metrics: which stored blocks
//! another replica already held (prefill computed twice), and which a replica computes again soon
//! after evicting them (recomputation, which the engine's own hit counter cannot tell apart from
//! new work).

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

/// `[reuse]`: how recomputation after eviction is recognised.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReuseConfig {
    /// A block stored again within this many seconds of its removal on the same replica counts
    /// as recomputed (default 60).
    #[serde(default = "default_recompute_window_s")]
    pub recompute_window_s: f64,
    /// Removals remembered per stream (default 65,536: 1.5 MiB at most per stream).
    #[serde(default = "default_max_tracked_removals")]
    pub max_tracked_removals: usize,
    /// (session, block) pairs remembered to tell reuse within one session from reuse across
    /// sessions in shadow mode (default 262,144: about 6 MiB).
    #[serde(default = "default_max_session_blocks")]
    pub max_session_blocks: usize,
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            recompute_window_s: default_recompute_window_s(),
            max_tracked_removals: default_max_tracked_removals(),
            max_session_blocks: default_max_session_blocks(),
        }
    }
}

fn default_recompute_window_s() -> f64 {
    60.0
}
fn default_max_tracked_removals() -> usize {
    65_536
}
fn default_max_session_blocks() -> usize {
    262_144
}

impl ReuseConfig {
    /// The field that is out of range, and why.
    pub fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if !(self.recompute_window_s.is_finite() && self.recompute_window_s >= 0.0) {
            return Err(("recompute_window_s", "must be a finite number >= 0"));
        }
        if self.max_tracked_removals > 1 << 24 {
            return Err(("max_tracked_removals", "must be at most 16777216"));
        }
        if self.max_session_blocks > 1 << 24 {
            return Err(("max_session_blocks", "must be at most 16777216"));
        }
        Ok(())
    }

    fn window_ms(&self) -> u64 {
        (self.recompute_window_s * 1000.0) as u64
    }
}

/// The most recent GPU removals of one stream, by engine block hash, bounded (oldest forgotten
/// first).
#[derive(Debug, Default)]
pub struct RecentRemovals {
    at_ms: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl RecentRemovals {
    /// Remembers that `hash` was removed at `now_ms`.
    pub fn removed(&mut self, cfg: &ReuseConfig, hash: u64, now_ms: u64) {
        if cfg.max_tracked_removals == 0 {
            return;
        }
        self.at_ms.insert(hash, now_ms);
        self.order.push_back((hash, now_ms));
        while self.order.len() > cfg.max_tracked_removals {
            if let Some((h, t)) = self.order.pop_front() {
                if self.at_ms.get(&h) == Some(&t) {
                    self.at_ms.remove(&h);
                }
            }
        }
    }

    /// Whether storing `hash` at `now_ms` recomputes a block removed within the window.
    pub fn stored_again(&mut self, cfg: &ReuseConfig, hash: u64, now_ms: u64) -> bool {
        self.at_ms
            .remove(&hash)
            .is_some_and(|t| now_ms.saturating_sub(t) <= cfg.window_ms())
    }

    /// Removals remembered.
    pub fn len(&self) -> usize {
        self.at_ms.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.at_ms.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_stored_again_soon_after_its_removal_is_recomputed() {
        let cfg = ReuseConfig {
            recompute_window_s: 10.0,
            max_tracked_removals: 4,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        r.removed(&cfg, 1, 1_000);
        r.removed(&cfg, 2, 1_000);
        assert!(r.stored_again(&cfg, 1, 5_000));
        assert!(!r.stored_again(&cfg, 1, 5_000), "counted once");
        assert!(!r.stored_again(&cfg, 2, 12_000), "outside the window");
        assert!(!r.stored_again(&cfg, 3, 1_000), "never removed");
    }

    #[test]
    fn removals_are_bounded_oldest_first() {
        let cfg = ReuseConfig {
            recompute_window_s: 60.0,
            max_tracked_removals: 3,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        for h in 0..10 {
            r.removed(&cfg, h, h);
        }
        assert_eq!(r.len(), 3);
        assert!(!r.stored_again(&cfg, 6, 20));
        assert!(r.stored_again(&cfg, 9, 20));
        // A hash removed twice keeps its latest time and is not dropped by its older entry.
        r.removed(&cfg, 7, 30);
        r.removed(&cfg, 7, 31);
        r.removed(&cfg, 20, 32);
        assert!(r.stored_again(&cfg, 7, 40));
    }

    #[test]
    fn zero_capacity_remembers_nothing() {
        let cfg = ReuseConfig {
            recompute_window_s: 60.0,
            max_tracked_removals: 0,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        r.removed(&cfg, 1, 0);
        assert!(r.is_empty());
    }
}
