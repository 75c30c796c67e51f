//! The shipped `envoy/envoy.yaml` through a real Envoy with the real .wasm: only the OpenAI API
//! reaches the replicas (the engine's `/reset_prefix_cache`, `/kv_event_sources`, `/metrics`,
//! LoRA and admin paths get a local 404, however the path is spelled), and slow clients are cut
//! off (headers and uploads must arrive in time) while slow responses are not.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

const DST: &str = "x-envoy-original-dst-host";

/// Requests the replicas saw, without Envoy's own health checks (`user-agent: Envoy/HC`).
fn seen(replicas: &[TestServer]) -> Vec<String> {
    replicas
        .iter()
        .flat_map(|r| {
            r.requests
                .lock()
                .expect("lock")
                .iter()
                .filter(|q| q.headers.get("user-agent").map(String::as_str) != Some("Envoy/HC"))
                .map(|q| format!("{} {}", q.method, q.path))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn only_the_openai_api_reaches_the_replicas() {
    let dir = scratch("paths");
    let replicas = [echo_replica(), echo_replica()];
    let indexer = FakeIndexer::start(
        "qwen3",
        RouteMode::To(replicas[0].addr()),
        TokenizerMode::Serve,
    );
    let opts = EnvoyOptions::new(
        indexer.server.port,
        replicas.iter().map(TestServer::addr).collect(),
        json!({"debug_headers": true, "models": {"qwen3": {}}}),
    );
    let envoy = Envoy::start("paths", &opts, &dir);
    envoy.wait_tokenizers(1);

    let body = json!({"model": "qwen3", "prompt": "hello", "max_tokens": 2}).to_string();
    // What an attacker tried on the public listener, and spellings that a prefix or a naive
    // matcher would let through.
    let forbidden: &[(&str, &str)] = &[
        ("POST", "/reset_prefix_cache"),
        ("GET", "/kv_event_sources"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("GET", "/version"),
        ("POST", "/tokenize"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/v1/completions/render"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/admin/replicas"),
        ("GET", "/debug/lookup"),
        ("POST", "/v1/../reset_prefix_cache"),
        ("POST", "/v1/chat/completions/../../reset_prefix_cache"),
        ("POST", "//reset_prefix_cache"),
        ("POST", "/%72eset_prefix_cache"),
        ("POST", "/reset_prefix_cache?next=/v1/models"),
        ("GET", "/v1/models/../../metrics"),
        ("GET", "/v1/models/extra"),
        ("POST", "/v1%2F..%2Freset_prefix_cache"),
        ("POST", "/V1/COMPLETIONS"),
    ];
    for (method, path) in forbidden {
        let r = http(
            envoy.port,
            method,
            path,
            &[
                ("content-type", "application/json"),
                (DST, &replicas[1].addr()),
            ],
            body.as_bytes(),
        );
        assert!(
            r.status == 404 || r.status == 400,
            "{method} {path}: {} {}",
            r.status,
            r.text()
        );
        if r.status == 404 {
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.json()["error"]["code"], 404, "{}", r.text());
        }
    }
    assert_eq!(
        seen(&replicas),
        Vec::<String>::new(),
        "a replica was reached on a forbidden path"
    );

    // The OpenAI API still goes through, routed or load-balanced.
    let chat = json!({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]});
    let allowed: &[(&str, &str, String)] = &[
        ("POST", "/v1/completions", body.clone()),
        ("POST", "/v1/chat/completions", chat.to_string()),
        ("POST", "/v1/completions?stream=false", body.clone()),
        ("GET", "/v1/models", String::new()),
        (
            "POST",
            "/v1/embeddings",
            json!({"model": "qwen3", "input": "x"}).to_string(),
        ),
    ];
    for (method, path, body) in allowed {
        let r = http(
            envoy.port,
            method,
            path,
            &[("content-type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(r.status, 200, "{method} {path}: {}", r.text());
        let bare = path.split('?').next().unwrap_or_default();
        assert_eq!(
            r.json()["path"].as_str().map(|p| p.split('?').next()),
            Some(Some(bare))
        );
    }
    assert_eq!(
        seen(&replicas).len(),
        allowed.len(),
        "{:?}",
        seen(&replicas)
    );
    assert!(envoy.kv("routed") >= 2, "the filter still routes");
}

/// Reads until the peer closes or answers; returns what arrived (bounded by `limit`).
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> String {
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let start = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                if !out.is_empty() && out.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn slow_clients_are_cut_off_and_slow_responses_are_not() {
    let dir = scratch("slow-clients");
    // A replica that takes 3 s to answer /v1/models: longer than the test's request timeout.
    let replica = TestServer::start(|req| {
        if req.path == "/v1/models" {
            Reply {
                delay: Duration::from_secs(3),
                ..Reply::json(200, &json!({"data": [{"id": "qwen3"}]}))
            }
        } else {
            Reply::json(200, &json!({"ok": true}))
        }
    });
    let indexer = FakeIndexer::start("qwen3", RouteMode::To(replica.addr()), TokenizerMode::Serve);
    let mut opts = EnvoyOptions::new(
        indexer.server.port,
        vec![replica.addr()],
        json!({"models": {"qwen3": {}}}),
    );
    // The shipped values are 10 s and 60 s; the test shortens them, not the shipped file.
    opts.yaml_edits = vec![
        (
            "request_headers_timeout: 10s".into(),
            "request_headers_timeout: 1s".into(),
        ),
        ("request_timeout: 60s".into(), "request_timeout: 2s".into()),
    ];
    let envoy = Envoy::start("slow-clients", &opts, &dir);
    envoy.wait_tokenizers(1);
    let bound = Duration::from_secs(30);

    // Headers that never end.
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")
        .expect("write");
    let got = read_until_closed(&mut s, bound);
    assert!(
        envoy.stat("http.kvroute_ingress.downstream_rq_header_timeout") >= 1,
        "unfinished headers were not timed out within {bound:?} (got {got:?})"
    );

    // An upload that trickles one byte every 100 ms: never idle, never complete.
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 4000000\r\n\r\n{\"model\":\"qwen3\",\"prompt\":\"",
    )
    .expect("write");
    let stop = Arc::new(AtomicBool::new(false));
    let trickle = {
        let (mut w, stop) = (s.try_clone().expect("clone"), stop.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) && w.write_all(b"7").is_ok() {
                thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let got = read_until_closed(&mut s, bound);
    stop.store(true, Ordering::SeqCst);
    let _ = trickle.join();
    assert!(
        got.starts_with("HTTP/1.1 408"),
        "the trickled upload was not cut off within {bound:?}: {got:?}"
    );
    assert!(envoy.stat("http.kvroute_ingress.downstream_rq_timeout") >= 1);
    assert!(
        replica
            .requests
            .lock()
            .expect("lock")
            .iter()
            .all(|r| r.path != "/v1/completions"),
        "the incomplete upload reached the replica"
    );

    // A complete request whose answer takes longer than the request timeout is not cut: the
    // timer covers receiving the request, not the response.
    let r = http(envoy.port, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data"][0]["id"], "qwen3");
}
