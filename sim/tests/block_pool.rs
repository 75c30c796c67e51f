//! The block pool and KV cache manager against vLLM's semantics, on plain token vectors.

use std::sync::Arc;

use kvroute_sim::block_pool::{BlockPool, PoolEvent, NULL_BLOCK};
use kvroute_sim::kv_manager::KvCacheManager;
use kvroute_sim::sequence::{
    BlockHash, ChainHasher, SeqMeta, Sequence, SequenceSpec, TokenSource, ToyHasher,
};

const BS: usize = 4;

fn seq(id: u64, prompt: Vec<u32>) -> Sequence {
    Sequence::new(
        SequenceSpec {
            id,
            prompt,
            max_tokens: 8,
            meta: Arc::new(SeqMeta::default()),
            report_full: false,
            source: TokenSource::new(id, 1000),
            arrival_s: 0.0,
        },
        BS,
        Arc::new(ToyHasher),
    )
}

/// Admits `s` like the scheduler does: lookup, then allocate the rest of the prompt.
fn admit(kv: &mut KvCacheManager, s: &mut Sequence) -> usize {
    let hit = kv.get_computed_blocks(s);
    let n = s.num_tokens() - hit.num_tokens;
    assert!(
        kv.allocate_slots(s, n, Some(&hit), true),
        "admission failed"
    );
    s.num_computed_tokens = s.num_tokens();
    hit.num_tokens
}

