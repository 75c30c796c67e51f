use kvroute_core::events::{BlockRemoved, BlockStored, KvEvent, Medium, WireBlockHash};
use kvroute_core::hashing::{ExtraKeyStyle, RequestExtras};
use kvroute_core::router_key::{chain, request_keys, RouterKey, ROOT};

use super::*;

pub(super) const BS: usize = 4;

/// Tokens of block `b` of a conversation `conv`.
pub(super) fn block_tokens(conv: u32, b: usize) -> Vec<u32> {
    (0..BS as u32)
        .map(|t| conv * 100_000 + b as u32 * 10 + t)
        .collect()
}

/// A fake engine hash for block `b` of `conv` on a replica hashing with `salt`.
pub(super) fn eh(conv: u32, b: usize, salt: u64) -> u64 {
    (u64::from(conv) << 32 | b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt
}

pub(super) fn stored(
    conv: u32,
    blocks: std::ops::Range<usize>,
    medium: Medium,
    salt: u64,
) -> KvEvent {
    let parent = if blocks.start == 0 {
        None
    } else {
        Some(WireBlockHash::Int(eh(conv, blocks.start - 1, salt)))
    };
    KvEvent::BlockStored(BlockStored {
        block_hashes: blocks
            .clone()
            .map(|b| WireBlockHash::Int(eh(conv, b, salt)))
            .collect(),
        parent_block_hash: parent,
        token_ids: blocks.clone().flat_map(|b| block_tokens(conv, b)).collect(),
        block_size: BS as u32,
        medium: Some(medium),
        ..BlockStored::default()
    })
}

pub(super) fn removed(conv: u32, blocks: &[usize], medium: Medium, salt: u64) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: blocks
            .iter()
            .map(|&b| WireBlockHash::Int(eh(conv, b, salt)))
            .collect(),
        medium: Some(medium),
        ..BlockRemoved::default()
    })
}

/// Router keys of the first `n` blocks of `conv`, computed the way a request computes them.
pub(super) fn keys(conv: u32, n: usize) -> Vec<RouterKey> {
    let tokens: Vec<u32> = (0..n).flat_map(|b| block_tokens(conv, b)).collect();
    request_keys(
        &tokens,
        BS,
        &RequestExtras::default(),
        ExtraKeyStyle::Tagged,
    )
}

pub(super) fn m(replica: u32, gpu: u32, predicted: u32, cpu: u32, storage: u32) -> ReplicaMatch {
    ReplicaMatch {
        replica,
        gpu,
        predicted,
        cpu,
        storage,
    }
}

pub(super) fn apply(ix: &mut KvIndex, r: u32, ev: &KvEvent) -> ApplyOutcome {
    ix.apply(r, ev).expect("event applies")
}

#[test]
fn chaining_from_parent_matches_request_keys() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..3, Medium::Gpu, 0));
    let out = apply(&mut ix, 0, &stored(1, 3..5, Medium::Gpu, 0));
    assert_eq!(out.stored, 2);
    assert_eq!(ix.lookup(&keys(1, 5), 0), vec![m(0, 5, 0, 0, 0)]);
    // Longer request: the match stops where the replica's chain stops.
    assert_eq!(ix.lookup(&keys(1, 9), 0), vec![m(0, 5, 0, 0, 0)]);
    // The key of block 3 is the chain of block 2's key, as if stored in one event.
    let k2 = ix.key_of_engine_hash(eh(1, 2, 0)).expect("block 2 known");
    assert_eq!(
        ix.key_of_engine_hash(eh(1, 3, 0)),
        Some(chain(k2, &block_tokens(1, 3), None))
    );
    assert_eq!(
        ix.key_of_engine_hash(eh(1, 0, 0)),
        Some(chain(ROOT, &block_tokens(1, 0), None))
    );
    let s = ix.stats();
    assert_eq!((s.blocks, s.entries, s.replicas), (5, 5, 1));
}

