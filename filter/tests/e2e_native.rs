//! The native dynamic-module build (filter-native, `libkvroute_filter_native.so`) in the real
//! Envoy 1.40: it loads, shares one plugin (one tokenizer) among all workers of the process,
//! strips a client's `x-envoy-original-dst-host` and routes through the real indexer to a
//! simulated replica; and a module built for another Envoy is refused at start with a message
//! that says so.
//!
//! Every other e2e suite runs against the native build too (`KVROUTE_FILTER_BUILD=native`, which
//! `cargo xtask test` sets for its second e2e pass); this file pins what only that build has.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

const DST: &str = "x-envoy-original-dst-host";

#[test]
fn one_tokenizer_serves_every_worker_and_the_module_routes_to_the_replica() {
    let dir = scratch("native-probe");
    let plans = vec![Sim::plan("r0")];
    let mut indexer = Indexer::start(&plans, &dir);
    let sim = Sim::start(&plans[0], &dir);
    indexer.wait_ready();
    let attacker = TestServer::start(|_| Reply::text(200, "attacker reached"));

    let mut opts = EnvoyOptions::new(
        indexer.port,
        vec![sim.addr()],
        json!({"route_timeout_ms": 1000, "debug_headers": true, "models": {"qwen3": {}}}),
    );
    opts.native_module = Some(native_module_path());
    opts.concurrency = 4;
    let envoy = Envoy::start("native-probe", &opts, &dir);
    assert!(
        envoy
            .log()
            .contains("Dynamic module ABI version v0.2.0 matched"),
        "Envoy did not accept the module's ABI version:\n{}",
        envoy.log()
    );
    envoy.wait_tokenizers(1);

    for i in 0..8 {
        let body = json!({"model": "qwen3", "max_tokens": 4, "prompt": format!("the native module says hello {i}")});
        let response = post_json(
            envoy.port,
            "/v1/completions",
            &body,
            &[(DST, &attacker.addr())],
        );
        assert_eq!(response.status, 200, "{}", response.text());
        assert!(
            response.json()["choices"].is_array(),
            "not a completion: {}",
            response.text()
        );
        assert_eq!(
            response.header("x-kvroute-replica"),
            Some("r0"),
            "not routed by the indexer"
        );
    }
    assert_eq!(attacker.hits(), 0, "the client's header chose the upstream");
    assert_eq!(envoy.kv("requests"), 8);
    assert_eq!(envoy.kv("routed"), 8, "{}", envoy.log());
    assert_eq!(envoy.kv("spoofed_header_removed"), 8);
    assert_eq!(
        envoy.kv("tokenizer_loaded"),
        1,
        "one tokenizer per Envoy process, whatever the number of workers"
    );

    // A path the filter does not route passes untouched (no body buffering, no callout).
    let models = http(
        envoy.port,
        "GET",
        "/v1/models",
        &[(DST, &attacker.addr())],
        b"",
    );
    assert_eq!(models.status, 200, "{}", models.text());
    assert_eq!(attacker.hits(), 0);
    assert_eq!(envoy.kv("requests"), 8);
}

#[test]
fn a_module_built_for_another_envoy_is_refused_at_start() {
    let dir = scratch("native-abi");
    // A module whose pinned Envoy build is another commit: the same library with the 40 hex
    // digits after the marker rewritten, exactly what building against other headers changes.
    let original = std::fs::read(native_module_path()).expect("read module");
    let marker = b"kvroute-envoy-build:9e5580933739775e8bce696a57a2e1bc99368f23";
    let at = original
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("the module carries its pinned Envoy build");
    let mut other = original.clone();
    other[at + 20..at + marker.len()].copy_from_slice(&[b'0'; 40]);
    let other_path = dir.join("libkvroute_filter_other.so");
    std::fs::write(&other_path, other).expect("write module copy");

    let mut opts = EnvoyOptions::new(free_port(), vec!["127.0.0.1:9".into()], json!({}));
    opts.native_module = Some(other_path.clone());
    let config = dir.join("native-abi.yaml");
    std::fs::write(&config, render_envoy(&opts, free_port(), free_port())).expect("write config");
    let log = dir.join("native-abi.log");
    let mut child = Command::new(envoy_bin())
        .arg("-c")
        .arg(&config)
        .arg("--disable-hot-restart")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn envoy");
    // Guard against a hang, not a timing assertion: Envoy exits as soon as the config fails.
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait envoy") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("Envoy kept running with a module built for another Envoy");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "Envoy started:\n{text}");
    assert!(
        text.contains(
            "kvroute_filter: ABI mismatch: this module was built for Envoy build \
             0000000000000000000000000000000000000000 (dynamic-module ABI v0.2.0) but is loaded \
             into Envoy build 9e5580933739775e8bce696a57a2e1bc99368f23"
        ),
        "no mismatch message:\n{text}"
    );
    assert!(
        text.contains(&format!(
            "Failed to initialize dynamic module: {}",
            other_path.display()
        )),
        "Envoy did not refuse the module:\n{text}"
    );
}
