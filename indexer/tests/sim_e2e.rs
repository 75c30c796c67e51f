//! End to end with the engine simulator: two `kvroute-sim` processes (one with two data-parallel
//! engines) and the real `kvroute-indexer serve`, configured with HTTP addresses only, so the
//! event endpoints (and the number of DP ranks) come from each sim's `GET /kv_event_sources`.
//! Completions go to the sims directly; the indexer must then route the same prompts to the
//! replica that served them, matching exactly the tokens the sim reports as cached on a repeat.
//! It scrapes the sims' load, stops routing to a killed sim, and drops a restarted sim's entries.

mod procs;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use procs::*;
use serde_json::{json, Value};

const MODEL: &str = "qwen3";
const BS: u64 = 16;

/// `<target>/debug/kvroute-sim`, built with `cargo build -p kvroute-sim` when missing or older
/// than its sources (sim, core, Cargo.lock); `cargo test --workspace` builds it anyway.
fn sim_binary() -> PathBuf {
    let bin = target_dir().join("debug/kvroute-sim");
    let ws = workspace();
    let newest_src = [
        "sim/src",
        "sim/Cargo.toml",
        "core/src",
        "core/Cargo.toml",
        "Cargo.lock",
    ]
    .iter()
    .filter_map(|p| newest_mtime(&ws.join(p)))
    .max();
    let fresh = bin
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .is_some_and(|t| newest_src.is_none_or(|s| t >= s));
    if !fresh {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut child = Command::new(cargo)
            .args(["build", "-p", "kvroute-sim"])
            .current_dir(workspace())
            .spawn()
            .expect("run cargo build -p kvroute-sim");
        let deadline = Instant::now() + Duration::from_secs(900);
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait for cargo") {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("`cargo build -p kvroute-sim` took more than 15 min");
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        assert!(status.success(), "`cargo build -p kvroute-sim` failed");
    }
    assert!(
        bin.is_file(),
        "{} missing: run `cargo build -p kvroute-sim`",
        bin.display()
    );
    bin
}

/// One simulated replica: fixed ports so it can be restarted in place.
struct SimSpec {
    name: &'static str,
    http: u16,
    pub_port: u16,
    replay_port: u16,
    dp: u16,
    /// The engine's publisher connects out to `tcp://127.0.0.1:pub_port` (vLLM's connect mode)
    /// instead of binding `tcp://*:pub_port`.
    connect_out: bool,
    /// More command-line arguments.
    args: Vec<&'static str>,
    /// `--num-gpu-blocks-override`.
    blocks: u32,
}

impl SimSpec {
    fn new(name: &'static str, dp: u16) -> SimSpec {
        SimSpec {
            name,
            http: free_port_run(1),
            pub_port: free_port_run(dp),
            replay_port: free_port_run(dp),
            dp,
            connect_out: false,
            args: Vec::new(),
            blocks: 2048,
        }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.http)
    }

    /// Starts the sim; retries while the previous incarnation's ports are still being released.
    fn start(&self, bin: &PathBuf, dir: &std::path::Path, attempt_tag: &str) -> Proc {
        let host = if self.connect_out { "127.0.0.1" } else { "*" };
        let events = format!(
            r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://{host}:{}","replay_endpoint":"tcp://*:{}","topic":"kv-events"}}"#,
            self.pub_port, self.replay_port
        );
        let mut last_log = String::new();
        for attempt in 0..20 {
            let mut cmd = Command::new(bin);
            cmd.args(["--host", "127.0.0.1", "--port", &self.http.to_string()])
                .args(["--served-model-name", MODEL])
                .arg("--model-dir")
                .arg(model_dir())
                .args(["--block-size", &BS.to_string()])
                .args(["--num-gpu-blocks-override", &self.blocks.to_string()])
                .args(["--prefix-caching-hash-algo", "sha256"])
                .args(["--data-parallel-size", &self.dp.to_string()])
                .args(["--kv-events-config", &events])
                .args(&self.args)
                .env_remove("PYTHONHASHSEED")
                .env("RUST_LOG", "warn");
            let log = dir.join(format!("{}-{attempt_tag}-{attempt}.log", self.name));
            let mut p = Proc::spawn_piped(self.name, cmd, log, false);
            // The sim prints its address once every socket is bound.
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut started = false;
            while Instant::now() < deadline {
                match p.try_line(Duration::from_millis(200)) {
                    Some(l) if l.starts_with("kvroute-sim listening on") => {
                        started = true;
                        break;
                    }
                    Some(_) => {}
                    None if p.exited() => break,
                    None => {}
                }
            }
            if started {
                return p;
            }
            last_log = p.log_tail();
            p.kill();
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!("{} did not start: {last_log}", self.name);
    }
}

async fn complete(c: &reqwest::Client, sim: &SimSpec, prompt: &[u32], max_tokens: u32) -> Value {
    let (status, body) = post_json(
        c,
        &format!("http://{}/v1/completions", sim.addr()),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "completion on {}: {body}", sim.name);
    body
}

fn cached(resp: &Value) -> u64 {
    resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {resp}"))
}

async fn route(c: &reqwest::Client, base: &str, prompt: &[u32]) -> Value {
    let (status, d) = post_json(
        c,
        &format!("{base}/v1/route"),
        &json!({"model": MODEL, "token_ids": prompt}),
    )
    .await;
    assert_eq!(status, 200, "route: {d}");
    d
}

