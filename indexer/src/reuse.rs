//! Reuse accounting from the event streams, for `assess` and the metrics: which stored blocks
//! another replica already held (prefill computed twice), and which a replica computes again soon
//! after evicting them (recomputation, which the engine's own hit counter cannot tell apart from
//! new work), and which a prefix-aware router would have found cached somewhere in the fleet.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::index::IdBuildHasher;

/// `[reuse]`: how recomputation after eviction is recognised.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReuseConfig {
    /// A block stored again within this many seconds of its removal on the same replica counts
    /// as recomputed (default 60).
    #[serde(default = "default_recompute_window_s")]
    pub recompute_window_s: f64,
    /// Removals remembered per model, all its replicas together (default 262,144: about
    /// 10 MiB); more removals within one window are followed on a hash sample
    /// ([`RecentRemovals`]).
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
    262_144
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

/// One model's recent GPU removals, by (stream, engine block hash), to recognise a block its
/// stream stores again within the recompute window.
///
/// Bounded twice: entries older than the window are forgotten, and the whole model's fleet
/// keeps at most `max_tracked_removals` of them. A fleet that removes more than that within one
/// window is followed on a hash sample (fixed-size SHARDS, Waldspurger et al., FAST'15): when the
/// table is full the sample halves and the entries outside it are dropped; each sampled
/// recomputation then stands for 1/rate. A bound per stream would grow with the fleet (100
/// replicas x 65,536 removals was 150 MiB); this one does not.
#[derive(Debug, Default)]
pub struct RecentRemovals {
    /// Sampled (stream, hash) key -> its [`Removal`].
    at: HashMap<u64, Removal, IdBuildHasher>,
    /// Keys in removal order, with their times (stale ones dropped lazily).
    order: VecDeque<(u64, u64)>,
    /// One key in `2^shift` is followed now.
    shift: u32,
}

/// One remembered removal.
#[derive(Debug, Clone, Copy)]
struct Removal {
    at_ms: u64,
    /// The sample it stands for: one in `2^shift` keys. Set when it is remembered, raised when
    /// the sample shrinks around it; a later widening of the sample leaves it, since the removals
    /// of the narrower period that it stands for were not remembered.
    shift: u32,
}

/// The sampled key of `hash` removed from `stream`: uniform over 64 bits whatever the hashes.
fn removal_key(stream: u32, hash: u64) -> u64 {
    use kvroute_core::rng::mix;
    mix(hash ^ mix(u64::from(stream)))
}

/// Whether `key` is in the sample of one key in `2^shift`.
fn in_sample(key: u64, shift: u32) -> bool {
    shift == 0 || key >> (64 - shift) == 0
}

impl RecentRemovals {
    /// Remembers that `stream` removed `hash` at `now_ms`.
    pub fn removed(&mut self, cfg: &ReuseConfig, stream: u32, hash: u64, now_ms: u64) {
        let cap = cfg.max_tracked_removals;
        if cap == 0 {
            return;
        }
        self.forget_older_than(now_ms.saturating_sub(cfg.window_ms()));
        // Widen the sample again once the table is well under its bound (hysteresis).
        if self.shift > 0 && self.at.len() < cap / 4 {
            self.shift -= 1;
        }
        let key = removal_key(stream, hash);
        if !in_sample(key, self.shift) {
            return;
        }
        let shift = self.shift;
        self.at.insert(
            key,
            Removal {
                at_ms: now_ms,
                shift,
            },
        );
        self.order.push_back((key, now_ms));
        while self.at.len() > cap && self.shift < 63 {
            self.narrow();
        }
        if self.order.len() > 2 * cap + 16 {
            let at = &self.at;
            self.order
                .retain(|(k, t)| at.get(k).is_some_and(|r| r.at_ms == *t));
        }
    }

    /// Halves the sample: drops the keys outside it; the ones left stand for twice as many.
    fn narrow(&mut self) {
        self.shift += 1;
        let shift = self.shift;
        self.at.retain(|&k, r| {
            r.shift = r.shift.max(shift);
            in_sample(k, shift)
        });
        self.order.retain(|&(k, _)| in_sample(k, shift));
    }

    /// How many recomputed blocks storing `hash` on `stream` at `now_ms` stands for: 0 when it
    /// was not removed within the window (or is outside the sample), else the inverse sampling
    /// rate of its removal (1 while the fleet's removals fit the bound).
    pub fn stored_again(&mut self, cfg: &ReuseConfig, stream: u32, hash: u64, now_ms: u64) -> u64 {
        match self.at.remove(&removal_key(stream, hash)) {
            Some(r) if now_ms.saturating_sub(r.at_ms) <= cfg.window_ms() => 1 << r.shift,
            _ => 0,
        }
    }

