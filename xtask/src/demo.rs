//! `cargo xtask demo`: the whole stack on loopback, and kvroute side by side with Envoy's round
//! robin on the same shared-prefix chat workload.
//!
//! 1. setup (tokenizer, venv, Envoy), release builds of the simulator, the indexer and the filter;
//! 2. 4 `kvroute-sim` replicas, the indexer and Envoy with the filter;
//! 3. the workload through kvroute;
//! 4. the replicas restarted cold, the same workload through a plain Envoy with ROUND_ROBIN;
//! 5. a table on the terminal, `<target>/demo/summary.json`, and everything stopped (also on
//!    Ctrl-C), unless `--keep`.

use std::collections::BTreeMap;
use std::fs;
use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use crate::chat_traffic::{self, ChatWorkload, Progress, Target};
use crate::paths::Layout;
use crate::prepare::PrepareOptions;
use crate::stack::{Binaries, Stack, StackConfig};
use crate::stats::PolicySummary;
use crate::supervisor;

/// Options of `cargo xtask demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoOptions {
    /// Leave the kvroute stack running at the end and print a curl line to try it.
    #[arg(long)]
    pub keep: bool,
    /// Setup and builds.
    #[command(flatten)]
    pub prepare: PrepareOptions,
    /// Only run kvroute (no round-robin comparison).
    #[arg(long)]
    pub kvroute_only: bool,
    /// Replicas.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// KV cache capacity of each replica, in 16-token blocks.
    #[arg(long, default_value_t = 400)]
    pub gpu_blocks: usize,
    /// The simulator's speed-up over real time (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Groups of users sharing one system prompt.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    /// Users (sessions) per group.
    #[arg(long, default_value_t = 16)]
    pub users: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Words in each system prompt (~1.3 tokens per word).
    #[arg(long, default_value_t = 1200)]
    pub system_words: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sessions start within this many seconds.
    #[arg(long, default_value_t = 40)]
    pub arrival_window_s: u64,
    /// Pause between a reply and the next turn, ms.
    #[arg(long, default_value_t = 500)]
    pub think_ms: u64,
    /// Concurrent client connections at most.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs the demo.
