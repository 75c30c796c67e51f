//! Differential check of the simulator's KV cache manager against vLLM 0.33.0's own
//! `KVCacheManager` (issue 18 item 4). Seeded random operation sequences (admit a request with its
//! prefix lookup, compute chunks and decode steps, free, preempt under pressure, reset the prefix
//! cache) run through `tests/vllm_reference/kv_manager_driver.py` (vLLM's manager, coordinators,
//! single-type managers and block pool, verbatim from the release wheel; one process for all
//! sequences) and through [`KvCacheManager`] (some requests with a `cache_salt`, some with
//! `kv_cache_report_mode: full`); every op must give the same hit length, the same
//! allocation outcome, byte-identical KV events (vLLM's msgspec encoder vs `encode_batch`, per
//! group, same sha256 hashes) and the same block tables (so the same blocks were evicted).
//!
//! Layouts: one full-attention group; Gemma-3-like 5 sliding-window groups : 1 full; gpt-oss-like
//! 1:1 with a 128-token window, hashed per block and with `hash_block_size` 4 < block size 16. `KVROUTE_KV_DIFF_SEQUENCES` (default 20 per layout) and
//! `KVROUTE_KV_DIFF_SEED` (default 1) run longer or other checks; `KVROUTE_KV_DIFF_DUMP=<file>`
//! writes the driver's input there (to replay a difference with the driver alone).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use kvroute_core::events::{encode_batch, EventBatch, WireLayout};
use kvroute_core::hashing::{BlockHasher, HashAlgo, HashConfig, RequestExtras};
use kvroute_core::hybrid::GroupKind;
use kvroute_core::rng::SplitMix64;
use kvroute_sim::events::to_kv_events;
use kvroute_sim::hashing::RequestChainHasher;
use kvroute_sim::kv_manager::KvCacheManager;
use kvroute_sim::sequence::{SeqId, Sequence, SequenceSpec, TokenSource};
use kvroute_testkit::paths::{python, workspace, Layout as Paths};
use serde_json::{json, Value};

const OPS_PER_SEQUENCE: usize = 50;
const BLOCK_SIZE: usize = 16;
/// The driver's default `max_model_len`.
const MAX_MODEL_LEN: usize = 1 << 20;

struct Layout {
    name: &'static str,
    num_blocks: usize,
    groups: Vec<GroupKind>,
    /// Tokens per request block hash (vLLM's `hash_block_size`, `--prefix-match-unit`).
    hash_block_size: usize,
    /// Longest prompt generated (tokens).
    max_prompt: usize,
    /// vLLM's `max_in_flight_tokens` (2 x `max_num_batched_tokens` with async scheduling): the
    /// largest chunk, and what a sliding-window group's admission cap is sized for.
    max_in_flight: usize,
}

fn layouts() -> Vec<Layout> {
    let sw = |window| GroupKind::SlidingWindow { window };
    vec![
        Layout {
            name: "full",
            num_blocks: 48,
            groups: vec![GroupKind::FullAttention],
            hash_block_size: BLOCK_SIZE,
            max_prompt: 320,
            max_in_flight: 128,
        },
        Layout {
            // Gemma 3's 5:1 layers (as `--kv-cache-layout gemma3` orders them), its 1024-token
            // window scaled down to 80 so that prompts of a few hundred tokens leave it.
            name: "gemma3-like",
            num_blocks: 240,
            groups: vec![
                sw(80),
                sw(80),
                sw(80),
                sw(80),
                sw(80),
                GroupKind::FullAttention,
            ],
            hash_block_size: BLOCK_SIZE,
            max_prompt: 320,
            max_in_flight: 64,
        },
        Layout {
            name: "gpt-oss-like",
            num_blocks: 96,
            groups: vec![sw(128), GroupKind::FullAttention],
            hash_block_size: BLOCK_SIZE,
            max_prompt: 480,
            max_in_flight: 128,
        },
        Layout {
            // `--prefix-match-unit 4` (vLLM accepts it with several groups only): hashed every 4
            // tokens, blocks keyed by their last 4-token hash.
            name: "gpt-oss-like, hash_block_size 4",
            num_blocks: 96,
            groups: vec![sw(128), GroupKind::FullAttention],
            hash_block_size: 4,
            max_prompt: 480,
            max_in_flight: 128,
        },
    ]
}

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn layout_json(l: &Layout) -> Value {
    let groups: Vec<Value> = l
        .groups
        .iter()
        .map(|g| match g {
            GroupKind::FullAttention => json!({"kind": "full_attention"}),
            GroupKind::SlidingWindow { window } => {
                json!({"kind": "sliding_window", "window": window})
            }
        })
        .collect();
    json!({"num_blocks": l.num_blocks, "block_size": BLOCK_SIZE,
           "hash_block_size": l.hash_block_size, "hash_algo": "sha256", "max_in_flight_tokens": l.max_in_flight,
           "groups": groups})
}

