//! Added latency of the kvroute filter inside Envoy (benchmark, `#[ignore]`d; run with
//! `cargo test -p kvroute-filter --release --test bench_filter -- --ignored --nocapture`, or
//! through `cargo xtask bench filter`).
//!
//! Two Envoys (concurrency 1) in front of the same instant-answer upstream: one plain, one with
//! the filter and an instant fake indexer (so the number is the filter's own work: body
//! buffering, JSON parse, chat template, tokenisation, router keys, the loopback callout, the
//! header). Chat prompts of about 1k, 8k and 32k tokens, sent one at a time:
//! * cold: every prompt is new text (nothing in the segment cache);
//! * warm: a multi-turn conversation whose earlier turns were already seen, with a new last turn.
//!
//! Each body goes through both Envoys in turn (alternating which goes first), so both lines see
//! the same moment of the machine.
//!
//! Results go to stdout and `<target>/bench/filter.json`. With `KVROUTE_FILTER_BUILD=native` the
//! filter Envoy runs the native dynamic module instead (`<target>/bench/filter-native.json`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvroute_testkit::text::chat_conversation;
use serde_json::{json, Value};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Milliseconds of one request through the Envoy at `port`.
fn time_one(port: u16, payload: &[u8]) -> f64 {
    let t = Instant::now();
    let r = http(
        port,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        payload,
    );
    let ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(r.status, 200, "{}", r.text());
    ms
}

fn measure(port: u16, bodies: &[Value]) -> Vec<f64> {
    bodies
        .iter()
        .map(|b| time_one(port, b.to_string().as_bytes()))
        .collect()
}

/// Each body through both Envoys in turn (the plain one first on even bodies, second on odd
/// ones), so that a drift of the machine's speed during the run falls on both lines alike.
fn measure_interleaved(plain: u16, with: u16, bodies: &[Value]) -> (Vec<f64>, Vec<f64>) {
    let (mut base, mut kvr) = (Vec::new(), Vec::new());
    for (i, b) in bodies.iter().enumerate() {
        let payload = b.to_string();
        if i % 2 == 0 {
            base.push(time_one(plain, payload.as_bytes()));
            kvr.push(time_one(with, payload.as_bytes()));
        } else {
            kvr.push(time_one(with, payload.as_bytes()));
            base.push(time_one(plain, payload.as_bytes()));
        }
    }
    (base, kvr)
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture (cargo xtask bench filter)"]
fn filter_added_latency() {
    let dir = scratch("bench-filter");
    let upstream = TestServer::start(|_| {
        Reply::json(
            200,
            &json!({"choices": [{"message": {"content": "ok"}}],
                    "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}),
        )
    });
    let indexer = FakeIndexer::start(
        "qwen3",
        RouteMode::To(upstream.addr()),
        TokenizerMode::Serve,
    );
    let cfg = json!({"route_timeout_ms": 5000, "models": {"qwen3": {}}});
    let with = Envoy::start(
        "bench-with",
        &EnvoyOptions::new(indexer.server.port, vec![upstream.addr()], cfg.clone()),
        &dir,
    );
    let mut plain_opts = EnvoyOptions::new(indexer.server.port, vec![upstream.addr()], cfg);
    plain_opts.with_filter = false;
    let without = Envoy::start("bench-without", &plain_opts, &dir);
    with.wait_tokenizers(1);

    let mut results = Vec::new();
    println!(
        "{:<6} {:<5} {:>5} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11}",
        "tokens",
        "cache",
        "n",
        "base p50",
        "base p99",
        "kvr p50",
        "kvr p99",
        "added p50",
        "added p99"
    );
    for &(tokens, n_cold, n_warm) in &[
        (1000usize, 60usize, 200usize),
        (8000, 40, 200),
        (32000, 12, 60),
    ] {
        for warm in [false, true] {
            let n = if warm { n_warm } else { n_cold };
            let base_seed = tokens as u64 * 7 + u64::from(warm);
            let bodies: Vec<Value> = (0..n as u64)
                .map(|i| {
                    if warm {
                        // Same earlier turns, a new last turn each time.
                        chat_conversation(base_seed, tokens, 900_000 + i)
                    } else {
                        chat_conversation(base_seed * 100 + i, tokens, 800_000 + i)
                    }
                })
                .collect();
            if warm {
                // Prime the segment cache and the connection pools.
                measure(with.port, &bodies[..1]);
            }
            measure(without.port, &bodies[..1]);
            let (mut base, mut kvr) = measure_interleaved(without.port, with.port, &bodies);
            base.sort_by(f64::total_cmp);
            kvr.sort_by(f64::total_cmp);
            let row = json!({
                "tokens": tokens, "warm": warm, "n": n,
                "baseline_p50_ms": percentile(&base, 0.5), "baseline_p99_ms": percentile(&base, 0.99),
                "filter_p50_ms": percentile(&kvr, 0.5), "filter_p99_ms": percentile(&kvr, 0.99),
                "added_p50_ms": percentile(&kvr, 0.5) - percentile(&base, 0.5),
                "added_p99_ms": percentile(&kvr, 0.99) - percentile(&base, 0.99),
            });
            println!(
                "{:<6} {:<5} {:>5} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>11.3} {:>11.3}",
                tokens,
                if warm { "warm" } else { "cold" },
                n,
                row["baseline_p50_ms"].as_f64().unwrap_or(f64::NAN),
                row["baseline_p99_ms"].as_f64().unwrap_or(f64::NAN),
                row["filter_p50_ms"].as_f64().unwrap_or(f64::NAN),
                row["filter_p99_ms"].as_f64().unwrap_or(f64::NAN),
                row["added_p50_ms"].as_f64().unwrap_or(f64::NAN),
                row["added_p99_ms"].as_f64().unwrap_or(f64::NAN),
            );
            results.push(row);
            if std::env::var_os("KVROUTE_BENCH_HISTOGRAMS").is_some() {
                std::thread::sleep(Duration::from_millis(5500)); // one stats flush
                let r = http(with.admin, "GET", "/stats?filter=kvroute.*_us", &[], b"");
                println!("{}", r.text());
            }
        }
    }
    assert_eq!(with.kv("routed") as usize, indexer.route_calls().len());
    std::thread::sleep(Duration::from_millis(500)); // one tick: the VMs publish their memory
    let vm_memory = with.kv("vm_memory_bytes");
    println!(
        "VM linear memory (one worker VM, Qwen3 tokenizer + segment cache): {:.1} MiB",
        vm_memory as f64 / 1048576.0
    );
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).expect("mkdir <target>/bench");
    let (build, file, artifact) = match filter_build() {
        FilterBuild::Wasm => ("wasm", "filter.json", wasm_path()),
        FilterBuild::Native => ("native", "filter-native.json", native_module_path()),
    };
    let report = json!({"build": build, "envoy_concurrency": 1, "results": results,
                        "vm_memory_bytes": vm_memory,
                        "artifact_bytes": std::fs::metadata(artifact).map(|m| m.len()).unwrap_or(0)});
    std::fs::write(
        out.join(file),
        serde_json::to_string_pretty(&report).unwrap_or_default(),
    )
    .expect("write the report under <target>/bench");
    std::thread::sleep(Duration::from_millis(10));
}
