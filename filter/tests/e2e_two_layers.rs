//! Two layers (issue 17, docs/two-layers.md): the real LiteLLM proxy (`litellm[proxy]`, pinned,
//! installed by `cargo xtask setup`) running `compose/litellm/config.yaml`, whose one deployment
//! is kvroute's Envoy (real Envoy + the real .wasm + kvroute-indexer + kvroute-sim replicas on
//! loopback). Which replica ran a request comes from the replicas' own
//! `vllm:prefix_cache_queries_total`, upstream attempts from `kvroute_sim:generate_attempts_total`.
//!
//! LiteLLM's virtual keys need its PostgreSQL database; without one, per-client keys come from
//! `compose/litellm/static_keys.py` (LiteLLM's `custom_auth` hook) and the master key.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use kvroute_testkit::paths::litellm_bin;
use serde_json::{json, Value};

const MASTER_KEY: &str = "sk-kvroute-e2e-master-000000";
const ALICE_KEY: &str = "sk-kvroute-e2e-alice-0000000";
/// The header kvroute reads a session from (the filter's and the indexer's default).
const SESSION_HEADER: &str = "x-session-id";
/// `compose/litellm/config.yaml`'s deployment address (kvroute's Envoy on the compose network).
const COMPOSE_API_BASE: &str = "http://172.30.57.10:10000/v1";

/// LiteLLM's proxy on a loopback port.
struct Litellm {
    proc: Proc,
    port: u16,
}

impl Litellm {
    /// Starts `compose/litellm/config.yaml` (with `static_keys.py` beside it) in front of
    /// `envoy_port`, and waits until it answers.
    fn start(dir: &Path, envoy_port: u16) -> Litellm {
        let compose = workspace().join("compose/litellm");
        let config = std::fs::read_to_string(compose.join("config.yaml")).expect("config.yaml");
        assert!(
            config.matches(COMPOSE_API_BASE).count() == 1,
            "compose/litellm/config.yaml has one deployment at {COMPOSE_API_BASE}"
        );
        let config = config.replace(
            COMPOSE_API_BASE,
            &format!("http://127.0.0.1:{envoy_port}/v1"),
        );
        let conf_dir = dir.join("litellm");
        std::fs::create_dir_all(&conf_dir).expect("litellm dir");
        std::fs::write(conf_dir.join("config.yaml"), config).expect("write config");
        std::fs::copy(
            compose.join("static_keys.py"),
            conf_dir.join("static_keys.py"),
        )
        .expect("copy static_keys.py");
        let port = free_port();
        let mut proc = Proc::spawn(
            "litellm",
            Command::new(litellm_bin())
                .arg("--config")
                .arg(conf_dir.join("config.yaml"))
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--num_workers", "1"])
                .current_dir(&conf_dir)
                // No price list from the internet, no telemetry.
                .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
                .env("LITELLM_MASTER_KEY", MASTER_KEY)
                .env("LITELLM_STATIC_KEYS", format!("alice={ALICE_KEY}"))
                .env("LITELLM_LOG", "ERROR"),
            dir,
        );
        let start = Instant::now();
        loop {
            proc.assert_running();
            if try_http(
                port,
                "GET",
                "/health/liveliness",
                &[],
                b"",
                Duration::from_secs(2),
            )
            .is_ok_and(|r| r.status == 200)
            {
                return Litellm { proc, port };
            }
            assert!(
                // Importing LiteLLM takes ~10 s idle, minutes on a loaded 2-core machine.
                start.elapsed() < Duration::from_secs(300),
                "LiteLLM not up in 300 s; log:\n{}",
                proc.log_tail()
            );
            thread::sleep(Duration::from_millis(200));
        }
    }
}

struct TwoLayers {
    dir: PathBuf,
    plans: Vec<SimPlan>,
    sims: Vec<Sim>,
    indexer: Option<Indexer>,
    indexer_port: u16,
    envoy: Envoy,
    litellm: Litellm,
}

/// What one request did.
#[derive(Debug)]
struct Outcome {
    replica: usize,
    hits: u64,
    usage: Value,
}

fn usage_of(r: &Response, streaming: bool) -> Value {
    if streaming {
        assert!(
            r.header("content-type")
                .is_some_and(|c| c.contains("text/event-stream")),
            "not SSE: {:?}",
            r.headers
        );
        let text = r.text();
        assert!(
            text.contains("data: [DONE]"),
            "the stream ends with [DONE]: {text}"
        );
        text.lines()
            .rev()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
            .expect("a final usage chunk")
    } else {
        r.json()["usage"].clone()
    }
}