/// What one op did, as both sides report it.
#[derive(Debug, PartialEq)]
struct Outcome {
    hit: Option<usize>,
    ok: Option<bool>,
    events_hex: String,
    blocks: Option<Vec<Vec<u32>>>,
}

/// The simulator's side: the manager plus the live requests, as the driver keeps them.
struct SimSide {
    kv: KvCacheManager,
    hasher: Arc<BlockHasher>,
    seqs: BTreeMap<SeqId, Sequence>,
}

impl SimSide {
    fn new(l: &Layout, hasher: Arc<BlockHasher>) -> Self {
        let kv = KvCacheManager::with_groups(l.num_blocks, BLOCK_SIZE, l.groups.clone(), true)
            .expect("pool")
            .with_admission_cap(l.max_in_flight, MAX_MODEL_LEN)
            .with_hash_block_size(l.hash_block_size)
            .expect("hash block size");
        SimSide {
            kv,
            hasher,
            seqs: BTreeMap::new(),
        }
    }

    fn events_hex(&mut self) -> String {
        let events = self.kv.take_events();
        if events.is_empty() {
            return String::new();
        }
        let batch = EventBatch {
            ts: 0.0,
            events: to_kv_events(&events, self.kv.groups()),
            data_parallel_rank: Some(0),
        };
        hex(&encode_batch(&batch, WireLayout::V0_33))
    }

    fn blocks(&self, id: SeqId) -> Option<Vec<Vec<u32>>> {
        if !self.seqs.contains_key(&id) {
            return None;
        }
        Some(
            (0..self.kv.groups().len())
                .map(|g| self.kv.group_blocks_of(id, g).to_vec())
                .collect(),
        )
    }

    /// Runs one op (the driver's semantics, see kv_manager_driver.py).
    fn apply(&mut self, op: &Value) -> Outcome {
        let id = op["id"]
            .as_str()
            .map(|s| s[1..].parse::<SeqId>().expect("id"));
        let (mut hit, mut ok) = (None, None);
        match op["op"].as_str().expect("op") {
            "add" => {
                let id = id.expect("add id");
                let prompt: Vec<u32> =
                    serde_json::from_value(op["prompt"].clone()).expect("prompt");
                let hbs = self.kv.hash_block_size();
                let extras = RequestExtras {
                    cache_salt: op["cache_salt"].as_str().map(str::to_owned),
                    ..RequestExtras::default()
                };
                let chain = RequestChainHasher::new(self.hasher.clone(), extras, hbs);
                let meta = Arc::new(chain.event_meta(None, None));
                let mut seq = Sequence::new(
                    SequenceSpec {
                        id,
                        prompt,
                        max_tokens: 1 << 20,
                        meta,
                        report_full: op["report_full"].as_bool().unwrap_or(false),
                        source: TokenSource::new(0, 1),
                        arrival_s: 0.0,
                    },
                    hbs,
                    Arc::new(chain),
                );
                let h = self.kv.get_computed_blocks(&seq);
                let n = chunk(op).min(seq.num_tokens() - h.num_tokens);
                let admitted = self.kv.allocate_slots(&seq, n, Some(&h), true);
                hit = Some(h.num_tokens);
                ok = Some(admitted);
                if admitted {
                    seq.num_computed_tokens = h.num_tokens + n;
                    if seq.num_computed_tokens == seq.num_tokens() {
                        seq.append_token(token(op));
                    }
                    self.seqs.insert(id, seq);
                }
            }
            "step" => {
                let id = id.expect("step id");
                let mut seq = self.seqs.remove(&id).expect("step of a live request");
                let n = chunk(op).min(seq.num_tokens() - seq.num_computed_tokens);
                let done = self.kv.allocate_slots(&seq, n, None, false);
                ok = Some(done);
                if done {
                    seq.num_computed_tokens += n;
                    if seq.num_computed_tokens == seq.num_tokens() {
                        seq.append_token(token(op));
                    }
                    self.seqs.insert(id, seq);
                } else {
                    self.kv.free(id);
                }
            }
            "free" => {
                let id = id.expect("free id");
                self.seqs.remove(&id).expect("free of a live request");
                self.kv.free(id);
            }
            "reset" => ok = Some(self.kv.reset_prefix_cache()),
            other => panic!("unknown op {other}"),
        }
        Outcome {
            hit,
            ok,
            events_hex: self.events_hex(),
            blocks: id.and_then(|id| self.blocks(id)),
        }
    }
}

