//! `cargo xtask bench filter`: what each filter build costs in Envoy. Two `#[ignore]`d tests of
//! kvroute-filter, in the release profile:
//! * `bench_filter`, once per build (`KVROUTE_FILTER_BUILD=wasm|native`): the latency the filter
//!   adds to 1k, 8k and 32k-token chats, cold and warm, against plain Envoy;
//! * `bench_memory` (`KVROUTE_MEMORY_CONCURRENCY=2,8,16`): Envoy's RSS, idle and after 320 routed
//!   requests, for plain Envoy, the Wasm filter and the native module at each concurrency;
//! * `bench_filter_cpu`, once per build: Envoy's CPU per streamed request with and without the
//!   filter (token-id and warm chat prompts, 20 and 200 events per response).
//!
//! Each test writes its JSON under `<target>/bench/`; this reads them back and prints two tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::Value;

use kvroute_testkit::filter_build::{self, FilterBuild};
use kvroute_testkit::paths::{cargo_bin, Layout};

/// Envoy `--concurrency` levels of the memory measurement.
const CONCURRENCY: [usize; 3] = [2, 8, 16];

/// The prompt sizes and cache states of the latency measurement, in the test's order.
const LATENCY_CASES: [(u64, bool); 6] = [
    (1000, false),
    (1000, true),
    (8000, false),
    (8000, true),
    (32000, false),
    (32000, true),
];

/// Runs both measurements and prints the table; `setup` first unless `no_setup`, the builds
/// unless `no_build`.
pub fn run(
    layout: &Layout,
    no_setup: bool,
    no_build: bool,
    setup: &dyn Fn(&Layout) -> Result<()>,
) -> Result<()> {
    if !no_setup {
        setup(layout)?;
    }
    if !no_build {
        filter_build::build_stack(layout, false, &FilterBuild::ALL)?;
    }
    let out = layout.target_dir.join("bench");
    run_per_build(
        layout,
        "bench_filter",
        "filter latency in Envoy (1k/8k/32k-token chats, cold and warm)",
    )?;
    let levels: Vec<String> = CONCURRENCY.iter().map(usize::to_string).collect();
    println!(
        "==> bench: Envoy RSS at --concurrency {}: plain, wasm, native",
        levels.join(", ")
    );
    run_test(
        layout,
        "bench_memory",
        &[("KVROUTE_MEMORY_CONCURRENCY", &levels.join(","))],
    )?;
    run_per_build(
        layout,
        "bench_filter_cpu",
        "Envoy CPU per streamed request against plain Envoy",
    )?;
    let latency = read_per_build(&out, latency_file)?;
    let memory = read_json(&out.join("memory.json"))?;
    println!("\n{}", table(&latency, &memory));
    println!("{}", cpu_table(&read_per_build(&out, cpu_file)?));
    Ok(())
}

/// Runs test `name` once per filter build, announcing each run as `what`.
fn run_per_build(layout: &Layout, name: &str, what: &str) -> Result<()> {
    for build in FilterBuild::ALL {
        println!("==> bench: {what}, {build} build");
        run_test(layout, name, &[("KVROUTE_FILTER_BUILD", build.name())])?;
    }
    Ok(())
}

/// Each build's report, read from `<out>/<file(build)>`.
fn read_per_build(
    out: &Path,
    file: fn(FilterBuild) -> &'static str,
) -> Result<Vec<(FilterBuild, Value)>> {
    FilterBuild::ALL
        .into_iter()
        .map(|build| Ok((build, read_json(&out.join(file(build)))?)))
        .collect()
}

/// The file `bench_filter_cpu` writes for `build`.
fn cpu_file(build: FilterBuild) -> &'static str {
    match build {
        FilterBuild::Wasm => "filter-cpu.json",
        FilterBuild::Native => "filter-cpu-native.json",
    }
}

