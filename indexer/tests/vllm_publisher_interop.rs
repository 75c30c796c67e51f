//! The real `kvroute-indexer serve` against vLLM 0.33.0's own `ZmqEventPublisher` (made by
//! `EventPublisherFactory.create` from the release wheel's `kv_events.py`, two DP ranks, replay
//! enabled), publishing `tests/vllm_reference/scenarios/indexer_interop.json`: block hashes of
//! 2^63 and above, raw 32-byte hashes, parents, a `kv_cache_report_mode: full` re-announce,
//! `BlockRemoved`, `AllBlocksCleared` on one rank, CPU offload, LoRA + cache salt extra keys, an
//! unknown parent. Phase 0 is published before the indexer subscribes (it can only arrive through
//! vLLM's ROUTER replay); phase 1 is live. The index must match the scenario's expected end state
//! exactly, with no decode error.

mod procs;

use std::process::Command;
use std::time::Duration;

use procs::*;
use serde_json::{json, Value};

const MODEL: &str = "m";

fn scenario_path() -> std::path::PathBuf {
    workspace().join("tests/vllm_reference/scenarios/indexer_interop.json")
}

/// `ep`, checked to be a loopback TCP endpoint.
fn tcp(ep: &str) -> &str {
    assert!(ep.starts_with("tcp://127.0.0.1:"), "not loopback: {ep}");
    ep
}

fn config_text(sources: &Value, dp: usize, bs: u64, topic: &str) -> String {
    let mut events = Vec::new();
    let mut replay = Vec::new();
    for rank in 0..dp {
        let s = &sources[rank.to_string()];
        events.push(format!(
            "\"{}\"",
            tcp(s["endpoint"].as_str().expect("endpoint"))
        ));
        replay.push(format!(
            "\"{}\"",
            tcp(s["replay_endpoint"].as_str().expect("replay_endpoint"))
        ));
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
        let done = streams_of(&d, "r0").iter().all(|s| {
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

async fn check_expectations(c: &reqwest::Client, base: &str, bs: u64, checks: &Value) -> usize {
    let mut n = 0;
    for check in checks.as_array().expect("expectations") {
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
        assert_eq!(status, 200, "lookup {}: {d}", check["name"]);
        let r = d["replicas"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["replica"] == "r0"))
            .unwrap_or_else(|| panic!("r0 missing in lookup: {d}"));
        for medium in ["gpu", "cpu"] {
            assert_eq!(
                r["blocks"][medium], check[medium],
                "{}: {medium} blocks; lookup answer {d}",
                check["name"]
            );
            assert_eq!(
                r["tokens"][medium].as_u64(),
                check[medium].as_u64().map(|b| b * bs),
                "{}: {medium} tokens",
                check["name"]
            );
        }
        assert_eq!(r["blocks"]["storage"], 0, "{}", check["name"]);
        n += 1;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_follows_vllms_own_publisher_live_and_through_replay() {
    let py = python();
    let pkg = vllm_pkg();
    let scenario: Value =
        serde_json::from_str(&std::fs::read_to_string(scenario_path()).expect("scenario file"))
            .expect("scenario JSON");
    let dp = scenario["data_parallel_size"].as_u64().unwrap() as usize;
    let bs = scenario["block_size"].as_u64().unwrap();
    let topic = scenario["topic"].as_str().unwrap();
    let expect = &scenario["expect"];
    let dir = TempDir::new("vllm-interop");

    // vLLM's publisher binds first and publishes phase 0 at once: nobody is subscribed yet.
    let mut cmd = Command::new(&py);
    cmd.arg(workspace().join("tests/vllm_reference/vllm_publisher.py"))
        .arg("--scenario")
        .arg(scenario_path())
        .arg("--vllm-dir")
        .arg(&pkg)
        .args(["--linger", "120"]);
    let mut publisher =
        Proc::spawn_piped("vllm_publisher.py", cmd, dir.0.join("publisher.log"), true);
    let ready: Value = serde_json::from_str(
        &publisher.wait_line(Duration::from_secs(30), |l| l.contains("\"ready\"")),
    )
    .expect("ready line");
    let sources = &ready["kv_event_sources"];
    let phase0: Value = serde_json::from_str(
        &publisher.wait_line(Duration::from_secs(30), |l| l.contains("\"published\": 0")),
    )
    .unwrap();

    // The late subscriber.
    let cfg = dir.0.join("indexer.toml");
    std::fs::write(&cfg, config_text(sources, dp, bs, topic)).unwrap();
    let (idx, base) = start_indexer(&cfg, &dir.0, &[]);
    let c = client();
    wait_seqs(&c, &base, &phase0["last_seq"], &idx).await;
    let checked0 = check_expectations(&c, &base, bs, &expect["after_phase"][0]).await;

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
    let checked1 = check_expectations(&c, &base, bs, &expect["after_phase"][1]).await;
    assert_eq!(checked0 + checked1, 12);

    // Routing sees the same state: chain C is 1 GPU block + 2 CPU blocks on r0.
    let c_tokens: Vec<u32> = (301..=313).collect();
    let (status, d) = post_json(
        &c,
        &format!("{base}/v1/route"),
        &json!({"model": MODEL, "token_ids": c_tokens}),
    )
    .await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["replica"], "r0");
    assert_eq!(d["matched_tokens"]["gpu"], bs);
    assert_eq!(d["matched_tokens"]["cpu"], 2 * bs);

    // Counters: every batch decoded, the unknown parent rejected, phase 0 came by replay, and
    // AllBlocksCleared is not a reset.
    let d = get_json(&c, &format!("{base}/debug/replicas")).await;
    for s in streams_of(&d, "r0") {
        assert!(s["replays"].as_u64().unwrap() >= 1, "no replay: {s}");
        assert_eq!(s["decode_errors"], 0, "{s}");
    }
    let m = get_text(&c, &format!("{base}/metrics")).await;
    let sum = |name: &str| {
        metric_sum(&m, &format!("kvroute_indexer_{name}"))
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    assert_eq!(sum("event_decode_errors_total"), 0.0);
    assert_eq!(
        sum("events_rejected_total"),
        expect["rejected_events"].as_f64().unwrap()
    );
    assert_eq!(sum("stream_resets_total"), 0.0);
    assert_eq!(sum("event_gaps_total"), 0.0);
    assert_eq!(sum("event_batches_total"), 13.0);

    publisher.kill();
    drop(idx);
}
