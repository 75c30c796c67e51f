//! Envoy's CPU per streamed request, with and without the kvroute filter (benchmark, `#[ignore]`d;
//! run with `cargo test -p kvroute-filter --release --test bench_filter_cpu -- --ignored --nocapture`,
//! `KVROUTE_FILTER_BUILD=native` for the dynamic module).
//!
//! The routing benchmark's router CPU moves 10-30 % between runs of one line: the simulator, the
//! load generator and the indexer share the machine's two cores with Envoy and change its event
//! batching. Here only Envoy runs the work that is measured: two Envoys (concurrency 1; plain, and
//! with the filter and an instant fake indexer) in front of one upstream that streams every
//! response as server-sent events, one event per write with a pause between (one read per token
//! in Envoy, as with a real engine), the last with `usage`. The same requests go through each
//! Envoy in alternating rounds; each round reads the Envoy process's CPU time (user + system,
//! `/proc/<pid>/stat`) before and after, so the number is Envoy's own (the test's client, upstream
//! and fake indexer run in this process).
//!
//! Rows: token-id completions (the routing benchmark's form) and warm chat, each with every count
//! of events per response in `KVROUTE_CPU_EVENTS` (default `20,200`: the filter's fixed cost per
//! request shows at 20, a typical reply at 200). `KVROUTE_CPU_ROUNDS` sets the rounds (5);
//! `KVROUTE_CPU_FILTER_CONFIG` adds a third Envoy whose filter has these settings merged into the
//! default ones (e.g. `{"complete_hold_ms": 0}`); `KVROUTE_CPU_UDS` one whose indexer cluster is
//! a Unix socket; `KVROUTE_CPU_BASELINE` one more plain Envoy from the routing benchmark's baseline
//! template. Results go to stdout and `<target>/bench/filter-cpu[-native].json`
//! (`cargo xtask bench filter` runs it for both builds and prints the table).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use kvroute_testkit::text::chat_conversation;
use serde_json::{json, Value};

/// Client threads sending at once.
const CLIENTS: usize = 16;
/// Rounds per Envoy (alternating), unless `KVROUTE_CPU_ROUNDS` says otherwise.
const ROUNDS: usize = 5;

fn rounds() -> usize {
    positive_env("KVROUTE_CPU_ROUNDS", ROUNDS)
}

/// Tokens of the first prompt of each token-id session (`KVROUTE_CPU_ID_TOKENS`, default 4000;
/// the routing benchmark's agentic prompts average ~25k).
fn id_prompt_tokens() -> usize {
    positive_env("KVROUTE_CPU_ID_TOKENS", 4000)
}

/// The positive number in environment variable `name`, else `default`.
fn positive_env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// The request header that tells the upstream how many events to stream.
const EVENTS_HEADER: &str = "x-bench-events";

fn event_counts() -> Vec<usize> {
    let list = std::env::var("KVROUTE_CPU_EVENTS").unwrap_or_else(|_| "20,200".into());
    let counts: Vec<usize> = list
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    assert!(
        !counts.is_empty(),
        "KVROUTE_CPU_EVENTS: a list of counts, not {list:?}"
    );
    counts
}

/// An upstream that streams, per request, as many SSE events as its [`EVENTS_HEADER`] asks
/// (200 without it), one write each, `gap` apart.
fn start_streaming_upstream(gap: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let port = listener.local_addr().expect("addr").port();
    thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            thread::spawn(move || serve_streaming(conn, gap));
        }
    });
    port
}

fn serve_streaming(conn: TcpStream, gap: Duration) {
    let _ = conn.set_nodelay(true);
    let Ok(mut w) = conn.try_clone() else { return };
    let mut r = BufReader::new(conn);
    loop {
        let (mut length, mut events) = (0usize, 200usize);
        let mut first = true;
        loop {
            let mut line = String::new();
            match r.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let line = line.trim_end();
            if line.is_empty() && !first {
                break;
            }
            first = false;
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                } else if k.eq_ignore_ascii_case(EVENTS_HEADER) {
                    events = v.trim().parse().unwrap_or(events);
                }
            }
        }
        let mut body = vec![0; length];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        if w.write_all(head.as_bytes()).is_err() {
            return;
        }
        for i in 0..=events {
            let event = if i < events {
                format!("data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\" tok{i}\",\"finish_reason\":null}}],\"usage\":null}}\n\n")
            } else {
                format!("data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[],\"usage\":{{\"prompt_tokens\":8000,\"completion_tokens\":{events},\"total_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":7000}}}}}}\n\ndata: [DONE]\n\n", 8000 + events)
            };
            let chunk = format!("{:x}\r\n{event}\r\n", event.len());
            if w.write_all(chunk.as_bytes()).is_err() {
                return;
            }
            thread::sleep(gap);
        }
        if w.write_all(b"0\r\n\r\n").is_err() {
            return;
        }
    }
}

