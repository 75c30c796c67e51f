//! In-flight accounting end to end (issue #16 item 5): real Envoy + the real .wasm +
//! kvroute-indexer + kvroute-sim replicas on loopback. However a request ends (its client leaves
//! while the route call is pending, two clients send the same `x-request-id`, Envoy dies
//! mid-request), every replica's `kvroute_indexer_replica_in_flight` returns to 0 and never counts
//! two requests as one.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const IN_FLIGHT: &str = "kvroute_indexer_replica_in_flight";
/// Bound on every wait: long enough for two busy shared cores, far below the old 600 s leak.
const BOUND: Duration = Duration::from_secs(40);

struct Stack {
    _dir: std::path::PathBuf,
    _sims: Vec<Sim>,
    indexer: Indexer,
    envoy: Envoy,
}

/// A kvroute-sim that decodes one token per 100 ms (a 2000-token answer streams for minutes),
/// so requests stay in flight for as long as a test needs.
fn slow_sim(plan: &SimPlan, dir: &std::path::Path) -> Sim {
    let kv = json!({
        "enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://127.0.0.1:{}", plan.events),
        "replay_endpoint": format!("tcp://127.0.0.1:{}", plan.replay),
        "topic": "kv-events"});
    let mut cmd = Command::new(bin("kvroute-sim"));
    cmd.arg("--port")
        .arg(plan.port.to_string())
        .args(["--block-size", "16", "--served-model-name", "qwen3"])
        .arg("--model-dir")
        .arg(model_dir())
        .args(["--num-gpu-blocks-override", "4096", "--time-scale", "20"])
        .args(["--decode-step-ms", "2000"])
        .arg("--kv-events-config")
        .arg(kv.to_string());
    let mut proc = Proc::spawn(&plan.name, &mut cmd, dir);
    wait_for(&format!("{} healthy", plan.name), BOUND, || {
        proc.assert_running();
        try_http(
            plan.port,
            "GET",
            "/health",
            &[],
            b"",
            Duration::from_secs(2),
        )
        .is_ok_and(|r| r.status == 200)
    });
    Sim {
        name: plan.name.clone(),
        port: plan.port,
        events: plan.events,
        replay: plan.replay,
        proc,
    }
}

fn stack(name: &str, indexer_toml: &str, route_timeout_ms: u64) -> Stack {
    let dir = scratch(name);
    let plans: Vec<SimPlan> = (0..2).map(|i| Sim::plan(&format!("r{i}"))).collect();
    let mut indexer = Indexer::start_with(&plans, &dir, indexer_toml);
    let sims: Vec<Sim> = plans.iter().map(|p| slow_sim(p, &dir)).collect();
    indexer.wait_ready();
    let opts = EnvoyOptions::new(
        indexer.port,
        sims.iter().map(Sim::addr).collect(),
        // Reports wait as long as route calls do (the abort test stops the indexer meanwhile).
        json!({"route_timeout_ms": route_timeout_ms, "complete_timeout_ms": route_timeout_ms,
               "debug_headers": true, "models": {"qwen3": {}}}),
    );
    let envoy = Envoy::start(name, &opts, &dir);
    envoy.wait_tokenizers(1);
    Stack {
        _dir: dir,
        _sims: sims,
        indexer,
        envoy,
    }
}

fn in_flight(s: &Stack) -> f64 {
    s.indexer.metric(IN_FLIGHT)
}

/// Waits until the indexer counts `n` requests in flight over all replicas.
fn wait_in_flight(s: &Stack, n: f64, what: &str) {
    let start = Instant::now();
    let mut last = in_flight(s);
    while last != n {
        assert!(
            start.elapsed() < BOUND,
            "{what}: in_flight is {last} after {BOUND:?}, expected {n}"
        );
        std::thread::sleep(Duration::from_millis(100));
        last = in_flight(s);
    }
}

fn chat(words: usize, seed: u64, max_tokens: u64, stream: bool) -> Value {
    json!({"model": "qwen3", "max_tokens": max_tokens, "stream": stream,
           "messages": [{"role": "user", "content": filler(seed, words)}]})
}

/// Sends a request and returns the open connection without reading anything.
fn send(port: u16, body: &Value, extra: &[(&str, &str)]) -> TcpStream {
    let body = body.to_string();
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to envoy");
    s.set_read_timeout(Some(BOUND)).expect("read timeout");
    s.write_all(req.as_bytes()).expect("send request");
    s
}

/// Sends a streaming request and reads its response head: the request is routed and running.
fn open_stream(s: &Stack, body: &Value, extra: &[(&str, &str)]) -> BufReader<TcpStream> {
    let mut r = BufReader::new(send(s.envoy.port, body, extra));
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    assert!(line.contains(" 200 "), "stream not started: {line:?}");
    let mut routed = false;
    loop {
        line.clear();
        r.read_line(&mut line).expect("header line");
        if line.trim().is_empty() {
            break;
        }
        routed |= line.to_ascii_lowercase().starts_with("x-kvroute-replica:");
    }
    assert!(routed, "the request was not routed by the indexer");
    r
}