fn stored_hashes(ev: &[PoolEvent]) -> Vec<BlockHash> {
    ev.iter()
        .filter_map(|e| match e {
            PoolEvent::Stored { hashes, .. } => Some(hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn removed(ev: &[PoolEvent]) -> Vec<BlockHash> {
    ev.iter()
        .filter_map(|e| match e {
            PoolEvent::Removed(h, _) => Some(*h),
            _ => None,
        })
        .collect()
}

#[test]
fn null_block_is_reserved_and_usage_counts_the_rest() {
    let pool = BlockPool::new(5, true).unwrap();
    assert_eq!(pool.num_free(), 4);
    assert!(!pool.free_queue().contains(&NULL_BLOCK));
    assert_eq!(pool.usage(), 0.0);
    assert!(BlockPool::new(1, true).is_err());
}

#[test]
fn hit_is_capped_at_num_tokens_minus_one() {
    let mut kv = KvCacheManager::new(32, BS, true).unwrap();
    let prompt: Vec<u32> = (0..8).collect(); // exactly 2 blocks
    let mut a = seq(1, prompt.clone());
    assert_eq!(admit(&mut kv, &mut a), 0);
    kv.free(1);
    // Same 8 tokens: both blocks are cached, but only (8-1)//4 = 1 block may be used.
    let b = seq(2, prompt.clone());
    assert_eq!(kv.get_computed_blocks(&b).num_tokens, 4);
    // 9 tokens: (9-1)//4 = 2 blocks.
    let mut p9 = prompt.clone();
    p9.push(99);
    let c = seq(3, p9);
    assert_eq!(kv.get_computed_blocks(&c).num_tokens, 8);
    // A different first block: no hit at all, even though block 1's tokens match.
    let mut d_prompt = prompt;
    d_prompt[0] = 500;
    d_prompt.push(1);
    let d = seq(4, d_prompt);
    assert_eq!(kv.get_computed_blocks(&d).num_tokens, 0);
}

#[test]
fn stored_events_chain_parents_and_carry_tokens() {
    let mut kv = KvCacheManager::new(32, BS, true).unwrap();
    let mut a = seq(1, (0..10).collect());
    admit(&mut kv, &mut a);
    let ev = kv.take_events();
    assert_eq!(ev.len(), 1);
    match &ev[0] {
        PoolEvent::Stored {
            parent,
            hashes,
            token_ids,
            first_block,
            ..
        } => {
            assert_eq!(*parent, None);
            assert_eq!(hashes, &a.block_hashes[..2]);
            assert_eq!(token_ids, &(0..8).collect::<Vec<u32>>());
            assert_eq!(*first_block, 0);
        }
        other => panic!("unexpected {other:?}"),
    }
    // A request extending the prefix stores only its new blocks, parented on the last hit.
    let mut b = seq(2, (0..13).collect());
    assert_eq!(admit(&mut kv, &mut b), 8);
    let ev = kv.take_events();
    match &ev[..] {
        [PoolEvent::Stored {
            parent,
            hashes,
            token_ids,
            ..
        }] => {
            assert_eq!(*parent, Some(b.block_hashes[1]));
            assert_eq!(hashes, &b.block_hashes[2..3]);
            assert_eq!(token_ids, &(8..12).collect::<Vec<u32>>());
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn lru_eviction_order_tail_blocks_first_and_events() {
    // 1 null + 4 usable blocks.
    let mut kv = KvCacheManager::new(5, BS, true).unwrap();
    let mut a = seq(1, (0..9).collect()); // 3 blocks (2 full + partial)
    admit(&mut kv, &mut a);
    kv.free(1);
    let _ = kv.take_events();
    // Freed in reverse: the unhashed partial block goes to the head, then the full blocks are
    // appended tail-first, so block 1 of the request is evicted before block 0.
    let q = kv.pool().free_queue();
    assert_eq!(q.len(), 4);
    let a_blocks: Vec<u32> = q
        .iter()
        .copied()
        .filter(|b| kv.pool().block_hash(*b).is_some())
        .collect();
    assert_eq!(
        kv.pool().block_hash(a_blocks[0]),
        Some((a.block_hashes[1], 0))
    );
    assert_eq!(
        kv.pool().block_hash(a_blocks[1]),
        Some((a.block_hashes[0], 0))
    );

    // Queue now: [a's partial block (never hashed, prepended), the never-used block, a's block 1,
    // a's block 0]. A 16-token unrelated request takes all four: a's block 1 is evicted before
    // a's block 0.
    assert_eq!(kv.pool().block_hash(q[0]), None);
    let mut b = seq(2, (100..116).collect());
    admit(&mut kv, &mut b);
    let ev = kv.take_events();
    assert_eq!(removed(&ev), vec![a.block_hashes[1], a.block_hashes[0]]);
    assert_eq!(stored_hashes(&ev), b.block_hashes[..4].to_vec());
    // Removals are emitted before the new blocks are stored (allocation precedes caching).
    assert!(matches!(ev[0], PoolEvent::Removed(..)));
    assert!(matches!(ev.last(), Some(PoolEvent::Stored { .. })));
}

#[test]
fn pinned_blocks_are_never_evicted_and_requests_that_do_not_fit_wait() {
    let mut kv = KvCacheManager::new(5, BS, true).unwrap();
    let mut a = seq(1, (0..8).collect()); // holds 2 blocks
    admit(&mut kv, &mut a);
    let mut b = seq(2, (100..108).collect()); // holds the other 2
    admit(&mut kv, &mut b);
    let _ = kv.take_events();
    assert_eq!(kv.pool().num_free(), 0);
    let c = seq(3, (200..204).collect());
    let hit = kv.get_computed_blocks(&c);
    assert!(!kv.allocate_slots(&c, 4, Some(&hit), true));
    assert!(kv.take_events().is_empty(), "no eviction of pinned blocks");
    assert_eq!(kv.pool().num_cached_hashes(), 4);
    kv.free(2);
    assert!(kv.allocate_slots(&c, 4, Some(&hit), true));
    // Only b's blocks were candidates.
    for h in removed(&kv.take_events()) {
        assert!(b.block_hashes.contains(&h));
    }
    for h in &a.block_hashes {
        assert!(kv.pool().get_cached_block(h, 0).is_some());
    }
}

#[test]
fn freed_blocks_keep_their_hash_and_a_hit_revives_them() {
    let mut kv = KvCacheManager::new(8, BS, true).unwrap();
    let mut a = seq(1, (0..9).collect());
    admit(&mut kv, &mut a);
    kv.free(1);
    let free_before = kv.pool().num_free();
    let _ = kv.take_events();
    let mut b = seq(2, (0..9).collect());
    assert_eq!(admit(&mut kv, &mut b), 8);
    // The two hit blocks left the free queue (ref_cnt 1) and nothing was re-stored.
    let blocks = kv.blocks_of(2).to_vec();
    assert_eq!(kv.pool().ref_cnt(blocks[0]), 1);
    assert!(!kv.pool().free_queue().contains(&blocks[0]));
    assert_eq!(kv.pool().num_free(), free_before - 3);
    assert!(kv.take_events().is_empty());
}

#[test]
fn shared_blocks_count_references() {
    let mut kv = KvCacheManager::new(16, BS, true).unwrap();
    let mut a = seq(1, (0..9).collect());
    admit(&mut kv, &mut a);
    let mut b = seq(2, (0..9).collect());
    admit(&mut kv, &mut b);
    let shared = kv.blocks_of(1)[0];
    assert_eq!(kv.blocks_of(2)[0], shared);
    assert_eq!(kv.pool().ref_cnt(shared), 2);
    kv.free(1);
    assert_eq!(kv.pool().ref_cnt(shared), 1);
    assert!(!kv.pool().free_queue().contains(&shared));
    kv.free(2);
    assert!(kv.pool().free_queue().contains(&shared));
}

#[test]
fn concurrent_identical_blocks_are_cached_twice_and_removed_twice() {
    // Two requests computing the same new block in one step (the second looked up before the
    // first cached): vLLM caches both blocks under one hash and emits two BlockStored; each
    // block's eviction later emits its own BlockRemoved.
    let mut kv = KvCacheManager::new(8, BS, true).unwrap();
    let a = seq(1, (0..5).collect());
    let b = seq(2, (0..5).collect());
    let ha = kv.get_computed_blocks(&a);
    let hb = kv.get_computed_blocks(&b);
    assert!(kv.allocate_slots(&a, 5, Some(&ha), true));
    assert!(kv.allocate_slots(&b, 5, Some(&hb), true));
    assert_eq!(
        stored_hashes(&kv.take_events()),
        vec![a.block_hashes[0], a.block_hashes[0]]
    );
    assert_ne!(kv.blocks_of(1)[0], kv.blocks_of(2)[0]);
    kv.free(1);
    kv.free(2);
    // Take every usable block: both copies are evicted.
    let c = seq(3, (100..128).collect());
    let hc = kv.get_computed_blocks(&c);
    assert!(kv.allocate_slots(&c, 28, Some(&hc), true));
    let ev = kv.take_events();
    assert_eq!(removed(&ev), vec![a.block_hashes[0], a.block_hashes[0]]);
}

#[test]
fn report_full_mode_reannounces_hits_without_parent() {
    let mut kv = KvCacheManager::new(16, BS, true).unwrap();
    let mut a = seq(1, (0..9).collect());
    admit(&mut kv, &mut a);
    kv.free(1);
    let _ = kv.take_events();
    let mut b = seq(2, (0..13).collect());
    b.report_full = true;
    admit(&mut kv, &mut b);
    let ev = kv.take_events();
    match &ev[..] {
        [PoolEvent::Stored {
            parent: None,
            hashes: h0,
            token_ids: t0,
            ..
        }, PoolEvent::Stored {
            parent: Some(p),
            hashes: h1,
            ..
        }] => {
            assert_eq!(h0, &b.block_hashes[..2]);
            assert_eq!(t0.len(), 8);
            assert_eq!(*p, b.block_hashes[1]);
            assert_eq!(h1, &b.block_hashes[2..3]);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn reset_clears_only_when_idle_and_emits_all_blocks_cleared() {
    let mut kv = KvCacheManager::new(8, BS, true).unwrap();
    let mut a = seq(1, (0..9).collect());
    admit(&mut kv, &mut a);
    let _ = kv.take_events();
    assert!(!kv.reset_prefix_cache(), "blocks are held");
    assert!(kv.take_events().is_empty());
    kv.free(1);
    assert!(kv.reset_prefix_cache());
    assert_eq!(kv.take_events(), vec![PoolEvent::Cleared]);
    assert_eq!(kv.pool().num_cached_hashes(), 0);
    let b = seq(2, (0..9).collect());
    assert_eq!(kv.get_computed_blocks(&b).num_tokens, 0);
}

#[test]
fn generated_tokens_fill_and_cache_blocks_during_decode() {
    let mut kv = KvCacheManager::new(16, BS, true).unwrap();
    let mut s = seq(1, (0..6).collect());
    admit(&mut kv, &mut s);
    assert_eq!(stored_hashes(&kv.take_events()).len(), 1);
    // Decode: sample tokens and compute them one by one, as the scheduler does.
    let mut stored = Vec::new();
    for _ in 0..4 {
        let t = s.source.next_token();
        s.append_token(t);
        assert!(kv.allocate_slots(&s, 1, None, false));
        s.num_computed_tokens += 1;
        stored.extend(stored_hashes(&kv.take_events()));
    }
    // 10 tokens computed: block 1 (tokens 4..8) is full and was cached once.
    assert_eq!(stored, vec![s.block_hashes[1]]);
}

#[test]
fn toy_hasher_chains() {
    let a = ToyHasher.hash_block(None, 0, &[1, 2]);
    let b = ToyHasher.hash_block(Some(&a), 1, &[1, 2]);
    assert_ne!(a, b);
}
