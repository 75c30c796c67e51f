//! Measurement (not a test of timing): one real `kvroute-indexer serve` process following a fleet
//! of 100 synthetic replicas with 30,000 GPU blocks each (issue 15, "fleet scale in one indexer").
//!
//! Every replica is a real ZeroMQ PUB + ROUTER (replay) publisher speaking vLLM 0.33's KV event
//! protocol (`common::Publisher`, kvroute_core's encoder) and an HTTP `/metrics` endpoint with
//! vLLM's metric names and labels (`kvroute_sim::metrics::render`), not a simulator. The run:
//!
//! 1. fill: every replica stores 30,000 blocks (8 of 64 shared 1,024-token system prompts, then
//!    3,072-token conversation tails on them), paced;
//! 2. idle: no events, no routing, for `IDLE_S`: the indexer's CPU time (`/proc/PID/stat`) is the
//!    cost of scraping 100 `/metrics` every second and holding 200 ZeroMQ connections;
//! 3. churn: every replica stores and evicts `CHURN_BLOCKS_PER_S` blocks per second in
//!    `STEPS_PER_S` batches (one per engine step), for `CHURN_S`: the indexer's CPU time again.
//!    The replicas step in lockstep (every replica's batch at each tick, the worst case);
//!    `KVROUTE_FLEET_CHURN=staggered` spreads them over the step (one replica after another,
//!    as independent engines step), at the same rate;
//! 4. route: `ROUTE_SAMPLES` sequential `POST /v1/route` with the router keys of 4,096-token
//!    prompts (256 keys, what the filter sends), during churn.
//!
//! RSS is the indexer's `VmRSS` / `VmHWM` from `/proc/PID/status`. The indexer runs with its
//! default `[scheduling]`; `KVROUTE_FLEET_SCHEDULING=off` turns it off, to compare,
//! `KVROUTE_FLEET_SCHEDULING=noyield` only the event threads' yield, `yield=<us>` sets the event
//! threads' `event_yield_after_us`, `coalesce=<ms>` the event streams' `event_coalesce_ms` (0:
//! the streams on the background runtime, a wake-up per batch), and
//! `KVROUTE_FLEET_SCHEDULING=<us>` the API threads' slice.
//!
//! ```text
//! cargo test --release -p kvroute-indexer --test fleet_scale -- --ignored --nocapture
//! ```
//!
//! The numbers go in docs/performance.md ("Fleet scale in one indexer").

mod common;
mod procs;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::events::KvEvent;
use serde_json::{json, Value};

const REPLICAS: usize = 100;
const GPU_BLOCKS: usize = 30_000;
const BS: usize = 16;
/// Shared system prompts in the fleet, of `PROMPT_BLOCKS` blocks; each replica holds `PROMPTS_PER_REPLICA`.
const SYSTEM_PROMPTS: usize = 64;
const PROMPT_BLOCKS: usize = 64;
const PROMPTS_PER_REPLICA: usize = 8;
/// A conversation tail after its system prompt (3,072 tokens).
const TAIL_BLOCKS: usize = 192;
/// Blocks per event batch while filling.
const FILL_BATCH: usize = 256;
/// Per replica: blocks stored (and as many evicted) per second under churn, in this many batches.
const CHURN_BLOCKS_PER_S: usize = 400;
const STEPS_PER_S: usize = 25;
const IDLE_S: u64 = 30;
const CHURN_S: u64 = 30;
const ROUTE_SAMPLES: usize = 2000;

/// Deterministic token ids of block `block` of sequence `seq` (distinct sequences never share a
/// block's tokens, so router keys differ).
fn tokens(seq: u64, block: usize) -> Vec<u32> {
    (0..BS as u64)
        .map(|i| {
            let mut x = seq
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add((block as u64) << 16 | i);
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 29;
            (x % 150_000) as u32
        })
        .collect()
}

