//! Hostile requests against the real Envoy + .wasm (issue 16): the 3.9 MB digit prompt that used
//! to abort the Wasm VM, bogus `model` names that used to fill every model slot, a 100 kB name
//! that was looked up and logged whole, and a body over the engine's limit.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const FALLBACK: &str = "cluster.kvroute_replicas_fallback.upstream_rq_total";
const CHAT: &str = "/v1/chat/completions";

/// A replica that answers every request with a small 200 (whatever the body).
fn ok_replica() -> TestServer {
    TestServer::start(|_| {
        Reply::json(
            200,
            &json!({"choices": [{"message": {"content": "ok"}}],
                    "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}),
        )
    })
}

fn chat_body(model: &str, content: &str) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": content}]})
        .to_string()
        .into_bytes()
}

fn send(envoy: &Envoy, body: &[u8]) -> Response {
    http(
        envoy.port,
        "POST",
        CHAT,
        &[("content-type", "application/json")],
        body,
    )
}

/// Envoy's Wasm VM life-cycle stats (`wasm.*`): created / active VMs per runtime.
fn vm_stats(envoy: &Envoy) -> Vec<(String, u64)> {
    envoy.stats_containing("^wasm\\.")
}

fn vms_created(envoy: &Envoy) -> u64 {
    vm_stats(envoy)
        .iter()
        .filter(|(k, _)| k.ends_with(".created"))
        .map(|(_, v)| v)
        .sum()
}

struct Stack {
    _dir: std::path::PathBuf,
    replica: TestServer,
    indexer: FakeIndexer,
    envoy: Envoy,
}

fn stack(name: &str, cfg: Value) -> Stack {
    let dir = scratch(name);
    let replica = ok_replica();
    let indexer = FakeIndexer::start("qwen3", RouteMode::To(replica.addr()), TokenizerMode::Serve);
    let opts = EnvoyOptions::new(indexer.server.port, vec![replica.addr()], cfg);
    let envoy = Envoy::start(name, &opts, &dir);
    Stack {
        _dir: dir,
        replica,
        indexer,
        envoy,
    }
}

#[test]
fn the_digit_bomb_fails_open_without_crashing_the_vm() {
    // The default max_body_bytes (2 MiB) refuses the bomb from its content-length; the issue's
    // 4 MiB lets it reach the tokenizer, whose cap must hold.
    let s = stack(
        "hostile-digits",
        json!({"debug_headers": true, "max_body_bytes": 4 << 20, "models": {"qwen3": {}}}),
    );
    s.envoy.wait_tokenizers(1);
    let r = send(&s.envoy, &chat_body("qwen3", "hello"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("x-kvroute-fail-open").is_none(), "routed");
    let created = vms_created(&s.envoy);
    let rss_warm = s.envoy.proc.rss_bytes();
    println!("wasm stats after warm-up: {:?}", vm_stats(&s.envoy));

    // The request: under the max_body_bytes (4 MiB), 3.9 M tokens for Qwen3.
    let bomb = chat_body("qwen3", &"7".repeat(3_900_000));
    assert!(bomb.len() < 4 * 1024 * 1024);
    let mut rss = Vec::new();
    let mut outcomes = Vec::new();
    let fallback = s.envoy.stat(FALLBACK);
    for _ in 0..20 {
        let r = send(&s.envoy, &bomb);
        outcomes.push((
            r.status,
            r.header("x-kvroute-fail-open").unwrap_or("-").to_string(),
        ));
        rss.push(s.envoy.proc.rss_bytes());
    }
    let mib = |b: u64| b / (1 << 20);
    println!(
        "envoy RSS warm {} MiB, after bombs 1, 10, 20: {} / {} / {} MiB; VM memory gauge {} MiB; outcomes {:?}",
        mib(rss_warm),
        mib(rss[0]),
        mib(rss[9]),
        mib(rss[19]),
        mib(s.envoy.kv("vm_memory_bytes")),
        &outcomes[..3]
    );
    let log = s.envoy.log();
    assert!(
        !log.contains("memory allocation of"),
        "a VM aborted: {}",
        s.envoy.proc.log_tail()
    );
    assert_eq!(s.envoy.stat("wasm.kvroute.vm_reload"), 0, "VM reloads");
    assert_eq!(
        vms_created(&s.envoy),
        created,
        "no VM was reloaded: {:?}",
        vm_stats(&s.envoy)
    );
    // Wasm memory never shrinks: the bombs must not grow it (docs/filter.md's sizing: ~200 MiB
    // per VM with the Qwen3 tokenizer, the tokenisation working set bounded by the cap).
    let rss_max = rss.iter().copied().max().unwrap_or(0);
    assert!(
        rss_max <= rss_warm + (128 << 20),
        "RSS grew by {} MiB under 20 bombs",
        mib(rss_max.saturating_sub(rss_warm))
    );
    assert!(
        s.envoy.kv("vm_memory_bytes") <= 256 << 20,
        "VM linear memory {} MiB",
        mib(s.envoy.kv("vm_memory_bytes"))
    );
    for (i, o) in outcomes.iter().enumerate() {
        assert_eq!(
            o,
            &(200, "prompt_too_long".to_string()),
            "bomb {i}: 200 through the fallback, failed open as prompt_too_long"
        );
    }
    assert_eq!(s.envoy.kv("fail_open.prompt_too_long"), 20);
    assert_eq!(
        s.envoy.stat(FALLBACK),
        fallback + 20,
        "all via the fallback"
    );
    // Under the size bound (1.5 MB < 131072 x 16) but 1.5 M tokens: stopped while tokenising,
    // within the documented VM size.
    let counted = chat_body("qwen3", &"7".repeat(1_500_000));
    for i in 0..5 {
        let r = send(&s.envoy, &counted);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-kvroute-fail-open"),
            Some("prompt_too_long"),
            "1.5 MB of digits, {i}"
        );
    }
    thread::sleep(Duration::from_millis(500)); // a tick publishes the gauge
    println!(
        "after 5 x 1.5 MB of digits: VM memory gauge {} MiB, envoy RSS {} MiB",
        mib(s.envoy.kv("vm_memory_bytes")),
        mib(s.envoy.proc.rss_bytes())
    );
    assert!(
        s.envoy.kv("vm_memory_bytes") <= 256 << 20,
        "VM linear memory {} MiB",
        mib(s.envoy.kv("vm_memory_bytes"))
    );
    assert_eq!(s.envoy.stat("wasm.kvroute.vm_reload"), 0, "VM reloads");
    // Still routing.
    let r = send(&s.envoy, &chat_body("qwen3", "hello again"));
    assert_eq!(r.status, 200);
    assert!(r.header("x-kvroute-fail-open").is_none(), "routed");
    assert!(s.replica.hits() >= 22);
}

#[test]
fn bogus_model_names_do_not_lock_out_a_real_model() {
    // No configured model: qwen3 must be discovered after the slots were attacked.
    let s = stack(
        "hostile-models",
        json!({"debug_headers": true, "max_models": 2, "unknown_model_retry_ms": 600000}),
    );
    for round in 0..3 {
        for i in 0..10 {
            let r = send(&s.envoy, &chat_body(&format!("bogus-{i}"), "hi"));
            assert_eq!(r.status, 200, "round {round}, bogus-{i}: {}", r.text());
        }
        thread::sleep(Duration::from_millis(500));
    }
    let asked: Vec<String> = s
        .indexer
        .server
        .requests
        .lock()
        .expect("lock")
        .iter()
        .filter(|r| r.path.contains("bogus"))
        .map(|r| r.path.clone())
        .collect();
    assert!(!asked.is_empty(), "the indexer was asked about bogus names");
    // Negative answers are cached (600 s): one question per name and VM at most.
    let mut unique = asked.clone();
    unique.sort();
    unique.dedup();
    assert!(
        asked.len() <= unique.len() * (s.envoy.concurrency + 2),
        "{} questions for {} names",
        asked.len(),
        unique.len()
    );
    // The real model, added "later": discovered and routed.
    let start = Instant::now();
    let mut reasons = Vec::new();
    loop {
        let r = send(&s.envoy, &chat_body("qwen3", "a real request"));
        assert_eq!(r.status, 200);
        match r.header("x-kvroute-fail-open") {
            None => break,
            Some(reason) => reasons.push(reason.to_string()),
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "qwen3 never routed after the bogus names; fail-open reasons: {reasons:?}"
        );
        thread::sleep(Duration::from_millis(200));
    }
    assert!(
        !reasons.iter().any(|r| r == "unknown_model"),
        "qwen3 was reported unknown: {reasons:?}"
    );
    assert!(s.envoy.kv("fail_open.unknown_model") > 0);
}

#[test]
fn a_huge_model_name_is_neither_looked_up_nor_logged() {
    let s = stack("hostile-name", json!({"debug_headers": true}));
    // With the default max_body_bytes (2 MiB) the digit bomb fails open from its length, unparsed.
    let r = send(&s.envoy, &chat_body("qwen3", &"7".repeat(3_900_000)));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvroute-fail-open"), Some("too_large"));
    let name = "n".repeat(100_000);
    let mut reasons = Vec::new();
    for _ in 0..3 {
        let r = send(&s.envoy, &chat_body(&name, "hi"));
        assert_eq!(r.status, 200, "{}", r.text());
        reasons.push(r.header("x-kvroute-fail-open").map(str::to_string));
    }
    // Several ticks: any fetch would have started by now.
    thread::sleep(Duration::from_secs(2));
    let longest = s
        .indexer
        .server
        .requests
        .lock()
        .expect("lock")
        .iter()
        .map(|r| r.path.len())
        .max()
        .unwrap_or(0);
    assert!(
        longest < 1000,
        "the indexer was asked about the name ({longest} bytes)"
    );
    let run = "n".repeat(1000);
    assert!(!s.envoy.log().contains(&run), "the name was logged whole");
    // Failed open at once, as unknown (not "loading").
    assert!(
        reasons
            .iter()
            .all(|r| r.as_deref() == Some("unknown_model")),
        "{reasons:?}"
    );
}

/// Head-of-line blocking: small requests from another client while 8 clients send the digit
/// bomb in a loop, against a single worker; plain Envoy, the filter with its defaults, and the
/// filter with the 4 MiB `max_body_bytes`. Prints p50/p99 of the small requests' latency
/// (no assertion on time). `cargo test -p kvroute-filter --test e2e_hostile -- --ignored
/// --nocapture head_of_line`
#[test]
#[ignore]
fn head_of_line_blocking_under_bombs() {
    for (label, with_filter, cfg) in [
        ("plain envoy", false, json!({})),
        (
            "filter, defaults",
            true,
            json!({"debug_headers": true, "models": {"qwen3": {}}}),
        ),
        (
            "filter, max_body_bytes 4 MiB",
            true,
            json!({"debug_headers": true, "max_body_bytes": 4 << 20, "models": {"qwen3": {}}}),
        ),
    ] {
        head_of_line(label, with_filter, cfg);
    }
}

fn head_of_line(label: &str, with_filter: bool, cfg: Value) {
    let dir = scratch("hostile-hol");
    let replica = ok_replica();
    let indexer = FakeIndexer::start("qwen3", RouteMode::To(replica.addr()), TokenizerMode::Serve);
    let mut opts = EnvoyOptions::new(indexer.server.port, vec![replica.addr()], cfg);
    opts.with_filter = with_filter;
    let envoy = Envoy::start("hostile-hol", &opts, &dir);
    if with_filter {
        envoy.wait_tokenizers(1);
    }
    let small = chat_body("qwen3", "What is KV-cache aware routing? Answer briefly.");
    // At most n samples or 120 s; a request without an answer in 120 s counts as 120 s.
    let measure = |n: usize| -> Vec<f64> {
        let mut v = Vec::with_capacity(n);
        let start = Instant::now();
        while v.len() < n && start.elapsed() < Duration::from_secs(120) {
            let t = Instant::now();
            let r = try_http(
                envoy.port,
                "POST",
                CHAT,
                &[("content-type", "application/json")],
                &small,
                Duration::from_secs(120),
            );
            assert!(r.as_ref().map_or(true, |r| r.status == 200), "{r:?}");
            v.push(t.elapsed().as_secs_f64() * 1000.0);
            thread::sleep(Duration::from_millis(20));
        }
        v
    };
    let pct = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    let mut quiet = measure(100);
    let port = envoy.port;
    let bomb = Arc::new(chat_body("qwen3", &"7".repeat(3_900_000)));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attackers: Vec<_> = (0..8)
        .map(|_| {
            let (bomb, stop) = (bomb.clone(), stop.clone());
            thread::spawn(move || {
                let mut statuses = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let r = try_http(
                        port,
                        "POST",
                        CHAT,
                        &[("content-type", "application/json")],
                        &bomb,
                        Duration::from_secs(120),
                    );
                    statuses.push(r.map(|r| r.status).unwrap_or(0));
                }
                statuses
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let mut loaded = measure(40);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let statuses: Vec<u16> = attackers
        .into_iter()
        .flat_map(|a| a.join().unwrap_or_default())
        .collect();
    let mut counts = std::collections::BTreeMap::new();
    for st in &statuses {
        *counts.entry(*st).or_insert(0) += 1;
    }
    let (q50, q99) = (pct(&mut quiet, 0.5), pct(&mut quiet, 0.99));
    let (l50, l99) = (pct(&mut loaded, 0.5), pct(&mut loaded, 0.99));
    println!(
        "{label}: small requests quiet p50 {q50:.1} ms p99 {q99:.1} ms; under 8 looping bombs ({} samples) p50 {l50:.1} ms p99 {l99:.1} ms (max {:.1} ms); bombs answered {counts:?}; fail-open {:?}",
        loaded.len(),
        loaded.last().copied().unwrap_or(0.0),
        (envoy.kv("fail_open.too_large"), envoy.kv("fail_open.prompt_too_long"), envoy.kv("fail_open.indexer_timeout"))
    );
}

fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + body.len() / 1000 + 16);
    for part in body.chunks(64 * 1024) {
        out.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        out.extend_from_slice(part);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

#[test]
fn a_body_over_the_engines_limit_gets_413_not_503() {
    let dir = scratch("hostile-413");
    // kvroute-sim answers 413 above 16 MiB (its --max-body-bytes default), as the filter's
    // default upstream_max_body_bytes assumes.
    let sim = Sim::start_without_events("r0", &dir);
    let indexer = FakeIndexer::start("qwen3", RouteMode::To(sim.addr()), TokenizerMode::Serve);
    let opts = EnvoyOptions::new(
        indexer.server.port,
        vec![sim.addr()],
        json!({"debug_headers": true, "models": {"qwen3": {}}}),
    );
    let envoy = Envoy::start("hostile-413", &opts, &dir);
    envoy.wait_tokenizers(1);
    let body = json!({"model": "qwen3", "prompt": "a ".repeat(17 << 19), "max_tokens": 1})
        .to_string()
        .into_bytes();
    assert!(body.len() > 17 << 20);
    let post = |headers: &[(&str, &str)], bytes: &[u8]| {
        try_http(
            envoy.port,
            "POST",
            "/v1/completions",
            headers,
            bytes,
            Duration::from_secs(120),
        )
        .map(|r| (r.status, r.text().chars().take(200).collect::<String>()))
        .unwrap_or_else(|e| (0, format!("no answer: {e}")))
    };
    let json_ct = ("content-type", "application/json");
    // The filter used to fail open and stream the body into the engine, whose early 413 was
    // often lost in the reset of the upload (Envoy then answered 503): now it never leaves Envoy.
    let fallback = envoy.stat(FALLBACK);
    let framed = chunked(&body);
    for round in 0..3 {
        // No declared length.
        let (status, text) = post(&[json_ct, ("transfer-encoding", "chunked")], &framed);
        assert_eq!(status, 413, "round {round}, chunked: {text}");
        // Declared length.
        let (status, text) = post(&[json_ct], &body);
        assert_eq!(status, 413, "round {round}, content-length: {text}");
    }
    assert_eq!(envoy.stat(FALLBACK), fallback, "forwarded to an engine");
    // A body over max_body_bytes (4 MiB) but within the engines' limit still fails open.
    let body = json!({"model": "qwen3", "prompt": (0..1_200_000).map(|i| i % 1000).collect::<Vec<u32>>(), "max_tokens": 1})
        .to_string()
        .into_bytes();
    assert!(body.len() > 4 << 20 && body.len() < 16 << 20);
    let (status, text) = post(
        &[json_ct, ("transfer-encoding", "chunked")],
        &chunked(&body),
    );
    assert_eq!(
        status, 400,
        "forwarded: the engine's own context-length error: {text}"
    );
    assert!(text.contains("maximum context length"), "{text}");
    assert!(envoy.kv("fail_open.too_large") >= 1);
}
