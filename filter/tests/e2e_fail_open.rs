//! Fail-open end to end: real Envoy + the real .wasm, kvroute-sim replicas, and a programmable
//! fake indexer (serving the real Qwen3 tokenizer) that can be slow, down, wrong or rude. Every
//! failure on kvroute's side must still get a 200 from a replica through the fallback cluster,
//! counted by reason. The replica that ran a request is read from its own
//! `vllm:prefix_cache_queries_total`.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn completion(model: &str, prompt: &str) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": 2})
}

struct Stack {
    _dir: std::path::PathBuf,
    replicas: Vec<Sim>,
    indexer: FakeIndexer,
    envoy: Envoy,
}

fn replicas(dir: &std::path::Path) -> Vec<Sim> {
    vec![
        Sim::start_without_events("r0", dir),
        Sim::start_without_events("r1", dir),
    ]
}

/// Index of the replica whose query counter moved while `f` ran (exactly one must).
fn ran_on(replicas: &[Sim], f: impl FnOnce() -> Response) -> (usize, Response) {
    let before: Vec<u64> = replicas.iter().map(|r| r.cache_counters().0).collect();
    let r = f();
    let after: Vec<u64> = replicas.iter().map(|r| r.cache_counters().0).collect();
    let ran: Vec<usize> = (0..replicas.len())
        .filter(|&i| after[i] > before[i])
        .collect();
    assert_eq!(
        ran.len(),
        1,
        "one replica ran it ({before:?} -> {after:?}): {}",
        r.text()
    );
    (ran[0], r)
}

fn stack(name: &str, cfg: Value, tokenizer: TokenizerMode) -> Stack {
    let dir = scratch(name);
    let replicas = replicas(&dir);
    let indexer = FakeIndexer::start("qwen3", RouteMode::To(replicas[0].addr()), tokenizer);
    let opts = EnvoyOptions::new(
        indexer.server.port,
        replicas.iter().map(Sim::addr).collect(),
        cfg,
    );
    let envoy = Envoy::start(name, &opts, &dir);
    Stack {
        _dir: dir,
        replicas,
        indexer,
        envoy,
    }
}

/// Sends a routed request and checks it reached a replica through the fallback cluster: a 200
/// completion run by one replica, or (for bodies no engine accepts) the replica's own 400.
fn assert_fails_open(s: &Stack, body: &[u8], reason: &str) {
    let before = s.envoy.kv(&format!("fail_open.{reason}"));
    let fallback = "cluster.kvroute_replicas_fallback.upstream_rq_total";
    let fallback_before = s.envoy.stat(fallback);
    let send = || {
        http(
            s.envoy.port,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            body,
        )
    };
    let before_queries: Vec<u64> = s.replicas.iter().map(|r| r.cache_counters().0).collect();
    let r = send();
    if r.status == 200 {
        let after: Vec<u64> = s.replicas.iter().map(|r| r.cache_counters().0).collect();
        let ran = (0..after.len())
            .filter(|&i| after[i] > before_queries[i])
            .count();
        assert_eq!(ran, 1, "{reason}: one replica ran it");
        assert!(
            r.json()["usage"]["prompt_tokens"].as_u64() > Some(0),
            "{reason}: a completion"
        );
    } else {
        // A body no engine accepts gets the replica's own 400, not a router error.
        assert_eq!(r.status, 400, "{reason}: {}", r.text());
        assert!(
            r.json()["error"]["message"].is_string(),
            "{reason}: {}",
            r.text()
        );
    }
    assert_eq!(
        r.header("x-kvroute-fail-open"),
        Some(reason),
        "{reason}: debug header"
    );
    assert_eq!(
        s.envoy.kv(&format!("fail_open.{reason}")),
        before + 1,
        "{reason}: counted"
    );
    assert_eq!(
        s.envoy.stat(fallback),
        fallback_before + 1,
        "{reason}: went through the fallback cluster"
    );
}