/// Sequence ids: system prompt `p` is `p`; tails are `1 << 40 | replica << 24 | n`.
fn tail_id(replica: usize, n: u64) -> u64 {
    1 << 40 | (replica as u64) << 24 | n
}

/// `/metrics` requests served, over all replicas.
static SCRAPES: AtomicU64 = AtomicU64::new(0);
/// Size of one `/metrics` answer.
static METRICS_BYTES: AtomicU64 = AtomicU64::new(0);

/// Engine block hash of (sequence, block): what vLLM would publish (identical content, identical
/// hash, so shared prompts carry the same hashes on every replica).
fn engine_hash(seq: u64, block: usize) -> u64 {
    seq << 12 | block as u64 | 1 << 63
}

/// One replica's cache: its system prompts and its tails (oldest first), as engine hashes.
struct Replica {
    index: usize,
    publisher: common::Publisher,
    prompts: Vec<usize>,
    tails: VecDeque<(u64, usize)>,
    next_tail: u64,
    /// The tail being written under churn: (id, blocks written so far).
    writing: Option<(u64, usize)>,
    /// The oldest tail's blocks left to evict (evicted from its end, as vLLM's LRU frees leaves).
    evicting: Option<(u64, usize)>,
    held: usize,
}

impl Replica {
    fn parent_prompt(&self, tail: u64) -> usize {
        self.prompts[(tail % PROMPTS_PER_REPLICA as u64) as usize]
    }

    /// The BlockStored events of blocks `from..to` of `seq`, parented on its previous block (a
    /// tail's first block on the last block of its system prompt).
    fn stored(&self, seq: u64, from: usize, to: usize, parent_prompt: Option<usize>) -> KvEvent {
        let hashes: Vec<u64> = (from..to).map(|b| engine_hash(seq, b)).collect();
        let parent = if from > 0 {
            Some(engine_hash(seq, from - 1))
        } else {
            parent_prompt.map(|p| engine_hash(p as u64, PROMPT_BLOCKS - 1))
        };
        let toks: Vec<u32> = (from..to).flat_map(|b| tokens(seq, b)).collect();
        common::stored(&hashes, parent, &toks, BS as u32)
    }

    /// One engine step under churn: `n` new blocks stored, `n` old ones evicted.
    fn churn_step(&mut self, n: usize) -> Vec<KvEvent> {
        let mut events = Vec::new();
        let mut left = n;
        while left > 0 {
            let (id, done) = match self.writing {
                Some(w) => w,
                None => {
                    let id = tail_id(self.index, self.next_tail);
                    self.next_tail += 1;
                    (id, 0)
                }
            };
            let k = left.min(TAIL_BLOCKS - done);
            let prompt = self.parent_prompt(id);
            events.push(self.stored(id, done, done + k, Some(prompt)));
            left -= k;
            if done + k == TAIL_BLOCKS {
                self.tails.push_back((id, TAIL_BLOCKS));
                self.writing = None;
            } else {
                self.writing = Some((id, done + k));
            }
        }
        let mut left = n;
        let mut removed = Vec::with_capacity(n);
        while left > 0 {
            let (id, remaining) = match self.evicting {
                Some(e) => e,
                None => match self.tails.pop_front() {
                    Some(t) => t,
                    None => break,
                },
            };
            let k = left.min(remaining);
            removed.extend((remaining - k..remaining).map(|b| engine_hash(id, b)));
            left -= k;
            self.evicting = (remaining > k).then_some((id, remaining - k));
        }
        if !removed.is_empty() {
            events.push(common::removed(&removed));
        }
        events
    }
}

fn cpu_seconds(pid: u32, ticks_per_s: f64) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, i.e. 12 and 13 after the state field (3).
    let utime: f64 = f[11].parse().expect("utime");
    let stime: f64 = f[12].parse().expect("stime");
    (utime + stime) / ticks_per_s
}

fn clock_ticks() -> f64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .expect("getconf CLK_TCK");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("CLK_TCK is a number")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn rss(pid: u32) -> (u64, u64) {
    (
        procs::proc_status_bytes(pid, "VmRSS").unwrap_or(0),
        procs::proc_status_bytes(pid, "VmHWM").unwrap_or(0),
    )
}