pub fn run(layout: &Layout, opts: &DemoOptions) -> Result<()> {
    supervisor::install_ctrl_c()?;
    if opts.replicas == 0 || opts.groups == 0 || opts.users == 0 || opts.turns == 0 {
        bail!("--replicas, --groups, --users and --turns must be at least 1");
    }
    opts.prepare.run(layout)?;

    let demo_dir = layout.target_dir.join("demo");
    let workload = ChatWorkload {
        model: "qwen3".to_string(),
        groups: opts.groups,
        users_per_group: opts.users,
        turns: opts.turns,
        system_prompt_words: opts.system_words,
        user_message_words: 40,
        max_tokens: opts.max_tokens,
        arrival_window: Duration::from_secs(opts.arrival_window_s),
        think_time: Duration::from_millis(opts.think_ms),
        seed: opts.seed,
    };
    let cfg = StackConfig {
        replicas: opts.replicas,
        model: workload.model.clone(),
        model_dir: layout.model_dir(),
        block_size: 16,
        gpu_blocks: opts.gpu_blocks,
        time_scale: opts.time_scale,
        hash_algo: "sha256_cbor".to_string(),
        envoy_concurrency: 2,
        sim_args: Vec::new(),
        scoring: Vec::new(),
        index: Vec::new(),
        filter: Vec::new(),
    };
    let mut stack = Stack::new(
        layout,
        cfg,
        Binaries::new(layout, opts.prepare.profile()),
        demo_dir.clone(),
        !opts.keep,
    )?;

    println!(
        "xtask demo: workload: {} groups x {} users x {} turns = {} chat requests, ~{} word system prompts, {} output tokens, sessions arriving over {}s",
        workload.groups,
        workload.users_per_group,
        workload.turns,
        workload.total_requests(),
        workload.system_prompt_words,
        workload.max_tokens,
        opts.arrival_window_s
    );
    println!(
        "xtask demo: stack: {} kvroute-sim replicas ({} KV blocks of 16 tokens each, time scale {}), logs in {}",
        opts.replicas,
        opts.gpu_blocks,
        opts.time_scale,
        demo_dir.join("logs").display()
    );

    step("starting replicas, indexer and Envoy with the kvroute filter");
    // The indexer snapshots its index (docs/indexer.md), so a restarted indexer resumes warm; a
    // previous demo's snapshot describes other processes and is removed.
    let snapshot = demo_dir.join("indexer.snap");
    let _ = fs::remove_file(&snapshot);
    stack.indexer_snapshot = Some(snapshot);
    stack.start_replicas()?;
    stack.start_indexer("kv")?;
    stack.start_kvroute_envoy()?;
    // Prompts (event and replay sockets) and admin endpoints stay on loopback.
    stack.check_loopback_only()?;

    let mut results: Vec<(&str, PolicySummary)> = Vec::new();
    let filter_before = stack.filter_counters().unwrap_or_default();
    let kvroute_addr = stack.kvroute_addr();
    let kv = run_policy(
        &mut stack,
        "kvroute",
        &kvroute_addr,
        &workload,
        opts,
        &demo_dir,
    )?;
    let filter_after = stack.filter_counters().unwrap_or_default();
    results.push(("kvroute", kv));

    if !opts.kvroute_only {
        step("restarting the replicas cold; starting Envoy with ROUND_ROBIN");
        stack.stop_replicas();
        stack.start_replicas()?;
        stack.start_baseline_envoy("ROUND_ROBIN")?;
        let baseline_addr = stack.baseline_addr();
        let rr = run_policy(
            &mut stack,
            "round_robin",
            &baseline_addr,
            &workload,
            opts,
            &demo_dir,
        )?;
        results.push(("round_robin", rr));
        stack.stop("envoy-baseline");
    }

    print_table(&results);
    print_filter_counters(&filter_before, &filter_after);
    let summary: serde_json::Map<String, serde_json::Value> = results
        .iter()
        .map(|(name, s)| Ok((name.to_string(), serde_json::to_value(s)?)))
        .collect::<Result<_>>()?;
    let summary_path = demo_dir.join("summary.json");
    fs::write(
        &summary_path,
        serde_json::to_string_pretty(&summary)? + "\n",
    )
    .with_context(|| format!("writing {}", summary_path.display()))?;
    println!("xtask demo: wrote {}", summary_path.display());

    if opts.keep {
        let addr = stack.kvroute_addr();
        let ports = stack.ports.clone();
        let pids = stack.detach();
        println!("\nxtask demo: --keep: the kvroute stack is still running:");
        for (pid, name) in &pids {
            println!("    {name:<16} pid {pid}");
        }
        println!("\nPorts, all on 127.0.0.1 (docs/operations.md#security says what each carries):");
        println!(
            "    {:<16} {} (clients: the OpenAI API)",
            "Envoy listener", ports.kvroute.0
        );
        println!(
            "    {:<16} {} (stats; unauthenticated admin)",
            "Envoy admin", ports.kvroute.1
        );
        println!(
            "    {:<16} {} (/v1/route, /metrics, /readyz, /debug/replicas, /debug/lookup)",
            "indexer HTTP", ports.indexer
        );
        for (i, p) in ports.replicas.iter().enumerate() {
            println!(
                "    {:<16} HTTP {}, KV events PUB {}, replay ROUTER {} (events carry prompt tokens)",
                format!("replica r{i}"),
                p.http,
                p.events,
                p.replay
            );
        }
        println!(
            "\nTry it:\n  curl -sN http://{addr}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"qwen3\",\"stream\":true,\"max_tokens\":32,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
        );
        let script = demo_dir.join("stop.sh");
        fs::write(&script, stop_script(&pids, &ports))
            .with_context(|| format!("writing {}", script.display()))?;
        println!(
            "Stop it (also stops a process restarted by hand on one of these ports):\n  sh {}",
            script.display()
        );
    } else {
        step("stopping everything");
    }
    Ok(())
}

