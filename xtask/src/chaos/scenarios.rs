//! The chaos scenarios. Each injects one fault or attack into a running stack, bounded in count
//! and time and on loopback only, then checks its own pass criteria and reports the figures it
//! measured (memory peaks, requests answered, time to recover).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::probe::{self, wait_for};
use super::traffic::{chat_body, send_chat, Load, LoadSummary};
use crate::stack::Stack;

/// What a scenario found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The scenario.
    pub name: &'static str,
    /// Figures measured, for the table (`what: value`).
    pub figures: Vec<String>,
    /// Pass criteria that did not hold; empty when the scenario passed.
    pub failures: Vec<String>,
}

impl Report {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            figures: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// Adds a figure.
    pub fn figure(&mut self, text: impl Into<String>) {
        self.figures.push(text.into());
    }

    /// Records a failed criterion unless `holds`.
    fn check(&mut self, holds: bool, criterion: impl Into<String>) {
        if !holds {
            self.failures.push(criterion.into());
        }
    }

    /// True when every criterion held.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The stack under test and how hard to push it.
pub struct Ctx<'a> {
    /// The running stack.
    pub stack: &'a mut Stack,
    /// The short form (for `cargo xtask test`): fewer requests, shorter faults.
    pub short: bool,
    /// The served model.
    pub model: String,
}

impl Ctx<'_> {
    fn scale(&self, short: usize, full: usize) -> usize {
        if self.short {
            short
        } else {
            full
        }
    }

    fn indexer(&self) -> String {
        format!("127.0.0.1:{}", self.stack.ports.indexer)
    }

    fn envoy_admin(&self) -> String {
        format!("127.0.0.1:{}", self.stack.ports.kvroute.1)
    }

    /// Wasm VMs Envoy has created so far (a VM that aborts is replaced by a new one).
    fn vms_created(&self) -> u64 {
        probe::envoy_stats(&self.envoy_admin(), "wasm")
            .map(|stats| {
                stats
                    .iter()
                    .filter(|(name, _)| name.ends_with(".created"))
                    .map(|(_, v)| *v)
                    .sum()
            })
            .unwrap_or(0)
    }

    fn envoy_pids(&self) -> Vec<u32> {
        self.stack.pids("envoy-kvroute")
    }

    fn counter(&self, name: &str) -> u64 {
        self.stack
            .filter_counters()
            .ok()
            .and_then(|c| c.get(name).copied())
            .unwrap_or(0)
    }

    /// Sum of the filter's fail-open counters.
    fn fail_opens(&self) -> u64 {
        self.stack
            .filter_counters()
            .map(|c| {
                c.iter()
                    .filter(|(k, _)| k.starts_with("kvroute.fail_open"))
                    .map(|(_, v)| *v)
                    .sum()
            })
            .unwrap_or(0)
    }
}

/// A scenario: runs against the stack and reports.
pub type Scenario = fn(&mut Ctx) -> Result<Report>;

/// Every scenario, in the order they run; `index_matches_engines` comes last on purpose.
pub const ALL: &[(&str, Scenario)] = &[
    ("spoofed_destination", spoofed_destination),
    ("blocked_paths", blocked_paths),
    ("huge_prompts", huge_prompts),
    ("client_aborts", client_aborts),
    ("slow_uploads", slow_uploads),
    ("indexer_sigstop", indexer_sigstop),
    ("indexer_kill9", indexer_kill9),
    ("replica_kill9_restart", replica_kill9_restart),
    ("hung_replica", hung_replica),
    ("index_matches_engines", index_matches_engines),
];