/// A `/metrics` endpoint in vLLM's format for one replica (a busy engine's values; the text is
/// re-rendered on every scrape, as vLLM's prometheus_client does).
async fn metrics_server(replica: usize) -> u16 {
    let start = 1.7e9 + replica as f64;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || async move {
            SCRAPES.fetch_add(1, Ordering::Relaxed);
            let mut e = kvroute_sim::metrics::EngineMetrics::new(40_960);
            e.cache_blocks = (GPU_BLOCKS, BS);
            e.running = 8 + replica % 5;
            e.waiting = replica % 3;
            e.kv_usage = 0.93;
            e.prefix_cache_queries = 10_000_000;
            e.prefix_cache_hits = 6_000_000;
            e.prompt_tokens = 10_000_000;
            e.generation_tokens = 2_000_000;
            e.requests_finished = 5_000;
            for i in 0..200 {
                e.ttft.observe(0.05 + i as f64 * 0.001);
                e.e2e.observe(2.0 + i as f64 * 0.01);
                e.itl.observe(0.02);
            }
            let text = kvroute_sim::metrics::render("m", &[e], start);
            METRICS_BYTES.store(text.len() as u64, Ordering::Relaxed);
            text
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind /metrics");
    let port = listener.local_addr().expect("local addr").port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

/// The upper bound of the bucket holding quantile `q` of the Prometheus histogram `name` in
/// `text` (no labels), seconds; infinity when it is the overflow bucket.
fn histogram_quantile(text: &str, name: &str, q: f64) -> f64 {
    let prefix = format!("{name}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map_or(f64::NAN, |b| b.0)
}

/// Prints `label: p50 .. us, p90 .. us, p99 .. us, max .. us` of `sorted` (ascending).
fn print_quantiles(label: &str, sorted: &[Duration]) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{label}: p50 {:.0} us, p90 {:.0} us, p99 {:.0} us, max {:.0} us",
        us(percentile(sorted, 0.50)),
        us(percentile(sorted, 0.90)),
        us(percentile(sorted, 0.99)),
        us(*sorted.last().expect("samples")),
    );
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[test]
#[ignore = "measurement (~2 min); run with --release --ignored --nocapture"]
fn one_indexer_follows_100_replicas_of_30k_blocks() {
    // The 100 replicas' publishers and `/metrics` servers stand for 100 other machines: their
    // threads run at a lower priority, so that on this shared CPU they take what the indexer and
    // the route client leave. The indexer and the client are started from this thread, at the
    // default priority (a process or thread inherits its creator's).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_start(|| {
            if let Err(e) = kvroute_testkit::process::lower_this_threads_priority(10) {
                eprintln!("replica threads keep the default priority: {e}");
            }
        })
        .enable_all()
        .build()
        .expect("replicas' runtime");
    let dir = procs::TempDir::new("fleet-scale");
    let (replicas, cfg_path) = rt.block_on(start_replicas(&dir.0));
    let (idx, base) = procs::start_indexer(&cfg_path, &dir.0, &[]);
    let (jobs, job) = std::sync::mpsc::channel::<RouteJob>();
    let client = std::thread::spawn(move || {
        let job = job.recv().expect("a route job");
        route_client(job)
    });
    rt.block_on(measure(replicas, idx, base, jobs, client));
}

/// What the route client sends, and where.
struct RouteJob {
    route_url: String,
    health_url: String,
    bodies: Vec<Vec<u8>>,
}

/// One route call: its time at the client and inside the indexer (its `Server-Timing`).
#[derive(Clone, Copy)]
struct RouteSample {
    client: Duration,
    inside: Duration,
    /// Its part in the index lookup, waiting for the index included.
    index: Duration,
}