#[test]
fn parent_unknown_drops_the_event_and_counts_it() {
    let mut ix = KvIndex::default();
    let err = ix
        .apply(0, &stored(1, 3..5, Medium::Gpu, 0))
        .expect_err("no parent");
    assert!(
        matches!(
            err,
            IndexError::ParentUnknown {
                replica: 0,
                blocks: 2,
                ..
            }
        ),
        "{err}"
    );
    let s = ix.stats();
    assert_eq!(
        (
            s.blocks,
            s.entries,
            s.parent_unknown,
            s.parent_unknown_blocks
        ),
        (0, 0, 1, 2)
    );
}

#[test]
fn invalid_event_is_rejected_without_change() {
    let mut ix = KvIndex::default();
    let KvEvent::BlockStored(mut st) = stored(1, 0..2, Medium::Gpu, 0) else {
        unreachable!()
    };
    st.token_ids.pop();
    let err = ix
        .apply(0, &KvEvent::BlockStored(st))
        .expect_err("bad token count");
    assert!(matches!(err, IndexError::InvalidEvent { .. }));
    assert_eq!(ix.stats().blocks, 0);
    assert_eq!(ix.stats().invalid_events, 1);
}

#[test]
fn lora_id_without_name_or_extra_keys_is_rejected() {
    // vLLM <= 0.11 names a LoRA block only by `lora_id`; it is not a base-model block.
    let mut ix = KvIndex::default();
    let KvEvent::BlockStored(mut st) = stored(1, 0..2, Medium::Gpu, 0) else {
        unreachable!()
    };
    st.lora_id = Some(1);
    let err = ix
        .apply(0, &KvEvent::BlockStored(st.clone()))
        .expect_err("lora_id only");
    assert!(
        matches!(
            err,
            IndexError::LoraIdOnly {
                replica: 0,
                lora_id: 1,
                blocks: 2
            }
        ),
        "{err}"
    );
    assert_eq!((ix.stats().blocks, ix.stats().invalid_events), (0, 1));
    assert_eq!(ix.lookup(&keys(1, 2), 0), vec![]);
    // With its name (vLLM >= 0.15) it is keyed under the adapter.
    st.lora_name = Some("sql-lora".into());
    apply(&mut ix, 0, &KvEvent::BlockStored(st));
    assert_eq!(ix.stats().blocks, 2);
    assert_eq!(ix.lookup(&keys(1, 2), 0), vec![]);
}

#[test]
fn removal_cuts_the_match_and_frees_blocks() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..6, Medium::Gpu, 0));
    apply(&mut ix, 1, &stored(1, 0..6, Medium::Gpu, 0));
    let out = apply(&mut ix, 0, &removed(1, &[3], Medium::Gpu, 0));
    assert_eq!(out.removed, 1);
    assert_eq!(
        ix.lookup(&keys(1, 6), 0),
        vec![m(0, 3, 0, 0, 0), m(1, 6, 0, 0, 0)]
    );
    // Unknown hashes and blocks the replica does not hold are counted, not errors.
    let out = apply(&mut ix, 0, &removed(1, &[3, 99], Medium::Gpu, 0));
    assert_eq!((out.removed, out.remove_unknown), (0, 2));
    apply(&mut ix, 1, &removed(1, &[0, 1, 2, 3, 4, 5], Medium::Gpu, 0));
    apply(&mut ix, 0, &removed(1, &[0, 1, 2, 4, 5], Medium::Gpu, 0));
    let s = ix.stats();
    assert_eq!(
        (s.blocks, s.entries, s.removed, s.remove_unknown),
        (0, 0, 12, 2)
    );
    assert!(ix.lookup(&keys(1, 6), 0).is_empty());
}

