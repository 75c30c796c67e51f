//! Mooncake conversation trace replay against the exact index, in the shape of Dynamo's
//! `mooncake_bench`: `cargo bench -p kvroute-indexer --bench mooncake`.
//!
//! The trace (`bench/data/mooncake/conversation_trace.jsonl`, 12,031 requests) names each prompt
//! by `hash_ids`: one id per 512-token block *and everything before it*. Each id expands to 512
//! deterministic tokens (a PRNG seeded by the id), the last block is cut to `input_length`, and the
//! prompt's router keys are the chained keys of its full 16-token blocks (32 per id).
//!
//! A fleet of simulated workers (vLLM-like prefix caches of a fixed number of blocks with LRU
//! eviction; a finished request's blocks are freed tail first, as vLLM's free queue does) serves
//! the requests in trace order. For each request the bench:
//! 1. looks the prompt up in the index (timed) and routes with `kvroute_core::scoring::choose`
//!    (matched blocks from the lookup, in-flight requests from a simple service-time model);
//! 2. checks that the index's match for **every** worker equals that worker's real prefix hit
//!    (the replay panics on the first difference: a correctness check, not a timing);
//! 3. lets the chosen worker cache the prompt, in chunks of `KVROUTE_MOONCAKE_EVENT_BLOCKS`
//!    blocks (one scheduler step each): a `BlockRemoved` for the blocks it evicts, then a
//!    `BlockStored` for the chunk, both applied to the index as real `KvEvent`s (each timed).
//!
//! Two variants: `apply` (events applied as values) and `decode+apply` (each event encoded as a
//! vLLM 0.33 msgpack batch beforehand; decoding is timed with the apply). At the end, the index's
//! per-replica entry counts must equal the workers' cache sizes.
//!
//! Reported: ops/s of index time (lookups + events), blocks/s, lookup p50/p99/max, per-event apply
//! p50/p99/max, hit rate (index and workers' truth, equal by construction of the check), index size
//! and bytes per entry.
//!
//! Environment (defaults in brackets): `KVROUTE_MOONCAKE_REQUESTS` [all], `KVROUTE_MOONCAKE_COPIES`
//! [1] (interleaved copies of the trace with disjoint ids, to scale up), `KVROUTE_MOONCAKE_WORKERS`
//! [16], `KVROUTE_MOONCAKE_CAPACITY` [16384 blocks per worker], `KVROUTE_MOONCAKE_EVENT_BLOCKS`
//! [128], `KVROUTE_MOONCAKE_TRACE` [the repo copy]. Without `--bench` (`cargo test -p kvroute-indexer
//! --bench mooncake`) it runs a 300-request smoke replay.

// The allocator `kvroute-indexer` ships with, set up the same way, so the numbers are the binary's.
kvroute_indexer::global_allocator!();

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_core::events::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium,
    WireBlockHash, WireLayout,
};
use kvroute_core::hashing::usable_hit_blocks;
use kvroute_core::router_key::{chain, RouterKey, ROOT};
use kvroute_core::scoring::{choose, Candidate, Load, MatchedBlocks, RequestShape, ScoringConfig};
use kvroute_indexer::index::{IndexConfig, KvIndex};
use serde::Deserialize;

const BS: usize = 16;
const TRACE_BLOCK: usize = 512;
const VOCAB: u64 = 151_000;
/// Service-time model for the in-flight load: prefill tokens per ms and ms per output token.
const PREFILL_TOKENS_PER_MS: u64 = 8;
const MS_PER_OUTPUT_TOKEN: u64 = 20;

#[derive(Debug, Clone, Deserialize)]
struct TraceRequest {
    timestamp: u64,
    input_length: usize,
    output_length: u64,
    hash_ids: Vec<u64>,
}

#[derive(Debug, Clone)]
struct Settings {
    trace: String,
    requests: usize,
    copies: u64,
    workers: u32,
    capacity: usize,
    event_blocks: usize,
}

fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

impl Settings {
    fn from_env(smoke: bool) -> Self {
        Settings {
            trace: std::env::var("KVROUTE_MOONCAKE_TRACE").unwrap_or_else(|_| {
                concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../bench/data/mooncake/conversation_trace.jsonl"
                )
                .to_string()
            }),
            requests: env_num("KVROUTE_MOONCAKE_REQUESTS").unwrap_or(if smoke {
                300
            } else {
                usize::MAX
            }),
            copies: env_num("KVROUTE_MOONCAKE_COPIES").unwrap_or(1).max(1),
            workers: env_num("KVROUTE_MOONCAKE_WORKERS").unwrap_or(16).max(1),
            capacity: env_num("KVROUTE_MOONCAKE_CAPACITY")
                .unwrap_or(16_384)
                .max(1),
            event_blocks: env_num("KVROUTE_MOONCAKE_EVENT_BLOCKS")
                .unwrap_or(128)
                .max(1),
        }
    }
}

