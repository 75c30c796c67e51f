//! Hashing a 32k-token prompt: 2,048 blocks of 16 tokens, chained, with each engine algorithm
//! kvroute reproduces and with kvroute's own router key.
//!
//! `cargo bench -p kvroute-core --bench hashing -- --warm-up-time 1 --measurement-time 3`

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvroute_core::hashing::{BlockHasher, ExtraKeyStyle, HashAlgo, HashConfig, RequestExtras};
use kvroute_core::router_key::request_keys;

const BLOCKS: usize = 2048;
const BLOCK_SIZE: usize = 16;

fn prompt() -> Vec<u32> {
    // Deterministic, realistic-range token ids (Qwen3's vocabulary is ~151k).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..BLOCKS * BLOCK_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 151_000) as u32
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let tokens = prompt();
    let extras = RequestExtras::default();
    let mut g = c.benchmark_group("hash_2048_blocks_of_16");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    for algo in [HashAlgo::Sha256Cbor, HashAlgo::Sha256, HashAlgo::XxhashCbor] {
        let cfg = HashConfig::new(algo, Some("0".into()));
        let hasher = match BlockHasher::new(&cfg) {
            Ok(h) => h,
            Err(e) => panic!("bench config: {e}"),
        };
        g.bench_function(algo.as_str(), |b| {
            b.iter(|| hasher.block_hashes(black_box(&tokens), BLOCK_SIZE, &extras))
        });
    }
    g.bench_function("router_key", |b| {
        b.iter(|| {
            request_keys(
                black_box(&tokens),
                BLOCK_SIZE,
                &extras,
                ExtraKeyStyle::Tagged,
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