/// Listens on `path` and forwards every connection to 127.0.0.1:`port`.
fn uds_pump(path: &std::path::Path, port: u16) {
    use std::os::unix::net::UnixListener;
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).expect("bind the unix socket");
    thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let Ok(tcp) = TcpStream::connect(("127.0.0.1", port)) else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (Ok(mut conn2), Ok(mut tcp2)) = (conn.try_clone(), tcp.try_clone()) else {
                continue;
            };
            let (mut conn, mut tcp) = (conn, tcp);
            thread::spawn(move || {
                let _ = std::io::copy(&mut conn, &mut tcp);
            });
            thread::spawn(move || {
                let _ = std::io::copy(&mut tcp2, &mut conn2);
            });
        }
    });
}

/// User + system CPU seconds of process `pid` so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/pid/stat");
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    ticks / 100.0
}

/// Sends every body once through `port` from [`CLIENTS`] threads, each asking for `events`
/// events; returns wall seconds.
fn send_all(port: u16, path: &'static str, bodies: &Arc<Vec<String>>, events: usize) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (next, bodies) = (Arc::clone(&next), Arc::clone(bodies));
            thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(body) = bodies.get(i) else { return };
                let events = events.to_string();
                let r = http(
                    port,
                    "POST",
                    path,
                    &[
                        ("content-type", "application/json"),
                        (EVENTS_HEADER, events.as_str()),
                    ],
                    body.as_bytes(),
                );
                assert_eq!(r.status, 200, "{}", r.text());
                assert!(r.text().contains("[DONE]"), "stream cut short");
            })
        })
        .collect();
    for w in workers {
        w.join().expect("client thread");
    }
    t.elapsed().as_secs_f64()
}

fn token_id_bodies(n: usize, tokens: usize) -> Vec<String> {
    // Sessions of growing prompts, as the routing benchmark's token-id traffic: each body
    // extends an earlier one, so most of its prefix is shared.
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut base: Vec<u32> = Vec::new();
    (0..n)
        .map(|i| {
            if i % 8 == 0 {
                base.clear();
            }
            let grow = if base.is_empty() { tokens } else { 256 };
            for _ in 0..grow {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                base.push((x % 150_000) as u32);
            }
            json!({"model": "qwen3", "prompt": base, "max_tokens": 200, "stream": true,
                   "stream_options": {"include_usage": true}})
            .to_string()
        })
        .collect()
}