/// Loads the trace; copy `c` of it gets ids offset by `c << 40` (disjoint prefixes), and the
/// copies are interleaved by timestamp.
fn load_trace(s: &Settings) -> Vec<TraceRequest> {
    let text = std::fs::read_to_string(&s.trace).unwrap_or_else(|e| {
        panic!(
            "cannot read the Mooncake trace {}: {e} (set KVROUTE_MOONCAKE_TRACE)",
            s.trace
        )
    });
    let base: Vec<TraceRequest> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: line {}: {e}", s.trace, i + 1))
        })
        .collect();
    let mut all: Vec<(u64, u64, TraceRequest)> = Vec::with_capacity(base.len() * s.copies as usize);
    for c in 0..s.copies {
        for (i, r) in base.iter().enumerate() {
            let mut r = r.clone();
            for id in &mut r.hash_ids {
                *id += c << 40;
            }
            all.push((r.timestamp, i as u64 * s.copies + c, r));
        }
    }
    all.sort_by_key(|(t, order, _)| (*t, *order));
    all.into_iter()
        .map(|(_, _, r)| r)
        .take(s.requests)
        .collect()
}

/// SplitMix64 step.
fn splitmix(state: &mut u64) -> u64 {
    let next = kvroute_core::rng::mix(*state);
    *state = state.wrapping_add(kvroute_core::rng::GOLDEN_GAMMA);
    next
}

/// The prompt's tokens: 512 tokens per hash id from a PRNG seeded by the id, cut to
/// `input_length`.
fn prompt_tokens(r: &TraceRequest) -> Vec<u32> {
    let len = r.input_length.min(r.hash_ids.len() * TRACE_BLOCK);
    let mut tokens = Vec::with_capacity(r.hash_ids.len() * TRACE_BLOCK);
    for &id in &r.hash_ids {
        let mut st = id ^ 0x6d6f_6f6e_6361_6b65;
        for _ in 0..TRACE_BLOCK {
            tokens.push((splitmix(&mut st) % VOCAB) as u32);
        }
    }
    tokens.truncate(len);
    tokens
}

/// Router keys of the full 16-token blocks, chained from `ROOT`.
fn prompt_keys(tokens: &[u32]) -> Vec<RouterKey> {
    let mut parent = ROOT;
    tokens
        .chunks_exact(BS)
        .map(|b| {
            parent = chain(parent, b, None);
            parent
        })
        .collect()
}

/// The engine's wire hash of a block (a different hash of the same prefix, as vLLM's is).
fn engine_hash(key: RouterKey) -> u64 {
    let mut st = key.0 ^ 0x656e_6769_6e65_2121;
    splitmix(&mut st)
}

/// One simulated vLLM worker: a prefix cache of `capacity` blocks with LRU eviction.
struct Worker {
    capacity: usize,
    /// Router key -> last-use stamp.
    cache: HashMap<u64, u64>,
    /// (stamp, key) in use order; entries whose stamp is stale are skipped.
    order: VecDeque<(u64, u64)>,
    clock: u64,
    /// End times (trace ms) of requests still in flight.
    busy_until: Vec<u64>,
}

impl Worker {
    fn new(capacity: usize) -> Self {
        Worker {
            capacity,
            cache: HashMap::with_capacity(capacity + 1),
            order: VecDeque::new(),
            clock: 0,
            busy_until: Vec::new(),
        }
    }

    /// Leading blocks of `keys` this worker holds (what vLLM's prefix cache would hit).
    fn prefix_hit(&self, keys: &[RouterKey]) -> usize {
        keys.iter()
            .take_while(|k| self.cache.contains_key(&k.0))
            .count()
    }

    fn touch(&mut self, key: u64) {
        self.clock += 1;
        self.cache.insert(key, self.clock);
        self.order.push_back((self.clock, key));
        if self.order.len() > 4 * self.capacity + 1024 {
            let cache = &self.cache;
            self.order.retain(|(s, k)| cache.get(k) == Some(s));
        }
    }

