//! Reuse accounting from the event streams, for `assess` and the metrics: which stored blocks
//! another replica already held (prefill computed twice), and which a replica computes again soon
//! after evicting them (recomputation, which the engine's own hit counter cannot tell apart from
//! new work), and which a prefix-aware router would have found cached somewhere in the fleet.

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
    /// Blocks the fleet cache (see [`FleetCache`]) follows per model; a fleet with more KV
    /// blocks is followed on a hash sample of its blocks (default 262,144: at most ~15 MiB).
    #[serde(default = "default_max_fleet_blocks")]
    pub max_fleet_blocks: usize,
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            recompute_window_s: default_recompute_window_s(),
            max_tracked_removals: default_max_tracked_removals(),
            max_session_blocks: default_max_session_blocks(),
            max_fleet_blocks: default_max_fleet_blocks(),
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
fn default_max_fleet_blocks() -> usize {
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
        if self.max_fleet_blocks > 1 << 24 {
            return Err(("max_fleet_blocks", "must be at most 16777216"));
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

/// One model's fleet seen as a single LRU cache as large as all its replicas' KV together, fed
/// with every replica's GPU stores: a block stored while this cache still holds it is prefill a
/// prefix-aware router would have served from cache (it was computed twice across replicas, or
/// again after an eviction that one copy per fleet would have avoided). The hit rate such a router
/// reaches is then the engines' hits plus those stores, as far as the fleet's memory allows.
///
/// Recency comes from stores only (engines do not announce hits), so a block kept hot by hits
/// looks older here than it is: the estimate errs low when the fleet's working set exceeds its
/// memory, and is exact (every repeat found) when it fits. Memory is bounded by following a hash
/// sample of the blocks (SHARDS, Waldspurger et al., FAST'15): at most `max_fleet_blocks`
/// followed, each sampled repeat standing for 1/rate.
#[derive(Debug, Default)]
pub struct FleetCache {
    touched: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    clock: u64,
}

impl FleetCache {
    /// Records a store of the block named `hash` in a fleet of `capacity_blocks` KV blocks (0:
    /// unknown, followed up to the limit); returns how many stores the result stands for when
    /// the cache held the block (the inverse sampling rate), 0 otherwise.
    pub fn stored(&mut self, cfg: &ReuseConfig, hash: u64, capacity_blocks: u64) -> u64 {
        let limit = cfg.max_fleet_blocks as u64;
        if limit == 0 {
            return 0;
        }
        // Sample 1 in 2^shift blocks, the smallest shift that fits the limit.
        let capacity = if capacity_blocks == 0 {
            limit
        } else {
            capacity_blocks
        };
        let shift = (capacity.div_ceil(limit))
            .next_power_of_two()
            .trailing_zeros();
        if shift > 0 && kvroute_core::rng::mix(hash) >> (64 - shift) != 0 {
            return 0;
        }
        let followed = (capacity >> shift).max(1);
        self.clock += 1;
        let held = self.touched.insert(hash, self.clock).is_some();
        self.order.push_back((hash, self.clock));
        while self.touched.len() as u64 > followed || self.order.len() as u64 > 2 * followed + 16 {
            let Some((h, t)) = self.order.pop_front() else {
                break;
            };
            if self.touched.get(&h) == Some(&t) {
                self.touched.remove(&h);
            }
        }
        if held {
            1 << shift
        } else {
            0
        }
    }

    /// Blocks followed.
    pub fn len(&self) -> usize {
        self.touched.len()
    }

    /// True when nothing is followed.
    pub fn is_empty(&self) -> bool {
        self.touched.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fleet_cache_finds_repeats_within_its_capacity_and_forgets_the_least_recent() {
        let cfg = ReuseConfig::default();
        let mut f = FleetCache::default();
        assert_eq!(f.stored(&cfg, 1, 3), 0);
        assert_eq!(f.stored(&cfg, 2, 3), 0);
        assert_eq!(f.stored(&cfg, 1, 3), 1, "stored on a second replica");
        assert_eq!(f.stored(&cfg, 3, 3), 0);
        // 1 was touched after 2: 4 pushes 2 out.
        assert_eq!(f.stored(&cfg, 4, 3), 0);
        assert_eq!(f.stored(&cfg, 2, 3), 0, "least recent, forgotten");
        assert_eq!(f.stored(&cfg, 4, 3), 1);
        assert_eq!(f.len(), 3);
    }

    #[test]
    fn a_fleet_larger_than_the_limit_is_followed_on_a_sample_that_estimates_its_repeats() {
        let cfg = ReuseConfig {
            max_fleet_blocks: 1_000,
            ..ReuseConfig::default()
        };
        let mut f = FleetCache::default();
        // 16,000 blocks of capacity: 1 in 16 followed. 8,000 distinct blocks stored twice.
        let mut repeats = 0;
        for round in 0..2 {
            for b in 0..8_000u64 {
                let n = f.stored(&cfg, b.wrapping_mul(0x9E37_79B9_7F4A_7C15), 16_000);
                assert!(round == 1 || n == 0);
                repeats += n;
            }
        }
        assert!(f.len() <= 1_000, "{} followed", f.len());
        assert!(
            (6_800..=9_200).contains(&repeats),
            "{repeats} repeats estimated of 8,000"
        );
    }

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