#[test]
fn restart_clears_only_that_replica() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..4, Medium::Gpu, 0));
    apply(&mut ix, 0, &stored(2, 0..2, Medium::Cpu, 0));
    apply(&mut ix, 1, &stored(1, 0..2, Medium::Gpu, 0));
    let out = apply(&mut ix, 0, &KvEvent::AllBlocksCleared);
    assert_eq!(out.cleared, 6);
    assert_eq!(ix.lookup(&keys(1, 4), 0), vec![m(1, 2, 0, 0, 0)]);
    assert!(ix.lookup(&keys(2, 2), 0).is_empty());
    let s = ix.stats();
    assert_eq!((s.blocks, s.entries), (2, 2));
    // The restarted engine starts again from block 0.
    apply(&mut ix, 0, &stored(1, 0..1, Medium::Gpu, 0));
    assert_eq!(
        ix.lookup(&keys(1, 4), 0),
        vec![m(0, 1, 0, 0, 0), m(1, 2, 0, 0, 0)]
    );
    assert_eq!(ix.remove_replica(1), 2);
    assert_eq!(ix.replicas(), vec![(0, 1)]);
    assert_eq!(ix.stats().entries, 1);
}

#[test]
fn re_announced_hits_refresh_without_double_counting() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..4, Medium::Gpu, 0));
    // kv_cache_report_mode "full": a hit on blocks 0..3 is re-announced with no parent.
    let out = apply(&mut ix, 0, &stored(1, 0..3, Medium::Gpu, 0));
    assert_eq!((out.stored, out.refreshed), (0, 3));
    let out = apply(&mut ix, 0, &stored(1, 0..4, Medium::Gpu, 0));
    assert_eq!((out.stored, out.refreshed), (0, 4));
    let s = ix.stats();
    assert_eq!((s.blocks, s.entries, s.stored, s.refreshed), (4, 4, 4, 7));
    // One removal per block is enough: presence, not copies.
    apply(&mut ix, 0, &removed(1, &[0, 1, 2, 3], Medium::Gpu, 0));
    assert_eq!(ix.stats().entries, 0);
    assert!(ix.lookup(&keys(1, 4), 0).is_empty());
}

#[test]
fn gpu_and_cpu_are_two_media_of_one_entry() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..3, Medium::Gpu, 0));
    let out = apply(&mut ix, 0, &stored(1, 0..3, Medium::Cpu, 0));
    assert_eq!(out.stored, 3);
    assert_eq!(ix.stats().entries, 3);
    assert_eq!(ix.holders(keys(1, 1)[0]), vec![(0, MEDIA_GPU | MEDIA_CPU)]);
    assert_eq!(ix.lookup(&keys(1, 3), 0), vec![m(0, 3, 0, 0, 0)]);
    apply(&mut ix, 0, &removed(1, &[0, 1, 2], Medium::Gpu, 0));
    assert_eq!(ix.lookup(&keys(1, 3), 0), vec![m(0, 0, 0, 3, 0)]);
    apply(&mut ix, 0, &removed(1, &[0, 1, 2], Medium::Cpu, 0));
    assert_eq!(ix.stats().entries, 0);
    assert_eq!(ix.stats().blocks, 0);
}

#[test]
fn lookup_reports_tiers_per_replica() {
    let mut ix = KvIndex::default();
    // Replica 0: blocks 0-1 on GPU, 2-3 only on CPU, 4 only on storage.
    apply(&mut ix, 0, &stored(1, 0..5, Medium::Storage, 0));
    apply(&mut ix, 0, &stored(1, 0..4, Medium::Cpu, 0));
    apply(&mut ix, 0, &stored(1, 0..2, Medium::Gpu, 0));
    // Replica 1: all five on CPU. Replica 2: GPU 0-2, then nothing. Replica 3: GPU block 1 only.
    apply(&mut ix, 1, &stored(1, 0..5, Medium::Cpu, 0));
    apply(&mut ix, 2, &stored(1, 0..3, Medium::Gpu, 0));
    apply(&mut ix, 3, &stored(1, 0..2, Medium::Gpu, 0));
    apply(&mut ix, 3, &removed(1, &[0], Medium::Gpu, 0));
    assert_eq!(
        ix.lookup(&keys(1, 8), 0),
        vec![m(0, 2, 0, 2, 1), m(1, 0, 0, 5, 0), m(2, 3, 0, 0, 0)]
    );
    // A GPU block after the CPU tier started does not count (the engine would not use it).
    apply(&mut ix, 4, &stored(1, 0..1, Medium::Cpu, 0));
    apply(&mut ix, 4, &stored(1, 1..2, Medium::Gpu, 0));
    let r4 = ix
        .lookup(&keys(1, 2), 0)
        .into_iter()
        .find(|x| x.replica == 4);
    assert_eq!(r4, Some(m(4, 0, 0, 1, 0)));
    assert!(ix.lookup(&keys(7, 3), 0).is_empty());
    assert!(ix.lookup(&[], 0).is_empty());
}

