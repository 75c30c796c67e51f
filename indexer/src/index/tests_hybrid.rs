//! The index on hybrid models: several KV cache groups, sliding windows (vLLM's hybrid hit rule).

use kvroute_core::events::{BlockStored, KvEvent, Medium};

use super::tests::{apply, keys, m, removed, stored, BS};
use super::*;

/// `stored` in KV cache group `group` of kind `kind` (window in tokens for sliding windows).
fn stored_in(
    group: i64,
    window: Option<i64>,
    conv: u32,
    blocks: std::ops::Range<usize>,
) -> KvEvent {
    let KvEvent::BlockStored(st) = stored(conv, blocks, Medium::Gpu, 0) else {
        unreachable!()
    };
    KvEvent::BlockStored(BlockStored {
        group_idx: Some(group),
        kv_cache_spec_kind: Some(
            if window.is_some() {
                "sliding_window"
            } else {
                "full_attention"
            }
            .into(),
        ),
        kv_cache_spec_sliding_window: window,
        ..st
    })
}

fn removed_in(group: i64, conv: u32, blocks: &[usize]) -> KvEvent {
    let KvEvent::BlockRemoved(mut rm) = removed(conv, blocks, Medium::Gpu, 0) else {
        unreachable!()
    };
    rm.group_idx = Some(group);
    KvEvent::BlockRemoved(rm)
}

/// A window of 9 tokens with blocks of 4 needs the last ceil(8 / 4) = 2 blocks.
const WINDOW: i64 = 2 * BS as i64 + 1;

/// gpt-oss-like layout: group 0 sliding window, group 1 full attention; `conv`'s blocks `0..n`
/// stored in both.
fn gpt_oss_like(ix: &mut KvIndex, replica: u32, conv: u32, n: usize) {
    apply(ix, replica, &stored_in(0, Some(WINDOW), conv, 0..n));
    apply(ix, replica, &stored_in(1, None, conv, 0..n));
}

#[test]
fn a_sliding_group_needs_only_the_blocks_of_the_last_window() {
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 8);
    assert_eq!(ix.lookup(&keys(1, 8), 0), vec![m(0, 8, 0, 0, 0)]);
    assert_eq!(ix.lookup(&keys(1, 5), 0), vec![m(0, 5, 0, 0, 0)]);
    // vLLM evicts the sliding group's early blocks first (freed as they leave the window): the
    // full 8-block hit stays, since the window before block 8 (blocks 6, 7) is held.
    apply(&mut ix, 0, &removed_in(0, 1, &[0, 1, 2, 3, 4, 5]));
    assert_eq!(ix.lookup(&keys(1, 8), 0), vec![m(0, 8, 0, 0, 0)]);
    // A shorter request ends where its own window is gone: no hit at 5 blocks.
    assert_eq!(ix.lookup(&keys(1, 5), 0), vec![]);
    // Block 6 gone too: no two contiguous sliding blocks before any hit point.
    apply(&mut ix, 0, &removed_in(0, 1, &[6]));
    assert_eq!(ix.lookup(&keys(1, 8), 0), vec![]);
    assert_eq!(ix.layout(0).len(), 2);
}

#[test]
fn group_zero_only_indexing_is_wrong_on_the_same_events() {
    // The constructed case: the sliding group (group 0, as vLLM numbers gpt-oss's and Gemma 3's
    // groups) lost its out-of-window blocks. vLLM serves 8 blocks; an index of group 0 alone,
    // read as full attention, predicts none.
    let mut hybrid = KvIndex::default();
    let mut group0 = KvIndex::new(IndexConfig {
        group_idx: Some(0),
        ..IndexConfig::default()
    });
    for ix in [&mut hybrid, &mut group0] {
        gpt_oss_like(ix, 0, 1, 8);
        apply(ix, 0, &removed_in(0, 1, &[0, 1, 2, 3, 4, 5]));
    }
    assert_eq!(hybrid.lookup(&keys(1, 8), 0), vec![m(0, 8, 0, 0, 0)]);
    assert_eq!(group0.lookup(&keys(1, 8), 0), vec![]);
    // And the other way: the full group lost a block, group 0 did not. vLLM gives 3.
    let mut hybrid = KvIndex::default();
    let mut group0 = KvIndex::new(IndexConfig {
        group_idx: Some(0),
        ..IndexConfig::default()
    });
    for ix in [&mut hybrid, &mut group0] {
        gpt_oss_like(ix, 0, 1, 8);
        apply(ix, 0, &removed_in(1, 1, &[3]));
    }
    assert_eq!(hybrid.lookup(&keys(1, 8), 0), vec![m(0, 3, 0, 0, 0)]);
    assert_eq!(group0.lookup(&keys(1, 8), 0), vec![m(0, 8, 0, 0, 0)]);
}