fn kill_signal(pid: u32, signal: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{signal} {pid}");
}

#[test]
fn clients_that_leave_while_the_route_call_is_pending_leak_nothing() {
    // The route calls stay pending for as long as the indexer is stopped (well within 30 s).
    let s = stack("inflight-abort", "", 30_000);
    // Control: a request that runs to its end is counted and released.
    let r = post_json(
        s.envoy.port,
        "/v1/chat/completions",
        &chat(40, 1, 2, false),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("x-kvroute-replica").is_some(), "routed");
    wait_in_flight(&s, 0.0, "after one completed request");

    let routed_before = s.indexer.metric("kvroute_indexer_routed_total");
    let calls = "cluster.kvroute_indexer.upstream_rq_total";
    let calls_before = s.envoy.stat(calls);
    kill_signal(s.indexer.proc.pid(), "STOP");
    let clients: Vec<TcpStream> = (0..20)
        .map(|i| send(s.envoy.port, &chat(60, 100 + i, 50, false), &[]))
        .collect();
    wait_for("20 route calls dispatched", BOUND, || {
        s.envoy.stat(calls) >= calls_before + 20
    });
    // Every client disconnects while its route call waits on the stopped indexer.
    drop(clients);
    wait_for("the 20 streams torn down", BOUND, || {
        s.envoy.stat("http.kvroute_ingress.downstream_rq_active") == 0
    });
    kill_signal(s.indexer.proc.pid(), "CONT");
    if !s.envoy.native {
        // The indexer decided all 20 (so each was counted in flight, at least for a moment) ...
        wait_for("20 route decisions", BOUND, || {
            s.indexer.metric("kvroute_indexer_routed_total") >= routed_before + 20.0
        });
    }
    // (The native build's route call belongs to its stream, and Envoy cancels it with the stream:
    // the stopped indexer decides only those whose request it read before the reset. Decided or
    // not, each is reported abandoned by its callout id, and none may stay in flight.)
    // ... and the filter's abandon reports released every one: no phantom load.
    wait_in_flight(&s, 0.0, "after 20 aborted requests");
    assert_eq!(s.envoy.kv("abandoned"), 20, "each abort was reported");
    // The fleet still routes (and counts) normally.
    let r = post_json(
        s.envoy.port,
        "/v1/chat/completions",
        &chat(40, 2, 2, false),
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(r.header("x-kvroute-replica").is_some(), "routed");
    wait_in_flight(&s, 0.0, "after a request following the aborts");
}

#[test]
fn colliding_request_ids_neither_merge_nor_release_each_other() {
    let s = stack("inflight-collide", "", 5_000);
    let same = [("x-request-id", "same-client-id")];
    // Two long streams with the same x-request-id, both running.
    let a = open_stream(&s, &chat(60, 7, 2000, true), &same);
    let b = open_stream(&s, &chat(60, 8, 2000, true), &same);
    wait_in_flight(&s, 2.0, "two running requests sharing an id");
    // A ends (its client leaves): only A's slot is released, B still counts.
    let done = s.indexer.metric("kvroute_indexer_completions_total");
    drop(a);
    wait_for("A's completion report", BOUND, || {
        s.indexer.metric("kvroute_indexer_completions_total") > done
    });
    assert_eq!(in_flight(&s), 1.0, "B is still running and still counted");
    drop(b);
    wait_in_flight(&s, 0.0, "after both ended");
    assert_eq!(
        s.indexer
            .metric("kvroute_indexer_completions_unknown_total"),
        0.0,
        "every completion found its own decision"
    );
}

#[test]
fn decisions_of_a_killed_envoy_expire_by_their_deadline() {
    // Short floor and cap: a 2000-token request's estimate (100 s at 20 tokens/s) is capped at 5 s.
    let mut s = stack(
        "inflight-vm-crash",
        "[inflight]\nexpiry_floor_ms = 1000\nexpiry_cap_ms = 5000\n",
        5_000,
    );
    let streams: Vec<_> = (0..4)
        .map(|i| open_stream(&s, &chat(60, 20 + i, 2000, true), &[]))
        .collect();
    // The VM (with the whole Envoy) dies mid-request: no completion or abandon is ever sent.
    s.envoy.proc.kill();
    drop(streams);
    wait_in_flight(&s, 0.0, "after Envoy was killed");
    assert_eq!(
        s.indexer.metric("kvroute_indexer_decisions_expired_total"),
        4.0,
        "released at their deadline"
    );
    s.indexer.proc.assert_running();
}