#[test]
fn held_blocks_follow_stores_and_removals_per_replica() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..4, Medium::Gpu, 0));
    apply(&mut ix, 0, &stored(2, 0..2, Medium::Gpu, 0));
    apply(&mut ix, 1, &stored(1, 0..2, Medium::Gpu, 0));
    let held = ix.held_blocks();
    assert_eq!((held.get(&0), held.get(&1)), (Some(&6), Some(&2)));
    apply(&mut ix, 0, &removed(1, &[2, 3], Medium::Gpu, 0));
    apply(&mut ix, 1, &KvEvent::AllBlocksCleared);
    let held = ix.held_blocks();
    assert_eq!(held.get(&0), Some(&4));
    assert_eq!(held.get(&1).copied().unwrap_or(0), 0);
}

#[test]
fn replicas_hashing_differently_share_router_keys() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..3, Medium::Gpu, 0));
    apply(&mut ix, 1, &stored(1, 0..3, Medium::Gpu, 0xDEAD));
    let s = ix.stats();
    assert_eq!((s.blocks, s.entries, s.engine_hash_aliases), (3, 6, 3));
    assert_eq!(
        ix.lookup(&keys(1, 3), 0),
        vec![m(0, 3, 0, 0, 0), m(1, 3, 0, 0, 0)]
    );
    // Replica 1 chains and removes with its own hashes.
    apply(&mut ix, 1, &stored(1, 3..4, Medium::Gpu, 0xDEAD));
    apply(&mut ix, 1, &removed(1, &[1], Medium::Gpu, 0xDEAD));
    assert_eq!(
        ix.lookup(&keys(1, 4), 0),
        vec![m(0, 3, 0, 0, 0), m(1, 1, 0, 0, 0)]
    );
    ix.clear_replica(0);
    ix.clear_replica(1);
    let s = ix.stats();
    assert_eq!((s.blocks, s.entries, s.engine_hash_aliases), (0, 0, 0));
}

#[test]
fn other_kv_cache_groups_are_ignored_when_one_group_is_configured() {
    let mut ix = KvIndex::new(IndexConfig {
        group_idx: Some(0),
        ..IndexConfig::default()
    });
    let KvEvent::BlockStored(mut st) = stored(1, 0..2, Medium::Gpu, 0) else {
        unreachable!()
    };
    st.group_idx = Some(1);
    let out = apply(&mut ix, 0, &KvEvent::BlockStored(st.clone()));
    assert!(out.ignored);
    assert_eq!(ix.stats().blocks, 0);
    st.group_idx = Some(0);
    apply(&mut ix, 0, &KvEvent::BlockStored(st));
    assert_eq!(ix.stats().blocks, 2);
    assert!(apply(&mut ix, 0, &KvEvent::Unknown("Future".into())).ignored);
}

#[test]
fn predicted_entries_expire_and_are_replaced_by_real_events() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..2, Medium::Gpu, 0));
    // Routed a 4-block request to replica 0 at t=1000 and one to replica 1.
    assert_eq!(
        ix.insert_predicted(0, &keys(1, 4), 1000, 2000)
            .expect("predict"),
        2
    );
    ix.insert_predicted(1, &keys(1, 4), 1000, 2000)
        .expect("predict");
    assert_eq!(
        ix.lookup(&keys(1, 4), 1500),
        vec![m(0, 2, 2, 0, 0), m(1, 0, 4, 0, 0)]
    );
    // The real event for replica 0 replaces its prediction.
    let out = apply(&mut ix, 0, &stored(1, 2..4, Medium::Gpu, 0));
    assert_eq!(out.predicted_replaced, 2);
    assert_eq!(
        ix.lookup(&keys(1, 4), 1500),
        vec![m(0, 4, 0, 0, 0), m(1, 0, 4, 0, 0)]
    );
    // Past the TTL, predictions no longer count, even before they are pruned.
    assert_eq!(ix.lookup(&keys(1, 4), 3000), vec![m(0, 4, 0, 0, 0)]);
    ix.expire_predicted(3000);
    let s = ix.stats();
    assert_eq!(
        (
            s.predicted_entries,
            s.predicted_expired,
            s.predicted_replaced
        ),
        (0, 4, 2)
    );
    assert_eq!(s.predicted_inserted, 6);
}