/// A shell script that stops the kept stack: its process groups, then whatever still listens on
/// one of its ports (a replica or indexer someone restarted, which is in no recorded group).
fn stop_script(pids: &[(u32, String)], ports: &crate::stack::Ports) -> String {
    let groups: Vec<String> = pids.iter().map(|(pid, _)| format!("-{pid}")).collect();
    let mut all = vec![ports.indexer, ports.kvroute.0, ports.kvroute.1];
    for p in &ports.replicas {
        all.extend([p.http, p.events, p.replay]);
    }
    let all: Vec<String> = all.iter().map(u16::to_string).collect();
    format!(
        r#"#!/bin/sh
# Written by `cargo xtask demo --keep`: stops the kept stack.
kill -TERM -- {groups} 2>/dev/null
for i in 1 2 3 4 5 6 7 8 9 10; do
  alive=0
  for g in {groups}; do kill -0 -- "$g" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && break
  sleep 1
done
for port in {ports}; do
  hex=$(printf ':%04X' "$port")
  for inode in $(awk -v p="$hex" '$4 == "0A" && substr($2, length($2) - 4) == p {{ print $10 }}' /proc/net/tcp /proc/net/tcp6 2>/dev/null); do
    for fd in /proc/[0-9]*/fd/*; do
      if [ "$(readlink "$fd" 2>/dev/null)" = "socket:[$inode]" ]; then
        pid=${{fd#/proc/}}; pid=${{pid%%/*}}
        echo "stopping pid $pid (listening on port $port)"
        kill -TERM "$pid" 2>/dev/null
      fi
    done
  done
done
"#,
        groups = groups.join(" "),
        ports = all.join(" ")
    )
}

fn step(what: &str) {
    println!("\n==> xtask demo: {what}");
}

fn run_policy(
    stack: &mut Stack,
    policy: &str,
    addr: &str,
    workload: &ChatWorkload,
    opts: &DemoOptions,
    demo_dir: &std::path::Path,
) -> Result<PolicySummary> {
    step(&format!(
        "replaying the workload through {policy} (http://{addr})"
    ));
    let before = stack.cache_counters()?;
    let target = Target {
        addr: addr.to_string(),
        headers: Vec::new(),
        io_timeout: Duration::from_secs(120),
    };
    let progress = Progress::default();
    let total = workload.total_requests();
    let started = Instant::now();
    let (records, wall) = thread::scope(|scope| {
        let runner = scope.spawn(|| {
            chat_traffic::replay(
                &target,
                workload,
                workload.sessions(),
                opts.clients,
                &progress,
                &supervisor::interrupted,
            )
        });
        let mut last_line = Instant::now();
        let tty = std::io::stderr().is_terminal();
        while !runner.is_finished() {
            thread::sleep(Duration::from_millis(200));
            if tty {
                draw_progress(policy, &progress, total, started.elapsed(), true);
            } else if last_line.elapsed() >= Duration::from_secs(10) {
                draw_progress(policy, &progress, total, started.elapsed(), false);
                last_line = Instant::now();
            }
        }
        draw_progress(policy, &progress, total, started.elapsed(), tty);
        if tty {
            eprintln!();
        }
        runner.join()
    })
    .map_err(|_| anyhow::anyhow!("the workload thread panicked"))?;
    if supervisor::interrupted() {
        bail!("interrupted");
    }
    stack.check_alive()?;
    let cache = stack.cache_counters()?.since(&before);
    let records_path = demo_dir.join(format!("requests-{policy}.jsonl"));
    write_records(&records_path, &records)?;
    let summary = PolicySummary::new(&records, wall, cache);
    if summary.errors > 0 {
        let first = records
            .iter()
            .find_map(|r| r.error.as_deref())
            .unwrap_or("");
        println!(
            "xtask demo: {policy}: {} of {} requests failed; first error: {first} (all in {})",
            summary.errors,
            summary.requests,
            records_path.display()
        );
    }
    Ok(summary)
}

fn draw_progress(policy: &str, progress: &Progress, total: usize, elapsed: Duration, tty: bool) {
    let done = progress.done.load(Ordering::Relaxed).min(total);
    let errors = progress.errors.load(Ordering::Relaxed);
    let width = 30;
    let filled = (done * width).checked_div(total).unwrap_or(width);
    let bar = format!("{}{}", "#".repeat(filled), "-".repeat(width - filled));
    let line = format!(
        "  {policy:<12} [{bar}] {done:>4}/{total} requests  {errors} errors  {:>4.0}s",
        elapsed.as_secs_f64()
    );
    let mut err = std::io::stderr();
    if tty {
        let _ = write!(err, "\r{line}");
    } else {
        let _ = writeln!(err, "{line}");
    }
    let _ = err.flush();
}

fn write_records(path: &std::path::Path, records: &[chat_traffic::RequestRecord]) -> Result<()> {
    let mut out = String::new();
    for r in records {
        out.push_str(
            &json!({
                "session": r.session,
                "turn": r.turn,
                "sent_at_ms": r.sent_at.as_secs_f64() * 1000.0,
                "ttft_ms": r.ttft.map(|d| d.as_secs_f64() * 1000.0),
                "latency_ms": r.latency.as_secs_f64() * 1000.0,
                "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens,
                "error": r.error,
            })
            .to_string(),
        );
        out.push('\n');
    }
    fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

fn ms(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.0} ms"))
}

fn print_table(results: &[(&str, PolicySummary)]) {
    println!();
    println!(
        "{:<14} {:>9} {:>10} {:>10} {:>14} {:>9} {:>7}",
        "policy", "hit rate", "TTFT p50", "TTFT p90", "output tok/s", "requests", "errors"
    );
    for (name, s) in results {
        println!(
            "{:<14} {:>8.1}% {:>10} {:>10} {:>14.1} {:>9} {:>7}",
            name,
            s.hit_rate * 100.0,
            ms(s.ttft_p50_ms),
            ms(s.ttft_p90_ms),
            s.output_tokens_per_s,
            s.requests,
            s.errors
        );
    }
    if let [(_, kv), (_, rr)] = results {
        if let (Some(k), Some(r)) = (kv.ttft_p90_ms, rr.ttft_p90_ms) {
            if k > 0.0 {
                println!(
                    "\nTTFT p90: kvroute {:.1}x {} than round robin; prefix-cache hit rate {:+.1} points.",
                    if r >= k { r / k } else { k / r },
                    if r >= k { "lower" } else { "HIGHER" },
                    (kv.hit_rate - rr.hit_rate) * 100.0
                );
            }
        }
    }
    println!("(hit rate: the replicas' own vllm:prefix_cache_hits / queries; TTFT measured by the client, streaming)");
}

fn print_filter_counters(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) {
    let delta = |name: &str| {
        after
            .get(name)
            .copied()
            .unwrap_or(0)
            .saturating_sub(before.get(name).copied().unwrap_or(0))
    };
    let fail_open: Vec<String> = after
        .keys()
        .filter(|k| k.starts_with("kvroute.fail_open."))
        .filter_map(|k| {
            let n = delta(k);
            (n > 0).then(|| format!("{} {n}", k.trim_start_matches("kvroute.fail_open.")))
        })
        .collect();
    println!(
        "kvroute filter: {} requests, {} routed by the indexer, failed open: {}",
        delta("kvroute.requests"),
        delta("kvroute.routed"),
        if fail_open.is_empty() {
            "none".to_string()
        } else {
            fail_open.join(", ")
        }
    );
}

#[cfg(test)]
mod tests {
    use crate::stack::{Ports, ReplicaPorts};
    use std::process::{Command, Stdio};

    /// The stop script ends the recorded groups and a process that was restarted by hand (in no
    /// recorded group) but listens on one of the stack's ports.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_stop_script_also_stops_a_restarted_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        drop(listener);
        // A stand-in for a hand-restarted replica: listens on the replica's HTTP port.
        let mut restarted = Command::new("python3")
            .args(["-c", &format!("import socket,time\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('127.0.0.1',{port}))\ns.listen()\nprint('up',flush=True)\ntime.sleep(120)")])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(restarted.stdout.take().expect("stdout")),
            &mut line,
        )
        .expect("read");
        assert_eq!(line.trim(), "up");
        let ports = Ports {
            replicas: vec![ReplicaPorts {
                http: port,
                events: 1,
                replay: 2,
            }],
            indexer: 3,
            kvroute: (4, 5),
            baseline: (6, 7),
            more_gateways: Vec::new(),
        };
        let script = super::stop_script(&[(999_999, "replica-r0".into())], &ports);
        let out = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .output()
            .expect("sh");
        let status = restarted.wait().expect("wait");
        assert!(
            !status.success(),
            "the restarted process survived: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("port {port}")));
    }
}