#[test]
fn every_group_must_serve_the_hit() {
    let mut ix = KvIndex::default();
    // Only the sliding group has reported the blocks: the full group holds nothing.
    apply(&mut ix, 0, &stored_in(0, Some(WINDOW), 1, 0..6));
    apply(&mut ix, 0, &stored_in(1, None, 2, 0..1));
    assert_eq!(ix.lookup(&keys(1, 6), 0), vec![]);
    apply(&mut ix, 0, &stored_in(1, None, 1, 0..4));
    assert_eq!(ix.lookup(&keys(1, 6), 0), vec![m(0, 4, 0, 0, 0)]);
}

#[test]
fn gemma3_like_five_sliding_groups_and_one_full() {
    let mut ix = KvIndex::default();
    for g in 0..5 {
        apply(&mut ix, 0, &stored_in(g, Some(WINDOW), 1, 0..10));
    }
    apply(&mut ix, 0, &stored_in(5, None, 1, 0..10));
    assert_eq!(ix.lookup(&keys(1, 10), 0), vec![m(0, 10, 0, 0, 0)]);
    // One sliding group lost block 8: the hit falls back to the last point where all five
    // windows are whole (blocks 6, 7 before 8).
    apply(&mut ix, 0, &removed_in(3, 1, &[8]));
    assert_eq!(ix.lookup(&keys(1, 10), 0), vec![m(0, 8, 0, 0, 0)]);
    // Entries are per (block, replica, group): 10 blocks x 6 groups, minus one.
    assert_eq!(ix.stats().entries, 59);
    assert_eq!(ix.replicas(), vec![(0, 59)]);
    assert_eq!(ix.stats().replicas, 1);
}

#[test]
fn plain_and_hybrid_replicas_side_by_side() {
    let mut ix = KvIndex::default();
    apply(&mut ix, 0, &stored(1, 0..5, Medium::Gpu, 0));
    apply(&mut ix, 0, &stored(1, 5..6, Medium::Cpu, 0));
    gpt_oss_like(&mut ix, 1, 1, 4);
    assert_eq!(
        ix.lookup(&keys(1, 8), 0),
        vec![m(0, 5, 0, 1, 0), m(1, 4, 0, 0, 0)]
    );
}

#[test]
fn predictions_stand_for_every_group() {
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 3);
    ix.insert_predicted(0, &keys(1, 6), 1_000, 500)
        .expect("predicted");
    assert_eq!(ix.lookup(&keys(1, 6), 1_000), vec![m(0, 3, 3, 0, 0)]);
    assert_eq!(ix.lookup(&keys(1, 6), 2_000), vec![m(0, 3, 0, 0, 0)]);
}

#[test]
fn a_prediction_bridges_a_gap_before_blocks_every_group_holds() {
    // Both groups lost blocks 0-2 (no replica holds them); 3-5 are still held. A sibling routed
    // here predicts 0-5: with the predicted blocks computed, vLLM serves all six.
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 6);
    for g in 0..2 {
        apply(&mut ix, 0, &removed_in(g, 1, &[0, 1, 2]));
    }
    assert_eq!(ix.lookup(&keys(1, 6), 1_000), vec![]);
    assert_eq!(ix.insert_predicted(0, &keys(1, 6), 1_000, 500), Ok(3));
    assert_eq!(ix.lookup(&keys(1, 6), 1_000), vec![m(0, 0, 6, 0, 0)]);
}

#[test]
fn a_block_is_predicted_unless_every_group_holds_it() {
    // The full-attention group (1) lost block 3, the sliding group still has it: the sibling's
    // prediction must cover block 3 for the full group.
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 4);
    apply(&mut ix, 0, &removed_in(1, 1, &[3]));
    assert_eq!(ix.lookup(&keys(1, 4), 1_000), vec![m(0, 3, 0, 0, 0)]);
    assert_eq!(ix.insert_predicted(0, &keys(1, 4), 1_000, 500), Ok(1));
    assert_eq!(ix.lookup(&keys(1, 4), 1_000), vec![m(0, 3, 1, 0, 0)]);
}

#[test]
fn a_store_in_any_group_replaces_the_prediction() {
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 2, 1);
    assert_eq!(ix.insert_predicted(0, &keys(1, 2), 1_000, 500), Ok(2));
    // Group 1 (not the group-0 slot the predictions sit on) stores them.
    let out = apply(&mut ix, 0, &stored_in(1, None, 1, 0..2));
    assert_eq!(out.predicted_replaced, 2);
    assert_eq!(ix.stats().predicted_entries, 0);
}

