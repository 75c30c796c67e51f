//! Envoy's memory per filter build (measurement, `#[ignore]`d; run with
//! `cargo test -p kvroute-filter --test bench_memory -- --ignored --nocapture`
//! after `cargo build -p kvroute-filter-native --release`, the release `.wasm` and the workspace
//! binaries, which `cargo xtask test` builds).
//!
//! For each Envoy `--concurrency` (2 and 16; `KVROUTE_MEMORY_CONCURRENCY=2,8,16` to choose) and
//! each build (plain Envoy, the Wasm filter, the native dynamic module): the real indexer serving
//! the Qwen3 tokenizer, two kvroute-sim replicas, Envoy; the tokenizers loaded; then 320 routed
//! chat requests (8 clients at once, ~1.5k tokens each, shared system prompts); then Envoy's RSS.
//! Results go to stdout and `<target>/bench/memory.json`; `cargo xtask bench filter` runs it at 2, 8
//! and 16 and prints it in one table with `bench_filter`'s latency of both builds.

mod common;

use std::thread;

use common::*;
use serde_json::{json, Value};

const CLIENTS: usize = 8;
const REQUESTS_PER_CLIENT: usize = 40;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    Plain,
    Wasm,
    Native,
}

impl Build {
    fn name(self) -> &'static str {
        match self {
            Build::Plain => "plain",
            Build::Wasm => "wasm",
            Build::Native => "native",
        }
    }
}

/// A chat request of ~1.5k tokens: one of four system prompts, a unique user turn.
fn chat(client: usize, i: usize) -> Value {
    let system = filler((i % 4) as u64, 700);
    let user = filler(10_000 + (client * 1000 + i) as u64, 400);
    json!({"model": "qwen3", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

fn rss_after_load(build: Build, concurrency: usize) -> (u64, u64) {
    let dir = scratch(&format!("memory-{}-{concurrency}", build.name()));
    let plans = vec![Sim::plan("r0"), Sim::plan("r1")];
    let mut indexer = Indexer::start(&plans, &dir);
    let sims: Vec<Sim> = plans.iter().map(|p| Sim::start(p, &dir)).collect();
    indexer.wait_ready();
    let mut opts = EnvoyOptions::new(
        indexer.port,
        sims.iter().map(Sim::addr).collect(),
        json!({"route_timeout_ms": 2000, "models": {"qwen3": {}}}),
    );
    opts.concurrency = concurrency;
    match build {
        Build::Plain => opts.with_filter = false,
        Build::Wasm => opts.native_module = None,
        Build::Native => opts.native_module = Some(native_module_path()),
    }
    let envoy = Envoy::start(&format!("memory-{}", build.name()), &opts, &dir);
    if build != Build::Plain {
        envoy.wait_tokenizers(1);
    }
    let idle = envoy.proc.rss_bytes();
    let port = envoy.port;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            thread::spawn(move || {
                for i in 0..REQUESTS_PER_CLIENT {
                    let r = post_json(port, "/v1/chat/completions", &chat(client, i), &[]);
                    assert_eq!(r.status, 200, "{}", r.text());
                }
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client thread");
    }
    if build != Build::Plain {
        assert_eq!(
            envoy.kv("routed") as usize,
            CLIENTS * REQUESTS_PER_CLIENT,
            "every request routed"
        );
    }
    (idle, envoy.proc.rss_bytes())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

#[test]
#[ignore = "measurement: run with --ignored --nocapture"]
fn envoy_rss_per_build_and_concurrency() {
    let levels: Vec<usize> = std::env::var("KVROUTE_MEMORY_CONCURRENCY")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![2, 16]);
    let mut rows = Vec::new();
    println!(
        "concurrency  build   idle MiB  after {} requests MiB",
        CLIENTS * REQUESTS_PER_CLIENT
    );
    for &concurrency in &levels {
        for build in [Build::Plain, Build::Wasm, Build::Native] {
            let (idle, loaded) = rss_after_load(build, concurrency);
            println!(
                "{concurrency:>11}  {:<6} {:>9.0}  {:>9.0}",
                build.name(),
                mib(idle),
                mib(loaded)
            );
            rows.push(json!({"concurrency": concurrency, "build": build.name(),
                             "rss_idle_bytes": idle, "rss_after_bytes": loaded}));
        }
    }
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).expect("mkdir <target>/bench");
    std::fs::write(
        out.join("memory.json"),
        serde_json::to_string_pretty(
            &json!({"requests": CLIENTS * REQUESTS_PER_CLIENT, "rows": rows}),
        )
        .unwrap_or_default(),
    )
    .expect("write <target>/bench/memory.json");
}