/// `ROUTE_SAMPLES` sequential route calls (after 200 warm-up ones), each after a `/healthz`
/// control; returns the route calls and the controls.
fn route_client(job: RouteJob) -> (Vec<RouteSample>, Vec<Duration>) {
    let RouteJob {
        route_url,
        health_url,
        bodies,
    } = job;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    rt.block_on(async move {
        let c = procs::client();
        let mut lat = Vec::with_capacity(ROUTE_SAMPLES);
        let mut floor = Vec::with_capacity(ROUTE_SAMPLES);
        for i in 0..ROUTE_SAMPLES + 200 {
            // The control: the same client's round trip to `/healthz`, which does nothing.
            let t = Instant::now();
            let r = c.get(&health_url).send().await.expect("healthz");
            assert!(r.status().is_success());
            r.bytes().await.expect("healthz body");
            if i >= 200 {
                floor.push(t.elapsed());
            }
            let body = bodies[i % bodies.len()].clone();
            let t = Instant::now();
            let r = c
                .post(&route_url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("route request");
            assert_eq!(r.status(), 200);
            let timing = |name| {
                common::server_timing(r.headers(), name).unwrap_or_else(|| {
                    panic!(
                        "route answer without its Server-Timing {name}: {:?}",
                        r.headers()
                    )
                })
            };
            let (inside, index) = (timing("route"), timing("index"));
            let answer: Value = r.json().await.expect("route answer");
            if i >= 200 {
                lat.push(RouteSample {
                    client: t.elapsed(),
                    inside,
                    index,
                });
            }
            assert!(
                answer["replica"].is_string() || answer["endpoint"].is_string(),
                "{answer}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        (lat, floor)
    })
}

/// The replicas' publishers and metrics servers, and the indexer's configuration for them.
async fn start_replicas(dir: &std::path::Path) -> (Vec<Replica>, std::path::PathBuf) {
    let mut replicas = Vec::with_capacity(REPLICAS);
    let mut cfg = format!("[[models]]\nname = \"m\"\nblock_size = {BS}\n");
    for i in 0..REPLICAS {
        let publisher = common::Publisher::start(0, 0).await;
        let http = metrics_server(i).await;
        cfg.push_str(&format!(
            "[[models.replicas]]\nname = \"r{i}\"\nhttp = \"127.0.0.1:{http}\"\nevents = [\"tcp://127.0.0.1:{}\"]\nreplay = [\"tcp://127.0.0.1:{}\"]\ntopic = \"kv-events\"\n",
            publisher.pub_port, publisher.replay_port
        ));
        replicas.push(Replica {
            index: i,
            publisher,
            prompts: (0..PROMPTS_PER_REPLICA)
                .map(|k| (i * PROMPTS_PER_REPLICA + k * 7) % SYSTEM_PROMPTS)
                .collect(),
            tails: VecDeque::new(),
            next_tail: 0,
            writing: None,
            evicting: None,
            held: 0,
        });
    }
    // `KVROUTE_FLEET_SCHEDULING=off`: the kernel's defaults for every thread, to compare; a
    // number: that API slice in microseconds.
    match std::env::var("KVROUTE_FLEET_SCHEDULING").as_deref() {
        Ok("off") => cfg.push_str(
            "[scheduling]\napi_slice_us = 0\nbackground_batch = false\nevent_yield_after_us = 0\nevent_coalesce_ms = 0\n",
        ),
        Ok(us) if us.parse::<u64>().is_ok() => {
            cfg.push_str(&format!("[scheduling]\napi_slice_us = {us}\n"))
        }
        Ok("noyield") => cfg.push_str("[scheduling]\nevent_yield_after_us = 0\n"),
        Ok(other) if other.starts_with("coalesce=") => cfg.push_str(&format!(
            "[scheduling]\nevent_coalesce_ms = {}\n",
            &other["coalesce=".len()..]
        )),
        Ok(other) if other.starts_with("yield=") => cfg.push_str(&format!(
            "[scheduling]\nevent_yield_after_us = {}\n",
            &other["yield=".len()..]
        )),
        _ => {}
    }
    // Defaults otherwise: scrape_interval_ms 1000, index.max_bytes 1 GiB (not reached here),
    // `[scheduling]` (the API's threads ask for a 0.4 ms slice, event intake runs SCHED_BATCH).
    let cfg_path = dir.join("indexer.toml");
    std::fs::write(&cfg_path, &cfg).expect("write config");
    (replicas, cfg_path)
}

async fn measure(
    mut replicas: Vec<Replica>,
    idx: procs::Proc,
    base: String,
    jobs: std::sync::mpsc::Sender<RouteJob>,
    client: std::thread::JoinHandle<(Vec<RouteSample>, Vec<Duration>)>,
) {
    let ticks = clock_ticks();
    let pid = idx.pid();
    let c = procs::client();
    let connected = procs::poll(Duration::from_secs(60), || {
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
    assert!(connected, "replicas never connected: {}", idx.log_tail());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_empty, _) = rss(pid);

    // 1. Fill, replica by replica, paced so the PUB queues never overflow.
    let fill_start = Instant::now();
    for r in replicas.iter_mut() {
        let mut batch = Vec::new();
        for p in r.prompts.clone() {
            for from in (0..PROMPT_BLOCKS).step_by(FILL_BATCH) {
                let to = (from + FILL_BATCH).min(PROMPT_BLOCKS);
                batch.push(r.stored(p as u64, from, to, None));
            }
            r.held += PROMPT_BLOCKS;
        }
        r.publisher.publish(std::mem::take(&mut batch)).await;
        while r.held + TAIL_BLOCKS <= GPU_BLOCKS {
            let id = tail_id(r.index, r.next_tail);
            r.next_tail += 1;
            let prompt = r.parent_prompt(id);
            for from in (0..TAIL_BLOCKS).step_by(FILL_BATCH) {
                let to = (from + FILL_BATCH).min(TAIL_BLOCKS);
                let ev = r.stored(id, from, to, Some(prompt));
                r.publisher.publish(vec![ev]).await;
            }
            r.tails.push_back((id, TAIL_BLOCKS));
            r.held += TAIL_BLOCKS;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let held: usize = replicas.iter().map(|r| r.held).sum();
    let metrics_url = format!("{base}/metrics");
    let want_entries = held as f64;
    let deadline = Instant::now() + Duration::from_secs(120);
    let (filled, entries) = loop {
        let text = procs::get_text(&c, &metrics_url).await;
        let got = kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_index_entries");
        if got >= want_entries || Instant::now() >= deadline {
            break (got >= want_entries, got);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let fill_s = fill_start.elapsed().as_secs_f64();
    let text = procs::get_text(&c, &metrics_url).await;
    let blocks = kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_index_blocks");
    let index_bytes = kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_index_bytes");
    let gaps = kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_event_gaps_total");
    let replays = kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_replays_total");
    assert!(
        filled,
        "index never filled: {entries} of {want_entries} entries\n{}",
        idx.log_tail()
    );
    let (rss_full, _) = rss(pid);
    println!(
        "\nfleet: {REPLICAS} replicas x {GPU_BLOCKS} GPU blocks (block size {BS}); filled {held} (block, replica) entries in {fill_s:.1} s"
    );
    println!(
        "index: {entries:.0} entries over {blocks:.0} distinct blocks, bytes_estimate {:.1} MiB; gaps {gaps:.0}, replays {replays:.0}",
        mib(index_bytes as u64)
    );
    println!(
        "indexer RSS: {:.1} MiB before fill, {:.1} MiB full",
        mib(rss_empty),
        mib(rss_full)
    );

    // 2. Idle: scrapes only.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let scrapes_before = SCRAPES.load(Ordering::Relaxed);
    let cpu0 = cpu_seconds(pid, ticks);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(IDLE_S)).await;
    let idle_cpu = (cpu_seconds(pid, ticks) - cpu0) / t0.elapsed().as_secs_f64();
    let scrapes = SCRAPES.load(Ordering::Relaxed) - scrapes_before;
    let failures = kvroute_testkit::prom::counter_sum(
        &procs::get_text(&c, &metrics_url).await,
        "kvroute_indexer_scrape_failures_total",
    );
    println!(
        "idle ({IDLE_S} s, no events, no routing; scrape_interval_ms 1000): indexer CPU {idle_cpu:.4} cores; {scrapes} /metrics scrapes served ({} B each), {failures:.0} scrape failures",
        METRICS_BYTES.load(Ordering::Relaxed)
    );

    // 3. Churn: every replica stores and evicts CHURN_BLOCKS_PER_S blocks/s, STEPS_PER_S batches/s.
    let per_step = CHURN_BLOCKS_PER_S / STEPS_PER_S;
    let step = Duration::from_secs_f64(1.0 / STEPS_PER_S as f64);
    let staggered = std::env::var("KVROUTE_FLEET_CHURN").as_deref() == Ok("staggered");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let churner = tokio::spawn(async move {
        // Lockstep: every replica's step at each tick. Staggered: one replica per 1/REPLICAS of
        // a step, in turn (the same rate).
        let mut tick = tokio::time::interval(if staggered {
            step / REPLICAS as u32
        } else {
            step
        });
        // Staggered ticks are finer than the timer's 1 ms: those it misses fire at once.
        tick.set_missed_tick_behavior(if staggered {
            tokio::time::MissedTickBehavior::Burst
        } else {
            tokio::time::MissedTickBehavior::Delay
        });
        let mut steps = 0u64;
        let mut late = 0u64;
        let started = Instant::now();
        let mut next = 0usize;
        while !*stop_rx.borrow() {
            tick.tick().await;
            let batch = if staggered { 1 } else { REPLICAS };
            for _ in 0..batch {
                let r = &mut replicas[next];
                next = (next + 1) % REPLICAS;
                let events = r.churn_step(per_step);
                r.publisher.publish(events).await;
                // The publisher keeps a replay buffer; keep it to the last ~10 s of batches.
                let keep = r.publisher.next_seq.saturating_sub(STEPS_PER_S as u64 * 10);
                r.publisher.forget_before(keep);
            }
            if next != 0 {
                continue;
            }
            steps += 1;
            let due = started.elapsed().as_secs_f64() * STEPS_PER_S as f64;
            if (steps as f64) + 2.0 < due {
                late += 1;
            }
        }
        (steps, late, started.elapsed(), replicas)
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0 = cpu_seconds(pid, ticks);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(CHURN_S)).await;
    let churn_cpu = (cpu_seconds(pid, ticks) - cpu0) / t0.elapsed().as_secs_f64();

    // 4. Route, during churn: 4,096-token prompts = system prompt + tail of replica k.
    let mut bodies: Vec<Value> = Vec::new();
    for k in 0..8u64 {
        let replica = (k as usize * 13) % REPLICAS;
        let prompt_id = ((replica * PROMPTS_PER_REPLICA) % SYSTEM_PROMPTS) as u64;
        let toks: Vec<u32> = (0..PROMPT_BLOCKS)
            .flat_map(|b| tokens(prompt_id, b))
            .chain((0..TAIL_BLOCKS).flat_map(|b| tokens(tail_id(0, 1_000_000 + k), b)))
            .collect();
        let (status, d) = procs::post_json(
            &c,
            &format!("{base}/debug/lookup"),
            &json!({"model": "m", "token_ids": toks}),
        )
        .await;
        assert_eq!(status, 200, "lookup: {d}");
        bodies.push(json!({
            "model": "m",
            "router_keys": d["router_keys"].clone(),
            "num_tokens": toks.len(),
            "block_size": BS,
        }));
    }
    let route_url = format!("{base}/v1/route");
    let health_url = format!("{base}/healthz");
    let bytes: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| serde_json::to_vec(b).expect("body"))
        .collect();
    jobs.send(RouteJob {
        route_url,
        health_url,
        bodies: bytes,
    })
    .expect("route client waiting");
    let (samples, mut floor) =
        tokio::task::spawn_blocking(move || client.join().expect("route client"))
            .await
            .expect("route client thread");
    stop_tx.send(true).expect("stop churn");
    let (steps, late, churn_wall, _replicas) = churner.await.expect("churn task");
    let (rss_end, hwm) = rss(pid);
    let mut lat: Vec<Duration> = samples.iter().map(|s| s.client).collect();
    let mut inside_each: Vec<Duration> = samples.iter().map(|s| s.inside).collect();
    let mut index_each: Vec<Duration> = samples.iter().map(|s| s.index).collect();
    lat.sort();
    inside_each.sort();
    index_each.sort();
    floor.sort();
    let text = procs::get_text(&c, &metrics_url).await;
    println!(
        "churn: {CHURN_BLOCKS_PER_S} blocks/s stored + {CHURN_BLOCKS_PER_S} evicted per replica in {STEPS_PER_S} batches/s ({} stored blocks/s fleet-wide); {steps} steps in {:.1} s ({late} late); indexer CPU {churn_cpu:.3} cores over {CHURN_S} s; gaps {:.0}, replays {:.0}",
        CHURN_BLOCKS_PER_S * REPLICAS,
        churn_wall.as_secs_f64(),
        kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_event_gaps_total"),
        kvroute_testkit::prom::counter_sum(&text, "kvroute_indexer_replays_total"),
    );
    print_quantiles(
        &format!("route (router_keys of 4,096-token prompts, 256 keys, during churn, {ROUTE_SAMPLES} sequential)"),
        &lat,
    );
    print_quantiles(
        "control: the same client's GET /healthz between them",
        &floor,
    );
    print_quantiles(
        "route inside the indexer, per call (its Server-Timing)",
        &inside_each,
    );
    print_quantiles(
        "  of which the index lookup, waiting for the index included",
        &index_each,
    );
    // The client's tail taken apart: of its slowest 1 % of calls, how many were slow inside.
    let mut slowest = samples.clone();
    slowest.sort_by_key(|s| std::cmp::Reverse(s.client));
    slowest.truncate((ROUTE_SAMPLES / 100).max(1));
    let slow = |d: Duration| d >= Duration::from_micros(500);
    let slow_inside = slowest.iter().filter(|s| slow(s.inside)).count();
    let slow_index = slowest.iter().filter(|s| slow(s.index)).count();
    println!(
        "the client's slowest {} calls ({:.0}-{:.0} us): {slow_inside} spent >= 500 us inside the indexer ({slow_index} of them in the index lookup, waiting included), {} less",
        slowest.len(),
        slowest.last().expect("samples").client.as_secs_f64() * 1e6,
        slowest[0].client.as_secs_f64() * 1e6,
        slowest.len() - slow_inside,
    );
    let inside = |q| histogram_quantile(&text, "kvroute_indexer_route_duration_seconds", q) * 1e6;
    println!(
        "route inside the indexer (its route_duration_seconds histogram, bucket bounds, 200 warm-up calls included): p50 <= {:.0} us, p90 <= {:.0} us, p99 <= {:.0} us",
        inside(0.50),
        inside(0.90),
        inside(0.99),
    );
    println!(
        "indexer RSS: {:.1} MiB at the end, peak (VmHWM) {:.1} MiB",
        mib(rss_end),
        mib(hwm)
    );
    println!(
        "goals: RSS < 256 MiB: {}; idle CPU < 0.1 core: {}; route p99 < 1 ms: {}",
        if hwm < 256 << 20 { "met" } else { "MISSED" },
        if idle_cpu < 0.1 { "met" } else { "MISSED" },
        if percentile(&lat, 0.99) < Duration::from_millis(1) {
            "met"
        } else {
            "MISSED"
        },
    );
    drop(idx);
}
