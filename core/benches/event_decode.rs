//! Decoding throughput of realistic KV event batches: `BlockStored` events of 64 blocks of 16
//! tokens each, in vLLM 0.33's map layout and the 0.23 array layout. Reported as blocks/s
//! (criterion "elements").

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvroute_core::events::{
    decode_batch, encode_batch, BlockStored, EventBatch, KvEvent, Medium, WireBlockHash, WireLayout,
};

const BLOCKS_PER_EVENT: usize = 64;
const BLOCK_SIZE: usize = 16;

/// A deterministic batch of `events` BlockStored events, 64 blocks each, full-width hashes.
fn batch(events: usize) -> EventBatch {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let events = (0..events)
        .map(|_| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..BLOCKS_PER_EVENT)
                    .map(|_| WireBlockHash::Int(next()))
                    .collect(),
                parent_block_hash: Some(WireBlockHash::Int(next())),
                token_ids: (0..BLOCKS_PER_EVENT * BLOCK_SIZE)
                    .map(|_| (next() % 151_936) as u32)
                    .collect(),
                block_size: BLOCK_SIZE as u32,
                medium: Some(Medium::Gpu),
                extra_keys: Some(vec![None; BLOCKS_PER_EVENT]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..Default::default()
            })
        })
        .collect();
    EventBatch {
        ts: 1_700_000_000.0,
        events,
        data_parallel_rank: Some(0),
    }
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("event_decode");
    for (name, layout) in [
        ("v0_33_map", WireLayout::V0_33),
        ("v0_23_array", WireLayout::Array0_23),
    ] {
        for events in [1usize, 8] {
            let payload = encode_batch(&batch(events), layout);
            group.throughput(Throughput::Elements((events * BLOCKS_PER_EVENT) as u64));
            group.bench_function(format!("{name}/{events}x64_blocks"), |b| {
                b.iter(|| decode_batch(black_box(&payload)).map(|b| b.events.len()))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
