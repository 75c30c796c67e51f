//! The real `kvroute-indexer serve` against the `ZmqEventPublisher` of vLLM **0.11.0, 0.23.0 and
//! 0.25.0**: each release's verbatim `kv_events.py` (read from its PyPI wheel by
//! `tests/vllm_reference/fetch_vllm.py`), made by that release's `EventPublisherFactory.create`,
//! two DP ranks, ROUTER replay on. 0.11.0 and 0.23.0 send events as msgpack arrays (0.11.0: 6
//! `BlockStored` fields, no `lora_name` / `extra_keys`), 0.25.0 as maps; all three answer replay
//! requests without a topic frame (`[b"", seq, payload]`).
//!
//! Scenario `tests/vllm_reference/scenarios/indexer_legacy.json`, events built with each release's
//! own structs (fields it lacks are dropped): chains with parents (hashes of 2^63 and above, raw
//! 32-byte hashes), LoRA and cache-salt chains, CPU offload, `BlockRemoved`, `AllBlocksCleared` on
//! one rank, an unknown parent. Phase 0 is published before the indexer subscribes, so it can only
//! arrive through the release's replay; phase 1 is live and chains onto a replayed block. The index
//! must equal the expected end state (per release where the release publishes less), with no
//! decode error.

mod procs;

use std::process::Command;
use std::time::Duration;

use procs::*;
use serde_json::{json, Value};

const MODEL: &str = "m";

fn scenario_path() -> std::path::PathBuf {
    workspace().join("tests/vllm_reference/scenarios/indexer_legacy.json")
}

/// An expectation: a value, or `{"<version>": v, "default": v}`.
fn pick<'a>(v: &'a Value, version: &str) -> &'a Value {
    match v {
        Value::Object(m) => m
            .get(version)
            .or_else(|| m.get("default"))
            .unwrap_or_else(|| panic!("no expectation for {version} or default in {v}")),
        _ => v,
    }
}

/// What each release's structs look like on the wire: `BlockStored` fields, `BlockRemoved`
/// fields, array (positional) encoding.
fn expected_structs(version: &str) -> (Vec<&'static str>, Vec<&'static str>, bool) {
    let v0_11 = vec![
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ];
    let mut v0_23 = v0_11.clone();
    v0_23.extend([
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ]);
    match version {
        "0.11.0" => (v0_11, vec!["block_hashes", "medium"], true),
        "0.23.0" => (v0_23, vec!["block_hashes", "medium", "group_idx"], true),
        "0.25.0" => (v0_23, vec!["block_hashes", "medium", "group_idx"], false),
        other => panic!("no struct facts for {other}"),
    }
}

/// `ep`, checked to be a loopback TCP endpoint.
fn tcp(ep: &Value) -> &str {
    let ep = ep.as_str().expect("endpoint string");
    assert!(ep.starts_with("tcp://127.0.0.1:"), "not loopback: {ep}");
    ep
}

fn config_text(sources: &Value, dp: usize, bs: u64, topic: &str) -> String {
    let mut events = Vec::new();
    let mut replay = Vec::new();
    for rank in 0..dp {
        let s = &sources[rank.to_string()];
        events.push(format!("\"{}\"", tcp(&s["endpoint"])));
        replay.push(format!("\"{}\"", tcp(&s["replay_endpoint"])));
    }
    // No HTTP server behind the publisher: scraping off, the address only has to be valid.
    format!(
        "scrape_interval_ms = 0\n\
         [[models]]\nname = \"{MODEL}\"\nblock_size = {bs}\n\
         [models.loras]\nsql-lora = \"/loras/sql\"\n\
         [[models.replicas]]\nname = \"r0\"\nhttp = \"127.0.0.1:{http}\"\n\
         data_parallel_size = {dp}\nevents = [{}]\nreplay = [{}]\ntopic = \"{topic}\"\n",
        events.join(", "),
        replay.join(", "),
        http = free_port(),
    )
}