#[test]
fn a_gpu_block_after_a_predicted_one_counts_as_predicted() {
    // Found by tests/index_reference.rs: replica 1 holds block 1 on GPU but not block 0, which is
    // predicted. The lookup reported `gpu: 1, predicted: 1`, as if block 0 were on GPU.
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..1, Medium::Gpu, 0));
    apply(&mut ix, 1, &stored(1, 1..3, Medium::Gpu, 0));
    apply(&mut ix, 1, &stored(1, 3..4, Medium::Cpu, 0));
    ix.insert_predicted(1, &keys(1, 1), 0, 100)
        .expect("predict");
    assert_eq!(
        ix.lookup(&keys(1, 4), 0),
        vec![m(0, 1, 0, 0, 0), m(1, 0, 3, 1, 0)]
    );
    // GPU, then predicted, then GPU again: the second GPU run is GPU-to-be as well.
    apply(&mut ix, 2, &stored(1, 0..3, Medium::Gpu, 0));
    apply(&mut ix, 2, &removed(1, &[1], Medium::Gpu, 0));
    ix.insert_predicted(2, &keys(1, 3), 0, 100)
        .expect("predict");
    assert_eq!(ix.lookup(&keys(1, 3), 0)[2], m(2, 1, 2, 0, 0));
    // Past the TTL the walk stops where the prediction was.
    assert_eq!(
        ix.lookup(&keys(1, 4), 100),
        vec![m(0, 1, 0, 0, 0), m(2, 1, 0, 0, 0)]
    );
}

#[test]
fn predicted_store_is_bounded() {
    let mut ix = KvIndex::new(IndexConfig {
        max_predicted: 10,
        ..IndexConfig::default()
    });
    for r in 0..20 {
        ix.insert_predicted(r, &keys(r + 100, 3), u64::from(r), 10_000)
            .expect("predict");
        assert!(ix.stats().predicted_entries <= 10);
    }
    let s = ix.stats();
    assert_eq!(s.predicted_entries, 10);
    assert_eq!(s.predicted_evicted, 50);
    // The newest survive.
    assert_eq!(ix.lookup(&keys(119, 3), 20), vec![m(19, 0, 3, 0, 0)]);
    assert!(ix.lookup(&keys(100, 3), 20).is_empty());
}

#[test]
fn budget_is_never_exceeded_and_hot_blocks_survive() {
    let max_bytes = 2 << 20;
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes,
        ..IndexConfig::default()
    });
    // A hot shared prefix, re-announced by hits all along.
    for conv in 0..4000u32 {
        let r = conv % 8;
        apply(&mut ix, r, &stored(0, 0..8, Medium::Gpu, 0));
        apply(&mut ix, r, &stored(conv + 1, 0..16, Medium::Gpu, 0));
        let s = ix.stats();
        assert!(s.bytes_estimate <= max_bytes as u64, "{s:?}");
    }
    let s = ix.stats();
    assert!(s.evicted_for_budget > 0, "{s:?}");
    assert_eq!(s.dropped_for_budget, 0);
    // The hot prefix is still there; the oldest conversations are gone; recent ones remain.
    assert_eq!(ix.lookup(&keys(0, 8), 0).len(), 8);
    assert!(ix.lookup(&keys(1, 16), 0).is_empty());
    assert_eq!(
        ix.lookup(&keys(4000, 16), 0),
        vec![m(3999 % 8, 16, 0, 0, 0)]
    );
    // Entries count matches a fresh walk of the index.
    let walked: u64 = ix
        .export()
        .iter_blocks()
        .map(|(_, _, holders)| holders.len() as u64)
        .sum();
    assert_eq!(walked, s.entries);
    assert_eq!(ix.export().blocks() as u64, s.blocks);
}