#[test]
fn every_indexer_failure_fails_open_to_the_fallback_cluster() {
    let s = stack(
        "fail-open-indexer",
        // Reports held long enough that every one but the last rides on the next route call.
        json!({"route_timeout_ms": 1000, "debug_headers": true, "models": {"qwen3": {}},
               "complete_hold_ms": 5000}),
        TokenizerMode::Serve,
    );
    s.envoy.wait_tokenizers(1);
    let body = completion("qwen3", "hello there, general kenobi").to_string();

    // Routed: the control that shows the indexer's answer is obeyed.
    s.indexer.set_route(RouteMode::To(s.replicas[1].addr()));
    for _ in 0..3 {
        let (i, r) = ran_on(&s.replicas, || {
            post_json(
                s.envoy.port,
                "/v1/completions",
                &completion("qwen3", "hi"),
                &[],
            )
        });
        assert_eq!(r.status, 200);
        assert_eq!(i, 1, "the indexer's choice is obeyed");
    }
    assert_eq!(s.envoy.kv("routed"), 3);
    // A streamed one too: its usage arrives in the last SSE chunk.
    let streamed = json!({"model": "qwen3", "prompt": "hi", "max_tokens": 2, "stream": true,
                          "stream_options": {"include_usage": true}});
    let r = post_json(s.envoy.port, "/v1/completions", &streamed, &[]);
    assert_eq!(r.status, 200);
    // Every routed request's end reached the indexer (carried by the next route call, or the
    // last one sent on the plugin's tick, so it survives the stream), with the engine's
    // cached_tokens from the JSON body or SSE tail.
    wait_for("4 completion reports", Duration::from_secs(10), || {
        s.indexer.completions().len() >= 4
    });
    let carried: usize = s
        .indexer
        .route_calls()
        .iter()
        .filter_map(|c| c["completed"].as_array().map(Vec::len))
        .sum();
    assert!(carried >= 1, "reports ride on later route calls");
    assert_eq!(s.envoy.kv("complete_carried"), carried as u64);
    let routed_ids: Vec<Value> = s
        .indexer
        .route_calls()
        .iter()
        .map(|c| c["request_id"].clone())
        .collect();
    for c in s.indexer.completions() {
        assert_eq!(c["endpoint"], s.replicas[1].addr().as_str(), "{c}");
        assert!(routed_ids.contains(&c["request_id"]), "{c}");
        assert!(c["cached_tokens"].is_u64(), "cached_tokens reported: {c}");
    }

    s.indexer.set_route(RouteMode::Slow(
        Duration::from_millis(4000),
        s.replicas[1].addr(),
    ));
    assert_fails_open(&s, body.as_bytes(), "indexer_timeout");
    s.indexer.set_route(RouteMode::Status(500));
    assert_fails_open(&s, body.as_bytes(), "indexer_error");
    s.indexer.set_route(RouteMode::Status(503));
    assert_fails_open(&s, body.as_bytes(), "indexer_unavailable");
    s.indexer.set_route(RouteMode::Garbage);
    assert_fails_open(&s, body.as_bytes(), "bad_answer");
    s.indexer.set_route(RouteMode::BadEndpoint);
    assert_fails_open(&s, body.as_bytes(), "bad_answer");
    assert_fails_open(&s, b"{not json", "not_json");
    assert_fails_open(&s, b"[1,2,3]", "not_json");
    assert_fails_open(&s, br#"{"prompt":"no model"}"#, "no_model");
    // Unknown model: the filter asks for its tokenizer (404) and then knows it is unknown.
    let unknown = completion("unlisted", "hi").to_string();
    wait_for("unknown model learned", Duration::from_secs(10), || {
        let r = http(
            s.envoy.port,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            unknown.as_bytes(),
        );
        assert_eq!(r.status, 200);
        s.envoy.kv("fail_open.unknown_model") > 0
    });
    assert_fails_open(&s, unknown.as_bytes(), "unknown_model");
    // Nothing panicked: the VM still routes.
    s.indexer.set_route(RouteMode::To(s.replicas[0].addr()));
    let (i, _) = ran_on(&s.replicas, || {
        post_json(
            s.envoy.port,
            "/v1/completions",
            &completion("qwen3", "hi"),
            &[],
        )
    });
    assert_eq!(i, 0);
    assert!(!s.envoy.log().contains("panicked"), "a VM panicked");
}

#[test]
fn indexer_down_and_tokenizer_not_ready_fail_open() {
    let s = stack(
        "fail-open-tokenizer",
        json!({"debug_headers": true, "models": {"qwen3": {}},
               "tokenizer_retry": {"initial_ms": 100, "max_ms": 200}}),
        TokenizerMode::Unavailable,
    );
    let body = completion("qwen3", "the tokenizer is still loading").to_string();
    assert_fails_open(&s, body.as_bytes(), "tokenizer_not_ready");
    s.indexer.set_tokenizer(TokenizerMode::Serve);
    s.envoy.wait_tokenizers(1);
    let (i, r) = ran_on(&s.replicas, || {
        post_json(
            s.envoy.port,
            "/v1/completions",
            &completion("qwen3", "hi"),
            &[],
        )
    });
    assert!(r.header("x-kvroute-fail-open").is_none());
    assert_eq!(i, 0, "routed once ready");
    assert!(s.envoy.kv("tokenizer_load_failed") >= 1);
}

#[test]
fn dead_indexer_fails_open_and_offline_tokenizers_need_no_indexer() {
    // Nothing listens on the indexer port: Envoy answers every callout with a local 503. The
    // tokenizer comes from the VM configuration (the documented offline set-up), so requests get
    // as far as the route call.
    let dir = scratch("fail-open-dead");
    let replicas = replicas(&dir);
    let mut opts = EnvoyOptions::new(
        free_port(),
        replicas.iter().map(Sim::addr).collect(),
        json!({"debug_headers": true, "models": {"qwen3": {"tokenizer_source": "vm_config"},
               "other": {}}}),
    );
    opts.vm_config = json!({"models": {"qwen3": tokenizer_answer("qwen3", 16)}});
    let envoy = Envoy::start("fail-open-dead", &opts, &dir);
    envoy.wait_tokenizers(1);
    for _ in 0..3 {
        let r = post_json(
            envoy.port,
            "/v1/completions",
            &completion("qwen3", "anyone home?"),
            &[],
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvroute-fail-open"), Some("indexer_unavailable"));
    }
    assert_eq!(envoy.kv("fail_open.indexer_unavailable"), 3);
    // A model whose tokenizer would come from the (dead) indexer is never ready.
    let r = post_json(
        envoy.port,
        "/v1/completions",
        &completion("other", "hi"),
        &[],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvroute-fail-open"), Some("tokenizer_not_ready"));
    wait_for("a failed tokenizer fetch", Duration::from_secs(10), || {
        envoy.kv("tokenizer_load_failed") >= 1
    });
}

#[test]
fn oversized_bodies_fail_open_or_get_413() {
    let cfg = json!({"max_body_bytes": 4096, "debug_headers": true, "models": {"qwen3": {}}});
    let s = stack("fail-open-large", cfg, TokenizerMode::Serve);
    s.envoy.wait_tokenizers(1);
    let big = completion("qwen3", &"word ".repeat(2000)).to_string();
    assert_fails_open(&s, big.as_bytes(), "too_large");
    // Without content-length (chunked): caught while buffering.
    let before = s.envoy.kv("fail_open.too_large");
    let mut chunked = Vec::new();
    for part in big.as_bytes().chunks(1000) {
        chunked.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        chunked.extend_from_slice(part);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = http(
        s.envoy.port,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("transfer-encoding", "chunked"),
        ],
        &chunked,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.envoy.kv("fail_open.too_large"), before + 1);
    assert!(
        r.json()["usage"]["prompt_tokens"].as_u64() > Some(2000),
        "the replica got the whole body: {}",
        r.text()
    );

    let cfg = json!({"max_body_bytes": 4096, "oversized_body": "reject", "models": {"qwen3": {}}});
    let s = stack("reject-large", cfg, TokenizerMode::Serve);
    let r = http(
        s.envoy.port,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        big.as_bytes(),
    );
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(s.envoy.kv("rejected_too_large"), 1);
    assert!(
        s.replicas.iter().all(|x| x.cache_counters().0 == 0),
        "nothing reached a replica"
    );
}

#[test]
fn invalid_configuration_is_refused_at_load_with_a_clear_log_line() {
    let dir = scratch("bad-config");
    let opts = EnvoyOptions::new(
        free_port(),
        vec!["127.0.0.1:1".into()],
        json!({"route_timeout": 5}),
    );
    let (port, admin) = (free_port(), free_port());
    let cfg = dir.join("bad.yaml");
    std::fs::write(&cfg, render_envoy(&opts, port, admin)).expect("write");
    let out = std::process::Command::new(envoy_bin())
        .arg("-c")
        .arg(&cfg)
        .arg("--mode")
        .arg("validate")
        .arg("--disable-hot-restart")
        .output()
        .expect("run envoy");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "envoy accepted a bad config:\n{log}");
    assert!(
        log.contains("kvroute: invalid plugin configuration") && log.contains("route_timeout"),
        "no clear log line:\n{log}"
    );
}