fn chat(system: &str, user: &str, stream: bool) -> Value {
    json!({"model": "qwen3", "max_tokens": 4, "stream": stream,
           "stream_options": {"include_usage": true},
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
}

impl TwoLayers {
    fn start() -> TwoLayers {
        let dir = scratch("two-layers");
        let plans: Vec<SimPlan> = (0..3).map(|i| Sim::plan(&format!("r{i}"))).collect();
        let mut indexer = Indexer::start(&plans, &dir);
        let sims: Vec<Sim> = plans.iter().map(|p| Sim::start(p, &dir)).collect();
        indexer.wait_ready();
        let opts = EnvoyOptions::new(
            indexer.port,
            sims.iter().map(Sim::addr).collect(),
            // Generous route timeout: two shared cores also run LiteLLM, the sims and the indexer.
            json!({"route_timeout_ms": 2000, "debug_headers": true, "models": {"qwen3": {}}}),
        );
        let envoy = Envoy::start("envoy", &opts, &dir);
        envoy.wait_tokenizers(1);
        let litellm = Litellm::start(&dir, envoy.port);
        TwoLayers {
            indexer_port: indexer.port,
            indexer: Some(indexer),
            dir,
            plans,
            sims,
            envoy,
            litellm,
        }
    }

    fn counters(&self) -> Vec<(u64, u64)> {
        self.sims.iter().map(Sim::cache_counters).collect()
    }

    /// Generation attempts every replica received so far.
    fn attempts(&self) -> u64 {
        self.sims
            .iter()
            .map(|s| s.metric("kvroute_sim:generate_attempts_total") as u64)
            .sum()
    }

    /// Sends `body` to kvroute's Envoy directly (`via_litellm` false) or through LiteLLM with
    /// Alice's key, alone on the fleet, and finds the replica that ran it.
    fn send(&self, via_litellm: bool, body: &Value, extra: &[(&str, &str)]) -> Outcome {
        let streaming = body["stream"].as_bool().unwrap_or(false);
        let before = self.counters();
        let auth = format!("Bearer {ALICE_KEY}");
        let mut headers = extra.to_vec();
        let (port, path) = if via_litellm {
            headers.push(("authorization", auth.as_str()));
            (self.litellm.port, "/v1/chat/completions")
        } else {
            (self.envoy.port, "/v1/chat/completions")
        };
        let response = post_json(port, path, body, &headers);
        assert_eq!(
            response.status,
            200,
            "via LiteLLM: {via_litellm}: {}\nLiteLLM log:\n{}",
            response.text(),
            self.litellm.proc.log_tail()
        );
        let usage = usage_of(&response, streaming);
        let after = self.counters();
        let ran: Vec<usize> = (0..self.sims.len())
            .filter(|&i| after[i].0 > before[i].0)
            .collect();
        assert_eq!(
            ran.len(),
            1,
            "exactly one replica ran it: {before:?} -> {after:?}"
        );
        let replica = ran[0];
        Outcome {
            replica,
            hits: after[replica].1 - before[replica].1,
            usage,
        }
    }

    /// Lets KV events reach the indexer.
    fn settle(&self) {
        thread::sleep(Duration::from_millis(300));
    }

    fn decisions(&self, reason: &str) -> f64 {
        let r = http(self.indexer_port, "GET", "/metrics", &[], b"");
        r.text()
            .lines()
            .filter(|l| {
                l.starts_with("kvroute_indexer_decisions_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// A request through LiteLLM lands where the same prefix sent directly landed, and the other way
/// round; the engine's hits show, and usage (streamed too) carries its cached tokens.
fn same_choice_as_direct(f: &TwoLayers, seed: u64, litellm_first: bool, stream: bool) {
    let system = filler(seed, 1400);
    let first = f.send(
        litellm_first,
        &chat(&system, &filler(seed + 1, 20), stream),
        &[],
    );
    assert!(
        first.usage["prompt_tokens"].as_u64().unwrap_or(0) > 1000,
        "a long prompt: {:?}",
        first.usage
    );
    f.settle();
    for i in 0..2 {
        let o = f.send(
            !litellm_first,
            &chat(&system, &filler(seed + 10 + i, 20), stream),
            &[],
        );
        let what = format!(
            "seed {seed}, {} first, stream={stream}, sibling {i}",
            if litellm_first { "LiteLLM" } else { "direct" }
        );
        assert_eq!(
            o.replica, first.replica,
            "{what}: lands on the replica holding the prefix"
        );
        assert!(
            o.hits >= 1000,
            "{what}: prefix_cache_hits_total grew by {}",
            o.hits
        );
        assert_eq!(
            o.usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some(o.hits),
            "{what}: usage.prompt_tokens_details.cached_tokens agrees with the engine: {:?}",
            o.usage
        );
        f.settle();
    }
}

#[test]
fn litellm_on_top_routes_like_kvroute_alone_and_adds_no_retries_or_leaks() {
    let mut f = TwoLayers::start();

    // 1. Same replica choice through LiteLLM as direct, both ways, JSON and streamed.
    same_choice_as_direct(&f, 100, false, false);
    same_choice_as_direct(&f, 200, true, false);
    same_choice_as_direct(&f, 300, true, true);

    // 2. A bad key (or none) never reaches kvroute: Envoy, the indexer and the replicas see
    //    nothing.
    let requests = f.envoy.kv("requests");
    let attempts = f.attempts();
    let ix = f.indexer.as_ref().expect("indexer");
    let routes = ix.metric("kvroute_indexer_decisions_total");
    let body = chat(&filler(400, 200), "hello", false);
    let near_miss = format!("Bearer {ALICE_KEY}x");
    for auth in [
        Some("Bearer sk-not-a-key-of-this-proxy"),
        Some(near_miss.as_str()),
        None,
    ] {
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", *a)).collect();
        let r = post_json(f.litellm.port, "/v1/chat/completions", &body, &headers);
        // A wrong key gets 401 from static_keys.py; no key at all gets 500 from LiteLLM 1.108.7
        // (its auth fails before custom_auth runs). Either way nothing reaches kvroute (below).
        let refused = if auth.is_some() {
            (400..500).contains(&r.status)
        } else {
            r.status >= 400
        };
        assert!(
            refused,
            "{auth:?}: refused by LiteLLM, got {}: {}",
            r.status,
            r.text()
        );
    }
    assert_eq!(f.envoy.kv("requests"), requests, "Envoy saw a bad key");
    assert_eq!(
        ix.metric("kvroute_indexer_decisions_total"),
        routes,
        "the indexer routed a bad key"
    );
    assert_eq!(f.attempts(), attempts, "a replica saw a bad key");

    // 3. A failing replica costs one retry in total (LiteLLM's num_retries: 1; kvroute's Envoy
    //    does not retry), not a stack of them.
    let system = filler(500, 1400);
    let home = f.send(true, &chat(&system, "first", false), &[]).replica;
    f.settle();
    let arm = |i: usize, n: u64| {
        let r = post_json(
            f.sims[i].port,
            "/admin/fail",
            &json!({"requests": n, "status": 500}),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
    };
    arm(home, 1000);
    let before = f.attempts();
    let auth = format!("Bearer {ALICE_KEY}");
    let r = post_json(
        f.litellm.port,
        "/v1/chat/completions",
        &chat(&system, "second", false),
        &[("authorization", &auth)],
    );
    let attempts = f.attempts() - before;
    arm(home, 0);
    assert_eq!(
        attempts,
        2,
        "one attempt and one retry reach the replicas (client saw {}: {})",
        r.status,
        r.text()
    );

    // 4. kvroute failing open (indexer stopped) is invisible to LiteLLM's client.
    let failed_open = f.envoy.kv("fail_open.indexer_unavailable")
        + f.envoy.kv("fail_open.indexer_timeout")
        + f.envoy.kv("fail_open.indexer_error");
    drop(f.indexer.take());
    for stream in [false, true] {
        // `send` asserts the 200 and the usage (streamed: through `[DONE]`).
        let o = f.send(true, &chat(&filler(600, 300), "after", stream), &[]);
        assert!(o.usage["completion_tokens"].as_u64().unwrap_or(0) > 0);
    }
    let now = f.envoy.kv("fail_open.indexer_unavailable")
        + f.envoy.kv("fail_open.indexer_timeout")
        + f.envoy.kv("fail_open.indexer_error");
    assert!(
        now >= failed_open + 2,
        "both requests failed open ({failed_open} -> {now})"
    );

    // 5. The session header a client sends reaches kvroute: with the indexer back under
    //    `--policy session`, a session's second request is routed by its binding.
    let restart = f.dir.join("session");
    std::fs::create_dir_all(&restart).expect("dir");
    let mut ix = Indexer::start_on(
        &f.plans,
        &restart,
        &model_dir(),
        "",
        f.indexer_port,
        &["--policy", "session"],
    );
    // The session policy reads no event stream; the replicas' streams may stay quiet.
    ix.wait_serving();
    f.indexer = Some(ix);
    let (new0, bound0) = (f.decisions("session_new"), f.decisions("session"));
    let sid = "two-layers-session-0001";
    let a = f.send(
        true,
        &chat(&filler(700, 200), "one", false),
        &[(SESSION_HEADER, sid)],
    );
    let b = f.send(
        true,
        &chat(&filler(800, 200), "two", true),
        &[(SESSION_HEADER, sid)],
    );
    assert_eq!(
        (
            f.decisions("session_new") - new0,
            f.decisions("session") - bound0
        ),
        (1.0, 1.0),
        "the first request opened the session, the second was routed by it"
    );
    assert_eq!(a.replica, b.replica, "the session stays on its replica");
    // Without the header there is no session to bind.
    f.send(true, &chat(&filler(900, 200), "three", false), &[]);
    assert_eq!(f.decisions("session") - bound0, 1.0);
}
