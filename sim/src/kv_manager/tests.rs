//! The coordinator's hit (a port of vLLM's right-to-left, fixed-point search) against
//! [`kvroute_core::hybrid::hit_blocks`] (the indexer's rule), on random pool contents.

use std::sync::Arc;

use kvroute_core::hybrid::{hit_blocks, GroupKind};
use kvroute_core::rng::SplitMix64;

use super::*;
use crate::sequence::SeqMeta;

const BS: usize = 4;

fn hashes(n: usize) -> Vec<BlockHash> {
    (0..n)
        .map(|i| BlockHash::from_digest(&(i as u64 + 1).to_be_bytes()))
        .collect()
}

/// A manager whose pool caches block `i` of group `g` iff `held[g][i]` (all blocks free).
fn manager_holding(groups: Vec<GroupKind>, held: &[Vec<bool>]) -> KvCacheManager {
    let total: usize = held.iter().map(|h| h.len()).sum();
    let mut kv = KvCacheManager::with_groups(total + 2, BS, groups, false).expect("pool");
    let hs = hashes(held[0].len());
    let meta = Arc::new(SeqMeta::default());
    let tokens = vec![0u32; hs.len() * BS];
    for (g, row) in held.iter().enumerate() {
        for (i, &h) in row.iter().enumerate() {
            if !h {
                continue;
            }
            let ids = kv.pool.get_new_blocks(1).expect("free block");
            let mut blocks = vec![NULL_BLOCK; i];
            blocks.push(ids[0]);
            kv.pool.cache_full_blocks(CacheRun {
                meta: &meta,
                tokens: &tokens,
                hashes: &hs,
                blocks: &blocks,
                num_cached: i,
                num_full: i + 1,
                block_size: BS,
                group: g as GroupId,
            });
            kv.pool.free_blocks([ids[0]]);
        }
    }
    kv
}

#[test]
fn the_coordinator_port_and_the_index_rule_agree() {
    let mut rng = SplitMix64::new(7);
    let layouts: [Vec<GroupKind>; 5] = [
        vec![GroupKind::FullAttention],
        vec![GroupKind::SlidingWindow { window: 9 }],
        vec![
            GroupKind::SlidingWindow { window: 9 },
            GroupKind::FullAttention,
        ],
        vec![
            GroupKind::SlidingWindow { window: 13 },
            GroupKind::SlidingWindow { window: 13 },
            GroupKind::SlidingWindow { window: 13 },
            GroupKind::FullAttention,
        ],
        vec![
            GroupKind::SlidingWindow { window: 5 },
            GroupKind::SlidingWindow { window: 17 },
            GroupKind::FullAttention,
        ],
    ];
    for round in 0..2_000 {
        let groups = layouts[round % layouts.len()].clone();
        let n = 1 + (rng.next_u64() % 14) as usize;
        // Dense rows (mostly held), so long hits and window edges both occur.
        let held: Vec<Vec<bool>> = groups
            .iter()
            .map(|_| (0..n).map(|_| !rng.next_u64().is_multiple_of(5)).collect())
            .collect();
        let kv = manager_holding(groups.clone(), &held);
        let max_tokens = (rng.next_u64() % (n as u64 * BS as u64 + 2)) as usize;
        let (per_group, tokens) = kv.find_longest_cache_hit(&hashes(n), max_tokens);
        let rules: Vec<Option<usize>> = groups
            .iter()
            .map(|k| k.contiguous_blocks(BS as u32))
            .collect();
        let expected = hit_blocks(&rules, (max_tokens / BS).min(n), |g, i| held[g][i]);
        assert_eq!(
            tokens,
            expected * BS,
            "round {round}: layout {groups:?}, held {held:?}, max {max_tokens}"
        );
        assert_eq!(per_group.len(), groups.len());
    }
}