/// One row per build and case: the median Envoy CPU per request of plain Envoy and of the filter
/// Envoy of the same run, and their ratio.
pub fn cpu_table(cpu: &[(FilterBuild, Value)]) -> String {
    let mut out = String::from(
        "Envoy CPU per streamed request (user + system, us; median of the rounds; plain Envoy \
         measured in the same run, taking turns with the filter Envoy).\n\n\
         | build | prompt | events | plain us | filter us | ratio |\n|---|---|---|---|---|---|\n",
    );
    for (build, report) in cpu {
        for row in report["results"].as_array().into_iter().flatten() {
            let median = |line: &str| row[line]["median_us"].as_f64().unwrap_or(f64::NAN);
            let (plain, filter) = (median("plain"), median("filter"));
            let _ = writeln!(
                out,
                "| {build} | {} | {} | {plain:.0} | {filter:.0} | {:.2}x |",
                row["row"].as_str().unwrap_or("?"),
                row["events"].as_u64().unwrap_or(0),
                filter / plain
            );
        }
    }
    out
}

/// The file `bench_filter` writes for `build`.
fn latency_file(build: FilterBuild) -> &'static str {
    match build {
        FilterBuild::Wasm => "filter.json",
        FilterBuild::Native => "filter-native.json",
    }
}

/// `cargo test --release -p kvroute-filter --test NAME -- --ignored --nocapture` with the
/// paths setup installed, the release binaries of the stack, and `env`.
fn run_test(layout: &Layout, name: &str, env: &[(&str, &str)]) -> Result<()> {
    let mut cargo = Command::new(cargo_bin());
    cargo
        .args(["test", "--release", "-p", "kvroute-filter", "--test", name])
        .args(["--", "--ignored", "--nocapture"])
        .current_dir(&layout.root);
    for (key, value) in layout.child_env() {
        cargo.env(key, value);
    }
    let release = layout.target_dir.join("release");
    cargo
        .env("KVROUTE_KVROUTE_SIM_BIN", release.join("kvroute-sim"))
        .env(
            "KVROUTE_KVROUTE_INDEXER_BIN",
            release.join("kvroute-indexer"),
        );
    for (key, value) in env {
        cargo.env(key, value);
    }
    kvroute_testkit::cmd::run(&mut cargo)
}

