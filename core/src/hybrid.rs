//! Hybrid models: several KV cache groups (full attention, sliding window) and vLLM's rule for
//! the prefix-cache hit they give together.
//!
//! vLLM (`HybridKVCacheCoordinator.find_longest_cache_hit`) accepts a hit of `e` blocks only if
//! **every** KV cache group can serve it:
//!
//! * a full-attention group needs every block `0..e` (`FullAttentionManager`);
//! * a sliding-window group of window `w` tokens needs only the last
//!   `c = ceil((w - 1) / block_size)` blocks before `e` (`SlidingWindowManager`,
//!   `_contiguous_blocks_for_hit`), or all of `0..e` when `e < c`; its right-to-left scan ends
//!   at a held block, so even `c = 0` (a one-token window) needs block `e - 1`;
//! * `e` is at most the usable blocks of the prompt (its last token is always recomputed:
//!   `max_cache_hit_length = num_tokens - 1`).
//!
//! vLLM reaches the answer by a fixed-point loop (each group lowers the candidate to its own
//! longest hit below it); since every group's accepted set is checked independently, the loop ends
//! at the largest `e` every group accepts, which [`hit_blocks`] computes directly. Block sizes are
//! assumed equal across groups (vLLM's uniform-page-size layouts of Gemma 3 and gpt-oss); EAGLE's
//! dropped block and Mamba groups are not modelled.

use serde::{Deserialize, Serialize};

/// How one KV cache group serves a prefix hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupKind {
    /// Full attention (also MLA and sink full attention): every block of the prefix.
    FullAttention,
    /// Sliding window attention of `window` tokens: the blocks inside the last window.
    SlidingWindow {
        /// Window in tokens.
        window: u32,
    },
}

/// What vLLM's events say a group is (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupKindError {
    /// A kind whose hit rule kvroute does not model (mamba, chunked local attention, ...).
    #[error("KV cache spec kind {0:?} is not supported")]
    Unsupported(String),
    /// A sliding-window group without a positive window.
    #[error("sliding-window group without a valid window ({0:?})")]
    BadWindow(Option<i64>),
}

impl GroupKind {
    /// From a `BlockStored`'s `kv_cache_spec_kind` / `kv_cache_spec_sliding_window`. A missing
    /// kind (vLLM before 0.22, one group) is full attention.
    pub fn from_event(
        kind: Option<&str>,
        window: Option<i64>,
    ) -> Result<GroupKind, GroupKindError> {
        match kind {
            None | Some("full_attention" | "mla_attention" | "sink_full_attention") => {
                Ok(GroupKind::FullAttention)
            }
            Some("sliding_window" | "sliding_window_mla") => match window {
                Some(w) if w > 0 && w <= i64::from(u32::MAX) => {
                    Ok(GroupKind::SlidingWindow { window: w as u32 })
                }
                other => Err(GroupKindError::BadWindow(other)),
            },
            Some(other) => Err(GroupKindError::Unsupported(other.to_string())),
        }
    }

    /// The event strings vLLM publishes for this kind: (`kv_cache_spec_kind`,
    /// `kv_cache_spec_sliding_window`).
    pub fn event_fields(&self) -> (&'static str, Option<i64>) {
        match self {
            GroupKind::FullAttention => ("full_attention", None),
            GroupKind::SlidingWindow { window } => ("sliding_window", Some(i64::from(*window))),
        }
    }

    /// Blocks before the hit point this group needs (`None`: all of them).
    pub fn contiguous_blocks(&self, block_size: u32) -> Option<usize> {
        match self {
            GroupKind::FullAttention => None,
            GroupKind::SlidingWindow { window } => {
                Some(contiguous_blocks_for_hit(*window, block_size))
            }
        }
    }
}

/// vLLM's `SlidingWindowManager._contiguous_blocks_for_hit` without EAGLE:
/// `ceil((window - 1) / block_size)`.
pub fn contiguous_blocks_for_hit(window: u32, block_size: u32) -> usize {
    if block_size == 0 {
        return 0;
    }
    (window.saturating_sub(1) as usize).div_ceil(block_size as usize)
}

