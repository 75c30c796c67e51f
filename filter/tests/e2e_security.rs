//! A client-supplied `x-envoy-original-dst-host` must never choose the upstream: on routed,
//! fail-open and non-routed paths. The attack is first shown to work against Envoy without the
//! filter, so the assertions below can fail.

mod common;

use common::*;
use serde_json::json;

const DST: &str = "x-envoy-original-dst-host";

fn attacker() -> TestServer {
    TestServer::start(|_| Reply::text(200, "attacker reached"))
}

#[test]
fn the_attack_works_without_the_filter() {
    let dir = scratch("attack-control");
    let evil = attacker();
    let replica = echo_replica();
    let mut opts = EnvoyOptions::new(free_port(), vec![replica.addr()], json!({}));
    opts.with_filter = false;
    let envoy = Envoy::start("attack-control", &opts, &dir);
    let r = http(envoy.port, "GET", "/v1/models", &[(DST, &evil.addr())], b"");
    assert_eq!(r.text(), "attacker reached");
    assert_eq!(evil.hits(), 1);
}

#[test]
fn a_client_dst_header_never_reaches_its_target() {
    let dir = scratch("attack");
    let evil = attacker();
    let evil_addr = evil.addr();
    let replicas = [echo_replica(), echo_replica()];
    let indexer = FakeIndexer::start(
        "qwen3",
        RouteMode::To(replicas[0].addr()),
        TokenizerMode::Serve,
    );
    let opts = EnvoyOptions::new(
        indexer.server.port,
        replicas.iter().map(TestServer::addr).collect(),
        json!({"max_body_bytes": 4096, "debug_headers": true, "models": {"qwen3": {}}}),
    );
    let envoy = Envoy::start("attack", &opts, &dir);
    envoy.wait_tokenizers(1);

    let replica_ports: Vec<u64> = replicas.iter().map(|r| u64::from(r.port)).collect();
    let check = |what: &str, r: Response| {
        assert_eq!(r.status, 200, "{what}: {}", r.text());
        let v = r.json();
        assert!(
            v["served_by"]
                .as_u64()
                .is_some_and(|p| replica_ports.contains(&p)),
            "{what}: not served by a replica: {v}"
        );
        assert!(
            v["saw_dst_header"].is_null() || v["saw_dst_header"] != evil_addr.as_str(),
            "{what}: replica saw the client's header"
        );
    };
    let spoof: [(&str, &str); 2] = [(DST, &evil_addr), ("content-type", "application/json")];
    let completion = json!({"model": "qwen3", "prompt": "hello", "max_tokens": 2}).to_string();

    // Routed.
    let r = http(
        envoy.port,
        "POST",
        "/v1/completions",
        &spoof,
        completion.as_bytes(),
    );
    assert!(r.header("x-kvroute-fail-open").is_none());
    check("routed", r);
    let chat =
        json!({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    check(
        "routed chat",
        http(
            envoy.port,
            "POST",
            "/v1/chat/completions",
            &spoof,
            chat.as_bytes(),
        ),
    );
    // Routed, header spelled differently and repeated.
    check(
        "mixed case, twice",
        http(
            envoy.port,
            "POST",
            "/v1/completions",
            &[
                ("X-Envoy-Original-Dst-Host", &evil_addr),
                ("x-envoy-original-dst-host", &evil_addr),
                ("content-type", "application/json"),
            ],
            completion.as_bytes(),
        ),
    );
    // Fail-open paths.
    check(
        "not json",
        http(envoy.port, "POST", "/v1/completions", &spoof, b"{oops"),
    );
    let unknown = json!({"model": "nope", "prompt": "x"}).to_string();
    check(
        "unknown model",
        http(
            envoy.port,
            "POST",
            "/v1/completions",
            &spoof,
            unknown.as_bytes(),
        ),
    );
    let big = json!({"model": "qwen3", "prompt": "x ".repeat(4000)}).to_string();
    check(
        "too large",
        http(
            envoy.port,
            "POST",
            "/v1/completions",
            &spoof,
            big.as_bytes(),
        ),
    );
    indexer.set_route(RouteMode::Status(500));
    check(
        "indexer error",
        http(
            envoy.port,
            "POST",
            "/v1/completions",
            &spoof,
            completion.as_bytes(),
        ),
    );
    indexer.set_route(RouteMode::To(replicas[0].addr()));
    // Non-routed paths and methods.
    check(
        "GET models",
        http(envoy.port, "GET", "/v1/models", &[(DST, &evil_addr)], b""),
    );
    check(
        "other path",
        http(
            envoy.port,
            "POST",
            "/v1/embeddings",
            &spoof,
            completion.as_bytes(),
        ),
    );
    check(
        "no body",
        http(
            envoy.port,
            "POST",
            "/v1/completions",
            &[(DST, &evil_addr)],
            b"",
        ),
    );

    assert_eq!(evil.hits(), 0, "the attacker was reached");
    assert_eq!(envoy.kv("spoofed_header_removed"), 10);
    assert!(envoy.kv("routed") >= 3);
}
