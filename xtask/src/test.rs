//! `cargo xtask test`: the whole check CI runs. Setup, then formatting, lints, the wasm32 builds,
//! the binaries, every test and the chaos suite's short form, stopping at (and naming) the first
//! step that fails.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cmd;
use crate::filter_build::FilterBuild;
use crate::paths::{cargo_bin, Layout};
use crate::setup;

/// The e2e suites of the filter (`filter/tests/<name>.rs`) that run against both builds: once in
/// the workspace's test step (the Wasm filter), once more with `KVROUTE_FILTER_BUILD=native` (the
/// dynamic module). `e2e_native` pins the native build itself and runs once.
const E2E_BOTH_BUILDS: [&str; 9] = [
    "e2e_fail_open",
    "e2e_hostile",
    "e2e_inflight",
    "e2e_override_host",
    "e2e_paths",
    "e2e_routing",
    "e2e_security",
    "e2e_shadow",
    "e2e_tokens",
];

/// Suites in real Envoy beside the e2e ones that also run against both builds:
/// `dashboard_queries` checks that the dashboard and alert rules name metrics the filter exports,
/// which must not depend on the build.
const OTHER_SUITES_BOTH_BUILDS: [&str; 1] = ["dashboard_queries"];

/// proptest's seed variable, and the seed `cargo xtask test` uses when it is not set.
const PROPTEST_SEED_VAR: &str = "PROPTEST_RNG_SEED";
const PROPTEST_SEED: &str = "20261201";

/// Options of `cargo xtask test`.
#[derive(Debug, Clone, Default)]
pub struct TestOptions {
    /// Skip `cargo fmt --check` and clippy.
    pub quick: bool,
    /// Skip `cargo xtask setup` (use what is already in the cache).
    pub no_setup: bool,
    /// Run the remaining steps after a failure, then report every failure.
    pub keep_going: bool,
    /// Use `cargo test` even when cargo-nextest is installed.
    pub no_nextest: bool,
    /// Test name filters passed through to the test runner.
    pub filters: Vec<String>,
}

struct Step {
    name: &'static str,
    command: Command,
    /// Tally the runner's result lines (libtest's `test result:`, nextest's `Summary`) into the
    /// overall total printed last.
    tally_libtest: bool,
}

struct Outcome {
    name: &'static str,
    elapsed: Duration,
    error: Option<String>,
}

/// Runs the check; an error names the step that failed.
pub fn run(layout: &Layout, opts: &TestOptions) -> Result<()> {
    let started = Instant::now();
    crate::disk::warn_if_low(
        &layout.target_dir,
        crate::disk::CLEAN_TEST_BYTES,
        "xtask test",
    );
    if opts.no_setup {
        println!(
            "xtask test: --no-setup: using {}",
            layout.cache_dir.display()
        );
        crate::toolchain::ensure_wasm_target(&layout.root)?;
    } else {
        setup::run(layout).context("xtask test: setup failed")?;
    }

    let steps = plan(opts);
    let total = steps.len();
    let mut outcomes = Vec::with_capacity(total);
    let mut tests = Tally::default();
    for (index, mut step) in steps.into_iter().enumerate() {
        for (key, value) in layout.child_env() {
            step.command.env(key, value);
        }
        // Property tests explore the same cases on every run of this command, so a result is
        // reproducible; set PROPTEST_RNG_SEED to explore others (docs/fuzzing.md).
        if std::env::var_os(PROPTEST_SEED_VAR).is_none() {
            step.command.env(PROPTEST_SEED_VAR, PROPTEST_SEED);
        }
        step.command.current_dir(&layout.root);
        println!(
            "\n==> xtask test [{}/{total}] {}: {}",
            index + 1,
            step.name,
            cmd::display(&step.command)
        );
        let _ = std::io::stdout().flush();
        let step_started = Instant::now();
        let result = if step.tally_libtest {
            run_tallying(&mut step.command, &mut tests)
        } else {
            cmd::run(&mut step.command)
        };
        let outcome = Outcome {
            name: step.name,
            elapsed: step_started.elapsed(),
            error: result.err().map(|e| format!("{e:#}")),
        };
        let failed = outcome.error.is_some();
        outcomes.push(outcome);
        if failed && !opts.keep_going {
            break;
        }
    }

    println!(
        "\n==> xtask test summary ({:.0}s)",
        started.elapsed().as_secs_f64()
    );
    for outcome in &outcomes {
        let status = if outcome.error.is_some() {
            "FAILED"
        } else {
            "ok"
        };
        println!(
            "    {status:<6} {:<22} {:>7.1}s",
            outcome.name,
            outcome.elapsed.as_secs_f64()
        );
    }
    for skipped in outcomes.len()..total {
        println!("    {:<6} step {} not run", "-", skipped + 1);
    }
    let failures: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_some()).collect();
    // The overall count, alone on the last line: `N passed, N failed, N skipped`.
    let closing = format!(
        "kvroute: {} passed, {} failed, {} skipped",
        tests.passed, tests.failed, tests.ignored
    );
    if failures.is_empty() {
        println!("xtask test: all {total} steps passed");
        println!("{closing}");
        return Ok(());
    }
    println!("{closing}");
    for failure in &failures {
        println!(
            "xtask test: step `{}` failed: {}",
            failure.name,
            failure.error.as_deref().unwrap_or("")
        );
    }
    let names: Vec<&str> = failures.iter().map(|f| f.name).collect();
    bail!("xtask test failed at: {}", names.join(", "))
}