/// GPU blocks per replica name for `prompt` (no routing side effects).
async fn lookup(c: &reqwest::Client, base: &str, prompt: &[u32]) -> Vec<(String, u64)> {
    let (status, d) = post_json(
        c,
        &format!("{base}/debug/lookup"),
        &json!({"model": MODEL, "token_ids": prompt}),
    )
    .await;
    assert_eq!(status, 200, "lookup: {d}");
    d["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["replica"].as_str().unwrap().to_string(),
                r["blocks"]["gpu"].as_u64().unwrap(),
            )
        })
        .collect()
}

async fn gpu_blocks(c: &reqwest::Client, base: &str, prompt: &[u32], replica: &str) -> u64 {
    lookup(c, base, prompt)
        .await
        .into_iter()
        .find(|(n, _)| n == replica)
        .map(|(_, b)| b)
        .unwrap_or(0)
}

/// Distinct prompts: `n` token ids from a seed, inside the tokenizer's ordinary vocabulary.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1000 + (seed * 7919 + i * 104_729) % 20_000)
        .collect()
}

async fn debug(c: &reqwest::Client, base: &str) -> Value {
    get_json(c, &format!("{base}/debug/replicas")).await
}

/// Polls `/debug/replicas` until `f` holds; panics with the last document and the log.
async fn wait_debug(
    c: &reqwest::Client,
    base: &str,
    idx: &Proc,
    what: &str,
    timeout: Duration,
    f: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        let d = debug(c, base).await;
        if f(&d) {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; /debug/replicas: {d:#}\nindexer log:\n{}",
            idx.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls a lookup until `replica` holds `want` GPU blocks of `prompt`.
async fn wait_blocks(c: &reqwest::Client, base: &str, prompt: &[u32], replica: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = gpu_blocks(c, base, prompt, replica).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{replica} holds {got} GPU blocks of the prompt, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn all_connected(d: &Value, name: &str, ranks: usize) -> bool {
    let s = streams_of(d, name);
    s.len() == ranks && s.iter().all(|s| s["connected"] == true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_binds_for_an_engine_that_connects_out() {
    // The engine is told to publish to tcp://127.0.0.1:P (no `*`): vLLM then connects out, and
    // the indexer, which only knows the engine's HTTP address, must bind P after discovery.
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-connect-out");
    let mut spec = SimSpec::new("sim-out", 1);
    spec.connect_out = true;
    let _sim = spec.start(&bin, &dir.0, "first");
    let cfg = format!(
        "scrape_interval_ms = 100\n\
         [events]\nmax_backoff_ms = 200\n\
         [[models]]\nname = \"{MODEL}\"\nmodel_dir = \"{}\"\n\
         [models.hash]\nalgo = \"sha256\"\nengine_version = \"0.33.0\"\n\
         [[models.replicas]]\nname = \"{}\"\nhttp = \"{}\"\ntopic = \"kv-events\"\n",
        model_dir().display(),
        spec.name,
        spec.addr(),
    );
    let cfg_path = dir.0.join("indexer.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let (idx, base) = start_indexer(&cfg_path, &dir.0, &[]);
    let c = client();
    let d = wait_debug(
        &c,
        &base,
        &idx,
        "discovery, bind and the engine connecting in",
        Duration::from_secs(30),
        |d| all_connected(d, spec.name, 1),
    )
    .await;
    let s = streams_of(&d, spec.name);
    // Bound on events.bind_address (loopback by default), not on every interface.
    assert_eq!(
        s[0]["endpoint"],
        format!("tcp://127.0.0.1:{}", spec.pub_port)
    );
    assert_eq!(
        s[0]["replay"],
        format!("tcp://127.0.0.1:{}", spec.replay_port)
    );
    // Events flow over the bound socket: a prompt the engine cached is in the index.
    let p = prompt(7, 120);
    complete(&c, &spec, &p, 1).await;
    let hit = cached(&complete(&c, &spec, &p, 1).await);
    assert_eq!(hit, (120 - 1) / BS * BS);
    wait_blocks(&c, &base, &p, spec.name, hit / BS).await;
    let r = route(&c, &base, &p).await;
    assert_eq!(r["endpoint"], spec.addr(), "{r}");
    assert_eq!(r["matched_tokens"]["gpu"], hit, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_routes_a_simulated_fleet_found_through_kv_event_sources() {
    let bin = sim_binary();
    let model = model_dir();
    let dir = TempDir::new("sim-e2e");
    let a = SimSpec::new("sim-a", 1);
    let b = SimSpec::new("sim-b", 2);
    let mut sim_a = a.start(&bin, &dir.0, "first");
    let _sim_b = b.start(&bin, &dir.0, "first");

    // HTTP addresses only: events, replay endpoints and DP size come from /kv_event_sources.
    let cfg = format!(
        "scrape_interval_ms = 100\nstale_after_ms = 2000\n\
         [events]\nmax_backoff_ms = 200\n\
         [[models]]\nname = \"{MODEL}\"\nmodel_dir = \"{}\"\n\
         [models.hash]\nalgo = \"sha256\"\nengine_version = \"0.33.0\"\n\
         [[models.replicas]]\nname = \"{}\"\nhttp = \"{}\"\ntopic = \"kv-events\"\n\
         [[models.replicas]]\nname = \"{}\"\nhttp = \"{}\"\ntopic = \"kv-events\"\n",
        model.display(),
        a.name,
        a.addr(),
        b.name,
        b.addr()
    );
    let cfg_path = dir.0.join("indexer.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let (idx, base) = start_indexer(&cfg_path, &dir.0, &[]);
    let c = client();

    let d = wait_debug(
        &c,
        &base,
        &idx,
        "discovery and connection",
        Duration::from_secs(30),
        |d| all_connected(d, a.name, 1) && all_connected(d, b.name, 2),
    )
    .await;
    // Discovered endpoints: the sims' wildcard binds resolved to their HTTP host, rank r at +r.
    let sb = streams_of(&d, b.name);
    for (r, s) in sb.iter().enumerate() {
        assert_eq!(
            s["endpoint"],
            format!("tcp://127.0.0.1:{}", b.pub_port + r as u16)
        );
        assert_eq!(
            s["replay"],
            format!("tcp://127.0.0.1:{}", b.replay_port + r as u16)
        );
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Warm one prompt on each sim, directly.
    let p1 = prompt(1, 200);
    let p2 = prompt(2, 150);
    complete(&c, &a, &p1, 1).await;
    complete(&c, &b, &p2, 1).await;
    // What the engine itself reports as cached on a repeat (usable blocks only: (n-1)/bs).
    let hit1 = cached(&complete(&c, &a, &p1, 1).await);
    let hit2 = cached(&complete(&c, &b, &p2, 1).await);
    assert_eq!(hit1, (200 - 1) / BS * BS);
    assert_eq!(hit2, (150 - 1) / BS * BS);
    wait_blocks(&c, &base, &p1, a.name, hit1 / BS).await;
    wait_blocks(&c, &base, &p2, b.name, hit2 / BS).await;
    // The binary's default `[scheduling]` reads the streams on a paused thread of their own.
    let metrics = get_text(&c, &format!("{base}/metrics")).await;
    let wakeups =
        kvroute_core::prometheus::sum(&metrics, "kvroute_indexer_event_thread_wakeups_total");
    assert!(
        wakeups.is_some_and(|w| w >= 1.0),
        "the event streams' thread never woke: {wakeups:?}"
    );

    let r1 = route(&c, &base, &p1).await;
    assert_eq!(r1["endpoint"], a.addr(), "{r1}");
    assert_eq!(r1["matched_tokens"]["gpu"], hit1, "{r1}");
    assert_eq!(r1["reason"], "prefix_hit", "{r1}");
    let r2 = route(&c, &base, &p2).await;
    assert_eq!(r2["endpoint"], b.addr(), "{r2}");
    assert_eq!(r2["matched_tokens"]["gpu"], hit2, "{r2}");

    // Load scraping: a long request keeps sim-b's rank 0 busy...
    let long_prompt = prompt(3, 64);
    let long = {
        let c = c.clone();
        let url = format!("http://{}/v1/completions", b.addr());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(60),
                c.post(url)
                    .json(&json!({"model": MODEL, "prompt": long_prompt, "max_tokens": 2000}))
                    .send(),
            )
            .await;
        })
    };
    wait_debug(
        &c,
        &base,
        &idx,
        "scraped num_requests_running",
        Duration::from_secs(20),
        |d| replica_of(d, b.name).is_some_and(|r| r["running"].as_f64() >= Some(1.0)),
    )
    .await;
    // ... so the next request goes to rank 1, whose stream the indexer found by discovery.
    let p3 = prompt(4, 100);
    complete(&c, &b, &p3, 1).await;
    let hit3 = cached(&complete(&c, &b, &p3, 1).await);
    assert_eq!(hit3, (100 - 1) / BS * BS);
    wait_blocks(&c, &base, &p3, b.name, hit3 / BS).await;
    let d = debug(&c, &base).await;
    let sb = streams_of(&d, b.name);
    assert!(
        sb[1]["events"].as_u64().unwrap_or(0) > 0,
        "rank 1 stream saw no events: {d:#}"
    );
    let rb = replica_of(&d, b.name).unwrap();
    assert!(rb["process_start"].as_f64().unwrap_or(0.0) > 1.0e9, "{rb}");
    assert!(rb["kv_usage"].as_f64().is_some(), "{rb}");
    // Rank 1 is now idle (silent) while rank 0 decodes (its stream carries a BlockStored per
    // filled block): that is not staleness. Staleness is judged per rank, from the engine-labelled
    // metrics, so the whole replica keeps its cache credit.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let d = debug(&c, &base).await;
    let rb = replica_of(&d, b.name).unwrap();
    assert!(
        rb["running"].as_f64() >= Some(1.0),
        "long request ended early: {rb}"
    );
    assert_eq!(
        rb["stale"], false,
        "an idle DP rank made a busy replica stale: {rb}"
    );
    long.abort();

    // Hash self-check: vLLM's sha256 recomputed from the events, no mismatch.
    let m = get_text(&c, &format!("{base}/metrics")).await;
    assert!(metric_sum(&m, "kvroute_indexer_hash_checks_total").unwrap_or(0.0) >= 1.0);
    assert_eq!(
        metric_sum(&m, "kvroute_indexer_hash_mismatches_total"),
        Some(0.0)
    );
    assert_eq!(
        metric_sum(&m, "kvroute_indexer_event_decode_errors_total"),
        Some(0.0)
    );

    // Kill sim-a: its streams disconnect, scrapes fail, and p1 (cached only there) goes elsewhere.
    let old_start = replica_of(&d, a.name).unwrap()["process_start"].as_f64();
    sim_a.kill();
    wait_debug(
        &c,
        &base,
        &idx,
        "sim-a unhealthy and stale",
        Duration::from_secs(20),
        |d| replica_of(d, a.name).is_some_and(|r| r["healthy"] == false && r["stale"] == true),
    )
    .await;
    let r = route(&c, &base, &p1).await;
    assert_eq!(r["endpoint"], b.addr(), "a dead replica was chosen: {r}");
    // Its entries are kept while it is away (it may come back with the same cache) ...
    assert_eq!(gpu_blocks(&c, &base, &p1, a.name).await, hit1 / BS);

    // ... and dropped when it comes back as a new engine (seq from 0, new process start time).
    let _sim_a2 = a.start(&bin, &dir.0, "restart");
    let d = wait_debug(
        &c,
        &base,
        &idx,
        "sim-a back",
        Duration::from_secs(30),
        |d| {
            all_connected(d, a.name, 1)
                && replica_of(d, a.name).is_some_and(|r| {
                    r["healthy"] == true && r["process_start"].as_f64() != old_start
                })
        },
    )
    .await;
    wait_blocks(&c, &base, &p1, a.name, 0).await;
    let resets = streams_of(&d, a.name)[0]["resets"].as_u64().unwrap_or(0);
    let m = get_text(&c, &format!("{base}/metrics")).await;
    let restarts = metric_sum(&m, "kvroute_indexer_engine_restarts_detected_total").unwrap_or(0.0);
    let resets_now = streams_of(&debug(&c, &base).await, a.name)[0]["resets"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        resets.max(resets_now) >= 1 || restarts >= 1.0,
        "restart not detected: resets {resets_now}, restarts {restarts}"
    );

    // The new engine warms up again and wins its prompt back.
    tokio::time::sleep(Duration::from_millis(200)).await;
    complete(&c, &a, &p1, 1).await;
    let hit1b = cached(&complete(&c, &a, &p1, 1).await);
    assert_eq!(hit1b, hit1);
    wait_blocks(&c, &base, &p1, a.name, hit1 / BS).await;
    let r = route(&c, &base, &p1).await;
    assert_eq!(r["endpoint"], a.addr(), "{r}");
    assert_eq!(r["matched_tokens"]["gpu"], hit1, "{r}");
    drop(idx);
}

/// The gauge `name` in the indexer's metrics (the test's one replica).
async fn replica_gauge(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = get_text(c, &format!("{base}/metrics")).await;
    metric_sum(&text, name).unwrap_or_else(|| panic!("{name} in\n{text}"))
}

/// Sends `n` requests of 2,048 distinct tokens and 16 output tokens, one at a time.
async fn sequential_load(c: &reqwest::Client, sim: &SimSpec, seed: u32, n: u32) {
    for i in 0..n {
        complete(c, sim, &prompt(seed * 1000 + i, 2048), 16).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibration_learns_the_simulators_rates_and_a_slowdown() {
    // The simulator's true model: 30k prompt tokens/s, 6 ms steps (+ per sequence and context),
    // 10x faster than the wall. The indexer starts from a prior three times too slow and learns
    // both rates from the simulator's own histograms.
    const SCALE: f64 = 10.0;
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-calibration");
    let mut spec = SimSpec::new("sim-cal", 1);
    spec.args = vec!["--time-scale", "10"];
    let _sim = spec.start(&bin, &dir.0, "first");
    let cfg = format!(
        "scrape_interval_ms = 100\n\
         [scoring]\nprefill_tokens_per_s = {}\ndecode_step_s = {}\n\
         [calibration]\nengine_time_scale = {SCALE}\n\
         [[models]]\nname = \"{MODEL}\"\nmodel_dir = \"{}\"\n\
         [[models.replicas]]\nname = \"{}\"\nhttp = \"{}\"\ntopic = \"kv-events\"\n",
        10_000.0 * SCALE,
        0.02 / SCALE,
        model_dir().display(),
        spec.name,
        spec.addr(),
    );
    let cfg_path = dir.0.join("indexer.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let (_idx, base) = start_indexer(&cfg_path, &dir.0, &[]);
    let c = client();
    let truth = get_json(&c, &format!("http://{}/admin/latency-model", spec.addr())).await;
    let rate = truth["prefill_tokens_per_s"].as_f64().unwrap();
    // A lone decoding sequence with ~2k tokens of context.
    let step_ms = truth["decode_step_ms"].as_f64().unwrap()
        + truth["decode_ms_per_seq"].as_f64().unwrap()
        + 2.06 * truth["decode_ms_per_1k_context"].as_f64().unwrap();
    // What a 2,048-token prefill sees: its compute and the step that carries it.
    let effective = 2048.0 / (2048.0 / rate + step_ms / 1000.0);

    sequential_load(&c, &spec, 1, 100).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let learned = |name: &'static str| {
        let c = c.clone();
        let base = base.clone();
        async move { replica_gauge(&c, &base, name).await }
    };
    let got_rate = learned("kvroute_indexer_replica_prefill_tokens_per_second").await / SCALE;
    let got_step_ms = learned("kvroute_indexer_replica_decode_step_seconds").await * SCALE * 1e3;
    assert!(
        (got_rate - effective).abs() < 0.10 * effective && (got_rate - rate).abs() < 0.10 * rate,
        "prefill rate learned {got_rate:.0}, true {rate:.0} ({effective:.0} as a prefill sees it)"
    );
    // The step the engine measured: on a machine busy with other work the simulator's steps run
    // slower than its nominal model, and what the engine measures is what requests there see.
    let sim_metrics = get_text(&c, &format!("http://{}/metrics", spec.addr())).await;
    let itl = |suffix: &str| {
        metric_sum(
            &sim_metrics,
            &format!("vllm:inter_token_latency_seconds_{suffix}"),
        )
        .unwrap_or(f64::NAN)
    };
    let measured_ms = itl("sum") / itl("count") * 1e3;
    assert!(
        (got_step_ms - measured_ms).abs() < 0.10 * measured_ms,
        "step learned {got_step_ms:.2} ms, the engine measured {measured_ms:.2} ms (nominal {step_ms:.2} ms)"
    );

    // The replica becomes 2x slower; 60 model seconds (6 wall s) of traffic re-learn it.
    let (status, _) = post_json(
        &c,
        &format!("http://{}/admin/speed", spec.addr()),
        &json!({"speed": 0.5}),
    )
    .await;
    assert_eq!(status, 200);
    let start = Instant::now();
    let mut seed = 2;
    while start.elapsed() < Duration::from_secs_f64(60.0 / SCALE) {
        sequential_load(&c, &spec, seed, 5).await;
        seed += 1;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let slow_rate = learned("kvroute_indexer_replica_prefill_tokens_per_second").await / SCALE;
    let slow_step_ms = learned("kvroute_indexer_replica_decode_step_seconds").await * SCALE * 1e3;
    assert!(
        (slow_rate - got_rate / 2.0).abs() < 0.10 * got_rate / 2.0,
        "after the slowdown: {slow_rate:.0} tokens/s, expected about {:.0}",
        got_rate / 2.0
    );
    assert!(
        (slow_step_ms - 2.0 * step_ms).abs() < 0.10 * 2.0 * step_ms,
        "after the slowdown: step {slow_step_ms:.2} ms, expected about {:.2}",
        2.0 * step_ms
    );
}

/// Runs `kvroute-indexer assess` over `sims` for `seconds` while `traffic` runs, and returns its
/// JSON report's first model.
async fn assess_while<F, Fut>(
    dir: &std::path::Path,
    tag: &str,
    sims: &[&SimSpec],
    seconds: u32,
    traffic: F,
) -> Value
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    assess_with(dir, tag, sims, seconds, &[], traffic).await.0
}

/// [`assess_while`] with extra `assess` arguments; also returns its log (stderr: everything
/// but the report).
async fn assess_with<F, Fut>(
    dir: &std::path::Path,
    tag: &str,
    sims: &[&SimSpec],
    seconds: u32,
    extra: &[&str],
    traffic: F,
) -> (Value, String)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut cfg = format!(
        "scrape_interval_ms = 100\n\
         [events]\nmax_backoff_ms = 200\n\
         [[models]]\nname = \"{MODEL}\"\nmodel_dir = \"{}\"\n\
         [models.hash]\nalgo = \"sha256\"\nengine_version = \"0.33.0\"\n",
        model_dir().display(),
    );
    for s in sims {
        cfg.push_str(&format!(
            "[[models.replicas]]\nname = \"{}\"\nhttp = \"{}\"\ntopic = \"kv-events\"\n",
            s.name,
            s.addr()
        ));
    }
    let cfg_path = dir.join(format!("assess-{tag}.toml"));
    std::fs::write(&cfg_path, cfg).unwrap();
    let json_path = dir.join(format!("assess-{tag}.json"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-indexer"));
    cmd.args(["assess", "--config"])
        .arg(&cfg_path)
        .args(["--duration", &format!("{seconds}s"), "--json"])
        .arg(&json_path)
        .args(extra)
        .env("RUST_LOG", "info");
    let mut p = Proc::spawn_piped(
        &format!("assess-{tag}"),
        cmd,
        dir.join(format!("assess-{tag}.log")),
        false,
    );
    p.wait_line(Duration::from_secs(60), |l| {
        l.starts_with("assess: watching")
    });
    // Subscriptions settle before the first event is published.
    tokio::time::sleep(Duration::from_millis(800)).await;
    traffic().await;
    // The JSON is written before the text report.
    p.wait_line(Duration::from_secs(u64::from(seconds) + 60), |l| {
        l.contains("verdict:")
    });
    let text = std::fs::read_to_string(&json_path)
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stderr:\n{}", p.log_tail()));
    let report: Value = serde_json::from_str(&text).expect("report JSON");
    let output = std::fs::read_to_string(dir.join(format!("assess-{tag}.log"))).unwrap_or_default();
    (report["models"][0].clone(), output)
}

fn replica_report<'a>(model: &'a Value, name: &str) -> &'a Value {
    model["replicas"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["replica"] == name))
        .unwrap_or_else(|| panic!("no {name} in {model}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assess_finds_prefill_computed_twice_and_judges_the_traffic() {
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-assess");
    let a = SimSpec::new("sim-assess-a", 1);
    let b = SimSpec::new("sim-assess-b", 1);
    let _sa = a.start(&bin, &dir.0, "first");
    let _sb = b.start(&bin, &dir.0, "first");
    let c = client();

    // A shared 800-token prefix (50 blocks) computed on both replicas, as a balancer that
    // ignores prefixes sends it: the second copy is prefill a prefix-aware router saves.
    let shared = prompt(41, 800);
    let model = assess_while(&dir.0, "shared", &[&a, &b], 4, || async {
        complete(&c, &a, &shared, 1).await;
        complete(&c, &b, &shared, 1).await;
        complete(&c, &a, &shared, 1).await;
    })
    .await;
    assert_eq!(model["verdict"]["kind"], "would_save", "{model}");
    let (ra, rb) = (
        replica_report(&model, a.name),
        replica_report(&model, b.name),
    );
    assert_eq!(ra["duplicated_tokens"], 0.0, "{model}");
    assert_eq!(rb["duplicated_tokens"], 800.0, "{model}");
    assert!(
        model["predicted_hit_rate"].as_f64() > model["hit_rate"].as_f64(),
        "{model}"
    );
    assert_eq!(model["thrash"], false, "{model}");

    // Unique prompts: nothing is computed twice.
    let model = assess_while(&dir.0, "unique", &[&a, &b], 3, || async {
        for seed in 0..4 {
            complete(&c, &a, &prompt(100 + seed, 400), 1).await;
            complete(&c, &b, &prompt(200 + seed, 400), 1).await;
        }
    })
    .await;
    assert_eq!(model["verdict"]["kind"], "low_reuse", "{model}");
    assert_eq!(model["duplicated_share"], 0.0, "{model}");

    // One replica: nothing to route, whatever the traffic.
    let model = assess_while(&dir.0, "single", &[&a], 1, || async {}).await;
    assert_eq!(model["verdict"]["kind"], "nothing_to_route", "{model}");
}

/// Thrash is judged against the fleet's whole KV: two replicas of 64 blocks cycling prefixes
/// their own KV cannot hold recompute them either way, but only a working set over the fleet's
/// 128 blocks is thrash (more KV fixes it); one within them is copies, which routing removes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assess_calls_thrash_only_what_the_fleets_kv_cannot_hold() {
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-thrash");
    let mut a = SimSpec::new("sim-thrash-a", 1);
    let mut b = SimSpec::new("sim-thrash-b", 1);
    a.blocks = 64;
    b.blocks = 64;
    let _sa = a.start(&bin, &dir.0, "first");
    let _sb = b.start(&bin, &dir.0, "first");
    let c = client();
    // 384-token prefixes: 24 blocks each.
    let prefixes: Vec<Vec<u32>> = (0..8).map(|i| prompt(500 + i, 384)).collect();

    // Four prefixes (96 blocks) sent to both replicas, round after round: each replica's 64
    // blocks cycle and recompute, the fleet's 128 would hold them once each.
    let copies = assess_while(&dir.0, "copies", &[&a, &b], 6, || async {
        for _ in 0..3 {
            for p in &prefixes[..4] {
                complete(&c, &a, p, 1).await;
                complete(&c, &b, p, 1).await;
            }
        }
    })
    .await;
    assert!(
        copies["recomputed_share"].as_f64() > Some(0.05),
        "the replicas recompute: {copies}"
    );
    assert!(
        copies["capacity_recomputed_share"].as_f64() < Some(0.05),
        "the fleet's KV would hold them: {copies}"
    );
    assert_eq!(copies["thrash"], false, "{copies}");
    assert!(
        copies["summary"]
            .as_str()
            .is_some_and(|s| s.contains("no thrash")),
        "{copies}"
    );

    // Eight prefixes (192 blocks), each to one replica: the fleet's KV cannot hold them.
    let over = assess_while(&dir.0, "over", &[&a, &b], 6, || async {
        for _ in 0..3 {
            for (i, p) in prefixes.iter().enumerate() {
                let sim = if i % 2 == 0 { &a } else { &b };
                complete(&c, sim, p, 1).await;
            }
        }
    })
    .await;
    assert!(
        over["capacity_recomputed_share"].as_f64() > Some(0.05),
        "the fleet's KV is too small: {over}"
    );
    assert_eq!(over["thrash"], true, "{over}");
}

/// An indexer following `sim`, in its own directory; `extra` is more of its TOML (top level).
fn indexer_for(sim: &SimSpec, name: &str, extra: &str) -> (TempDir, Proc, String) {
    let dir = TempDir::new(name);
    let cfg = format!(
        "scrape_interval_ms = 100\n{extra}\n\
         [events]\nmax_backoff_ms = 200\n\
         [[models]]\nname = \"{MODEL}\"\nmodel_dir = \"{}\"\n\
         [models.hash]\nalgo = \"sha256\"\nengine_version = \"0.33.0\"\n\
         [[models.replicas]]\nname = \"{}\"\nhttp = \"{}\"\ntopic = \"kv-events\"\n",
        model_dir().display(),
        sim.name,
        sim.addr(),
    );
    let cfg_path = dir.0.join("indexer.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let (idx, base) = start_indexer(&cfg_path, &dir.0, &[]);
    (dir, idx, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_hybrid_sim_the_index_predicts_the_engines_hit_and_group_zero_alone_does_not() {
    // gpt-oss's layout (group 0 sliding window, group 1 full attention) with a 32-token window
    // (2 blocks of 16 before the hit point) and a pool of exactly what one 200-token request
    // needs in both groups (26 blocks + the null block), so evictions are deterministic.
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-hybrid");
    let mut spec = SimSpec::new("sim-hybrid", 1);
    spec.args = vec!["--kv-cache-layout", "gpt-oss", "--sliding-window", "32"];
    spec.blocks = 27;
    let _sim = spec.start(&bin, &dir.0, "first");
    let (_d1, idx, base) = indexer_for(&spec, "sim-e2e-hybrid-ix", "");
    let (_d2, idx0, base0) =
        indexer_for(&spec, "sim-e2e-hybrid-ix0", "[index]\nkv_cache_group = 0\n");
    let c = client();
    for (i, b) in [(&idx, &base), (&idx0, &base0)] {
        wait_debug(&c, b, i, "connection", Duration::from_secs(30), |d| {
            all_connected(d, spec.name, 1)
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A: 200 tokens, 2 output tokens. The decode step frees sliding blocks 0-9 (they left the
    // window), ahead of everything else in the free queue.
    let p = prompt(11, 200);
    complete(&c, &spec, &p, 2).await;
    wait_blocks(&c, &base, &p, spec.name, 12).await;
    // F: 96 unrelated tokens take 6 blocks per group from the queue's head: the two unhashed
    // tail blocks of A, then A's sliding blocks 9..0, which are evicted (BlockRemoved, group 0).
    complete(&c, &spec, &prompt(12, 96), 1).await;
    // The first 100 tokens of A: a 6-block hit needs sliding blocks 4 and 5, now gone, so the
    // hybrid rule gives nothing; seeing that proves the index applied the evictions.
    wait_blocks(&c, &base, &p[..100], spec.name, 0).await;
    // The full prompt: full attention holds blocks 0-11 and the window before block 12 (blocks
    // 10, 11) is still cached: 12 blocks. Group 0 alone (read as full attention) misses block 0.
    wait_blocks(&c, &base0, &p, spec.name, 0).await;
    let predicted = gpu_blocks(&c, &base, &p, spec.name).await;
    assert_eq!(predicted, 12);
    let r = route(&c, &base, &p).await;
    assert_eq!(r["matched_tokens"]["gpu"], 12 * BS, "{r}");
    // What the engine gives.
    let hit = cached(&complete(&c, &spec, &p, 1).await);
    assert_eq!(
        hit,
        predicted * BS,
        "engine hit vs the hybrid index's prediction"
    );
    // Group-0-only indexing predicted 0 blocks (waited for above): wrong by 192 tokens.
    assert_eq!(hit, 192);
}

/// Polls `/debug/replicas` until the replica's streams stop receiving events (no new batch for
/// 500 ms): the index has applied what the last request stored.
async fn settle(c: &reqwest::Client, base: &str) -> Value {
    let seq = |d: &Value| d["replicas"][0]["streams"][0]["last_seq"].clone();
    let mut last = debug(c, base).await;
    let mut quiet = 0;
    while quiet < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = debug(c, base).await;
        quiet = if seq(&now) == seq(&last) {
            quiet + 1
        } else {
            0
        };
        last = now;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_prefix_match_unit_below_the_block_size_and_evictions_the_index_predicts_every_hit()
{
    // gpt-oss's layout hashed every 8 tokens with blocks of 16 (vLLM's --prefix-match-unit 8):
    // blocks are named by their last hash block and full-attention groups also key the block
    // holding the prompt's last hash boundary (one-hash-block BlockStored events). A pool of 80
    // blocks makes the engine evict as the requests go on, so requests whose sliding-window
    // blocks were evicted compute full-attention blocks again into second copies.
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-hash-block");
    let mut spec = SimSpec::new("sim-hash-block", 1);
    spec.args = vec![
        "--kv-cache-layout",
        "gpt-oss",
        "--sliding-window",
        "32",
        "--prefix-match-unit",
        "8",
    ];
    spec.blocks = 80;
    let _sim = spec.start(&bin, &dir.0, "first");
    let (_d, idx, base) = indexer_for(&spec, "sim-e2e-hash-block-ix", "");
    let c = client();
    wait_debug(
        &c,
        &base,
        &idx,
        "connection",
        Duration::from_secs(30),
        |d| all_connected(d, spec.name, 1),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut rng = kvroute_core::rng::SplitMix64::new(0x5eed);
    let families: Vec<Vec<u32>> = (0..3).map(|f| prompt(40 + f, 320)).collect();
    let (mut with_hit, mut hit_tokens) = (0, 0);
    for i in 0..24u32 {
        // A shared prefix of any length (not a multiple of 8 or 16), then a unique tail.
        let family = &families[rng.below(families.len())];
        let shared = 20 + rng.below(280);
        let mut p = family[..shared].to_vec();
        p.extend(prompt(100 + i, 1 + rng.below(40)));
        let output = 1 + rng.below(24) as u32;
        settle(&c, &base).await;
        let predicted = gpu_blocks(&c, &base, &p, spec.name).await * BS;
        let hit = cached(&complete(&c, &spec, &p, output).await);
        assert_eq!(
            hit,
            predicted,
            "request {i} ({} tokens, {shared} shared): engine hit vs prediction",
            p.len()
        );
        with_hit += usize::from(hit > 0);
        hit_tokens += hit;
    }
    let d = settle(&c, &base).await;
    assert!(
        with_hit >= 8,
        "{with_hit} of 24 requests hit ({hit_tokens} tokens)"
    );
    let r = &d["replicas"][0];
    assert_eq!(r["hash_mismatch"], Value::Null, "{r}");
    assert_eq!(r["streams"][0]["rejected_events"], 0, "{r}");
    assert_eq!(r["streams"][0]["decode_errors"], 0, "{r}");
    let page = get_text(&c, &format!("{base}/metrics")).await;
    let skipped = metric_sum(&page, "kvroute_indexer_index_hash_block_events_total");
    assert!(
        skipped.unwrap_or(0.0) > 0.0,
        "no hash-block events reached the index"
    );
    assert!(metric_sum(&page, "kvroute_indexer_hash_checks_total").unwrap_or(0.0) > 0.0);
    assert_eq!(
        metric_sum(&page, "kvroute_indexer_hash_mismatches_total"),
        Some(0.0)
    );
    let models = get_json(&c, &format!("{base}/v1/models")).await;
    assert_eq!(models["models"][0]["block_size"], BS, "{models}");
}

/// A chat request whose system prompt starts with `stamp` (a per-request timestamp, or the same
/// one for all) before ~700 tokens of shared instructions, then its own question.
fn stamped_chat(stamp: &str, question: usize) -> Value {
    let rules: String = (0..60)
        .map(|i| format!("Rule {i}: answer briefly, cite the manual, and never guess. "))
        .collect();
    json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": format!("Current time: {stamp}. {rules}")},
        {"role": "user", "content": format!("Question {question}: how do I reset device {}?", question * 37)}]})
}

/// The engine's token ids of a chat body, from the indexer's own tokenizer CLI.
fn chat_tokens(body: &Value) -> Vec<u32> {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-indexer"))
        .args(["tokenize", "--model-dir"])
        .arg(model_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("kvroute-indexer tokenize");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(body.to_string().as_bytes())
        .expect("write body");
    let out = child.wait_with_output().expect("tokenize output");
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).expect("token JSON");
    serde_json::from_value(v["token_ids"].clone()).expect("token ids")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompt_audit_finds_a_per_request_timestamp_and_nothing_in_clean_prompts() {
    let bin = sim_binary();
    let dir = TempDir::new("sim-e2e-audit");
    let a = SimSpec::new("sim-audit-a", 1);
    let b = SimSpec::new("sim-audit-b", 1);
    let _sa = a.start(&bin, &dir.0, "first");
    let _sb = b.start(&bin, &dir.0, "first");
    let c = client();
    let n = 6;
    let stamps: Vec<String> = (0..n)
        .map(|i| format!("2026-12-03 09:{:02}:{:02} UTC", 10 + i, 7 * i + 3))
        .collect();
    let send = |bodies: Vec<Value>| {
        let c = &c;
        let sims = [&a, &b];
        async move {
            for (i, body) in bodies.iter().enumerate() {
                let sim = sims[i % 2];
                let (status, reply) = post_json(
                    c,
                    &format!("http://{}/v1/chat/completions", sim.addr()),
                    body,
                )
                .await;
                assert_eq!(status, 200, "{reply}");
            }
        }
    };

    // Where the prompts really diverge: the first token at which any two differ.
    let stamped: Vec<Value> = (0..n).map(|i| stamped_chat(&stamps[i], i)).collect();
    let tokens: Vec<Vec<u32>> = stamped.iter().map(chat_tokens).collect();
    let truth = tokens[1..]
        .iter()
        .map(|t| {
            t.iter()
                .zip(&tokens[0])
                .position(|(x, y)| x != y)
                .expect("differ")
        })
        .min()
        .expect("truth");
    assert!(
        truth < 32,
        "the stamp is early in the prompt (token {truth})"
    );

    let (model, log) = assess_with(
        &dir.0,
        "audit-stamped",
        &[&a, &b],
        4,
        &["--audit", "--show-text"],
        || send(stamped.clone()),
    )
    .await;
    let audit = &model["audit"];
    let found = audit["divergences"].as_array().expect("divergences");
    assert_eq!(found.len(), 1, "{audit}");
    let d = &found[0];
    let at = d["position_tokens"].as_u64().expect("position") as i64;
    assert!(
        (at - truth as i64).abs() < 16,
        "divergence reported at token {at}, the prompts differ from token {truth}: {audit}"
    );
    assert_eq!(d["requests"], n as u64, "{audit}");
    // Every block of the shared instructions after the stamp is stored once per request.
    let shared_blocks = (tokens[0].len() - truth) as u64 / 16;
    let destroyed = d["reuse_destroyed_tokens"].as_u64().expect("destroyed");
    assert!(
        destroyed >= (n as u64 - 1) * 16 * (shared_blocks - 4),
        "{destroyed} tokens destroyed, expected about {} ({audit})",
        (n as u64 - 1) * 16 * shared_blocks
    );
    let text = d["text"]
        .as_array()
        .expect("--show-text puts the text in the report");
    assert!(
        text.iter().any(|t| t
            .as_str()
            .is_some_and(|t| t.contains("Current time: 2026-12-03 09:1"))),
        "{text:?}"
    );
    // The prompt text is in the report, never in the log.
    assert!(log.contains("INFO"), "the log was captured: {log}");
    assert!(!log.contains("Current time"), "prompt text logged:\n{log}");

    // The same prompts with one (new) timestamp for all: nothing diverges early.
    let clean: Vec<Value> = (0..n)
        .map(|i| stamped_chat("2026-12-03 10:00:00 UTC", i))
        .collect();
    let (model, _) = assess_with(&dir.0, "audit-clean", &[&a, &b], 4, &["--audit"], || {
        send(clean.clone())
    })
    .await;
    let audit = &model["audit"];
    assert!(audit["blocks"].as_u64() > Some(40), "{audit}");
    assert_eq!(audit["divergences"], json!([]), "{audit}");

    // Without --audit, no audit at all.
    let model = assess_while(&dir.0, "no-audit", &[&a], 1, || async {}).await;
    assert!(model.get("audit").is_none(), "{model}");
}