fn read_json(path: &Path) -> Result<Value> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// One table: a row per build (plain Envoy, wasm, native), the added latency p50 / p99 of each
/// prompt size and cache state, and Envoy's RSS idle / after load at each concurrency.
pub fn table(latency: &[(FilterBuild, Value)], memory: &Value) -> String {
    let mut rss: BTreeMap<(String, u64), (f64, f64)> = BTreeMap::new();
    for row in memory["rows"].as_array().into_iter().flatten() {
        let build = row["build"].as_str().unwrap_or("?").to_string();
        let level = row["concurrency"].as_u64().unwrap_or(0);
        let mib = |key: &str| row[key].as_f64().unwrap_or(f64::NAN) / 1_048_576.0;
        rss.insert(
            (build, level),
            (mib("rss_idle_bytes"), mib("rss_after_bytes")),
        );
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Added latency: the filter Envoy's p50 / p99 minus plain Envoy's, ms, one request at a \
         time (Envoy --concurrency 1). Envoy RSS: MiB idle / after {} routed requests.\n",
        memory["requests"].as_u64().unwrap_or(0)
    );
    let mut header = vec!["build".to_string(), "artifact MB".to_string()];
    for (tokens, warm) in LATENCY_CASES {
        let cache = if warm { "warm" } else { "cold" };
        header.push(format!("{}k {cache}", tokens / 1000));
    }
    header.extend(CONCURRENCY.iter().map(|c| format!("RSS c={c}")));
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(out, "|{}", "---|".repeat(header.len()));
    for build in ["plain", "wasm", "native"] {
        let report = latency
            .iter()
            .find(|(b, _)| b.name() == build)
            .map(|(_, v)| v);
        let mut cells = vec![build.to_string()];
        cells.push(report.map_or("-".into(), |r| {
            format!(
                "{:.1}",
                r["artifact_bytes"].as_f64().unwrap_or(f64::NAN) / 1e6
            )
        }));
        for (tokens, warm) in LATENCY_CASES {
            cells.push(report.map_or("-".into(), |r| added(r, tokens, warm)));
        }
        for level in CONCURRENCY {
            cells.push(
                rss.get(&(build.to_string(), level as u64))
                    .map_or("-".into(), |(idle, after)| {
                        format!("{idle:.0} / {after:.0}")
                    }),
            );
        }
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out
}

/// `p50 / p99` added ms of one case of a `bench_filter` report (`-` when it has none).
fn added(report: &Value, tokens: u64, warm: bool) -> String {
    report["results"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["tokens"].as_u64() == Some(tokens) && r["warm"].as_bool() == Some(warm))
        .map_or("-".into(), |r| {
            format!(
                "{:.2} / {:.2}",
                r["added_p50_ms"].as_f64().unwrap_or(f64::NAN),
                r["added_p99_ms"].as_f64().unwrap_or(f64::NAN)
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn latency(build: &str, added_p50: f64) -> Value {
        json!({"build": build, "artifact_bytes": 4_500_000, "results": [
            {"tokens": 1000, "warm": false, "added_p50_ms": added_p50, "added_p99_ms": 2.0},
            {"tokens": 32000, "warm": true, "added_p50_ms": 9.5, "added_p99_ms": 12.25},
        ]})
    }

    #[test]
    fn the_cpu_table_has_a_row_per_build_and_case_with_the_ratio_to_plain_envoy() {
        let report = |filter: f64| {
            json!({"results": [
                {"row": "chat ~8k, warm", "events": 20,
                 "plain": {"median_us": 500.0, "rounds_us": [500.0]},
                 "filter": {"median_us": filter, "rounds_us": [filter]}},
            ]})
        };
        let t = cpu_table(&[
            (FilterBuild::Wasm, report(900.0)),
            (FilterBuild::Native, report(625.0)),
        ]);
        assert!(
            t.contains("| wasm | chat ~8k, warm | 20 | 500 | 900 | 1.80x |"),
            "{t}"
        );
        assert!(
            t.contains("| native | chat ~8k, warm | 20 | 500 | 625 | 1.25x |"),
            "{t}"
        );
    }

    #[test]
    fn one_row_per_build_with_latency_and_rss_per_concurrency() {
        let memory = json!({"requests": 320, "rows": [
            {"concurrency": 2, "build": "plain", "rss_idle_bytes": 30 * 1_048_576u64,
             "rss_after_bytes": 32 * 1_048_576u64},
            {"concurrency": 16, "build": "wasm", "rss_idle_bytes": 900 * 1_048_576u64,
             "rss_after_bytes": 1000 * 1_048_576u64},
            {"concurrency": 16, "build": "native", "rss_idle_bytes": 120 * 1_048_576u64,
             "rss_after_bytes": 150 * 1_048_576u64},
        ]});
        let t = table(
            &[
                (FilterBuild::Wasm, latency("wasm", 1.5)),
                (FilterBuild::Native, latency("native", 0.75)),
            ],
            &memory,
        );
        assert!(t.contains("after 320 routed requests"), "{t}");
        assert!(t.contains(
            "| build | artifact MB | 1k cold | 1k warm | 8k cold | 8k warm | 32k cold | 32k warm \
             | RSS c=2 | RSS c=8 | RSS c=16 |"
        ));
        assert!(
            t.contains("| plain | - | - | - | - | - | - | - | 30 / 32 | - | - |"),
            "{t}"
        );
        assert!(
            t.contains(
                "| wasm | 4.5 | 1.50 / 2.00 | - | - | - | - | 9.50 / 12.25 | - | - | 900 / 1000 |"
            ),
            "{t}"
        );
        assert!(t.contains("| native | 4.5 | 0.75 / 2.00 |"), "{t}");
        assert!(t.contains("| 150 |") || t.contains("120 / 150 |"), "{t}");
        let columns = t
            .lines()
            .find(|l| l.starts_with("| build"))
            .map(|l| l.matches(" | ").count());
        let rows: Vec<usize> = t
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| build"))
            .map(|l| l.matches(" | ").count())
            .collect();
        assert_eq!(rows.len(), 3);
        assert!(rows.iter().all(|n| Some(*n) == columns), "{t}");
    }
}
