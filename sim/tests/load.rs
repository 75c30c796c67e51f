//! Load benchmark (ignored by default): how many requests/s and KV events/s one `kvroute-sim`
//! process sustains at `--time-scale 10` with 8k-token prompts, and how much CPU it uses.
//!
//! ```text
//! cargo test -p kvroute-sim --test load -- --ignored --nocapture
//! # one core: prefix with `taskset -c 0`
//! ```
//! Knobs: KVROUTE_LOAD_SECS (default 20), KVROUTE_LOAD_CONCURRENCY (default 64).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{events_config, free_port, metric, Sim};
use serde_json::json;
use zeromq::{Socket, SocketRecv};

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn sustained_load_8k_prompts_time_scale_10() {
    let secs = env_num("KVROUTE_LOAD_SECS", 20);
    let conc = env_num("KVROUTE_LOAD_CONCURRENCY", 64);
    let (p, r) = (free_port(), free_port());
    let s = Sim::start(&[
        "--time-scale",
        "10",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--num-gpu-blocks-override",
        "28672",
        "--kv-events-config",
        &events_config(p, r, ""),
    ]);
    // Count what a subscriber actually receives.
    let received = Arc::new(AtomicU64::new(0));
    let rc = received.clone();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{p}")).await.unwrap();
    sub.subscribe("").await.unwrap();
    tokio::spawn(async move {
        while let Ok(m) = sub.recv().await {
            if let Some(payload) = m.get(2) {
                if let Ok(b) = kvroute_core::events::decode_batch(payload) {
                    rc.fetch_add(b.events.len() as u64, Ordering::Relaxed);
                }
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let c = reqwest::Client::new();
    let cpu0 = cpu_seconds(s.pid());
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let done = Arc::new(AtomicU64::new(0));
    let cached = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..conc {
        let (c, url, done, cached) = (
            c.clone(),
            s.url("/v1/completions"),
            done.clone(),
            cached.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i: u64 = 0;
            while Instant::now() < deadline {
                // 8192-token prompts: 6144 tokens from one of 16 shared prefixes + a unique tail.
                let group = (w * 7919 + i) % 16;
                let mut ids: Vec<u32> = (0..6144u32)
                    .map(|k| 1000 + (group as u32 * 6144 + k) % 30000)
                    .collect();
                ids.extend(
                    (0..2048u32)
                        .map(|k| 1000 + ((w as u32 * 1_000_003 + i as u32 * 8191 + k * 7) % 30000)),
                );
                let body = json!({"model": "qwen3", "prompt": ids, "max_tokens": 16});
                if let Ok(resp) = c.post(&url).json(&body).send().await {
                    if let Ok(v) = resp.json::<serde_json::Value>().await {
                        if v["usage"].is_object() {
                            done.fetch_add(1, Ordering::Relaxed);
                            cached.fetch_add(
                                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                                    .as_u64()
                                    .unwrap_or(0),
                                Ordering::Relaxed,
                            );
                        }
                    }
                }
                i += 1;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds(s.pid()) - cpu0;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = c
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let l = "{engine=\"0\",model_name=\"qwen3\"}";
    let events = metric(&m, &format!("kvroute_sim:kv_events_total{l}")).unwrap_or(0.0);
    let dropped = metric(
        &m,
        &format!("kvroute_sim:kv_event_batches_dropped_total{l}"),
    )
    .unwrap_or(0.0);
    let steps = metric(&m, &format!("kvroute_sim:steps_total{l}")).unwrap_or(0.0);
    let ttft_sum = metric(&m, &format!("vllm:time_to_first_token_seconds_sum{l}")).unwrap_or(0.0);
    let ttft_n = metric(&m, &format!("vllm:time_to_first_token_seconds_count{l}")).unwrap_or(1.0);
    let n = done.load(Ordering::Relaxed) as f64;
    println!(
        "load: {secs}s, concurrency {conc}, 8192-token prompts (6144 shared in 16 groups), max_tokens 16, time-scale 10"
    );
    println!(
        "  requests/s {:.1}  events/s {:.0} (subscriber received {:.0}/s)  steps/s {:.0}  dropped batches {dropped}",
        n / wall,
        events / wall,
        received.load(Ordering::Relaxed) as f64 / wall,
        steps / wall
    );
    println!(
        "  sim CPU {:.2} cores  mean cached tokens {:.0}  mean simulated TTFT {:.3}s",
        cpu / wall,
        cached.load(Ordering::Relaxed) as f64 / n.max(1.0),
        ttft_sum / ttft_n.max(1.0)
    );
    assert!(n > 0.0);
}