    /// Evicts the least recently used block.
    fn evict_lru(&mut self) -> Option<u64> {
        while let Some((s, k)) = self.order.pop_front() {
            if self.cache.get(&k) == Some(&s) {
                self.cache.remove(&k);
                return Some(k);
            }
        }
        None
    }

    fn in_flight(&mut self, now_ms: u64) -> u32 {
        self.busy_until.retain(|&t| t > now_ms);
        self.busy_until.len() as u32
    }
}

/// Timings and counters of one replay.
#[derive(Default)]
struct Report {
    lookup_ns: Vec<u64>,
    event_ns: Vec<u64>,
    stored_blocks: u64,
    removed_blocks: u64,
    stored_events: u64,
    removed_events: u64,
    prompt_blocks: u64,
    usable_blocks: u64,
    hit_blocks_index: u64,
    hit_blocks_truth: u64,
    checked_pairs: u64,
    /// Hit blocks one infinite cache shared by the fleet would have had (an upper bound).
    hit_blocks_unbounded: u64,
    wall: Duration,
}

fn pct(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0
}

fn stored_event(keys: &[RouterKey], tokens: &[u32], range: std::ops::Range<usize>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: range
            .clone()
            .map(|b| WireBlockHash::Int(engine_hash(keys[b])))
            .collect(),
        parent_block_hash: (range.start > 0)
            .then(|| WireBlockHash::Int(engine_hash(keys[range.start - 1]))),
        token_ids: tokens[range.start * BS..range.end * BS].to_vec(),
        block_size: BS as u32,
        medium: Some(Medium::Gpu),
        ..BlockStored::default()
    })
}

fn removed_event(evicted: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: evicted
            .iter()
            .map(|&k| WireBlockHash::Int(engine_hash(RouterKey(k))))
            .collect(),
        medium: Some(Medium::Gpu),
        ..BlockRemoved::default()
    })
}

/// Applies `ev` from `worker` (optionally through msgpack) and records its time.
fn apply_timed(ix: &mut KvIndex, worker: u32, ev: KvEvent, decode: bool, rep: &mut Report) {
    let elapsed = if decode {
        let bytes = encode_batch(
            &EventBatch {
                ts: 0.0,
                events: vec![ev],
                data_parallel_rank: Some(0),
            },
            WireLayout::V0_33,
        );
        let t = Instant::now();
        let batch = decode_batch(black_box(&bytes)).expect("our own encoding decodes");
        for ev in &batch.events {
            ix.apply(worker, ev)
                .expect("a simulated event applies cleanly");
        }
        t.elapsed()
    } else {
        let t = Instant::now();
        ix.apply(worker, black_box(&ev))
            .expect("a simulated event applies cleanly");
        t.elapsed()
    };
    rep.event_ns.push(elapsed.as_nanos() as u64);
}

