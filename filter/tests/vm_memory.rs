//! Where a VM's memory goes, natively (heap bytes counted by a global allocator; a wasm32 VM
//! holds less, its pointers are 4 bytes, but the phases are the same): the tokenizer answer
//! as the filter receives it, its parse, the tokenizer build, the tokenizer at rest, and the
//! filter benchmark's chat workload (segment cache, per-request buffers). Wasm memory never
//! shrinks, so a VM keeps the highest peak of any phase.
//!
//! `cargo test -p kvroute-filter --test vm_memory -- --nocapture` prints the table; the test
//! asserts that the load peaks stay within the budget the lean VM is sized for.

use kvroute_core::request::{Endpoint, RequestBody};
use kvroute_filter::config::FilterConfig;
use kvroute_filter::loaded_model::LoadedModel;
use kvroute_testkit::counting_alloc::CountingAllocator;
use kvroute_testkit::paths::model_dir;
use kvroute_testkit::text::filler;
use serde_json::{json, Value};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

const MIB: f64 = 1048576.0;

/// The indexer's answer to `GET /v1/models/qwen3/tokenizer` in the given form, as bytes.
fn answer(compact: bool) -> Vec<u8> {
    let files = kvroute_core::request::ModelFiles::from_dir(model_dir())
        .unwrap_or_else(|e| panic!("{e}: run `cargo xtask setup`"));
    let bundle =
        kvroute_core::api::TokenizerBundle::from_files("qwen3", files, compact).expect("bundle");
    serde_json::to_vec(&bundle).expect("serialise")
}

/// ~`tokens` tokens of chat, as `filter/tests/bench_filter.rs` sends them.
fn conversation(seed: u64, tokens: usize, last_turn_seed: u64) -> Value {
    let words = 380;
    let turns = (tokens / 1000).max(1);
    let mut messages = vec![json!({"role": "system", "content": filler(seed, words)})];
    for t in 0..turns.saturating_sub(1) {
        messages.push(json!({"role": "user", "content": filler(seed * 1000 + t as u64, words)}));
        messages
            .push(json!({"role": "assistant", "content": filler(seed * 2000 + t as u64, words)}));
    }
    messages.push(json!({"role": "user", "content": filler(last_turn_seed, words)}));
    json!({"model": "qwen3", "max_tokens": 1, "messages": messages})
}

/// One phase's figures: the heap live after it and the highest peak since the start.
struct Phases {
    start: usize,
    rows: Vec<(String, f64, f64)>,
}

impl Phases {
    fn new() -> Self {
        let start = HEAP.reset_peak();
        Self {
            start,
            rows: Vec::new(),
        }
    }
    fn mark(&mut self, name: &str) -> f64 {
        let live = HEAP.current().saturating_sub(self.start) as f64 / MIB;
        let peak = HEAP.peak().saturating_sub(self.start) as f64 / MIB;
        self.rows.push((name.to_owned(), live, peak));
        peak
    }
    fn print(&self, title: &str) {
        println!(
            "{title}\n{:<44} {:>9} {:>9}",
            "phase", "live MiB", "peak MiB"
        );
        for (name, live, peak) in &self.rows {
            println!("{name:<44} {live:>9.1} {peak:>9.1}");
        }
    }
}

/// Runs one VM's life in the given form; returns (load peak, workload peak) in MiB.
fn vm_life(compact: bool) -> (f64, f64) {
    let cfg = FilterConfig::parse(br#"{"models": {"qwen3": {}}}"#).expect("config");
    let body = answer(compact);
    let mut p = Phases::new();
    let body = std::hint::black_box(body.clone());
    p.mark(&format!("answer body ({:.1} MiB)", body.len() as f64 / MIB));
    let bundle = kvroute_core::api::TokenizerBundle::parse(&body).expect("answer parses");
    p.mark("answer parsed");
    drop(body);
    let model =
        LoadedModel::from_bundle(&bundle, cfg.models.get("qwen3"), &cfg).expect("tokenizer loads");
    drop(bundle);
    let load_peak = p.mark("tokenizer built (live: at rest)");
    for &(tokens, n_cold, n_warm) in &[(1000usize, 40u64, 100u64), (8000, 20, 60), (32000, 8, 30)] {
        for warm in [false, true] {
            let n = if warm { n_warm } else { n_cold };
            let base_seed = tokens as u64 * 7 + u64::from(warm);
            for i in 0..n {
                let body = if warm {
                    conversation(base_seed, tokens, 900_000 + i)
                } else {
                    conversation(base_seed * 100 + i, tokens, 800_000 + i)
                };
                let bytes = serde_json::to_vec(&body).expect("body");
                drop(body);
                let parsed = RequestBody::parse(&bytes, Endpoint::ChatCompletions).expect("json");
                model
                    .prepare(Endpoint::ChatCompletions, &parsed)
                    .expect("prepare");
            }
        }
        p.mark(&format!("+ {tokens}-token chats (live: + segment cache)"));
    }
    let all = p.mark("after the filter benchmark's workload");
    p.print(if compact {
        "compact answer (tables)"
    } else {
        "plain answer (tokenizer.json)"
    });
    drop(model);
    (load_peak, all)
}

#[test]
fn vm_memory_by_phase() {
    let (plain_load, _) = vm_life(false);
    let (compact_load, compact_all) = vm_life(true);
    assert!(
        compact_load * 3.0 < plain_load,
        "the compact form's load peak ({compact_load:.1} MiB) is not a third of the plain one's ({plain_load:.1} MiB)"
    );
    assert!(
        compact_all < 64.0,
        "a VM's heap peaks at {compact_all:.1} MiB natively, over the 64 MiB budget"
    );
}