#[test]
fn a_block_computed_twice_counts_once_per_replica_not_per_group() {
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 3);
    // Replica 1 computes the same blocks: one duplicate per block, whatever its group count.
    let first = apply(&mut ix, 1, &stored_in(0, Some(WINDOW), 1, 0..3));
    let second = apply(&mut ix, 1, &stored_in(1, None, 1, 0..3));
    assert_eq!((first.duplicated, second.duplicated), (3, 0));
    // The same replica's second group is not "elsewhere".
    let mut ix = KvIndex::default();
    let out = [
        apply(&mut ix, 0, &stored_in(0, Some(WINDOW), 1, 0..3)),
        apply(&mut ix, 0, &stored_in(1, None, 1, 0..3)),
    ];
    assert_eq!(out.map(|o| o.duplicated), [0, 0]);
}

#[test]
fn clearing_and_removing_a_hybrid_replica_forgets_every_group() {
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 4);
    gpt_oss_like(&mut ix, 1, 1, 4);
    assert_eq!(ix.clear_replica(0), 8);
    assert_eq!(ix.lookup(&keys(1, 4), 0), vec![m(1, 4, 0, 0, 0)]);
    assert_eq!(ix.remove_replica(1), 8);
    assert!(ix.lookup(&keys(1, 4), 0).is_empty());
    assert_eq!(ix.stats().blocks, 0);
    assert!(ix.layout(1).is_empty());
}

#[test]
fn unsupported_group_kinds_are_ignored() {
    let mut ix = KvIndex::default();
    let KvEvent::BlockStored(mut st) = stored_in(1, None, 1, 0..2) else {
        unreachable!()
    };
    st.kv_cache_spec_kind = Some("mamba".into());
    assert!(apply(&mut ix, 0, &KvEvent::BlockStored(st)).ignored);
    let KvEvent::BlockStored(mut st) = stored_in(0, Some(WINDOW), 1, 0..2) else {
        unreachable!()
    };
    st.kv_cache_spec_sliding_window = None;
    assert!(apply(&mut ix, 0, &KvEvent::BlockStored(st)).ignored);
    assert_eq!(ix.stats().ignored_events, 2);
}

#[test]
fn hash_block_keys_of_a_finer_prefix_match_unit_are_skipped_without_touching_the_layout() {
    // `--prefix-match-unit 2` with blocks of 4: after blocks 0-2 the engine keys block 2 by the
    // hash of its first 2 tokens too (one hash, block size 2, parent the hash block before).
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 3);
    let KvEvent::BlockStored(full) = stored_in(1, None, 1, 2..3) else {
        unreachable!()
    };
    let hash_block = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![kvroute_core::events::WireBlockHash::Int(0xfeed)],
        parent_block_hash: Some(kvroute_core::events::WireBlockHash::Int(0xbeef)),
        token_ids: full.token_ids[..2].to_vec(),
        block_size: 2,
        ..full
    });
    let out = apply(&mut ix, 0, &hash_block);
    assert!(out.ignored);
    let stats = ix.stats();
    assert_eq!(
        (
            stats.hash_block_events,
            stats.parent_unknown,
            stats.invalid_events
        ),
        (1, 0, 0)
    );
    assert!(ix
        .layout(0)
        .iter()
        .flatten()
        .all(|g| g.block_size == BS as u32));
    assert_eq!(ix.lookup(&keys(1, 3), 0), vec![m(0, 3, 0, 0, 0)]);
}

