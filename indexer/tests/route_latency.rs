//! Measurement (not a test of timing): `POST /v1/route` latency of the real `kvroute-indexer serve`
//! over loopback HTTP, for an 8,192-token prompt sent as `token_ids` (the indexer computes the
//! router keys) and as `router_keys` (what the filter sends), against 8 replicas whose indexes hold
//! the prompt's prefix at different lengths (fed through real ZeroMQ event streams).
//!
//! ```text
//! cargo test --release -p kvroute-indexer --test route_latency -- --ignored --nocapture
//! ```
//!
//! Prints p50/p90/p99/max per body kind; the numbers go in docs/indexer.md.

mod common;
mod procs;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BS: usize = 16;
const PROMPT_TOKENS: usize = 8192;
const REPLICAS: usize = 8;
const WARMUP: usize = 200;
const SAMPLES: usize = 3000;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn measure(
    c: &reqwest::Client,
    url: &str,
    body: &Value,
    label: &str,
) -> (Duration, Duration) {
    let bytes = serde_json::to_vec(body).unwrap();
    let send = || async {
        let r = c
            .post(url)
            .header("content-type", "application/json")
            .body(bytes.clone())
            .send()
            .await
            .expect("route request");
        assert_eq!(r.status(), 200);
        r.bytes().await.expect("route body")
    };
    for _ in 0..WARMUP {
        send().await;
    }
    let mut lat = Vec::with_capacity(SAMPLES);
    let start = Instant::now();
    for _ in 0..SAMPLES {
        let t = Instant::now();
        send().await;
        lat.push(t.elapsed());
    }
    let wall = start.elapsed();
    lat.sort();
    let (p50, p90, p99) = (
        percentile(&lat, 0.50),
        percentile(&lat, 0.90),
        percentile(&lat, 0.99),
    );
    println!(
        "{label:<34} body {:>6} B  p50 {:>7.1} us  p90 {:>7.1} us  p99 {:>7.1} us  max {:>8.1} us  ({:.0} req/s, 1 connection)",
        bytes.len(),
        p50.as_secs_f64() * 1e6,
        p90.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        lat.last().unwrap().as_secs_f64() * 1e6,
        SAMPLES as f64 / wall.as_secs_f64(),
    );
    (p50, p99)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run with --release --ignored --nocapture"]
async fn route_latency_over_loopback() {
    let dir = procs::TempDir::new("route-latency");
    let mut pubs = Vec::new();
    let mut cfg = format!("scrape_interval_ms = 0\n[[models]]\nname = \"m\"\nblock_size = {BS}\n");
    for i in 0..REPLICAS {
        let p = common::Publisher::start(0, 0).await;
        cfg.push_str(&format!(
            "[[models.replicas]]\nname = \"r{i}\"\nhttp = \"127.0.0.1:{}\"\nevents = [\"tcp://127.0.0.1:{}\"]\nreplay = [\"tcp://127.0.0.1:{}\"]\ntopic = \"kv-events\"\n",
            common::free_port(),
            p.pub_port,
            p.replay_port
        ));
        pubs.push(p);
    }
    let cfg_path = dir.0.join("indexer.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let (idx, base) = procs::start_indexer(&cfg_path, &dir.0, &[]);
    let c = procs::client();
    let ok = procs::poll(Duration::from_secs(20), || {
        let c = c.clone();
        let url = format!("{base}/debug/replicas");
        async move {
            let d = procs::get_json(&c, &url).await;
            d["replicas"].as_array().is_some_and(|a| {
                a.len() == REPLICAS && a.iter().all(|r| r["streams"][0]["connected"] == true)
            })
        }
    })
    .await;
    assert!(ok, "replicas never connected: {}", idx.log_tail());
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Replica i holds the first 512 * (REPLICAS - i) / REPLICAS blocks of the prompt, 128 blocks
    // per event batch (engine hashes are arbitrary; router keys come from the tokens).
    let prompt: Vec<u32> = (0..PROMPT_TOKENS as u32)
        .map(|i| 1000 + (i * 7919) % 30_000)
        .collect();
    let blocks = PROMPT_TOKENS / BS;
    for (i, p) in pubs.iter_mut().enumerate() {
        let held = blocks * (REPLICAS - i) / REPLICAS;
        let mut parent = None;
        for start in (0..held).step_by(128) {
            let end = (start + 128).min(held);
            let hashes: Vec<u64> = (start..end)
                .map(|b| ((i as u64) << 32) | (b as u64 + 1))
                .collect();
            p.publish(vec![common::stored(
                &hashes,
                parent,
                &prompt[start * BS..end * BS],
                BS as u32,
            )])
            .await;
            parent = hashes.last().copied();
        }
    }
    // Wait until the index holds it all (r0 has every usable block).
    let lookup_body = json!({"model": "m", "token_ids": prompt});
    let deadline = Instant::now() + Duration::from_secs(20);
    let keys = loop {
        let (_, d) = procs::post_json(&c, &format!("{base}/debug/lookup"), &lookup_body).await;
        if d["replicas"][0]["blocks"]["gpu"].as_u64() == Some((blocks - 1) as u64) {
            break d["router_keys"].clone();
        }
        assert!(Instant::now() < deadline, "index never filled: {d}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let url = format!("{base}/v1/route");
    println!("\n/v1/route over loopback HTTP/1.1 keep-alive, {REPLICAS} replicas, {PROMPT_TOKENS}-token prompt, block size {BS}, {SAMPLES} sequential requests:");
    measure(
        &c,
        &url,
        &json!({"model": "m", "token_ids": prompt}),
        "token_ids (8192 tokens)",
    )
    .await;
    measure(
        &c,
        &url,
        &json!({"model": "m", "router_keys": keys, "num_tokens": PROMPT_TOKENS, "block_size": BS}),
        "router_keys (512 keys, JSON array)",
    )
    .await;
    // What the filter sends: the same keys packed (kvroute_core::packed_keys).
    let key_list: Vec<u64> = serde_json::from_value(keys.clone()).expect("router keys");
    let packed = kvroute_core::packed_keys::encode(&key_list);
    measure(
        &c,
        &url,
        &json!({"model": "m", "router_keys": packed, "num_tokens": PROMPT_TOKENS, "block_size": BS}),
        "router_keys (512 keys, packed)",
    )
    .await;
    let short: Vec<u32> = prompt[..256].to_vec();
    measure(
        &c,
        &url,
        &json!({"model": "m", "token_ids": short}),
        "token_ids (256 tokens)",
    )
    .await;
    let unique: Vec<u32> = (0..PROMPT_TOKENS as u32)
        .map(|i| 40_000 + i % 9000)
        .collect();
    measure(
        &c,
        &url,
        &json!({"model": "m", "token_ids": unique}),
        "token_ids (8192, no cached prefix)",
    )
    .await;
    drop(idx);
}
