//! `cargo xtask chaos`: the standing chaos suite. One local stack (3 `kvroute-sim` replicas, the
//! indexer, Envoy with the filter, all on 127.0.0.1), then every scenario of
//! [`scenarios::ALL`] in turn: attacks (spoofed destination, engine admin paths, huge prompts,
//! aborted and stalled clients) and faults (indexer SIGSTOP and kill -9, a replica killed and
//! restarted, a hung replica), each with its own pass criteria and figures, and last a check that
//! the index equals what the engines really cache. Then the attacks that need peers of their own
//! (frame bombs and replay bombs on the event sockets, the route API fuzz, the filter's hostile
//! requests and registry, spoofing, in-flight leaks, engine paths and slow clients) run as the
//! integration tests they are.
//!
//! `--short` (what `cargo xtask test` runs) sends fewer requests, holds faults shorter and leaves
//! the integration tests to the test step that ran just before it.

mod probe;
mod scenarios;
mod traffic;

use std::fs;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use crate::paths::Layout;
use crate::prepare::PrepareOptions;
use crate::stack::{Binaries, Stack, StackConfig};
use crate::supervisor;

/// Options of `cargo xtask chaos`.
#[derive(Debug, Clone, Args)]
pub struct ChaosOptions {
    /// Fewer requests and shorter faults (a couple of minutes; `cargo xtask test` runs this).
    #[arg(long)]
    pub short: bool,
    /// Only the scenarios whose names contain one of these.
    #[arg(long = "only")]
    pub only: Vec<String>,
    /// Setup and builds.
    #[command(flatten)]
    pub prepare: PrepareOptions,
}