/// A client-chosen `x-envoy-original-dst-host` never reaches the host it names.
fn spoofed_destination(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("spoofed_destination");
    let trap = TcpListener::bind("127.0.0.1:0").context("binding the trap listener")?;
    trap.set_nonblocking(true)?;
    let trap_addr = trap.local_addr()?.to_string();
    let addr = ctx.stack.kvroute_addr();
    let good = chat_body(&ctx.model, 0, 1, 4);
    let unknown_model = good.replace(&format!("\"{}\"", ctx.model), "\"no-such-model\"");
    let bodies: [(&str, &str); 4] = [
        ("/v1/chat/completions", good.as_str()),
        ("/v1/chat/completions", unknown_model.as_str()),
        ("/v1/chat/completions", "{not json"),
        ("/v1/completions", "{\"model\":1}"),
    ];
    let rounds = ctx.scale(5, 50);
    let mut sent = 0;
    for round in 0..rounds {
        for (path, body) in bodies {
            let header = if round % 2 == 0 {
                "x-envoy-original-dst-host"
            } else {
                "X-Envoy-Original-Dst-Host"
            };
            let _ = crate::http::request(
                "POST",
                &addr,
                path,
                &[("content-type", "application/json"), (header, &trap_addr)],
                body.as_bytes(),
                Duration::from_secs(20),
            )
            .and_then(|resp| resp.text(1 << 20));
            sent += 1;
        }
    }
    let mut reached = 0;
    while trap.accept().is_ok() {
        reached += 1;
    }
    r.figure(format!(
        "{sent} requests naming a trap host, {reached} reached it"
    ));
    r.check(
        reached == 0,
        format!("{reached} connections reached the trap"),
    );
    Ok(r)
}

