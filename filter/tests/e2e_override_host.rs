//! Retrying onto the runner-up, end to end: real Envoy with the real filter (either build), two
//! kvroute-sim replicas and an address where nothing listens, and a fake indexer whose answer
//! ranks the dead address first and replica r1 second (`x-kvroute-destinations`).
//!
//! With the shipped configuration (ORIGINAL_DST cluster, `x-envoy-original-dst-host`) Envoy
//! sends the request to the dead address and answers 503. With the replicas' cluster using
//! Envoy's `override_host` load balancing on `x-kvroute-destinations` and a retry policy
//! (docs/filter.md "Retrying onto the runner-up"), Envoy retries onto r1 and the request
//! succeeds; a client's own `x-kvroute-destinations` is removed before Envoy reads it.

mod common;

use common::*;
use serde_json::{json, Value};

fn completion() -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "qwen3", "prompt": "retry me", "max_tokens": 2}))
        .expect("json")
}

fn send(envoy: &Envoy, headers: &[(&str, &str)]) -> Response {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    http(envoy.port, "POST", "/v1/completions", &all, &completion())
}

/// Each replica's `vllm:prefix_cache_queries_total` (it moves on the replica that runs a request).
fn queries(replicas: &[Sim]) -> Vec<u64> {
    replicas.iter().map(|r| r.cache_counters().0).collect()
}

#[test]
fn override_host_retries_onto_the_runner_up_where_original_dst_cannot() {
    let dir = scratch("e2e-override-host");
    let replicas = vec![
        Sim::start_without_events("r0", &dir),
        Sim::start_without_events("r1", &dir),
    ];
    let dead = format!("127.0.0.1:{}", kvroute_testkit::ports::free_port());
    let indexer = FakeIndexer::start(
        "qwen3",
        RouteMode::Ranked(vec![dead.clone(), replicas[1].addr()]),
        TokenizerMode::Serve,
    );
    let members: Vec<String> = std::iter::once(dead.clone())
        .chain(replicas.iter().map(Sim::addr))
        .collect();
    let cfg = json!({"models": {"qwen3": {}}, "route_timeout_ms": 5000});

    // The shipped configuration: the choice only, no retry onto another replica.
    let opts = EnvoyOptions::new(indexer.server.port, members.clone(), cfg.clone());
    let shipped = Envoy::start("override-host-shipped", &opts, &dir);
    shipped.wait_tokenizers(1);
    let r = send(&shipped, &[]);
    assert_eq!(r.status, 503, "the dead choice, no retry: {}", r.text());
    drop(shipped);

    // override_host on x-kvroute-destinations, with retries.
    let mut opts = EnvoyOptions::new(indexer.server.port, members, cfg);
    opts.yaml_edits = kvroute_testkit::stack::override_host_edits()
        .iter()
        .map(|&(from, to)| (from.to_string(), to.to_string()))
        .collect();
    let envoy = Envoy::start("override-host", &opts, &dir);
    envoy.wait_tokenizers(1);
    let retries = "cluster.kvroute_replicas_fallback.upstream_rq_retry";
    for round in 0..3 {
        let before = queries(&replicas);
        let retried_before = envoy.stat(retries);
        // A client's own list would send it to r0: it is removed first.
        let spoof = replicas[0].addr();
        let r = send(&envoy, &[("x-kvroute-destinations", spoof.as_str())]);
        assert_eq!(r.status, 200, "round {round}: {}", r.text());
        let body: Value = serde_json::from_slice(&r.body).expect("a completion");
        assert!(body["choices"].is_array(), "{body}");
        let after = queries(&replicas);
        assert_eq!(after[0], before[0], "round {round}: r0 never ran it");
        assert!(
            after[1] > before[1],
            "round {round}: r1, the runner-up, ran it"
        );
        assert!(
            envoy.stat(retries) > retried_before,
            "round {round}: reached through a retry"
        );
    }
    assert_eq!(envoy.kv("routed"), 3);
    assert_eq!(envoy.kv("spoofed_header_removed"), 3);
}
