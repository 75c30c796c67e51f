//! Exact index benchmarks: `cargo bench -p kvroute-indexer --bench index`.
//!
//! * `ingest/*`: BlockStored blocks per second on one core, with and without msgpack decoding
//!   (`kvroute_core::events::decode_batch`), into an index held at its memory budget (so eviction
//!   is part of the cost), 64 replicas, 8 events of 64 blocks (block size 16) per batch.
//! * `lookup/*`: one 2,048-block query against an index of 64 replicas and
//!   `KVROUTE_BENCH_ENTRIES` (default 10,000,000) (block, replica) entries; p50/p99/max over
//!   individually timed lookups are printed too, with bytes per entry.
//!
//! Set `KVROUTE_BENCH_ENTRIES=1000000` for a quick run.

use kvroute_core::rng::SplitMix64;
use std::time::{Duration, Instant};

// The allocator `kvroute-indexer` ships with, set up the same way, so the numbers are the binary's.
kvroute_indexer::global_allocator!();

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::events::{
    decode_batch, encode_batch, BlockStored, EventBatch, KvEvent, Medium, WireBlockHash, WireLayout,
};
use kvroute_core::hashing::{ExtraKeyStyle, RequestExtras};
use kvroute_core::router_key::{request_keys, RouterKey};
use kvroute_indexer::index::{IndexConfig, KvIndex};

const BS: usize = 16;
const REPLICAS: u32 = 64;
const QUERY_BLOCKS: usize = 2048;
const SYSTEM_BLOCKS: usize = 128;

/// SplitMix64, for reproducible workloads.
struct Rng(SplitMix64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Token ids of document `doc` (block `b` of every document < SYSTEM_BLOCKS is the shared
/// system prompt).
fn doc_tokens(doc: u64, blocks: usize) -> Vec<u32> {
    let mut rng = Rng(SplitMix64::new(doc.wrapping_mul(0x2545_F491_4F6C_DD1D)));
    let mut sys = Rng(SplitMix64::new(7));
    (0..blocks * BS)
        .map(|i| {
            if i < SYSTEM_BLOCKS * BS {
                (sys.next() % 150_000) as u32
            } else {
                (rng.next() % 150_000) as u32
            }
        })
        .collect()
}

/// A fake but consistent engine hash for block `b` of `doc`.
fn engine_hash(doc: u64, b: usize) -> u64 {
    if b < SYSTEM_BLOCKS {
        (b as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93)
    } else {
        (doc << 20 | b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555
    }
}

fn stored(doc: u64, tokens: &[u32], blocks: std::ops::Range<usize>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: blocks
            .clone()
            .map(|b| WireBlockHash::Int(engine_hash(doc, b)))
            .collect(),
        parent_block_hash: (blocks.start > 0)
            .then(|| WireBlockHash::Int(engine_hash(doc, blocks.start - 1))),
        token_ids: tokens[blocks.start * BS..blocks.end * BS].to_vec(),
        block_size: BS as u32,
        medium: Some(Medium::Gpu),
        ..BlockStored::default()
    })
}

/// One scheduler step's worth of events: 8 events of 64 new blocks each (conversation `conv`
/// continuing), on replica `conv % 64`.
fn ingest_batch(conv: u64) -> (u32, EventBatch, usize) {
    let tokens = doc_tokens(conv + 1_000_000, 8 * 64);
    let events: Vec<KvEvent> = (0..8)
        .map(|e| {
            let ev = stored(conv + 1_000_000, &tokens, e * 64..(e + 1) * 64);
            // Unique chains: the first event starts at the root.
            if let KvEvent::BlockStored(mut st) = ev {
                if e == 0 {
                    st.parent_block_hash = None;
                }
                KvEvent::BlockStored(st)
            } else {
                ev
            }
        })
        .collect();
    (
        (conv % u64::from(REPLICAS)) as u32,
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        },
        8 * 64,
    )
}