/// Engine admin paths are not reachable through the public listener.
fn blocked_paths(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("blocked_paths");
    let addr = ctx.stack.kvroute_addr();
    let replica = ctx.stack.replica_addrs()[0].clone();
    let queries_before = probe::metrics_text(&replica)
        .map(|t| crate::stats::metric_sum(&t, "vllm:prefix_cache_queries"))
        .unwrap_or(0.0);
    let mut leaked = Vec::new();
    for (method, path) in [
        ("POST", "/reset_prefix_cache"),
        ("GET", "/kv_event_sources"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("POST", "/v1/load_lora_adapter"),
        ("GET", "/debug/replicas"),
    ] {
        let status = crate::http::request(method, &addr, path, &[], b"", Duration::from_secs(10))
            .map(|resp| resp.status)
            .unwrap_or(0);
        if status != 404 {
            leaked.push(format!("{method} {path} -> {status}"));
        }
    }
    let models = crate::http::get(&addr, "/v1/models", Duration::from_secs(10))
        .map(|(s, _)| s)
        .unwrap_or(0);
    let queries_after = probe::metrics_text(&replica)
        .map(|t| crate::stats::metric_sum(&t, "vllm:prefix_cache_queries"))
        .unwrap_or(0.0);
    r.figure(format!(
        "6 engine/admin paths: {} not answered 404; /v1/models -> {models}",
        leaked.len()
    ));
    r.check(
        leaked.is_empty(),
        format!("reachable: {}", leaked.join(", ")),
    );
    r.check(models == 200, format!("/v1/models answered {models}"));
    r.check(
        queries_after >= queries_before,
        "a replica's prefix-cache counters went backwards (reset reached it)",
    );
    Ok(r)
}

/// A prompt of 3.9 M digits (each its own token for Qwen): answered, no VM abort, memory bounded.
fn huge_prompts(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("huge_prompts");
    let addr = ctx.stack.kvroute_addr();
    let bomb = |digits: usize| {
        serde_json::json!({"model": ctx.model, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "7".repeat(digits)}]})
        .to_string()
    };
    // Over the filter's default body limit (refused unread), and under it (parsed, rendered and
    // stopped while tokenising at the prompt cap).
    let (body, under_limit) = (bomb(3_900_000), bomb(1_900_000));
    let loaded_before = ctx.counter("kvroute.tokenizer_loaded");
    let vms_before = ctx.vms_created();
    let before = probe::memory_of(&ctx.envoy_pids());
    let count = ctx.scale(4, 20);
    let mut statuses = Vec::new();
    for n in 0..count {
        let body = if n % 2 == 0 { &body } else { &under_limit };
        let (status, _) = send_chat(&addr, body, Duration::from_secs(120));
        statuses.push(status);
    }
    // Other clients' small requests while 8 huge prompts arrive at once.
    let concurrent = ctx.scale(4, 8);
    let probe_load = Load::start(&addr, &ctx.model, 10.0, 4);
    thread::sleep(Duration::from_secs(1));
    let small_before = probe_load.finished();
    let answered = Arc::new(AtomicUsize::new(0));
    thread::scope(|s| {
        for _ in 0..concurrent {
            let (addr, body, answered) = (&addr, &body, answered.clone());
            s.spawn(move || {
                if let (Some(status), _) = send_chat(addr, body, Duration::from_secs(120)) {
                    if status == 200 || (400..500).contains(&status) {
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    thread::sleep(Duration::from_secs(1));
    let small = probe_load.stop();
    let during = LoadSummary::of(&small);
    let after = probe::memory_of(&ctx.envoy_pids());
    let loaded_after = ctx.counter("kvroute.tokenizer_loaded");
    let vms_after = ctx.vms_created();
    let bad: Vec<String> = statuses
        .iter()
        .filter(|s| !matches!(s, Some(200) | Some(400..=499)))
        .map(|s| s.map_or("none".to_string(), |s| s.to_string()))
        .collect();
    r.figure(format!(
        "{count} sequential (3.9 and 1.9 M digits in turn): {} answered 200/4xx; {concurrent} concurrent: {} answered",
        count - bad.len(),
        answered.load(Ordering::Relaxed)
    ));
    r.figure(format!(
        "Envoy RSS {:.0} -> {:.0} MiB (peak {:.0} MiB)",
        before.rss_mib, after.rss_mib, after.peak_mib
    ));
    r.figure(format!(
        "small requests meanwhile ({} before the burst): {}",
        small_before,
        during.describe()
    ));
    r.check(bad.is_empty(), format!("statuses: {}", bad.join(", ")));
    r.check(
        answered.load(Ordering::Relaxed) == concurrent,
        "a concurrent huge prompt got a 5xx or no answer",
    );
    r.check(
        loaded_after == loaded_before,
        format!(
            "the filter reloaded its tokenizer ({loaded_before} -> {loaded_after} loads): a VM restarted"
        ),
    );
    r.check(
        vms_after == vms_before,
        format!(
            "Envoy created {} new wasm VMs (a VM aborted)",
            vms_after.saturating_sub(vms_before)
        ),
    );
    r.check(
        after.rss_mib <= before.rss_mib + HUGE_PROMPT_RSS_GROWTH_MIB,
        format!(
            "Envoy grew by {:.0} MiB (bound {HUGE_PROMPT_RSS_GROWTH_MIB} MiB)",
            after.rss_mib - before.rss_mib
        ),
    );
    r.check(
        during.unanswered == 0 && during.other_status == 0,
        "a small request failed during the burst",
    );
    Ok(r)
}

/// How much Envoy may grow over a run of huge prompts: every worker VM's tokenisation working
/// set at the filter's prompt cap (docs/filter.md, memory sizing), with room to spare.
const HUGE_PROMPT_RSS_GROWTH_MIB: f64 = 256.0;

/// Clients that leave before their answer leave no phantom in-flight requests behind: some
/// while the answer streams, some while the filter still waits for the indexer (frozen for it).
fn client_aborts(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("client_aborts");
    let addr = ctx.stack.kvroute_addr();
    let indexer = ctx.indexer();
    let indexer_pid = *ctx
        .stack
        .pids("indexer")
        .first()
        .context("no indexer running")?;
    let count = ctx.scale(20, 200);
    let decided_before = decisions(&indexer);
    // First half: leave once the answer has started.
    let leave = |n: usize, wait_for_answer: bool| -> Result<()> {
        let body = chat_body(&ctx.model, 9, 10_000 + n as u64, 64);
        let mut stream = TcpStream::connect(&addr).context("connecting to Envoy")?;
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             x-request-id: same-id-for-all\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(body.as_bytes())?;
        if wait_for_answer {
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut first = [0u8; 1];
            let _ = stream.read(&mut first);
        } else {
            // Long enough for the filter to have sent its route call, well inside its
            // 100 ms route timeout.
            thread::sleep(Duration::from_millis(25));
        }
        let _ = stream.shutdown(Shutdown::Both);
        Ok(())
    };
    let streamed = count / 2;
    for n in 0..streamed {
        leave(n, true)?;
    }
    // Second half, all at once, while the indexer is frozen: the route calls wait, the clients
    // leave, then the indexer wakes (before the filter's route timeout) and answers calls whose
    // requests are gone.
    probe::signal_group(indexer_pid, libc::SIGSTOP)?;
    let pending = count - streamed;
    thread::scope(|s| {
        for n in streamed..count {
            let leave = &leave;
            s.spawn(move || leave(n, false));
        }
        thread::sleep(Duration::from_millis(50));
        let _ = probe::signal_group(indexer_pid, libc::SIGCONT);
    });
    let _ = probe::signal_group(indexer_pid, libc::SIGCONT);
    thread::sleep(Duration::from_millis(500));
    let decided = decisions(&indexer) - decided_before;
    let limit = Duration::from_secs(if ctx.short { 20 } else { 60 });
    let settled = wait_for(limit, || {
        probe::indexer_in_flight(&indexer).is_ok_and(|v| v == 0.0)
    });
    let left = probe::indexer_in_flight(&indexer).unwrap_or(f64::NAN);
    r.figure(format!(
        "{count} clients left ({streamed} while the answer streamed, {pending} while the route \
         call was pending; one shared x-request-id); {decided} decisions made"
    ));
    r.figure(format!(
        "in flight back to 0 after {}",
        settled.map_or(
            format!("more than {} s ({left} left)", limit.as_secs()),
            |d| { format!("{:.1} s", d.as_secs_f64()) }
        )
    ));
    // Calls that outlived the route timeout never became decisions; at least one of those left
    // while pending must have, or the pending case was not exercised.
    r.check(
        decided > streamed as f64,
        format!(
            "none of the {pending} requests left while pending reached a decision: the pending \
             case was not exercised"
        ),
    );
    r.check(
        settled.is_some(),
        format!("{left} requests still counted in flight"),
    );
    Ok(r)
}

/// Routing decisions the indexer has made so far.
fn decisions(indexer: &str) -> f64 {
    probe::metrics_text(indexer)
        .map(|t| crate::stats::metric_sum(&t, "kvroute_indexer_decisions"))
        .unwrap_or(0.0)
}

/// Uploads that never finish are cut off, and do not hold memory.
fn slow_uploads(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("slow_uploads");
    let addr = ctx.stack.kvroute_addr();
    let count = ctx.scale(20, 150);
    let before = probe::memory_of(&ctx.envoy_pids());
    let mut streams = Vec::with_capacity(count);
    let chunk = vec![b'x'; 256 * 1024];
    for _ in 0..count {
        let mut stream = TcpStream::connect(&addr).context("connecting to Envoy")?;
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: 3900000\r\n\r\n{{\"model\":\"qwen3\",\"messages\":[{{\"role\":\"user\",\"content\":\""
        );
        stream.write_all(head.as_bytes())?;
        let _ = stream.write_all(&chunk);
        stream.set_read_timeout(Some(Duration::from_millis(50)))?;
        streams.push(stream);
    }
    let held = probe::memory_of(&ctx.envoy_pids());
    let started = Instant::now();
    let limit = Duration::from_secs(SLOW_UPLOAD_LIMIT_S);
    let mut open = streams.len();
    let mut closed = vec![false; streams.len()];
    while open > 0 && started.elapsed() < limit && !crate::supervisor::interrupted() {
        for (i, stream) in streams.iter_mut().enumerate() {
            if closed[i] {
                continue;
            }
            let mut buf = [0u8; 4096];
            match stream.read(&mut buf) {
                Ok(0) => {
                    closed[i] = true;
                    open -= 1;
                }
                Ok(_) => {} // a 408 or 400 on its way; the close follows
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => {
                    closed[i] = true;
                    open -= 1;
                }
            }
        }
    }
    let waited = started.elapsed();
    drop(streams);
    r.figure(format!(
        "{count} stalled 3.9 MB uploads: {} cut off within {:.1} s; Envoy RSS {:.0} -> {:.0} MiB while held",
        count - open,
        waited.as_secs_f64(),
        before.rss_mib,
        held.rss_mib
    ));
    r.check(
        open == 0,
        format!("{open} stalled uploads still open after {SLOW_UPLOAD_LIMIT_S} s"),
    );
    Ok(r)
}

/// How long Envoy may keep a stalled upload: the shipped `envoy/envoy.yaml` idle timeouts plus
/// slack (docs/operations.md, Security).
const SLOW_UPLOAD_LIMIT_S: u64 = 90;

/// The indexer frozen under traffic: every request is still answered (fail open).
fn indexer_sigstop(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("indexer_sigstop");
    let pids = ctx.stack.pids("indexer");
    let pid = *pids.first().context("no indexer running")?;
    let opens_before = ctx.fail_opens();
    let stop_for = Duration::from_secs(ctx.scale(3, 20) as u64);
    let load = Load::start(&ctx.stack.kvroute_addr(), &ctx.model, 10.0, 8);
    thread::sleep(Duration::from_secs(2));
    probe::signal_group(pid, libc::SIGSTOP)?;
    thread::sleep(stop_for);
    probe::signal_group(pid, libc::SIGCONT)?;
    thread::sleep(Duration::from_secs(3));
    let outcomes = load.stop();
    let s = LoadSummary::of(&outcomes);
    let opens = ctx.fail_opens() - opens_before;
    r.figure(format!(
        "stopped {} s under 10 req/s: {}; {opens} failed open",
        stop_for.as_secs(),
        s.describe()
    ));
    r.check(
        s.ok == s.sent && s.sent > 0,
        "a request was not answered 200",
    );
    r.check(
        opens > 0,
        "no request failed open while the indexer was stopped",
    );
    Ok(r)
}

/// The indexer killed and restarted under traffic: answered throughout, routing resumes.
fn indexer_kill9(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("indexer_kill9");
    let pid = *ctx
        .stack
        .pids("indexer")
        .first()
        .context("no indexer running")?;
    let load = Load::start(&ctx.stack.kvroute_addr(), &ctx.model, 10.0, 8);
    thread::sleep(Duration::from_secs(2));
    probe::signal_group(pid, libc::SIGKILL)?;
    thread::sleep(Duration::from_secs(2));
    ctx.stack.stop("indexer");
    let restarted = Instant::now();
    ctx.stack.start_indexer("kv")?;
    let routed_before = ctx.counter("kvroute.routed");
    let resumed = wait_for(Duration::from_secs(30), || {
        ctx.counter("kvroute.routed") > routed_before
    })
    .map(|_| restarted.elapsed());
    thread::sleep(Duration::from_secs(2));
    let outcomes = load.stop();
    let s = LoadSummary::of(&outcomes);
    r.figure(format!("killed under 10 req/s: {}", s.describe()));
    r.figure(format!(
        "routing by the indexer again {} after its restart",
        resumed.map_or("never (30 s)".into(), |d| format!(
            "{:.1} s",
            d.as_secs_f64()
        ))
    ));
    r.check(
        s.ok == s.sent && s.sent > 0,
        "a request was not answered 200",
    );
    r.check(resumed.is_some(), "routing did not resume within 30 s");
    Ok(r)
}

/// A replica killed and restarted cold: requests after its death are not sent to it, and its
/// entries leave the index.
fn replica_kill9_restart(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("replica_kill9_restart");
    let victim = 1usize.min(ctx.stack.ports.replicas.len() - 1);
    let name = format!("replica-r{victim}");
    let pid = *ctx
        .stack
        .pids(&name)
        .first()
        .context("victim replica not running")?;
    let load = Load::start(&ctx.stack.kvroute_addr(), &ctx.model, 10.0, 8);
    thread::sleep(Duration::from_secs(2));
    let killed = Instant::now();
    probe::signal_group(pid, libc::SIGKILL)?;
    thread::sleep(Duration::from_secs(4));
    ctx.stack.stop(&name);
    ctx.stack.start_replica(victim)?;
    let back = killed.elapsed();
    thread::sleep(Duration::from_secs(4));
    let outcomes = load.stop();
    let s = LoadSummary::of(&outcomes);
    let kill_at = outcomes
        .first()
        .map(|o| o.sent_at + (Duration::from_secs(2)))
        .unwrap_or_default();
    // Requests sent more than 2 s after the death (the indexer scrapes every 0.5 s and sees the
    // event stream drop) must not fail.
    let late_failures = outcomes
        .iter()
        .filter(|o| o.sent_at > kill_at + Duration::from_secs(2) && o.status != Some(200))
        .count();
    r.figure(format!(
        "r{victim} killed, restarted cold after {:.1} s: {}; {late_failures} failed later than 2 s after the kill",
        back.as_secs_f64(),
        s.describe()
    ));
    r.check(
        late_failures == 0,
        format!("{late_failures} requests failed more than 2 s after the replica died"),
    );
    Ok(r)
}

/// A replica that hangs (SIGSTOP): requests are not held forever, the fleet recovers.
fn hung_replica(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("hung_replica");
    let victim = 2usize.min(ctx.stack.ports.replicas.len() - 1);
    let pid = *ctx
        .stack
        .pids(&format!("replica-r{victim}"))
        .first()
        .context("victim replica not running")?;
    let hang = Duration::from_secs(ctx.scale(5, 30) as u64);
    let load = Load::start(&ctx.stack.kvroute_addr(), &ctx.model, 10.0, 16);
    thread::sleep(Duration::from_secs(2));
    probe::signal_group(pid, libc::SIGSTOP)?;
    thread::sleep(hang);
    probe::signal_group(pid, libc::SIGCONT)?;
    thread::sleep(Duration::from_secs(3));
    let outcomes = load.stop();
    let s = LoadSummary::of(&outcomes);
    r.figure(format!(
        "r{victim} hung {} s under 10 req/s: {}",
        hang.as_secs(),
        s.describe()
    ));
    r.check(s.unanswered == 0, "a request got no answer at all");
    Ok(r)
}

/// After everything above, with traffic stopped: each replica's entries in the index equal the
/// blocks its engine really caches.
fn index_matches_engines(ctx: &mut Ctx) -> Result<Report> {
    let mut r = Report::new("index_matches_engines");
    let indexer = ctx.indexer();
    let replicas = ctx.stack.replica_addrs();
    let mut last = String::new();
    let matched = wait_for(Duration::from_secs(20), || {
        let Ok(index) = probe::metrics_text(&indexer) else {
            return false;
        };
        let mut all_equal = true;
        let mut parts = Vec::new();
        for (i, addr) in replicas.iter().enumerate() {
            let engine = probe::metrics_text(addr)
                .ok()
                .map(|t| crate::stats::metric_sum(&t, "kvroute_sim:cached_blocks"));
            let indexed = probe::metric_with_label(
                &index,
                "kvroute_indexer_replica_index_entries",
                &format!("replica=\"r{i}\""),
            );
            parts.push(format!(
                "r{i} index {} / engine {}",
                indexed.map_or("?".into(), |v| v.to_string()),
                engine.map_or("?".into(), |v| v.to_string())
            ));
            all_equal &= indexed.is_some() && indexed == engine;
        }
        last = parts.join(", ");
        all_equal
    });
    r.figure(last.clone());
    r.check(
        matched.is_some(),
        format!("index and engines differ: {last}"),
    );
    Ok(r)
}