fn chunk(op: &Value) -> usize {
    op["chunk"].as_u64().expect("chunk") as usize
}

fn token(op: &Value) -> u32 {
    op["token"].as_u64().expect("token") as u32
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Prompts share prefixes: a few shared "system prompts" of random length, then a random tail.
struct PromptGen {
    prefixes: Vec<Vec<u32>>,
    max_prompt: usize,
}

impl PromptGen {
    fn new(rng: &mut SplitMix64, max_prompt: usize) -> Self {
        let prefixes = (0..4)
            .map(|_| {
                let len = rng.below(max_prompt * 3 / 4) + 1;
                (0..len).map(|_| rng.below(1000) as u32 + 1).collect()
            })
            .collect();
        PromptGen {
            prefixes,
            max_prompt,
        }
    }

    fn prompt(&self, rng: &mut SplitMix64) -> Vec<u32> {
        let mut p = if rng.below(5) == 0 {
            Vec::new()
        } else {
            let base = &self.prefixes[rng.below(self.prefixes.len())];
            base[..rng.below(base.len()) + 1].to_vec()
        };
        let tail = rng.below(self.max_prompt.saturating_sub(p.len()).max(1)) + 1;
        p.extend((0..tail).map(|_| rng.below(1000) as u32 + 1));
        p
    }
}

/// Generates one sequence's ops by driving the simulator (ops only name requests it holds), and
/// returns the ops with the simulator's outcomes.
fn generate(l: &Layout, seed: u64, hasher: &Arc<BlockHasher>) -> (Vec<Value>, Vec<Outcome>) {
    let mut rng = SplitMix64::new(seed);
    let prompts = PromptGen::new(&mut rng, l.max_prompt);
    let mut sim = SimSide::new(l, hasher.clone());
    let (mut ops, mut outcomes) = (Vec::new(), Vec::new());
    let mut next_id: SeqId = 0;
    for _ in 0..OPS_PER_SEQUENCE {
        let live: Vec<SeqId> = sim.seqs.keys().copied().collect();
        let pick = rng.below(100);
        let chunk = match rng.below(3) {
            0 => BLOCK_SIZE * (rng.below(4) + 1),
            1 => rng.below(100) + 1,
            _ => l.max_in_flight,
        }
        .min(l.max_in_flight);
        let token = rng.below(1000) + 1;
        let op = if live.is_empty() || pick < 40 {
            if pick >= 95 {
                json!({"op": "reset"})
            } else {
                next_id += 1;
                let mut op = json!({"op": "add", "id": format!("r{next_id}"),
                                    "prompt": prompts.prompt(&mut rng), "chunk": chunk,
                                    "token": token});
                if rng.below(5) == 0 {
                    op["cache_salt"] = json!(["tenant-a", "tenant-b"][rng.below(2)]);
                }
                if rng.below(4) == 0 {
                    op["report_full"] = json!(true);
                }
                op
            }
        } else {
            let id = format!("r{}", live[rng.below(live.len())]);
            match pick {
                40..=79 => json!({"op": "step", "id": id, "chunk": chunk, "token": token}),
                80..=96 => json!({"op": "free", "id": id}),
                _ => json!({"op": "reset"}),
            }
        };
        outcomes.push(sim.apply(&op));
        ops.push(op);
    }
    (ops, outcomes)
}

/// vLLM's events without token ids: type, group, hashes, parent.
fn summarize(events: &Value) -> String {
    let items: Vec<String> = events
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|e| {
            format!(
                "{}(group {}, hashes {}, parent {})",
                e["type"].as_str().unwrap_or("?"),
                e["group_idx"],
                e["block_hashes"],
                e["parent_block_hash"]
            )
        })
        .collect();
    format!("[{}]", items.join(", "))
}

fn vllm_outcome(r: &Value) -> Outcome {
    Outcome {
        hit: r["hit"].as_u64().map(|v| v as usize),
        ok: if r["unknown"].as_bool() == Some(true) {
            None
        } else {
            r["ok"].as_bool()
        },
        events_hex: r["events_hex"].as_str().expect("events_hex").to_owned(),
        blocks: serde_json::from_value(r["blocks"].clone()).expect("blocks"),
    }
}