fn plan(opts: &TestOptions) -> Vec<Step> {
    let cargo = |args: &[&str]| {
        let mut command = Command::new(cargo_bin());
        command.args(args);
        command
    };
    let step = |name, command| Step {
        name,
        command,
        tally_libtest: false,
    };
    let mut steps = Vec::new();
    if !opts.quick {
        steps.push(step("fmt", cargo(&["fmt", "--all", "--", "--check"])));
        steps.push(step(
            "clippy",
            cargo(&[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
        ));
        steps.push(step(
            "clippy (wasm32)",
            cargo(&[
                "clippy",
                "-p",
                "kvroute-core",
                "-p",
                "kvroute-filter",
                "--target",
                crate::toolchain::WASM_TARGET,
                "--",
                "-D",
                "warnings",
            ]),
        ));
    }
    steps.push(step(
        "core (wasm32)",
        cargo(&[
            "build",
            "-p",
            "kvroute-core",
            "--target",
            crate::toolchain::WASM_TARGET,
        ]),
    ));
    steps.push(step("filter .wasm", cargo(FilterBuild::Wasm.cargo_args())));
    // Alone (see `cargo_args`); the native e2e tests load this `.so`.
    steps.push(step(
        "filter native .so",
        cargo(FilterBuild::Native.cargo_args()),
    ));
    steps.push(step("binaries", cargo(&["build", "--workspace", "--bins"])));

    let nextest = !opts.no_nextest && nextest_available();
    if nextest {
        let mut run = cargo(&["nextest", "run", "--workspace", "--no-fail-fast"]);
        run.args(&opts.filters);
        steps.push(Step {
            name: "tests (nextest)",
            command: run,
            tally_libtest: true,
        });
        let mut doc = cargo(&["test", "--workspace", "--doc", "--no-fail-fast"]);
        if !opts.filters.is_empty() {
            doc.arg("--").args(&opts.filters);
        }
        steps.push(Step {
            name: "doc tests",
            command: doc,
            tally_libtest: true,
        });
    } else {
        let mut run = cargo(&["test", "--workspace", "--no-fail-fast"]);
        if !opts.filters.is_empty() {
            run.arg("--").args(&opts.filters);
        }
        steps.push(Step {
            name: "tests",
            command: run,
            tally_libtest: true,
        });
    }
    steps.push(Step {
        name: "e2e (native build)",
        command: native_e2e(nextest, &opts.filters),
        tally_libtest: true,
    });
    if opts.filters.is_empty() {
        // The standing chaos suite's short form, on the debug binaries built above.
        let mut chaos = Command::new(std::env::current_exe().unwrap_or_else(|_| "xtask".into()));
        chaos.args(["chaos", "--short", "--no-setup", "--no-build", "--debug"]);
        steps.push(step("chaos (short)", chaos));
    }
    steps
}

/// The e2e suites (and [`OTHER_SUITES_BOTH_BUILDS`]) once more, in Envoy with the native dynamic
/// module instead of the Wasm filter.
fn native_e2e(nextest: bool, filters: &[String]) -> Command {
    let mut command = Command::new(cargo_bin());
    if nextest {
        command.args(["nextest", "run", "--no-fail-fast", "--no-tests=pass"]);
    } else {
        command.args(["test", "--no-fail-fast"]);
    }
    command.args(["-p", "kvroute-filter"]);
    for suite in E2E_BOTH_BUILDS.iter().chain(&OTHER_SUITES_BOTH_BUILDS) {
        command.args(["--test", suite]);
    }
    if nextest {
        command.args(filters);
    } else if !filters.is_empty() {
        command.arg("--").args(filters);
    }
    command.env("KVROUTE_FILTER_BUILD", "native");
    command
}

fn nextest_available() -> bool {
    Command::new(cargo_bin())
        .args(["nextest", "--version"])
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Totals over libtest's per-binary `test result: ok. 3 passed; 0 failed; 1 ignored; ...` lines
/// or nextest's `Summary [ 73.5s] 280 tests run: 279 passed, 1 failed, 3 skipped` lines.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tally {
    binaries: u32,
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Tally {
    fn merge(&mut self, other: &Tally) {
        self.binaries += other.binaries;
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }

    /// Adds the counts of one result line (`rest` after its prefix, parts split by `separator`).
    fn add_counts(&mut self, rest: &str, separator: char) {
        self.binaries += 1;
        for part in rest.split(separator) {
            let mut words = part.split_whitespace().rev();
            let (Some(label), Some(count)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(count) = count.parse::<u64>() else {
                continue;
            };
            match label {
                "passed" => self.passed += count,
                "failed" => self.failed += count,
                "ignored" | "skipped" => self.ignored += count,
                _ => {}
            }
        }
    }
}

/// The result lines of one test command's output. Nextest echoes a failing test's own output,
/// libtest's `test result:` line included, so where nextest summarised, its summaries alone count.
#[derive(Debug, Default)]
struct OutputTally {
    libtest: Tally,
    nextest: Tally,
}

impl OutputTally {
    fn add_line(&mut self, line: &str) {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("test result:") {
            self.libtest.add_counts(rest, ';');
        } else if let Some((_, rest)) = line
            .strip_prefix("Summary [")
            .and_then(|r| r.split_once("tests run:"))
        {
            self.nextest.add_counts(rest, ',');
        }
    }

    fn merge(&mut self, other: &OutputTally) {
        self.libtest.merge(&other.libtest);
        self.nextest.merge(&other.nextest);
    }

    /// The counts: nextest's summaries when there are any, else libtest's lines.
    fn total(&self) -> Tally {
        if self.nextest.binaries > 0 {
            self.nextest
        } else {
            self.libtest
        }
    }
}

/// Runs a test command, echoing its stdout and stderr as they come (nextest reports on stderr),
/// prints this step's total, and adds it to `overall`.
fn run_tallying(command: &mut Command, overall: &mut Tally) -> Result<()> {
    let line = cmd::display(command);
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{line}`"))?;
    let stderr_reader = child.stderr.take().map(|stderr| {
        std::thread::spawn(move || {
            let mut tally = OutputTally::default();
            let mut err = std::io::stderr();
            for text in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                tally.add_line(&text);
                let _ = writeln!(err, "{text}");
            }
            tally
        })
    });
    let mut tally = OutputTally::default();
    if let Some(stdout) = child.stdout.take() {
        let mut out = std::io::stdout();
        for text in BufReader::new(stdout).lines() {
            let text = text.context("reading test output")?;
            tally.add_line(&text);
            let _ = writeln!(out, "{text}");
        }
    }
    if let Some(from_stderr) = stderr_reader.and_then(|h| h.join().ok()) {
        tally.merge(&from_stderr);
    }
    let tally = tally.total();
    overall.merge(&tally);
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{line}`"))?;
    println!(
        "xtask test: Summary: {} passed, {} failed, {} ignored in {} test binaries",
        tally.passed, tally.failed, tally.ignored, tally.binaries
    );
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{OutputTally, Tally, E2E_BOTH_BUILDS};

    /// The e2e suites that run once (against the Wasm build unless they pin one): `e2e_native`
    /// pins the native build itself; `e2e_two_layers` checks the layer above kvroute (LiteLLM), whose behaviour does not
    /// depend on the filter's build, and takes minutes to start; `e2e_gateways` kills and restarts
    /// whole gateways (Envoy and indexer processes), which no filter build changes, and pins the
    /// native build (it loads the tokenizer in a second).
    const E2E_ONE_BUILD: [&str; 3] = ["e2e_gateways", "e2e_native", "e2e_two_layers"];

    #[test]
    fn every_e2e_suite_but_the_native_one_runs_against_both_builds() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../filter/tests");
        let mut suites: Vec<String> = std::fs::read_dir(&dir)
            .expect("filter/tests")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter_map(|n| n.strip_suffix(".rs").map(str::to_owned))
            .filter(|n| n.starts_with("e2e_") && !E2E_ONE_BUILD.contains(&n.as_str()))
            .collect();
        suites.sort();
        assert_eq!(suites, E2E_BOTH_BUILDS);
    }

    #[test]
    fn tally_sums_libtest_result_lines() {
        let mut tally = OutputTally::default();
        for line in [
            "running 3 tests",
            "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
            "test result: FAILED. 5 passed; 2 failed; 0 ignored; 0 measured; 4 filtered out; finished in 1.20s",
            "some test printing test result: in the middle is not a result line? yes it is not",
        ] {
            tally.add_line(line);
        }
        assert_eq!(
            tally.total(),
            Tally {
                binaries: 2,
                passed: 8,
                failed: 2,
                ignored: 1
            }
        );
    }

    #[test]
    fn tally_reads_nextest_summaries() {
        let mut tally = OutputTally::default();
        for line in [
            "        PASS [   0.016s] (276/280) xtask::bin/xtask stats::tests::percentiles_interpolate",
            // A failing test's own output, echoed by nextest, holds libtest's line.
            "test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 12 filtered out; finished in 10.40s",
            "     Summary [  73.690s] 280 tests run: 279 passed, 1 failed, 3 skipped",
        ] {
            tally.add_line(line);
        }
        assert_eq!(
            tally.total(),
            Tally {
                binaries: 1,
                passed: 279,
                failed: 1,
                ignored: 3
            }
        );
        let mut all_passed = OutputTally::default();
        all_passed.add_line("     Summary [  73.504s] 280 tests run: 280 passed, 3 skipped");
        let all_passed = all_passed.total();
        assert_eq!(
            (all_passed.passed, all_passed.failed, all_passed.ignored),
            (280, 0, 3)
        );
    }
}