/// Replays `trace` on a fresh index and fleet. Panics if the index ever disagrees with a worker.
fn replay(s: &Settings, trace: &[TraceRequest], decode: bool) -> (Report, KvIndex) {
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes: 4 << 30,
        ..IndexConfig::default()
    });
    let mut workers: Vec<Worker> = (0..s.workers).map(|_| Worker::new(s.capacity)).collect();
    let scoring = ScoringConfig::default();
    let mut rep = Report::default();
    let mut truth = vec![0usize; s.workers as usize];
    let mut cands: Vec<Candidate> = Vec::with_capacity(s.workers as usize);
    // hash id -> most tokens of it ever cached anywhere (the unbounded reference).
    let mut seen: HashMap<u64, usize> = HashMap::new();
    let start = Instant::now();
    for (ri, r) in trace.iter().enumerate() {
        let tokens = prompt_tokens(r);
        let keys = prompt_keys(&tokens);
        let usable = usable_hit_blocks(tokens.len(), BS);
        let mut unbounded_tokens = 0;
        for (j, id) in r.hash_ids.iter().enumerate() {
            let have = seen.get(id).copied().unwrap_or(0);
            let want = tokens
                .len()
                .saturating_sub(j * TRACE_BLOCK)
                .min(TRACE_BLOCK);
            unbounded_tokens += have.min(want);
            if have < want {
                break;
            }
        }
        rep.hit_blocks_unbounded += (unbounded_tokens / BS).min(usable) as u64;
        for (j, id) in r.hash_ids.iter().enumerate() {
            let len = tokens
                .len()
                .saturating_sub(j * TRACE_BLOCK)
                .min(TRACE_BLOCK);
            let e = seen.entry(*id).or_insert(0);
            *e = (*e).max(len);
        }

        let t = Instant::now();
        let matches = ix.lookup(black_box(&keys), r.timestamp);
        rep.lookup_ns.push(t.elapsed().as_nanos() as u64);

        // Correctness: the index's match equals every worker's real prefix hit.
        for (w, worker) in workers.iter().enumerate() {
            truth[w] = worker.prefix_hit(&keys);
        }
        let mut from_index = vec![0usize; s.workers as usize];
        for m in &matches {
            assert_eq!(
                (m.cpu, m.storage, m.predicted),
                (0, 0, 0),
                "request {ri}: only GPU blocks were stored"
            );
            from_index[m.replica as usize] = m.gpu as usize;
        }
        assert_eq!(
            from_index, truth,
            "request {ri}: index match per worker differs from the workers' caches"
        );
        rep.checked_pairs += u64::from(s.workers);

        cands.clear();
        for (w, worker) in workers.iter_mut().enumerate() {
            cands.push(Candidate {
                replica: w as u32,
                matched: MatchedBlocks {
                    gpu: from_index[w] as u32,
                    ..MatchedBlocks::default()
                },
                load: Load {
                    in_flight: worker.in_flight(r.timestamp),
                    running: worker.in_flight(r.timestamp),
                    ..Load::default()
                },
                rates: scoring.prior_rates(),
                healthy: true,
                stale: false,
            });
        }
        let seed = (ri as u64).wrapping_mul(0x2545_F491_4F6C_DD1D);
        let shape = RequestShape {
            prompt_tokens: tokens.len() as u32,
            block_size: BS as u32,
            usable_blocks: usable as u32,
            output_tokens: 256,
            expected_successors: 0.0,
            session_blocks: 0.0,
        };
        let w = choose(&scoring, &shape, &cands, seed)
            .expect("every worker is healthy")
            .replica as usize;
        let hit = truth[w];
        rep.prompt_blocks += keys.len() as u64;
        rep.usable_blocks += usable as u64;
        rep.hit_blocks_index += from_index[w].min(usable) as u64;
        rep.hit_blocks_truth += hit.min(usable) as u64;

        // The chosen worker serves the request: hit blocks become most recent, the rest is
        // computed and cached chunk by chunk (evicting LRU blocks first).
        let worker = &mut workers[w];
        let n = keys.len().min(worker.capacity);
        for k in keys[..hit.min(n)].iter().rev() {
            worker.touch(k.0);
        }
        let mut chunk_start = hit.min(n);
        while chunk_start < n {
            let chunk_end = (chunk_start + s.event_blocks).min(n);
            let mut evicted = Vec::new();
            for k in &keys[chunk_start..chunk_end] {
                if !worker.cache.contains_key(&k.0) && worker.cache.len() >= worker.capacity {
                    if let Some(v) = worker.evict_lru() {
                        evicted.push(v);
                    }
                }
                worker.touch(k.0);
            }
            if !evicted.is_empty() {
                rep.removed_events += 1;
                rep.removed_blocks += evicted.len() as u64;
                apply_timed(&mut ix, w as u32, removed_event(&evicted), decode, &mut rep);
            }
            rep.stored_events += 1;
            rep.stored_blocks += (chunk_end - chunk_start) as u64;
            apply_timed(
                &mut ix,
                w as u32,
                stored_event(&keys, &tokens, chunk_start..chunk_end),
                decode,
                &mut rep,
            );
            chunk_start = chunk_end;
        }
        // Finished: freed tail first, so block 0 is the last to go.
        for k in keys[..n].iter().rev() {
            worker.touch(k.0);
        }
        let uncached = tokens.len().saturating_sub(hit * BS) as u64;
        worker.busy_until.push(
            r.timestamp + uncached / PREFILL_TOKENS_PER_MS + r.output_length * MS_PER_OUTPUT_TOKEN,
        );
    }
    rep.wall = start.elapsed();

    // Correctness at the end: entries per replica equal the workers' cache sizes.
    let stats = ix.stats();
    assert_eq!(stats.parent_unknown, 0, "no event may lose its parent");
    assert_eq!(stats.evicted_for_budget, 0, "the budget must not interfere");
    assert_eq!(stats.remove_unknown, 0, "every removal names a held block");
    for (id, entries) in ix.replicas() {
        assert_eq!(
            entries,
            workers[id as usize].cache.len() as u64,
            "worker {id}: index entries differ from its cache"
        );
    }
    assert_eq!(
        stats.entries,
        workers.iter().map(|w| w.cache.len() as u64).sum::<u64>()
    );
    assert_eq!(rep.hit_blocks_index, rep.hit_blocks_truth);
    (rep, ix)
}