#[test]
fn simulator_kv_manager_matches_vllms_own() {
    let n = env_usize("KVROUTE_KV_DIFF_SEQUENCES", 20);
    let seed = env_usize("KVROUTE_KV_DIFF_SEED", 1) as u64;
    let hasher = Arc::new(
        BlockHasher::new(&HashConfig::new(HashAlgo::Sha256, None)).expect("sha256 hasher"),
    );
    let mut sequences = Vec::new();
    let mut expected = Vec::new();
    for (li, l) in layouts().iter().enumerate() {
        for s in 0..n {
            let (ops, outcomes) = generate(l, seed * 1_000_003 + (li * 10_000 + s) as u64, &hasher);
            sequences.push(json!({"layout": layout_json(l), "ops": ops}));
            expected.push((l.name, s, outcomes));
        }
    }
    let input = serde_json::to_vec(&json!({ "sequences": sequences })).expect("json");
    if let Ok(path) = std::env::var("KVROUTE_KV_DIFF_DUMP") {
        std::fs::write(&path, &input).expect("write KVROUTE_KV_DIFF_DUMP");
    }
    let script = workspace().join("tests/vllm_reference/kv_manager_driver.py");
    let mut child = Command::new(python())
        .arg(&script)
        .env_remove("PYTHONHASHSEED")
        .env("KVROUTE_CACHE", Paths::for_tests().cache_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the vLLM driver");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("vLLM driver output");
    writer
        .join()
        .expect("writer")
        .expect("write the driver's input");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kv_manager_driver.py failed ({}): {stderr}",
        out.status
    );
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout)
        .expect("utf8")
        .lines()
        .collect();
    assert_eq!(
        lines.len(),
        expected.len(),
        "one line per sequence; stderr: {stderr}"
    );

    let mut ops_checked = 0;
    let (mut hits, mut evicting_ops, mut failed_allocs, mut partial_stores) = (0, 0, 0, 0);
    for (seq_index, ((layout, s, sim), line)) in expected.iter().zip(&lines).enumerate() {
        let doc: Value = serde_json::from_str(line).expect("driver json");
        let results = doc["results"].as_array().expect("results");
        assert_eq!(results.len(), sim.len());
        for (i, (mine, r)) in sim.iter().zip(results).enumerate() {
            let theirs = vllm_outcome(r);
            if mine != &theirs {
                let op = &sequences[seq_index]["ops"][i];
                let mut shown = op.clone();
                if let Some(p) = op["prompt"].as_array() {
                    shown["prompt"] = json!(format!("{} tokens", p.len()));
                }
                panic!(
                    "layout {layout}, sequence {s}, op {i} ({shown}): the simulator differs from \
                     vLLM\n simulator: hit {:?} ok {:?} blocks {:?}\n vLLM:      hit {:?} ok {:?} \
                     blocks {:?}\n events identical: {}; vLLM's events: {}",
                    mine.hit,
                    mine.ok,
                    mine.blocks,
                    theirs.hit,
                    theirs.ok,
                    theirs.blocks,
                    mine.events_hex == theirs.events_hex,
                    summarize(&r["events"]),
                );
            }
            ops_checked += 1;
            hits += usize::from(mine.hit.is_some_and(|h| h > 0));
            failed_allocs += usize::from(mine.ok == Some(false));
            let events = r["events"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            evicting_ops += usize::from(events.iter().any(|e| e["type"] == "BlockRemoved"));
            partial_stores += events
                .iter()
                .filter(|e| e["type"] == "BlockStored" && e["block_size"] != json!(BLOCK_SIZE))
                .count();
        }
    }
    // The sequences must exercise what they claim to: hits, evictions, refused allocations.
    assert!(hits > n, "only {hits} prefix hits in {ops_checked} ops");
    assert!(
        evicting_ops > n,
        "only {evicting_ops} evicting ops in {ops_checked} ops"
    );
    assert!(
        failed_allocs > 0,
        "no allocation was refused in {ops_checked} ops"
    );
    assert!(
        partial_stores > 0,
        "no partial-block BlockStored in {ops_checked} ops"
    );
    eprintln!(
        "{ops_checked} ops identical to vLLM's ({hits} hits, {evicting_ops} evicting, \
         {failed_allocs} refused allocations, {partial_stores} partial-block stores)"
    );
}