#[test]
fn a_block_computed_again_while_held_is_a_second_copy_each_evicted_on_its_own() {
    // The sliding group lost the window before block 2, so a request recomputes blocks 2-5 of
    // the full group it still holds: vLLM caches second physical blocks under the same hashes
    // and later evicts each copy with its own BlockRemoved.
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 6);
    let again = apply(&mut ix, 0, &stored_in(1, None, 1, 2..6));
    assert_eq!((again.stored, again.refreshed), (0, 4));
    assert_eq!(ix.stats().extra_copies, 4);
    apply(&mut ix, 0, &removed_in(1, 1, &[2, 3, 4, 5]));
    assert_eq!(
        ix.group_holders(keys(1, 6)[5]),
        vec![(0, 0, MEDIA_GPU), (0, 1, MEDIA_GPU)],
        "the second copies are still cached"
    );
    apply(&mut ix, 0, &removed_in(1, 1, &[2, 3, 4, 5]));
    assert_eq!(ix.group_holders(keys(1, 6)[5]), vec![(0, 0, MEDIA_GPU)]);
    // Another medium coming and going keeps the copies (the reference test's minimal case).
    let KvEvent::BlockStored(cpu) = stored_in(1, None, 1, 2..6) else {
        unreachable!()
    };
    for _ in 0..2 {
        apply(&mut ix, 0, &stored_in(1, None, 1, 2..6));
    }
    apply(
        &mut ix,
        0,
        &KvEvent::BlockStored(BlockStored {
            medium: Some(Medium::Cpu),
            ..cpu
        }),
    );
    apply(&mut ix, 0, &removed_in(1, 1, &[5]));
    assert_eq!(
        ix.group_holders(keys(1, 6)[5]),
        vec![(0, 0, MEDIA_GPU), (0, 1, MEDIA_GPU | MEDIA_CPU)]
    );
    apply(&mut ix, 0, &removed_in(1, 1, &[5]));
    assert_eq!(
        ix.group_holders(keys(1, 6)[5]),
        vec![(0, 0, MEDIA_GPU), (0, 1, MEDIA_CPU)]
    );
    // A parentless chain over held blocks may re-announce hits: not a copy.
    apply(&mut ix, 0, &stored_in(1, None, 1, 0..2));
    apply(&mut ix, 0, &removed_in(1, 1, &[0, 1]));
    assert_eq!(ix.group_holders(keys(1, 2)[1]), vec![(0, 0, MEDIA_GPU)]);
}

#[test]
fn snapshots_keep_groups_and_layouts() {
    let mut ix = KvIndex::default();
    gpt_oss_like(&mut ix, 0, 1, 8);
    apply(&mut ix, 0, &removed_in(0, 1, &[0, 1, 2, 3, 4, 5]));
    apply(&mut ix, 2, &stored(1, 0..3, Medium::Gpu, 0));
    let bytes = postcard::to_allocvec(&ix.export()).expect("encodes");
    let snap: IndexSnapshot = postcard::from_bytes(&bytes).expect("decodes");
    let back = KvIndex::import(IndexConfig::default(), &snap).expect("imports");
    assert_eq!(back.lookup(&keys(1, 8), 0), ix.lookup(&keys(1, 8), 0));
    assert_eq!(back.lookup(&keys(1, 5), 0), vec![m(2, 3, 0, 0, 0)]);
    assert_eq!(back.layout(0), ix.layout(0));
    assert_eq!(back.stats().entries, ix.stats().entries);
}

#[test]
fn gemma3_like_cost_per_block_and_the_budget_holds() {
    // Unbounded: what a block held by one replica in six groups costs.
    let mut ix = KvIndex::default();
    let convs = 200u32;
    for conv in 0..convs {
        for g in 0..5 {
            apply(&mut ix, 0, &stored_in(g, Some(WINDOW), conv, 0..20));
        }
        apply(&mut ix, 0, &stored_in(5, None, conv, 0..20));
    }
    let s = ix.stats();
    assert_eq!(s.blocks, u64::from(convs) * 20);
    assert_eq!(s.entries, s.blocks * 6);
    let per_block = s.bytes_estimate as f64 / s.blocks as f64;
    assert!(per_block < 200.0, "{per_block} B per six-group block");
    // Bounded: the budget holds while hybrid events stream in.
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes: 256 * 1024,
        ..IndexConfig::default()
    });
    for conv in 0..convs {
        for g in 0..5 {
            let _ = ix.apply(0, &stored_in(g, Some(WINDOW), conv, 0..20));
        }
        let _ = ix.apply(0, &stored_in(5, None, conv, 0..20));
        assert!(ix.stats().bytes_estimate <= 256 * 1024);
    }
    assert!(ix.stats().evicted_for_budget > 0);
}

#[test]
fn a_new_group_that_cannot_fit_the_budget_is_refused_and_counted() {
    // Room for the first group's blocks and little more: the bookkeeping of a fresh
    // (replica, group) pair must fit too, or its event is refused whole.
    let mut probe = KvIndex::default();
    apply(&mut probe, 0, &stored_in(0, None, 1, 0..2));
    let max_bytes = probe.stats().bytes_estimate as usize;
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes,
        ..IndexConfig::default()
    });
    apply(&mut ix, 0, &stored_in(0, None, 1, 0..2));
    let mut refused = 0;
    for g in 1..8 {
        match ix.apply(1 + g as u32, &stored_in(g, None, 1, 0..2)) {
            Err(IndexError::NoRoomForGroup { blocks: 2, .. }) => refused += 1,
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => {}
        }
        let s = ix.stats();
        assert!(s.bytes_estimate <= max_bytes as u64, "group {g}: {s:?}");
    }
    assert!(refused > 0, "the budget never bound");
    assert_eq!(ix.stats().dropped_for_budget, 2 * refused);
}