fn chat_bodies(n: usize, tokens: usize) -> Vec<String> {
    (0..n as u64)
        .map(|i| {
            let mut body = chat_conversation(tokens as u64 * 7 + 1, tokens, 900_000 + i);
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            body.to_string()
        })
        .collect()
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn envoy_cpu_per_streamed_request() {
    let dir = scratch("bench-filter-cpu");
    let (counts, rounds) = (event_counts(), rounds());
    let upstream = start_streaming_upstream(Duration::from_micros(300));
    let upstream_addr = format!("127.0.0.1:{upstream}");
    let indexer = FakeIndexer::start(
        "qwen3",
        RouteMode::To(upstream_addr.clone()),
        TokenizerMode::Serve,
    );
    // As the real indexer answers without `[peers]`: the filter may hold its completion reports
    // for its next route call (`{"complete_hold_ms": 0}` as the variant gives a fleet's filter).
    indexer.set_report_hold_ms(Some(250));
    let cfg = json!({"route_timeout_ms": 5000, "models": {"qwen3": {}}});
    let start_filtered = |name: &str, cfg: Value, edits: Vec<(String, String)>| {
        let mut opts = EnvoyOptions::new(indexer.server.port, vec![upstream_addr.clone()], cfg);
        opts.yaml_edits = edits;
        Envoy::start(name, &opts, &dir)
    };
    let mut envoys = vec![("plain", {
        let mut plain_opts = EnvoyOptions::new(
            indexer.server.port,
            vec![upstream_addr.clone()],
            cfg.clone(),
        );
        plain_opts.with_filter = false;
        Envoy::start("cpu-plain", &plain_opts, &dir)
    })];
    envoys.push((
        "filter",
        start_filtered("cpu-with", cfg.clone(), Vec::new()),
    ));
    // A variant of the filter's settings beside the default (e.g. `{"report_completion": false}`).
    if let Some(extra) = std::env::var("KVROUTE_CPU_FILTER_CONFIG")
        .ok()
        .and_then(|v| serde_json::from_str::<serde_json::Map<String, Value>>(&v).ok())
    {
        let mut variant = cfg.clone();
        for (k, v) in extra {
            variant[k] = v;
        }
        envoys.push((
            "variant",
            start_filtered("cpu-variant", variant, Vec::new()),
        ));
    }
    // The indexer over a Unix socket (a pump in this process forwards to the fake indexer).
    if std::env::var_os("KVROUTE_CPU_UDS").is_some() {
        let path = dir.join("indexer.sock");
        uds_pump(&path, indexer.server.port);
        let edit = (
            "socket_address: { address: 127.0.0.1, port_value: {{INDEXER_PORT}} }".to_string(),
            format!("pipe: {{ path: {} }}", path.display()),
        );
        envoys.push(("uds", start_filtered("cpu-uds", cfg.clone(), vec![edit])));
    }
    // The routing benchmark's plain Envoy (its own template: no overload manager, one STATIC
    // cluster), to tell what kvroute's Envoy configuration costs apart from the filter.
    let filtered = envoys.len();
    if std::env::var_os("KVROUTE_CPU_BASELINE").is_some() {
        let ports = (free_port(), free_port());
        let yaml = kvroute_testkit::stack::render(
            kvroute_testkit::stack::BASELINE_TEMPLATE,
            &[
                ("LISTEN_PORT", ports.0.to_string()),
                ("ADMIN_PORT", ports.1.to_string()),
                ("LB_POLICY", "ROUND_ROBIN".into()),
                (
                    "LB_ENDPOINTS",
                    kvroute_testkit::stack::loopback_endpoints(&[upstream], false),
                ),
            ],
        )
        .expect("render the baseline template");
        envoys.push((
            "baseline",
            Envoy::start_rendered("cpu-baseline", &yaml, ports, 1, false, &dir),
        ));
    }
    for (_, envoy) in &envoys[1..filtered] {
        envoy.wait_tokenizers(1);
    }

    let id_tokens = id_prompt_tokens();
    let rows: [(String, &'static str, Arc<Vec<String>>); 2] = [
        (
            format!("token ids ~{}k, growing", id_tokens / 1000),
            "/v1/completions",
            Arc::new(token_id_bodies(480, id_tokens)),
        ),
        (
            "chat ~8k, warm".to_string(),
            "/v1/chat/completions",
            Arc::new(chat_bodies(480, 8000)),
        ),
    ];
    println!("{CLIENTS} clients, {rounds} rounds per Envoy");
    let mut results = Vec::new();
    for (events, (name, path, bodies)) in counts
        .iter()
        .flat_map(|&n| rows.iter().map(move |row| (n, row)))
    {
        let path: &'static str = path;
        // Warm-up: connection pools, the segment cache, the page cache.
        for (_, envoy) in &envoys {
            send_all(envoy.port, path, &Arc::new(bodies[..32].to_vec()), events);
        }
        let mut per_request: Vec<Vec<f64>> = vec![Vec::new(); envoys.len()];
        for round in 0..rounds {
            // Every round starts with a different Envoy, so a drift falls on all alike.
            for k in 0..envoys.len() {
                let e = (k + round) % envoys.len();
                let pid = envoys[e].1.proc.pid();
                let before = cpu_seconds(pid);
                send_all(envoys[e].1.port, path, bodies, events);
                per_request[e].push((cpu_seconds(pid) - before) * 1e6 / bodies.len() as f64);
            }
        }
        let medians: Vec<f64> = per_request
            .iter()
            .map(|v| {
                let mut v = v.clone();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            })
            .collect();
        println!(
            "{name}, {events} events: Envoy CPU us per request, median of {rounds} rounds [each round]"
        );
        let mut row = json!({"row": name, "events": events});
        for (e, (label, _)) in envoys.iter().enumerate() {
            println!(
                "  {label:<8} {:>7.0}  {:.2}x plain  {:.0?}",
                medians[e],
                medians[e] / medians[0],
                per_request[e]
            );
            row[*label] = json!({"median_us": medians[e], "rounds_us": per_request[e]});
        }
        results.push(row);
    }
    let with = &envoys[1].1;
    assert!(with.kv("routed") > 0, "the filter routed nothing");
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).expect("mkdir <target>/bench");
    let file = match filter_build() {
        FilterBuild::Wasm => "filter-cpu.json",
        FilterBuild::Native => "filter-cpu-native.json",
    };
    let report = json!({"clients": CLIENTS, "rounds": rounds,
                        "variant": std::env::var("KVROUTE_CPU_FILTER_CONFIG").ok(),
                        "results": results});
    std::fs::write(
        out.join(file),
        serde_json::to_string_pretty(&report).unwrap_or_default(),
    )
    .expect("write the report under <target>/bench");
}