    /// Drops the removals before `oldest_ms`.
    fn forget_older_than(&mut self, oldest_ms: u64) {
        while let Some(&(k, t)) = self.order.front() {
            if t >= oldest_ms {
                break;
            }
            self.order.pop_front();
            if self.at.get(&k).is_some_and(|r| r.at_ms == t) {
                self.at.remove(&k);
            }
        }
    }

    /// Removals remembered.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// The sampling rate's exponent now: one removal in `2^shift` is followed.
    pub fn sample_shift(&self) -> u32 {
        self.shift
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
    touched: HashMap<u64, u64, IdBuildHasher>,
    order: VecDeque<(u64, u64)>,
    clock: u64,
}

impl FleetCache {
    /// Records a store of the block named `hash` in a fleet of `capacity_blocks` KV blocks (0:
    /// unknown, followed up to the limit); returns whether the cache held it and the number of
    /// stores a followed block stands for (the inverse sampling rate), or `None` when the block
    /// is not in the followed sample (nothing is known of it).
    pub fn touch(
        &mut self,
        cfg: &ReuseConfig,
        hash: u64,
        capacity_blocks: u64,
    ) -> Option<(bool, u64)> {
        let limit = cfg.max_fleet_blocks as u64;
        if limit == 0 {
            return None;
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
            return None;
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
        Some((held, 1 << shift))
    }

    /// Records the stores of a prompt's blocks, in prompt order, and returns how many of its
    /// leading blocks the cache held. Exact when every block is followed; on a sample, the held
    /// prefix ends between the last followed block held before the first followed miss and that
    /// miss (or the prompt's end), and the midpoint is returned.
    pub fn held_prefix(&mut self, cfg: &ReuseConfig, keys: &[u64], capacity_blocks: u64) -> usize {
        let (mut at_least, mut at_most) = (0, None);
        for (i, &key) in keys.iter().enumerate() {
            // Every block is stored (the request computes what was not held).
            let held = self.touch(cfg, key, capacity_blocks);
            match (at_most, held) {
                (None, Some((true, _))) => at_least = i + 1,
                (None, Some((false, _))) => at_most = Some(i),
                _ => {}
            }
        }
        let at_most = at_most.unwrap_or(keys.len());
        at_least + (at_most - at_least) / 2
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

    impl FleetCache {
        /// The stores a store of `hash` stands for when the cache held it, 0 otherwise.
        fn stored(&mut self, cfg: &ReuseConfig, hash: u64, capacity_blocks: u64) -> u64 {
            match self.touch(cfg, hash, capacity_blocks) {
                Some((true, weight)) => weight,
                _ => 0,
            }
        }
    }

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
    fn a_block_stored_again_soon_after_its_removal_on_the_same_stream_is_recomputed() {
        let cfg = ReuseConfig {
            recompute_window_s: 10.0,
            max_tracked_removals: 4,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        r.removed(&cfg, 0, 1, 1_000);
        r.removed(&cfg, 0, 2, 1_000);
        assert_eq!(r.stored_again(&cfg, 1, 1, 5_000), 0, "another stream");
        assert_eq!(r.stored_again(&cfg, 0, 1, 5_000), 1);
        assert_eq!(r.stored_again(&cfg, 0, 1, 5_000), 0, "counted once");
        assert_eq!(r.stored_again(&cfg, 0, 2, 12_000), 0, "outside the window");
        assert_eq!(r.stored_again(&cfg, 0, 3, 1_000), 0, "never removed");
    }

    #[test]
    fn removals_older_than_the_window_are_forgotten() {
        let cfg = ReuseConfig {
            recompute_window_s: 1.0,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        for h in 0..1_000 {
            r.removed(&cfg, 7, h, 0);
        }
        assert_eq!(r.len(), 1_000);
        r.removed(&cfg, 7, 5_000, 1_001);
        assert_eq!(r.len(), 1, "only the removal within the window is kept");
        assert_eq!(r.stored_again(&cfg, 7, 5_000, 1_500), 1);
    }

    #[test]
    fn a_fleet_removing_more_than_the_bound_is_sampled_and_estimates_its_recomputations() {
        let cfg = ReuseConfig {
            recompute_window_s: 60.0,
            max_tracked_removals: 1_000,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        // 100 streams remove 160 blocks each (16,000 within the window, 16x the bound); then
        // half of every stream's blocks are stored again.
        for stream in 0..100u32 {
            for b in 0..160u64 {
                r.removed(&cfg, stream, b.wrapping_mul(0x9E37_79B9_7F4A_7C15), 1_000);
                assert!(r.len() <= 1_000, "{} remembered", r.len());
            }
        }
        assert!(r.sample_shift() >= 4, "shift {}", r.sample_shift());
        let mut estimated = 0;
        for stream in 0..100u32 {
            for b in 0..80u64 {
                estimated +=
                    r.stored_again(&cfg, stream, b.wrapping_mul(0x9E37_79B9_7F4A_7C15), 2_000);
            }
        }
        assert!(
            (6_800..=9_200).contains(&estimated),
            "{estimated} recomputations estimated of 8,000"
        );
    }

    #[test]
    fn the_sample_widens_again_once_the_burst_left_the_window() {
        let cfg = ReuseConfig {
            recompute_window_s: 10.0,
            max_tracked_removals: 1_000,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        for b in 0..16_000u64 {
            r.removed(&cfg, 0, b, 0);
        }
        assert!(r.sample_shift() >= 4);
        // After the window, a trickle of removals: each remembered, each worth one block.
        for b in 100_000..100_200u64 {
            r.removed(&cfg, 1, b, 20_000);
        }
        assert_eq!(r.sample_shift(), 0);
        let estimated: u64 = (100_000..100_200u64)
            .map(|b| r.stored_again(&cfg, 1, b, 21_000))
            .sum();
        assert!((170..=240).contains(&estimated), "{estimated} of 200");
    }

    #[test]
    fn zero_capacity_remembers_nothing() {
        let cfg = ReuseConfig {
            recompute_window_s: 60.0,
            max_tracked_removals: 0,
            ..ReuseConfig::default()
        };
        let mut r = RecentRemovals::default();
        r.removed(&cfg, 0, 1, 0);
        assert!(r.is_empty());
        assert_eq!(r.stored_again(&cfg, 0, 1, 0), 0);
    }

    #[test]
    fn a_prompt_finds_the_prefix_the_fleet_still_holds() {
        let cfg = ReuseConfig::default();
        let mut fleet = FleetCache::default();
        assert_eq!(
            fleet.held_prefix(&cfg, &[1, 2, 3, 4], 100),
            0,
            "nothing held yet"
        );
        assert_eq!(fleet.held_prefix(&cfg, &[1, 2, 3, 9], 100), 3);
        assert_eq!(fleet.held_prefix(&cfg, &[1, 2, 3, 9, 10], 100), 4);
        assert_eq!(
            fleet.held_prefix(&cfg, &[7, 2, 3], 100),
            0,
            "a prefix starts at block 0"
        );
        // A fleet of 4 blocks keeps only the 4 most recent: the first prompt's blocks are gone.
        let mut small = FleetCache::default();
        small.held_prefix(&cfg, &[1, 2, 3, 4], 4);
        small.held_prefix(&cfg, &[5, 6, 7, 8], 4);
        assert_eq!(small.held_prefix(&cfg, &[1, 2], 4), 0);
        assert_eq!(small.held_prefix(&cfg, &[7, 8], 4), 2);
    }

    #[test]
    fn on_a_sample_the_held_prefix_is_bracketed_by_followed_blocks() {
        // 64 blocks of capacity followed on 16: 1 in 4 blocks.
        let cfg = ReuseConfig {
            max_fleet_blocks: 16,
            ..ReuseConfig::default()
        };
        let followed = |k: u64| kvroute_core::rng::mix(k) >> 62 == 0;
        let keys: Vec<u64> = (1..=40).collect();
        let mut fleet = FleetCache::default();
        fleet.held_prefix(&cfg, &keys[..20], 64);
        // The first 20 blocks were stored, the next 20 not: the estimate lies between the last
        // followed block among the first 20 and the first followed one after them.
        let got = fleet.held_prefix(&cfg, &keys, 64);
        let last_held = keys[..20]
            .iter()
            .rposition(|&k| followed(k))
            .map_or(0, |i| i + 1);
        let first_miss = (20..40).find(|&i| followed(keys[i])).unwrap_or(40);
        assert!(
            (last_held..=first_miss).contains(&got),
            "{got} outside {last_held}..={first_miss}"
        );
    }
}
