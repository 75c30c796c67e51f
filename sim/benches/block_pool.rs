//! The engine core's CPU cost per scheduled token: scheduler + KV cache manager + block pool,
//! on 8k-token prompts (6k shared by groups of requests, so hits, LRU and eviction all run),
//! hashing excluded (hashes are computed when the sequences are built, outside the timing).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvroute_sim::scheduler::{Scheduler, SchedulerConfig};
use kvroute_sim::sequence::{SeqMeta, Sequence, SequenceSpec, TokenSource, ToyHasher};

const BS: usize = 16;
const REQS: u64 = 64;
const OUT: usize = 16;

fn workload() -> Vec<Sequence> {
    (0..REQS)
        .map(|i| {
            let group = (i % 8) as u32;
            let mut p: Vec<u32> = (0..6144u32).map(|k| group * 100_000 + k).collect();
            p.extend((0..2048u32).map(|k| 1_000_000 + i as u32 * 10_000 + k));
            Sequence::new(
                SequenceSpec {
                    id: i,
                    prompt: p,
                    max_tokens: OUT,
                    meta: Arc::new(SeqMeta::default()),
                    report_full: false,
                    source: TokenSource::new(i, 32_000),
                    arrival_s: 0.0,
                },
                BS,
                Arc::new(ToyHasher),
            )
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    // A cache of 4096 blocks (64k tokens) holds ~8 of these requests: eviction is constant.
    let cfg = SchedulerConfig {
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        num_gpu_blocks: 4096,
        block_size: BS,
        kv_cache_groups: vec![kvroute_core::hybrid::GroupKind::FullAttention],
        max_model_len: 1 << 20,
        hash_block_size: BS,
    };
    // Count the scheduled tokens of one run to express the cost per token.
    let mut s = Scheduler::new(cfg.clone(), true).unwrap();
    let mut tokens = 0u64;
    for q in workload() {
        s.add(q);
    }
    while s.has_work() {
        let p = s.schedule();
        tokens += p.num_scheduled_tokens() as u64;
        s.finish_step(p, 0.0);
        let _ = s.take_events();
    }
    let mut g = c.benchmark_group("engine_core");
    g.throughput(Throughput::Elements(tokens));
    g.bench_function("schedule_8k_prompts_per_scheduled_token", |b| {
        b.iter_batched(
            workload,
            |seqs| {
                let mut s = Scheduler::new(cfg.clone(), true).unwrap();
                for q in seqs {
                    s.add(q);
                }
                let mut events = 0usize;
                while s.has_work() {
                    let p = s.schedule();
                    s.finish_step(p, 0.0);
                    events += s.take_events().len();
                }
                events
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