/// The longest hit (in blocks, at most `max_blocks`) every group accepts. `rules[g]` is group
/// `g`'s [`GroupKind::contiguous_blocks`] (`None`: full attention); `held(g, i)` whether group `g`
/// holds block `i`. No groups: no hit.
pub fn hit_blocks(
    rules: &[Option<usize>],
    max_blocks: usize,
    held: impl Fn(usize, usize) -> bool,
) -> usize {
    if rules.is_empty() {
        return 0;
    }
    // Full attention is downward closed: the shortest leading run bounds everything.
    let mut bound = max_blocks;
    for (g, rule) in rules.iter().enumerate() {
        if rule.is_none() {
            bound = (0..bound).find(|&i| !held(g, i)).unwrap_or(bound);
        }
    }
    let windows: Vec<(usize, usize)> = rules
        .iter()
        .enumerate()
        .filter_map(|(g, r)| r.map(|c| (g, c)))
        .collect();
    if windows.is_empty() || bound == 0 {
        return bound;
    }
    // run[w][i]: consecutive blocks held by window group `w` ending at block `i`.
    let runs: Vec<Vec<usize>> = windows
        .iter()
        .map(|&(g, _)| {
            let mut run = Vec::with_capacity(bound);
            let mut n = 0usize;
            for i in 0..bound {
                n = if held(g, i) { n + 1 } else { 0 };
                run.push(n);
            }
            run
        })
        .collect();
    (1..=bound)
        .rev()
        .find(|&e| {
            windows
                .iter()
                .zip(&runs)
                .all(|(&(_, c), run)| run[e - 1] >= c.max(1).min(e))
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_from<'a>(sets: &'a [&'a [usize]]) -> impl Fn(usize, usize) -> bool + 'a {
        move |g, i| sets[g].contains(&i)
    }

    #[test]
    fn full_attention_needs_every_block() {
        let sets: &[&[usize]] = &[&[0, 1, 2, 4, 5]];
        assert_eq!(hit_blocks(&[None], 6, held_from(sets)), 3);
        assert_eq!(hit_blocks(&[None], 2, held_from(sets)), 2);
    }

    #[test]
    fn a_window_needs_only_its_last_blocks() {
        // Window 9 tokens, block size 4: ceil(8 / 4) = 2 blocks.
        assert_eq!(contiguous_blocks_for_hit(9, 4), 2);
        let sets: &[&[usize]] = &[&[0, 1, 2, 3, 4, 5, 6, 7], &[4, 5, 6]];
        // Full holds 0..8, the window group only 4..7: the hit ends where the window's last
        // two blocks are held: e = 7 (blocks 5, 6).
        assert_eq!(hit_blocks(&[None, Some(2)], 8, held_from(sets)), 7);
        // Capped by the full group.
        let sets: &[&[usize]] = &[&[0, 1, 2, 3, 4, 5], &[4, 5, 6]];
        assert_eq!(hit_blocks(&[None, Some(2)], 8, held_from(sets)), 6);
        // A window group with a gap right before the full group's end cannot serve it.
        let sets: &[&[usize]] = &[&[0, 1, 2, 3, 4, 5], &[1, 2, 3, 5]];
        assert_eq!(hit_blocks(&[None, Some(2)], 8, held_from(sets)), 4);
    }

    #[test]
    fn short_prefixes_need_every_block_of_a_window_group() {
        // c = 3, only blocks 0 and 1 held: e = 2 (the whole prefix is inside the window).
        let sets: &[&[usize]] = &[&[0, 1]];
        assert_eq!(hit_blocks(&[Some(3)], 5, held_from(sets)), 2);
        // Block 0 missing: nothing.
        let sets: &[&[usize]] = &[&[1, 2]];
        assert_eq!(hit_blocks(&[Some(3)], 5, held_from(sets)), 0);
    }

    #[test]
    fn a_one_token_window_still_needs_the_last_block() {
        // c = 0: vLLM's scan stops at the first held block from the right.
        assert_eq!(contiguous_blocks_for_hit(1, 4), 0);
        let sets: &[&[usize]] = &[&[0, 1, 2]];
        assert_eq!(hit_blocks(&[Some(0)], 5, held_from(sets)), 3);
        let sets: &[&[usize]] = &[&[1, 3]];
        assert_eq!(hit_blocks(&[Some(0)], 5, held_from(sets)), 4);
        let sets: &[&[usize]] = &[&[]];
        assert_eq!(hit_blocks(&[Some(0)], 5, held_from(sets)), 0);
    }

    #[test]
    fn kinds_from_events() {
        assert_eq!(
            GroupKind::from_event(None, None),
            Ok(GroupKind::FullAttention)
        );
        assert_eq!(
            GroupKind::from_event(Some("sliding_window"), Some(1024)),
            Ok(GroupKind::SlidingWindow { window: 1024 })
        );
        assert!(GroupKind::from_event(Some("sliding_window"), None).is_err());
        assert!(GroupKind::from_event(Some("mamba"), None).is_err());
        assert_eq!(
            GroupKind::SlidingWindow { window: 128 }.contiguous_blocks(16),
            Some(8)
        );
    }
}