#[test]
fn a_budget_too_small_for_anything_drops_and_counts() {
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes: 1000,
        ..IndexConfig::default()
    });
    let out = apply(&mut ix, 0, &stored(1, 0..2, Medium::Gpu, 0));
    assert_eq!(out.dropped_for_budget, 2);
    let s = ix.stats();
    assert_eq!(s.blocks, 0);
    assert!(s.bytes_estimate <= 1000);
}

#[test]
fn snapshot_round_trips_through_postcard() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..5, Medium::Gpu, 0));
    apply(&mut ix, 1, &stored(1, 0..3, Medium::Cpu, 7));
    apply(&mut ix, 2, &stored(2, 0..4, Medium::Gpu, 0));
    for r in 3..8 {
        apply(&mut ix, r, &stored(1, 0..2, Medium::Gpu, 0));
    }
    ix.remove_replica(2);
    apply(&mut ix, 9, &stored(3, 0..1, Medium::Gpu, 0));
    apply(&mut ix, 9, &removed(3, &[0], Medium::Gpu, 0));
    let snap = ix.export();
    let bytes = postcard::to_allocvec(&snap).expect("encode");
    let back: IndexSnapshot = postcard::from_bytes(&bytes).expect("decode");
    assert_eq!(back, snap);
    let mut ix2 = KvIndex::import(IndexConfig::default(), &back).expect("import");
    for conv in 1..4 {
        assert_eq!(ix2.lookup(&keys(conv, 6), 0), ix.lookup(&keys(conv, 6), 0));
    }
    let (a, b) = (ix.stats(), ix2.stats());
    assert_eq!(
        (a.blocks, a.entries, a.engine_hash_aliases),
        (b.blocks, b.entries, b.engine_hash_aliases)
    );
    assert_eq!(ix2.replicas(), ix.replicas());
    // Events keep applying after import: chaining and alias removal still work.
    apply(&mut ix2, 1, &removed(1, &[0], Medium::Cpu, 7));
    apply(&mut ix2, 0, &stored(1, 5..6, Medium::Gpu, 0));
    assert_eq!(ix2.lookup(&keys(1, 6), 0)[0], m(0, 6, 0, 0, 0));
    let bad = IndexSnapshot {
        version: 99,
        ..snap
    };
    assert!(matches!(
        KvIndex::import(IndexConfig::default(), &bad),
        Err(IndexError::SnapshotVersion { found: 99, .. })
    ));
    // Arrays that disagree are refused, not half-imported.
    let mut short = ix.export();
    short.holders.pop();
    assert!(matches!(
        KvIndex::import(IndexConfig::default(), &short),
        Err(IndexError::SnapshotCorrupt)
    ));
    let mut stray = ix.export();
    stray.holders[0] = 200 << 8 | 1;
    assert!(matches!(
        KvIndex::import(IndexConfig::default(), &stray),
        Err(IndexError::SnapshotCorrupt)
    ));
}

#[test]
fn budget_holds_when_replicas_hash_differently() {
    // Every replica names the same blocks with its own engine hashes (another seed or LoRA path):
    // the index keeps one node per block plus aliases for the other hashes, which count too.
    let max_bytes = 2 << 20;
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes,
        ..IndexConfig::default()
    });
    for conv in 0..3000u32 {
        for r in 0..4u32 {
            apply(
                &mut ix,
                r,
                &stored(conv, 0..16, Medium::Gpu, u64::from(r) + 1),
            );
            let s = ix.stats();
            assert!(
                s.bytes_estimate <= max_bytes as u64,
                "conv {conv} replica {r}: {s:?}"
            );
        }
    }
    let s = ix.stats();
    assert!(s.engine_hash_aliases > 0, "{s:?}");
    assert!(s.evicted_for_budget > 0, "{s:?}");
    // A removal by an aliased hash still finds its block while it is indexed.
    let last = 2999;
    apply(&mut ix, 3, &removed(last, &[15], Medium::Gpu, 4));
    let m = ix.lookup(&keys(last, 16), 0);
    assert!(m.iter().any(|m| m.replica == 3 && m.gpu == 15), "{m:?}");
}