fn bench_ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(512));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(8));
    for decode in [false, true] {
        let name = if decode { "decode_and_apply" } else { "apply" };
        // 128 MiB budget by default: full after ~2M blocks, so most samples include eviction.
        let mut ix = KvIndex::new(IndexConfig {
            max_bytes: std::env::var("KVROUTE_BENCH_INGEST_MIB")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(128)
                << 20,
            ..IndexConfig::default()
        });
        let mut conv = 0u64;
        g.bench_function(BenchmarkId::new(name, "8x64_blocks"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    conv += 1;
                    let (replica, batch, _) = ingest_batch(conv);
                    if decode {
                        let bytes = encode_batch(&batch, WireLayout::V0_33);
                        let t = Instant::now();
                        if let Ok(decoded) = decode_batch(black_box(&bytes)) {
                            for ev in &decoded.events {
                                let _ = black_box(ix.apply(replica, ev));
                            }
                        }
                        total += t.elapsed();
                    } else {
                        let t = Instant::now();
                        for ev in &batch.events {
                            let _ = black_box(ix.apply(replica, ev));
                        }
                        total += t.elapsed();
                    }
                }
                total
            })
        });
        let s = ix.stats();
        eprintln!(
            "ingest {name}: index after run: {} blocks, {} entries, {:.1} MiB of {:.0} MiB, {} evicted",
            s.blocks,
            s.entries,
            s.bytes_estimate as f64 / (1 << 20) as f64,
            s.max_bytes as f64 / (1 << 20) as f64,
            s.evicted_for_budget
        );
    }
    g.finish();
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// 64 replicas; a 128-block system prompt on all of them; documents of 2,048 blocks (system
/// prompt + 1,920 own blocks), each held by 1-8 random replicas up to a random length
/// (256..=2048 blocks), until `target` entries.
fn build_fleet(target: u64) -> (KvIndex, Vec<Vec<RouterKey>>) {
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes: 8 << 30,
        ..IndexConfig::default()
    });
    let mut rng = Rng(SplitMix64::new(42));
    let mut queries = Vec::new();
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    let mut doc = 0u64;
    let mut blocks_applied = 0u64;
    while ix.stats().entries < target {
        doc += 1;
        let tokens = doc_tokens(doc, QUERY_BLOCKS);
        let holders = 1 + rng.below(8);
        for _ in 0..holders {
            let r = rng.below(u64::from(REPLICAS)) as u32;
            let len = 256 + rng.below((QUERY_BLOCKS - 256 + 1) as u64) as usize;
            for start in (0..len).step_by(256) {
                let end = (start + 256).min(len);
                if ix.apply(r, &stored(doc, &tokens, start..end)).is_ok() {
                    blocks_applied += (end - start) as u64;
                }
            }
        }
        if queries.len() < 512 {
            queries.push(request_keys(
                &tokens,
                BS,
                &RequestExtras::default(),
                ExtraKeyStyle::Tagged,
            ));
        }
    }
    let s = ix.stats();
    let rss = rss_bytes().saturating_sub(rss0);
    eprintln!(
        "fleet: {} docs, {} blocks, {} entries ({:.2} replicas/block), built from {} blocks in {:.1} s ({:.2} M blocks/s incl. router keys)",
        doc,
        s.blocks,
        s.entries,
        s.entries as f64 / s.blocks as f64,
        blocks_applied,
        t0.elapsed().as_secs_f64(),
        blocks_applied as f64 / t0.elapsed().as_secs_f64() / 1e6
    );
    eprintln!(
        "memory: bytes_estimate {:.1} MiB = {:.1} B/entry ({:.1} B/block); RSS growth {:.1} MiB = {:.1} B/entry (includes the allocator's slack and the 512 query key lists)",
        s.bytes_estimate as f64 / (1 << 20) as f64,
        s.bytes_estimate as f64 / s.entries as f64,
        s.bytes_estimate as f64 / s.blocks as f64,
        rss as f64 / (1 << 20) as f64,
        rss as f64 / s.entries as f64
    );
    // The service's snapshot: `export` runs under the index lock (routing waits for it), the
    // postcard encoding after the lock is released.
    let t = Instant::now();
    let export = ix.export();
    let export_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let bytes = postcard::to_stdvec(&export).map(|b| b.len()).unwrap_or(0);
    eprintln!(
        "snapshot: export {export_ms:.0} ms (under the index lock), postcard {:.0} ms, {:.1} MiB",
        t.elapsed().as_secs_f64() * 1e3,
        bytes as f64 / (1 << 20) as f64
    );
    (ix, queries)
}

fn percentiles(label: &str, ix: &KvIndex, queries: &[Vec<RouterKey>]) {
    let mut times = Vec::with_capacity(20_000);
    let mut matched = 0u64;
    for i in 0..20_000 {
        let q = &queries[i % queries.len()];
        let t = Instant::now();
        let r = ix.lookup(black_box(q), 0);
        times.push(t.elapsed());
        matched += r.len() as u64;
    }
    times.sort_unstable();
    let p = |q: f64| times[((times.len() as f64 - 1.0) * q) as usize].as_secs_f64() * 1e6;
    eprintln!(
        "lookup {label}: p50 {:.1} us, p99 {:.1} us, max {:.1} us ({:.1} matching replicas per query)",
        p(0.5),
        p(0.99),
        p(1.0),
        matched as f64 / times.len() as f64
    );
}

fn bench_lookup(c: &mut Criterion) {
    let target: u64 = std::env::var("KVROUTE_BENCH_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    let (ix, queries) = build_fleet(target);
    percentiles("fleet", &ix, &queries);

    // Adversarial: all 64 replicas hold the whole 2,048-block query on GPU.
    let mut hot = KvIndex::default();
    let tokens = doc_tokens(1, QUERY_BLOCKS);
    for r in 0..REPLICAS {
        for start in (0..QUERY_BLOCKS).step_by(256) {
            let _ = hot.apply(r, &stored(1, &tokens, start..start + 256));
        }
    }
    let hot_q = vec![request_keys(
        &tokens,
        BS,
        &RequestExtras::default(),
        ExtraKeyStyle::Tagged,
    )];
    percentiles("all-64-hold-all-2048", &hot, &hot_q);

    let mut g = c.benchmark_group("lookup");
    g.sample_size(50);
    g.measurement_time(Duration::from_secs(5));
    let mut i = 0usize;
    g.bench_function(BenchmarkId::new("fleet_2048_blocks", target), |b| {
        b.iter(|| {
            i += 1;
            black_box(ix.lookup(&queries[i % queries.len()], 0))
        })
    });
    g.bench_function("all_64_hold_all_2048", |b| {
        b.iter(|| black_box(hot.lookup(&hot_q[0], 0)))
    });
    let miss: Vec<RouterKey> = (0..QUERY_BLOCKS as u64).map(RouterKey).collect();
    g.bench_function("miss_2048_blocks", |b| {
        b.iter(|| black_box(ix.lookup(&miss, 0)))
    });
    g.finish();
}

criterion_group!(benches, bench_ingest, bench_lookup);
criterion_main!(benches);