/// Runs the suite; fails when any scenario failed.
pub fn run(layout: &Layout, opts: &ChaosOptions) -> Result<()> {
    supervisor::install_ctrl_c()?;
    opts.prepare.run(layout)?;
    let selected: Vec<_> = scenarios::ALL
        .iter()
        .filter(|(name, _)| opts.only.is_empty() || opts.only.iter().any(|o| name.contains(o)))
        .collect();
    let suites_selected = !opts.short
        && ATTACK_SUITES
            .iter()
            .any(|(name, _, _)| opts.only.is_empty() || opts.only.iter().any(|o| name.contains(o)));
    if selected.is_empty() && !suites_selected {
        bail!(
            "no scenario matches {:?}; the scenarios are: {}",
            opts.only,
            scenarios::ALL
                .iter()
                .map(|(n, _)| *n)
                .chain(ATTACK_SUITES.iter().map(|(n, _, _)| *n))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let work_dir = layout.target_dir.join("chaos");
    let _ = fs::remove_dir_all(&work_dir);
    let cfg = StackConfig {
        replicas: 3,
        model: "qwen3".to_string(),
        model_dir: layout.model_dir(),
        block_size: 16,
        gpu_blocks: 2_000,
        time_scale: 4.0,
        hash_algo: "sha256_cbor".to_string(),
        envoy_concurrency: 2,
        sim_args: Vec::new(),
        scoring: Vec::new(),
        index: Vec::new(),
        filter: Vec::new(),
    };
    let model = cfg.model.clone();
    let profile = opts.prepare.profile();
    let mut stack = Stack::new(
        layout,
        cfg,
        Binaries::new(layout, profile),
        work_dir.clone(),
        true,
    )?;
    if !selected.is_empty() {
        println!("xtask chaos: starting 3 replicas, the indexer and Envoy with the filter ...");
        stack.start_replicas()?;
        stack.start_indexer("kv")?;
        stack.start_kvroute_envoy()?;
    }

    let mut reports = Vec::new();
    let started = Instant::now();
    for (name, scenario) in selected {
        println!("xtask chaos: {name} ...");
        let t = Instant::now();
        let mut ctx = scenarios::Ctx {
            stack: &mut stack,
            short: opts.short,
            model: model.clone(),
        };
        let mut report = match scenario(&mut ctx) {
            Ok(report) => report,
            Err(e) => scenarios::Report {
                name,
                figures: Vec::new(),
                failures: vec![format!("could not run: {e:#}")],
            },
        };
        if let Err(e) = stack.check_alive() {
            report
                .failures
                .push(format!("a process of the stack died: {e:#}"));
        }
        println!(
            "xtask chaos: {name}: {} in {:.1} s",
            if report.passed() { "pass" } else { "FAIL" },
            t.elapsed().as_secs_f64()
        );
        reports.push(report);
        if supervisor::interrupted() {
            bail!("interrupted");
        }
    }
    drop(stack);

    // The attacks that need their own peers (hostile ZeroMQ publishers, fake indexers, an Envoy
    // of their own) are integration tests; the full form runs them here too, the short one
    // leaves them to `cargo xtask test`'s test step, which has just run them.
    if !opts.short {
        for (name, package, target) in ATTACK_SUITES {
            if !opts.only.is_empty() && !opts.only.iter().any(|o| name.contains(o.as_str())) {
                continue;
            }
            println!("xtask chaos: {name} (cargo test -p {package} --test {target}) ...");
            reports.push(run_suite(layout, &work_dir, name, package, target));
            if supervisor::interrupted() {
                bail!("interrupted");
            }
        }
    }

    print_table(&reports);
    let summary = json!({
        "short": opts.short,
        "seconds": started.elapsed().as_secs_f64(),
        "scenarios": reports.iter().map(|r| json!({
            "name": r.name, "passed": r.passed(), "figures": r.figures, "failures": r.failures,
        })).collect::<Vec<_>>(),
    });
    let path = work_dir.join("summary.json");
    fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.name)
        .collect();
    let passed = reports.len() - failed.len();
    println!(
        "xtask chaos: {passed} passed, {} failed (logs and summary.json in {})",
        failed.len(),
        work_dir.display()
    );
    if !failed.is_empty() {
        bail!("chaos scenarios failed: {}", failed.join(", "));
    }
    Ok(())
}

/// Attacks run as integration tests: (scenario, package, test target).
const ATTACK_SUITES: &[(&str, &str, &str)] = &[
    ("event_socket_attacks", "kvroute-indexer", "hostile_peers"),
    ("route_api_fuzz", "kvroute-indexer", "api_properties"),
    ("filter_hostile_requests", "kvroute-filter", "e2e_hostile"),
    ("filter_spoofing", "kvroute-filter", "e2e_security"),
    ("inflight_leaks", "kvroute-filter", "e2e_inflight"),
    ("paths_and_slow_clients", "kvroute-filter", "e2e_paths"),
];

/// Runs one integration test target as a scenario; its libtest counts are the figures.
fn run_suite(
    layout: &Layout,
    work_dir: &std::path::Path,
    name: &'static str,
    package: &str,
    target: &str,
) -> scenarios::Report {
    let log = work_dir.join("logs").join(format!("{name}.log"));
    let mut cmd = std::process::Command::new(crate::paths::cargo_bin());
    cmd.args(["test", "-p", package, "--test", target])
        .current_dir(&layout.root);
    for (key, value) in layout.child_env() {
        cmd.env(key, value);
    }
    let mut report = scenarios::Report {
        name,
        figures: Vec::new(),
        failures: Vec::new(),
    };
    match cmd.output() {
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let _ = fs::write(&log, &text);
            let results: Vec<&str> = text
                .lines()
                .filter_map(|l| l.trim().strip_prefix("test result: "))
                .collect();
            report.figure(format!(
                "cargo test -p {package} --test {target}: {}",
                results.join("; ")
            ));
            if !out.status.success() {
                report.failures.push(format!(
                    "the tests failed ({}; log {})",
                    out.status,
                    log.display()
                ));
            }
        }
        Err(e) => report.failures.push(format!("could not run cargo: {e}")),
    }
    report
}

fn print_table(reports: &[scenarios::Report]) {
    println!("\n{:<24} {:<6} figures", "scenario", "result");
    for r in reports {
        let result = if r.passed() { "pass" } else { "FAIL" };
        let mut lines = r.figures.iter();
        println!(
            "{:<24} {result:<6} {}",
            r.name,
            lines.next().map_or("", String::as_str)
        );
        for line in lines {
            println!("{:<31} {line}", "");
        }
        for failure in &r.failures {
            println!("{:<31} failed: {failure}", "");
        }
    }
    println!();
}