#[test]
fn budget_holds_for_long_unique_chains_from_many_replicas() {
    // The ingest benchmark's shape, scaled down: 512-block conversations sharing a 128-block
    // prefix, in 8 events of 64 blocks, from 64 replicas, far more than the budget holds.
    let max_bytes = 4 << 20;
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes,
        ..IndexConfig::default()
    });
    for conv in 0..600u32 {
        for e in 0..8usize {
            let ev = if e < 2 {
                stored(0, e * 64..(e + 1) * 64, Medium::Gpu, 0)
            } else {
                let KvEvent::BlockStored(mut st) =
                    stored(conv + 1, e * 64..(e + 1) * 64, Medium::Gpu, 0)
                else {
                    unreachable!("stored() builds a BlockStored")
                };
                if e == 2 {
                    st.parent_block_hash = Some(WireBlockHash::Int(eh(0, 127, 0)));
                }
                KvEvent::BlockStored(st)
            };
            apply(&mut ix, conv % 64, &ev);
            let s = ix.stats();
            assert!(
                s.bytes_estimate <= max_bytes as u64,
                "conv {conv} event {e}: {s:?}"
            );
        }
    }
    let s = ix.stats();
    assert!(s.evicted_for_budget > 0, "{s:?}");
    // The shared prefix is hot and held by every replica: it survives the churn.
    assert_eq!(ix.lookup(&keys(0, 128), 0).len(), 64);
}

#[test]
fn the_shared_handle_applies_a_batch_and_runs_the_follow_up_under_its_lock() {
    let ix = SharedIndex::new(IndexConfig::default());
    // One chain from the root, one whose parent nobody stored.
    let batch = [
        stored(1, 0..3, Medium::Gpu, 0),
        stored(2, 5..6, Medium::Gpu, 0),
    ];
    let (out, seen) = ix.apply_batch(7, &batch, |o| (o.applied, o.rejected));
    assert_eq!((out.applied, out.rejected), (1, 1));
    assert_eq!(seen, (1, 1), "the follow-up sees the batch's outcome");
    assert!(matches!(
        out.first_error,
        Some(IndexError::ParentUnknown { .. })
    ));
    let found = ix.lookup(&keys(1, 3), 0);
    assert_eq!(
        found.iter().map(|m| (m.replica, m.gpu)).collect::<Vec<_>>(),
        [(7, 3)]
    );
    assert!(ix.lookup(&[], 0).is_empty());
    assert_eq!(out.duplicated, 0);

    // Another replica computes the same blocks: each is prefill computed twice; storing them
    // again there (a re-announced hit) or on CPU is not.
    let (again, ()) = ix.apply_batch(8, &[stored(1, 0..3, Medium::Gpu, 0)], |_| ());
    assert_eq!((again.stored, again.duplicated), (3, 3));
    let (refreshed, ()) = ix.apply_batch(8, &[stored(1, 0..3, Medium::Gpu, 0)], |_| ());
    assert_eq!((refreshed.stored, refreshed.duplicated), (0, 0));
    let (cpu, ()) = ix.apply_batch(9, &[stored(1, 0..3, Medium::Cpu, 0)], |_| ());
    assert_eq!((cpu.stored, cpu.duplicated), (3, 0));
    ix.remove_streams([8, 9]);

    // Export, clear, import: the entries come back.
    let (snap, ()) = ix.export(|| ());
    let (dropped, ()) = ix.clear_stream(7, || ());
    assert_eq!(dropped, 3);
    assert!(ix.lookup(&keys(1, 3), 0).iter().all(|m| m.total() == 0));
    ix.import(&snap, || ()).expect("import");
    assert_eq!(ix.lookup(&keys(1, 3), 0)[0].gpu, 3);
    ix.remove_streams([7]);
    assert!(ix.entries_by_stream().is_empty());
}