fn print_report(label: &str, rep: &mut Report, ix: &KvIndex, requests: usize) {
    rep.lookup_ns.sort_unstable();
    rep.event_ns.sort_unstable();
    let lookup_total: u64 = rep.lookup_ns.iter().sum();
    let event_total: u64 = rep.event_ns.iter().sum();
    let ops = (rep.lookup_ns.len() + rep.event_ns.len()) as f64;
    let index_s = (lookup_total + event_total) as f64 / 1e9;
    let s = ix.stats();
    println!("== mooncake replay, {label} ==");
    println!(
        "requests {requests}: {} lookups + {} events ({} BlockStored, {} BlockRemoved) = {} ops in {:.3} s of index time; replay wall time {:.1} s (includes the simulation and the check)",
        rep.lookup_ns.len(),
        rep.event_ns.len(),
        rep.stored_events,
        rep.removed_events,
        ops,
        index_s,
        rep.wall.as_secs_f64()
    );
    println!(
        "throughput: {:.0} ops/s; events {:.0}/s; blocks stored {:.2} M/s, removed {} blocks ({:.2} M blocks/s of event time incl. removals)",
        ops / index_s,
        rep.event_ns.len() as f64 / (event_total as f64 / 1e9),
        rep.stored_blocks as f64 / (event_total as f64 / 1e9) / 1e6,
        rep.removed_blocks,
        (rep.stored_blocks + rep.removed_blocks) as f64 / (event_total as f64 / 1e9) / 1e6
    );
    println!(
        "lookup ({:.0} blocks/query avg): p50 {:.1} us, p99 {:.1} us, max {:.1} us, mean {:.1} us",
        rep.prompt_blocks as f64 / requests.max(1) as f64,
        pct(&rep.lookup_ns, 0.5),
        pct(&rep.lookup_ns, 0.99),
        pct(&rep.lookup_ns, 1.0),
        lookup_total as f64 / 1e3 / rep.lookup_ns.len().max(1) as f64
    );
    println!(
        "event apply ({:.0} blocks/event avg): p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        (rep.stored_blocks + rep.removed_blocks) as f64 / rep.event_ns.len().max(1) as f64,
        pct(&rep.event_ns, 0.5),
        pct(&rep.event_ns, 0.99),
        pct(&rep.event_ns, 1.0)
    );
    println!(
        "hit rate (usable prompt blocks served from cache on the chosen worker): index {:.2} %, workers' truth {:.2} % (per-worker match checked for {} (request, worker) pairs: all equal)",
        100.0 * rep.hit_blocks_index as f64 / rep.usable_blocks.max(1) as f64,
        100.0 * rep.hit_blocks_truth as f64 / rep.usable_blocks.max(1) as f64,
        rep.checked_pairs
    );
    println!(
        "reference: one unbounded cache shared by the whole fleet would hit {:.2} %",
        100.0 * rep.hit_blocks_unbounded as f64 / rep.usable_blocks.max(1) as f64
    );
    println!(
        "index at the end: {} blocks, {} entries, {:.1} MiB = {:.1} B/entry; {} stored, {} refreshed, {} removed",
        s.blocks,
        s.entries,
        s.bytes_estimate as f64 / (1 << 20) as f64,
        s.bytes_estimate as f64 / s.entries.max(1) as f64,
        s.stored,
        s.refreshed,
        s.removed
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: run a smoke replay then.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let s = Settings::from_env(smoke);
    let trace = load_trace(&s);
    println!(
        "mooncake: {} requests ({} cop{} of {}), {} workers x {} blocks of {BS} tokens, <= {} blocks per event{}",
        trace.len(),
        s.copies,
        if s.copies == 1 { "y" } else { "ies" },
        s.trace,
        s.workers,
        s.capacity,
        s.event_blocks,
        if smoke { " (smoke run: pass --bench for the full replay)" } else { "" }
    );
    for decode in [false, true] {
        let (mut rep, ix) = replay(&s, &trace, decode);
        let label = if decode {
            "decode+apply (vLLM 0.33 msgpack, one event per batch)"
        } else {
            "apply (KvEvent values)"
        };
        print_report(label, &mut rep, &ix, trace.len());
    }
}