/// Waits until every rank's `last_seq` in `/debug/replicas` equals the publisher's.
async fn wait_seqs(c: &reqwest::Client, base: &str, want: &Value, idx: &Proc) {
    let url = format!("{base}/debug/replicas");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let d = get_json(c, &url).await;
        let streams = streams_of(&d, "r0");
        let done = !streams.is_empty()
            && streams.iter().all(|s| {
                let rank = s["rank"].as_u64().unwrap_or(u64::MAX).to_string();
                want.get(&rank).is_none_or(|w| s["last_seq"] == *w)
            });
        if done {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "indexer never reached the publisher's seqs {want}; /debug/replicas: {d:#}\nindexer log:\n{}",
            idx.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks every lookup of `checks` against r0's leading blocks per medium; returns how many.
async fn check_expectations(
    c: &reqwest::Client,
    base: &str,
    bs: u64,
    checks: &Value,
    version: &str,
) -> usize {
    let mut n = 0;
    for check in checks.as_array().expect("expectations") {
        let name = format!("{version} {}", check["name"]);
        let mut tokens: Vec<u64> = check["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        // One more token: the last prompt token is always recomputed, so only full blocks before
        // it are usable hits.
        tokens.push(9999);
        let mut body = json!({"model": MODEL, "token_ids": tokens});
        for k in ["lora", "cache_salt"] {
            if let Some(v) = check.get(k) {
                body[k] = v.clone();
            }
        }
        let (status, d) = post_json(c, &format!("{base}/debug/lookup"), &body).await;
        assert_eq!(status, 200, "lookup {name}: {d}");
        let r = d["replicas"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["replica"] == "r0"))
            .unwrap_or_else(|| panic!("r0 missing in lookup: {d}"));
        for medium in ["gpu", "cpu"] {
            let want = pick(&check[medium], version)
                .as_u64()
                .unwrap_or_else(|| panic!("{name}: {medium} expectation is not a number"));
            assert_eq!(
                r["blocks"][medium].as_u64(),
                Some(want),
                "{name}: {medium} blocks; lookup answer {d}"
            );
            assert_eq!(
                r["tokens"][medium].as_u64(),
                Some(want * bs),
                "{name}: {medium} tokens"
            );
        }
        assert_eq!(r["blocks"]["storage"], 0, "{name}");
        n += 1;
    }
    n
}

/// `/v1/route` for `tokens`: r0 with these matched tokens per medium.
async fn check_route(c: &reqwest::Client, base: &str, tokens: Vec<u32>, gpu: u64, cpu: u64) {
    let (status, d) = post_json(
        c,
        &format!("{base}/v1/route"),
        &json!({"model": MODEL, "token_ids": tokens}),
    )
    .await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["replica"], "r0", "{d}");
    assert_eq!(d["matched_tokens"]["gpu"], gpu, "{d}");
    assert_eq!(d["matched_tokens"]["cpu"], cpu, "{d}");
}

async fn indexer_follows_legacy_publisher(version: &str) {
    let py = python();
    let pkg = vllm_legacy_pkg(version);
    let scenario: Value =
        serde_json::from_str(&std::fs::read_to_string(scenario_path()).expect("scenario file"))
            .expect("scenario JSON");
    let dp = scenario["data_parallel_size"].as_u64().unwrap() as usize;
    let bs = scenario["block_size"].as_u64().unwrap();
    let topic = scenario["topic"].as_str().unwrap();
    let expect = &scenario["expect"];
    let dir = TempDir::new(&format!("vllm-legacy-{version}"));

    // The release's publisher binds first and publishes phase 0 at once: nobody is subscribed yet.
    let mut cmd = Command::new(&py);
    cmd.arg(workspace().join("tests/vllm_reference/vllm_publisher.py"))
        .arg("--scenario")
        .arg(scenario_path())
        .args(["--kv-events-impl", version])
        .arg("--vllm-dir")
        .arg(&pkg)
        .args(["--linger", "120"]);
    let mut publisher = Proc::spawn_piped(
        &format!("vllm_publisher.py {version}"),
        cmd,
        dir.0.join("publisher.log"),
        true,
    );
    let ready: Value = serde_json::from_str(
        &publisher.wait_line(Duration::from_secs(30), |l| l.contains("\"ready\"")),
    )
    .expect("ready line");
    assert_eq!(ready["impl"], version);

    // The module really is that release's: its structs' fields and encoding.
    let (stored, removed, array) = expected_structs(version);
    let structs = &ready["structs"];
    assert_eq!(structs["BlockStored"]["fields"], json!(stored), "{version}");
    assert_eq!(
        structs["BlockRemoved"]["fields"],
        json!(removed),
        "{version}"
    );
    for s in ["BlockStored", "BlockRemoved", "AllBlocksCleared"] {
        assert_eq!(structs[s]["array_like"], array, "{version} {s}");
    }

    let sources = &ready["kv_event_sources"];
    let phase0: Value = serde_json::from_str(
        &publisher.wait_line(Duration::from_secs(30), |l| l.contains("\"published\": 0")),
    )
    .unwrap();
    assert_eq!(
        phase0["last_seq"], expect["phase0_last_seq"],
        "publisher seqs"
    );

    // The late subscriber: phase 0 can only come from the release's ROUTER replay.
    let cfg = dir.0.join("indexer.toml");
    std::fs::write(&cfg, config_text(sources, dp, bs, topic)).unwrap();
    let (idx, base) = start_indexer(&cfg, &dir.0, &[]);
    let c = client();
    wait_seqs(&c, &base, &phase0["last_seq"], &idx).await;
    let d = get_json(&c, &format!("{base}/debug/replicas")).await;
    let streams = streams_of(&d, "r0");
    assert_eq!(streams.len(), dp, "{d}");
    for s in &streams {
        let rank = s["rank"].as_u64().unwrap().to_string();
        let sent = phase0["last_seq"][&rank].as_u64().unwrap() + 1;
        assert_eq!(
            s["batches"], sent,
            "phase 0 batches applied from replay: {s}"
        );
        assert!(s["replays"].as_u64().unwrap() >= 1, "no replay: {s}");
        assert_eq!(s["decode_errors"], 0, "{s}");
    }
    let checked0 = check_expectations(&c, &base, bs, &expect["after_phase"][0], version).await;

    // Every stream is connected and subscribed before phase 1 goes out live.
    let ok = poll(Duration::from_secs(10), || {
        let c = c.clone();
        let url = format!("{base}/debug/replicas");
        async move {
            let d = get_json(&c, &url).await;
            let s = streams_of(&d, "r0");
            s.len() == dp && s.iter().all(|s| s["connected"] == true)
        }
    })
    .await;
    assert!(ok, "streams never all connected");
    tokio::time::sleep(Duration::from_millis(300)).await;
    publisher.send_line("next");
    let phase1: Value = serde_json::from_str(
        &publisher.wait_line(Duration::from_secs(30), |l| l.contains("\"published\": 1")),
    )
    .unwrap();
    assert_eq!(phase1["last_seq"], expect["last_seq"], "publisher seqs");
    wait_seqs(&c, &base, &phase1["last_seq"], &idx).await;
    let checked1 = check_expectations(&c, &base, bs, &expect["after_phase"][1], version).await;
    assert_eq!(checked0 + checked1, 17);

    // Routing sees the same state: chain C is 1 GPU + 2 CPU blocks; chain G (a live block whose
    // parent came by replay) is 2 GPU blocks.
    check_route(&c, &base, (301..=313).collect(), bs, 2 * bs).await;
    check_route(
        &c,
        &base,
        vec![1, 2, 3, 4, 901, 902, 903, 904, 905],
        2 * bs,
        0,
    )
    .await;

    // Counters: every batch decoded, the expected rejections, no gap, no reset.
    let m = get_text(&c, &format!("{base}/metrics")).await;
    let sum = |name: &str| {
        metric_sum(&m, &format!("kvroute_indexer_{name}"))
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    assert_eq!(sum("event_decode_errors_total"), 0.0, "{version}");
    assert_eq!(
        sum("events_rejected_total"),
        pick(&expect["rejected_events"], version).as_f64().unwrap(),
        "{version}: rejected events"
    );
    assert_eq!(sum("replay_failures_total"), 0.0, "{version}");
    assert_eq!(sum("stream_resets_total"), 0.0, "{version}");
    assert_eq!(sum("event_gaps_total"), 0.0, "{version}");
    assert_eq!(
        sum("event_batches_total"),
        expect["batches"].as_f64().unwrap(),
        "{version}"
    );

    publisher.kill();
    drop(idx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_follows_vllm_0_11_0_publisher() {
    indexer_follows_legacy_publisher("0.11.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_follows_vllm_0_23_0_publisher() {
    indexer_follows_legacy_publisher("0.23.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_follows_vllm_0_25_0_publisher() {
    indexer_follows_legacy_publisher("0.25.0").await;
}
