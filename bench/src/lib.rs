//! kvroute-bench: the routing benchmark (`cargo xtask bench routing` drives it). Every workload is replayed through every
//! policy against the same `kvroute-sim` replicas (restarted cold before each policy), with the
//! same arrival times; the replicas' own counters give the hit rate, the streaming client gives
//! TTFT and inter-token latency; `docs/benchmarks.md` gets the tables and `docs/benchmarks/` the
//! plots.
//!
//! The default is a quick run (one load point of each of three workloads, 4 replicas, ~10 min on
//! 2 cores); `--full` sweeps fleets (4, 8, 16 replicas), KV capacity and every workload at a load
//! ladder.

mod agentic;
mod assess;
mod assess_checks;
pub mod chat_traffic;
mod decision_counts;
mod filter_costs;
mod fleet;
mod gateways;
mod goal_check;
mod ideal;
mod oracle;
mod peers;
mod policies;
mod prediction;
mod repeats;
mod replay;
mod replica_counters;
mod report;
mod router_usage;
mod scaleout;
mod spread;
pub mod stats;
mod summary;
mod text_vocab;
mod trace;
mod workloads;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde_json::json;

use kvroute_testkit::filter_build::{self, FilterBuild};
use kvroute_testkit::redis::RedisServer;
use kvroute_testkit::{http, paths, stack, supervisor};

use crate::paths::Layout;
use crate::stack::{Binaries, PeerRedis, Stack, StackConfig};

use gateways::{GatewayFacts, GatewaySetup, PeerSharing};
use spread::{GatewaySpread, Targets};

use policies::Policy;
use replay::{Progress, ReplayConfig};
use replica_counters::ReplicaCounters;
use report::{RunFacts, WorkloadResults};
use summary::{RunContext, RunSummary};
use workloads::{MooncakeTrace, MooncakeWindow, MultiTurn, NoSharing, SharedPrefix, Workload};

/// Which benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchTarget {
    /// Routing quality and latency against the baselines (Envoy + filter + indexer + replicas).
    Routing,
    /// The filter's own costs, both builds (wasm, native): added latency in Envoy, and Envoy's
    /// RSS at --concurrency 2, 8 and 16 against plain Envoy.
    Filter,
}

/// The workloads `--workloads` can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// llm-d's shared prefix: 150 groups x 5 prompts, 6,000 + 1,200 tokens, 1,000 output tokens.
    SharedPrefix,
    /// Mooncake's synthetic trace (a window of it).
    MooncakeSynthetic,
    /// Mooncake's conversation trace (a window of it).
    MooncakeConversation,
    /// Multi-turn chat under shared system prompts.
    MultiTurn,
    /// Every prompt unique (the control).
    NoSharing,
    /// Coding-agent sessions: contexts growing by tool output every turn (seeded generator).
    Agentic,
    /// Multi-turn chat whose every conversation has its own system prompt: all reuse is within
    /// a session (assess's "session affinity would do"; not part of `--full`).
    SessionsOnly,
}

/// Options of `cargo xtask bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchOptions {
    /// Which benchmark.
    #[arg(value_enum)]
    pub what: BenchTarget,
    /// The big sweep: 4, 8 and 16 replicas, two KV capacities, every workload, a load ladder.
    #[arg(long)]
    pub full: bool,
    /// Workloads (default: shared-prefix, mooncake-synthetic, no-sharing; --full: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub workloads: Vec<WorkloadKind>,
    /// Policies (default: all): kv, round-robin, least-request, random, session, approx-prefix.
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<Policy>,
    /// Peer routers to run after the policies (issue 7): `all`, a product (vllm-router, smg,
    /// sglang-router, litellm, dynamo) or a line (`vllm-router:kv_aware`); each is installed into
    /// its own venv under <cache>/peers on first use.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Fleet sizes (default 4; --full: 4,8,16). Loads scale with the fleet (given for 4).
    #[arg(long, value_delimiter = ',')]
    pub replicas: Vec<usize>,
    /// KV capacity per replica in 16-token blocks (default 32768; --full: 8192,32768).
    #[arg(long, value_delimiter = ',')]
    pub gpu_blocks: Vec<usize>,
    /// Shared-prefix load ladder, requests per model second for 4 replicas
    /// (default 6; --full: 2,4,6,8,10).
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Shared-prefix groups (llm-d: 150). Fewer make a shorter run that ends before the fleet
    /// reaches its steady state (a request decodes for ~100 model s).
    #[arg(long, default_value_t = 150)]
    pub groups: usize,
    /// Shared-prefix output tokens (llm-d: 1000).
    #[arg(long, default_value_t = 1000)]
    pub output_tokens: u32,
    /// First Mooncake record replayed (default: the synthetic trace's last 500 records, where
    /// its reuse is; the conversation trace from 0).
    #[arg(long)]
    pub mooncake_start: Option<usize>,
    /// Mooncake records replayed.
    #[arg(long, default_value_t = 500)]
    pub mooncake_count: usize,
    /// The simulator's speed-up over real time.
    #[arg(long, default_value_t = 4.0)]
    pub time_scale: f64,
    /// TTFT SLO for goodput and the highest load meeting it, model ms.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ms: f64,
    /// Requests in flight at most (client threads).
    #[arg(long, default_value_t = 384)]
    pub concurrency: usize,
    /// Longest wall time of one policy's replay, s (later arrivals are recorded as not sent).
    #[arg(long, default_value_t = 300)]
    pub max_run_s: u64,
    /// Engine max-model-len; longer Mooncake records are dropped (and reported).
    #[arg(long, default_value_t = 131_072)]
    pub max_model_len: u32,
    /// Seed of the synthetic workloads.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A scoring setting for the indexer, `key=value` as in its `[scoring]` table (repeatable;
    /// e.g. `--scoring itl_objective_s=0.0125`); it replaces the value the stack writes, and is
    /// taken as given, in wall time (the stack's own priors are its model-time defaults over
    /// `--time-scale`). The report's command line shows it.
    #[arg(long, value_parser = parse_scoring_setting)]
    pub scoring: Vec<String>,
    /// An index setting for the indexer, `key=value` as in its `[index]` table (repeatable;
    /// e.g. `--index kv_cache_group=0` to index group 0 only).
    #[arg(long, value_parser = parse_index_setting)]
    pub index: Vec<String>,
    /// A setting of the filter's configuration, `key=value` with a number or true/false
    /// (repeatable; e.g. `--filter complete_hold_ms=0`), for the kv lines' Envoy.
    #[arg(long, value_parser = parse_filter_setting)]
    pub filter: Vec<(String, serde_json::Value)>,
    /// The replicas' KV cache groups (`kvroute-sim --kv-cache-layout`: `full`, `gemma3`,
    /// `gpt-oss`, or a list such as `sliding_window:512,full_attention`).
    #[arg(long, default_value = "full")]
    pub kv_cache_layout: String,
    /// Where the report goes (its generated section is replaced).
    #[arg(long, default_value = "docs/benchmarks.md")]
    pub out: PathBuf,
    /// Do not write the report (results still go to <target>/bench/routing/).
    #[arg(long)]
    pub no_report: bool,
    /// Do not run setup first.
    #[arg(long)]
    pub no_setup: bool,
    /// Do not build; use the release binaries and .wasm already built.
    #[arg(long)]
    pub no_build: bool,
    /// The filter build of the lines through the filter (kv, random, approx-prefix): `wasm`
    /// (proxy-wasm, one VM per Envoy worker) or `native` (the Envoy dynamic module).
    /// `bench filter` measures both regardless.
    #[arg(long, default_value_t = FilterBuild::Wasm)]
    pub filter_build: FilterBuild,
    /// The lines through the filter send routed requests through Envoy's `override_host` load
    /// balancing on `x-kvroute-destinations` (the choice, then the runner-up, tried in order on
    /// retries) instead of the ORIGINAL_DST cluster (docs/filter.md "Retrying onto the runner-up").
    #[arg(long)]
    pub override_host: bool,
    /// Runs every line of each workload this many times, interleaved (all lines, then all lines
    /// again), and prints each line's spread (median, min, max) and its router CPU against the
    /// first load-only line's, round by round. Later rounds are labelled `<line> (run k)`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub repeat: u32,
    /// Trace replay, fleet speeds and scale-out (boxed: the options of every command share one
    /// enum).
    #[command(flatten)]
    pub fleet: Box<FleetOptions>,
}

/// `cargo xtask bench routing` options for replaying a trace file, heterogeneous fleets and
/// scale-out.
#[derive(Debug, Clone, Args)]
pub struct FleetOptions {
    /// Replay a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids`, optional `session`, sent as `x-session-id`); its name in the report comes from
    /// the file name. Without `--workloads`, only the trace runs.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per hash id of `--trace` (Mooncake's traces: 512).
    #[arg(long, default_value_t = workloads::MOONCAKE_BLOCK_TOKENS)]
    pub trace_block_tokens: u32,
    /// Arrival compression of `--trace`: timestamps are divided by this (a session's requests
    /// keep their order).
    #[arg(long, default_value_t = 1.0)]
    pub trace_rate: f64,
    /// First record of `--trace` replayed (0-based).
    #[arg(long, default_value_t = 0)]
    pub trace_start: usize,
    /// Records of `--trace` replayed (default: to the end).
    #[arg(long)]
    pub trace_count: Option<usize>,
    /// Per-replica speed factors (`1,1,0.5,0.5`), one per replica of the fleet, passed to each
    /// `kvroute-sim` as `--speed` (a step takes 1/speed as long); the report compares each
    /// replica's share of requests and prefill work with its share of capacity.
    #[arg(long, value_delimiter = ',', value_parser = fleet::parse_speed)]
    pub replica_speeds: Vec<f64>,
    /// Scale-out: the fleet's last replica starts cold once this fraction (0 < f < 1) of the
    /// workload's arrival span has passed (configured in the indexer and Envoy from the start);
    /// the report shows its share of requests after joining and the hit rate before and after.
    #[arg(long)]
    pub scale_out_at: Option<f64>,
    /// Gateways in front of the same replicas for the lines through the filter (kv, random,
    /// approx-prefix): N Envoy + indexer pairs on loopback, each indexer following every
    /// replica; a list runs each (`1,2,3`). With more than one, the client spreads requests over
    /// them as a Kubernetes Service would: round robin, or by session (a hash of
    /// `x-session-id`) when the workload has sessions. Plain-Envoy and shadow lines keep one.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub gateways: Vec<usize>,
    /// With more than one gateway: `on` shares the indexers' decisions (`[peers]`) through one
    /// redis-server the benchmark starts, `off` runs the same gateways without `[peers]`;
    /// `on,off` runs both, showing the gap the sharing closes.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "on")]
    pub peer_sharing: Vec<PeerSharing>,
    /// With more than one gateway: `auto` sends a session's requests to one gateway (a hash of
    /// its session) when the workload has sessions, `round-robin` spreads every request in turn,
    /// so a session's turns reach different gateways (a Service without session affinity).
    #[arg(long, value_enum, default_value = "auto")]
    pub gateway_spread: GatewaySpread,
}

/// Most gateways `--gateways` starts (each is an Envoy and an indexer on a 2-core machine).
const MAX_GATEWAYS: usize = 8;

/// What the benchmark asks of its driver: `cargo xtask setup` (installs the tokenizer, the venv
/// and Envoy), run unless `--no-setup`.
pub type Setup<'a> = &'a dyn Fn(&Layout) -> Result<()>;

/// Runs `cargo xtask bench ...`.
pub fn run(layout: &Layout, opts: &BenchOptions, setup: Setup) -> Result<()> {
    match opts.what {
        BenchTarget::Routing => routing(layout, opts, setup),
        BenchTarget::Filter => filter_costs::run(layout, opts.no_setup, opts.no_build, setup),
    }
}

/// The resolved plan of a run.
struct Plan {
    workloads: Vec<WorkloadKind>,
    policies: Vec<Policy>,
    replicas: Vec<usize>,
    gpu_blocks: Vec<usize>,
    rates: Vec<f64>,
}

impl Plan {
    fn from(opts: &BenchOptions) -> Result<Self> {
        let or = |given: &[usize], quick: &[usize], full: &[usize]| -> Vec<usize> {
            if !given.is_empty() {
                given.to_vec()
            } else if opts.full {
                full.to_vec()
            } else {
                quick.to_vec()
            }
        };
        let workloads = if !opts.workloads.is_empty() {
            opts.workloads.clone()
        } else if opts.fleet.trace.is_some() {
            Vec::new()
        } else if opts.full {
            WorkloadKind::value_variants()
                .iter()
                .copied()
                .filter(|&k| k != WorkloadKind::SessionsOnly)
                .collect()
        } else {
            vec![
                WorkloadKind::SharedPrefix,
                WorkloadKind::MooncakeSynthetic,
                WorkloadKind::NoSharing,
            ]
        };
        let policies = if opts.policies.is_empty() {
            Policy::DEFAULT.to_vec()
        } else {
            opts.policies.clone()
        };
        let rates = if !opts.rates.is_empty() {
            opts.rates.clone()
        } else if opts.full {
            vec![2.0, 4.0, 6.0, 8.0, 10.0]
        } else {
            vec![6.0]
        };
        let plan = Self {
            workloads,
            policies,
            replicas: or(&opts.replicas, &[4], &[4, 8, 16]),
            gpu_blocks: or(&opts.gpu_blocks, &[32_768], &[8_192, 32_768]),
            rates,
        };
        if plan.replicas.contains(&0) || plan.gpu_blocks.iter().any(|&b| b < 64) {
            bail!("--replicas must be >= 1 and --gpu-blocks >= 64");
        }
        if plan.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            bail!("--rates must be > 0");
        }
        if !(opts.time_scale.is_finite() && opts.time_scale > 0.0) {
            bail!("--time-scale must be > 0");
        }
        fleet::check_speeds(&opts.fleet.replica_speeds, &plan.replicas)?;
        if let Some(f) = opts.fleet.scale_out_at {
            if !(f.is_finite() && f > 0.0 && f < 1.0) {
                bail!("--scale-out-at must be between 0 and 1 (exclusive), got {f}");
            }
            if plan.replicas.iter().any(|&n| n < 2) {
                bail!("--scale-out-at needs fleets of at least 2 replicas");
            }
        }
        if opts.fleet.gateways.is_empty()
            || opts
                .fleet
                .gateways
                .iter()
                .any(|&n| n == 0 || n > MAX_GATEWAYS)
        {
            bail!("--gateways must be between 1 and {MAX_GATEWAYS}");
        }
        if opts.fleet.peer_sharing.is_empty() {
            bail!("--peer-sharing needs on, off or both");
        }
        if opts.fleet.gateways.iter().any(|&n| n > 1) && opts.fleet.scale_out_at.is_some() {
            bail!("--scale-out-at runs with one gateway only (drop --gateways)");
        }
        if !(opts.fleet.trace_rate.is_finite() && opts.fleet.trace_rate > 0.0) {
            bail!("--trace-rate must be > 0");
        }
        if opts.fleet.trace_block_tokens == 0 || opts.fleet.trace_count == Some(0) {
            bail!("--trace-block-tokens and --trace-count must be > 0");
        }
        if let Some(path) = &opts.fleet.trace {
            // Read it now: a bad file fails before setup, builds and replicas.
            trace::load(path, "trace", trace_options(opts))?;
        }
        Ok(plan)
    }
}

impl Plan {
    /// Every line of a workload: each policy with each of its gateway setups.
    fn lines(&self, opts: &BenchOptions) -> Vec<(Policy, GatewaySetup)> {
        self.policies
            .iter()
            .flat_map(|&p| {
                GatewaySetup::for_policy(p, &opts.fleet.gateways, &opts.fleet.peer_sharing)
                    .into_iter()
                    .map(move |s| (p, s))
            })
            .collect()
    }
}

/// Builds the workloads of `kind` for a fleet of `replicas` (loads given for 4 replicas scale).
fn build_workloads(
    layout: &Layout,
    kind: WorkloadKind,
    opts: &BenchOptions,
    plan: &Plan,
    replicas: usize,
) -> Result<Vec<Workload>> {
    let fleet = replicas as f64 / 4.0;
    let data = layout.root.join("bench").join("data").join("mooncake");
    Ok(match kind {
        WorkloadKind::SharedPrefix => {
            let sp = SharedPrefix {
                groups: opts.groups,
                output_tokens: opts.output_tokens,
                ..SharedPrefix::llm_d(opts.seed)
            };
            plan.rates
                .iter()
                .map(|r| sp.at_rate(r * fleet))
                .collect::<Result<_>>()?
        }
        WorkloadKind::MooncakeSynthetic | WorkloadKind::MooncakeConversation => {
            let trace = if kind == WorkloadKind::MooncakeSynthetic {
                MooncakeTrace::Synthetic
            } else {
                MooncakeTrace::Conversation
            };
            let records = workloads::read_mooncake(&data, trace)?;
            let start = opts.mooncake_start.unwrap_or(match trace {
                MooncakeTrace::Synthetic => records.len().saturating_sub(opts.mooncake_count),
                MooncakeTrace::Conversation => 0,
            });
            let mut w = workloads::mooncake(
                trace,
                &records,
                MooncakeWindow {
                    start,
                    count: opts.mooncake_count,
                    rate_multiplier: fleet,
                    max_model_len: opts.max_model_len,
                    max_output_tokens: 2_000,
                },
            )?;
            if replicas != 4 {
                w.notes.push(format!(
                    "arrivals compressed x{fleet} for {replicas} replicas (the trace's own rate is for 4)"
                ));
            }
            vec![w]
        }
        WorkloadKind::MultiTurn | WorkloadKind::SessionsOnly => {
            let sessions_only = kind == WorkloadKind::SessionsOnly;
            let mt = MultiTurn {
                conversations: 100,
                turns: 4,
                // sessions-only: one system prompt per conversation.
                system_prompts: if sessions_only { 100 } else { 10 },
                system_tokens: 3_000,
                user_tokens: 300,
                reply_tokens: 200,
                turn_gap_s: 20.0,
                seed: opts.seed,
            };
            let mut w = mt.at_rate(0.6 * fleet)?;
            if sessions_only {
                w.name = "sessions-only".to_string();
                w.description = format!(
                    "sessions only: {} (one per conversation: no reuse across sessions)",
                    w.description.replace(" shared ", " distinct ")
                );
            }
            vec![w]
        }
        WorkloadKind::NoSharing => {
            let ns = NoSharing {
                requests: 400,
                min_tokens: 1_000,
                max_tokens: 6_000,
                output_tokens: 200,
                seed: opts.seed,
            };
            vec![ns.at_rate(14.0 * fleet)?]
        }
        WorkloadKind::Agentic => {
            let sessions = ((48.0 * fleet).round() as usize).max(1);
            vec![agentic::Agentic::coding_agents(sessions, opts.seed).build()?]
        }
    })
}

/// Every workload of the run for a fleet of `replicas`: the named kinds, then `--trace`.
fn all_workloads(
    layout: &Layout,
    opts: &BenchOptions,
    plan: &Plan,
    replicas: usize,
) -> Result<Vec<Workload>> {
    let mut out = Vec::new();
    for &kind in &plan.workloads {
        out.extend(build_workloads(layout, kind, opts, plan, replicas)?);
    }
    if let Some(path) = &opts.fleet.trace {
        let taken: Vec<String> = WorkloadKind::value_variants()
            .iter()
            .filter_map(|k| Some(k.to_possible_value()?.get_name().to_string()))
            .collect();
        let taken: Vec<&str> = taken.iter().map(String::as_str).collect();
        let name = trace::workload_name(path, &taken);
        out.push(trace::load(path, &name, trace_options(opts))?);
    }
    Ok(out)
}

/// How `--trace` is cut and paced.
fn trace_options(opts: &BenchOptions) -> trace::TraceOptions {
    trace::TraceOptions {
        block_tokens: opts.fleet.trace_block_tokens,
        rate: opts.fleet.trace_rate,
        start: opts.fleet.trace_start,
        count: opts.fleet.trace_count,
        max_model_len: opts.max_model_len,
        max_output_tokens: 2_000,
    }
}

fn routing(layout: &Layout, opts: &BenchOptions, setup: Setup) -> Result<()> {
    supervisor::install_ctrl_c()?;
    let plan = Plan::from(opts)?;
    let begun = Instant::now();
    if !opts.no_setup {
        setup(layout)?;
    }
    if !opts.no_build {
        filter_build::build_stack(layout, false, &[opts.filter_build])?;
    }
    let out_dir = layout.target_dir.join("bench").join("routing");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;

    if !opts.fleet.replica_speeds.is_empty() {
        fleet::check_sim_has_speed(&Binaries::new(layout, "release").sim)?;
    }
    // The cost model of the ideal bound: the simulator's own defaults, then what a running
    // replica reports.
    let mut sim_latency = ideal::SimLatency::from_sim_help(&Binaries::new(layout, "release").sim)?;
    let mut results: Vec<WorkloadResults> = Vec::new();
    // One Redis for every line whose gateways share decisions (kept for the whole run; each
    // line's indexers are fresh, so no message outlives its line).
    let shares = plan.policies.iter().any(|&p| {
        GatewaySetup::for_policy(p, &opts.fleet.gateways, &opts.fleet.peer_sharing)
            .iter()
            .any(|s| s.sharing)
    });
    let redis = if shares {
        Some(RedisServer::start("bench")?)
    } else {
        None
    };
    let peer_redis = redis.as_ref().map(|r| PeerRedis {
        addr: r.addr(),
        password: r.password.clone(),
        channel: "kvroute:bench".to_string(),
    });
    let mut peer_bench = peers::PeerBench::new(
        peers::select(&opts.peers)?,
        layout.cache_dir.clone(),
        peers::PeerEnv {
            root: layout.root.clone(),
            model: "qwen3".to_string(),
            model_dir: layout.model_dir(),
            block_size: 16,
            gpu_blocks: 0,
            topic: "kv-events".to_string(),
            work_dir: out_dir.clone(),
            kvroute_addr: None,
        },
        peers::run::PeerRunConfig {
            model: "qwen3".to_string(),
            time_scale: opts.time_scale,
            concurrency: opts.concurrency,
            max_wall: Duration::from_secs(opts.max_run_s),
        },
    );
    for &replicas in &plan.replicas {
        for &gpu_blocks in &plan.gpu_blocks {
            let cfg = StackConfig {
                replicas,
                model: "qwen3".to_string(),
                model_dir: layout.model_dir(),
                block_size: 16,
                gpu_blocks,
                time_scale: opts.time_scale,
                hash_algo: "sha256_cbor".to_string(),
                envoy_concurrency: 2,
                sim_args: vec![
                    "--max-model-len".into(),
                    opts.max_model_len.to_string(),
                    "--kv-cache-layout".into(),
                    opts.kv_cache_layout.clone(),
                ],
                scoring: opts.scoring.clone(),
                index: opts.index.clone(),
                filter: opts.filter.clone(),
            };
            let work_dir = out_dir.join(format!("{replicas}x{gpu_blocks}"));
            let mut stack = Stack::new(
                layout,
                cfg,
                Binaries::new(layout, "release").with_filter(layout, opts.filter_build),
                work_dir.clone(),
                true,
            )?;
            for index in 0..replicas {
                stack.set_replica_args(index, fleet::sim_args(&opts.fleet.replica_speeds, index));
            }
            stack.set_health_checks(opts.fleet.scale_out_at.is_some());
            stack.set_override_host(opts.override_host);
            for workload in all_workloads(layout, opts, &plan, replicas)? {
                let hits = policies::ceiling_hits(&workload, 16);
                let ceiling = policies::ceiling_of(&workload, &hits).hit_rate();
                let uncached_after = |hits: &[u64]| -> Vec<u64> {
                    workload
                        .requests
                        .iter()
                        .zip(hits)
                        .map(|(r, h)| (r.num_tokens() as u64).saturating_sub(*h))
                        .collect()
                };
                let uncached = uncached_after(&hits);
                let uncached_fleet_kv = uncached_after(&policies::fleet_cache_hits(
                    &workload,
                    16,
                    replicas * gpu_blocks,
                ));
                println!(
                        "\n==> bench: {} at {} on {replicas} replicas x {gpu_blocks} blocks: {} requests, {:.0} model s ({:.0} wall s at x{}), {:.1}M prompt tokens, ceiling {:.1} %",
                        workload.name,
                        workload.load_label(),
                        workload.requests.len(),
                        workload.span_s(),
                        workload.span_s() / opts.time_scale,
                        opts.time_scale,
                        workload.prompt_tokens() as f64 / 1e6,
                        ceiling * 100.0
                    );
                let slot = match results.iter().position(|w| w.name == workload.name) {
                    Some(i) => i,
                    None => {
                        results.push(WorkloadResults {
                            name: workload.name.clone(),
                            description: workload.description.clone(),
                            notes: Vec::new(),
                            runs: Vec::new(),
                            spreads: Vec::new(),
                        });
                        results.len() - 1
                    }
                };
                for note in &workload.notes {
                    if !results[slot].notes.contains(note) {
                        results[slot].notes.push(note.clone());
                    }
                }
                let context = |policy: &str| RunContext {
                    workload: workload.name.clone(),
                    load: workload.load_label(),
                    offered_rate: workload.offered_rate(),
                    replicas,
                    gpu_blocks,
                    policy: policy.to_string(),
                    ceiling,
                    time_scale: opts.time_scale,
                    slo_ms: opts.slo_ms,
                };
                let lines = plan.lines(opts);
                let rounds = (1..=opts.repeat).flat_map(|k| lines.iter().map(move |&l| (k, l)));
                for (round, (policy, setup)) in rounds {
                    let ctx = context(&repeats::run_label(&setup.label(policy.name()), round));
                    let extras = RunExtras {
                        hits: &hits,
                        uncached: &uncached,
                        uncached_fleet_kv: &uncached_fleet_kv,
                    };
                    let line = Line {
                        policy,
                        gateways: setup,
                        peers: peer_redis.as_ref().filter(|_| setup.sharing),
                    };
                    let summary = match run_policy(
                        &layout.envoy_bin(),
                        &mut stack,
                        line,
                        &workload,
                        &ctx,
                        opts,
                        &work_dir,
                        &extras,
                        &mut sim_latency,
                    ) {
                        Ok(s) => s,
                        Err(e) if supervisor::interrupted() => return Err(e),
                        Err(e) => {
                            println!("    {}: FAILED: {e:#}", ctx.policy);
                            RunSummary::failed(&ctx, workload.requests.len(), format!("{e:#}"))
                        }
                    };
                    print_line(&summary);
                    results[slot].runs.push(summary);
                    write_json(&out_dir.join("results.json"), &results)?;
                }
                // This load point's and fleet's runs (the workload's results hold every one).
                let ours: Vec<RunSummary> = results[slot]
                    .runs
                    .iter()
                    .filter(|r| {
                        r.load == workload.load_label()
                            && r.replicas == replicas
                            && r.gpu_blocks == gpu_blocks
                    })
                    .cloned()
                    .collect();
                if opts.repeat > 1 {
                    let labels: Vec<String> =
                        lines.iter().map(|(p, s)| s.label(p.name())).collect();
                    let baseline = lines
                        .iter()
                        .find(|(p, s)| p.load_only() && s.gateways <= 1)
                        .map(|(p, s)| s.label(p.name()));
                    let spreads =
                        repeats::spreads(&ours, &labels, opts.repeat, baseline.as_deref());
                    repeats::print(&spreads, opts.repeat);
                    results[slot].spreads.extend(spreads);
                    write_json(&out_dir.join("results.json"), &results)?;
                }
                if !peer_bench.is_empty() {
                    let ctx = context("");
                    peer_bench.set_fleet(gpu_blocks, &work_dir);
                    peer_bench.run_workload(&mut stack, &workload, &ctx, &ours, print_line)?;
                }
            }
            stack.stop("");
        }
    }

    let mut facts = RunFacts {
        command: command_line(),
        date: utc_now(),
        machine: machine_facts(),
        revision: git_revision(&layout.root),
        stack: format!(
            "kvroute-sim replicas (block size 16, sha256_cbor, default cost model: 30k prefill tokens/s, 6 ms decode step), time scale x{}, kvroute-indexer, {} with 2 workers and the filter's {} build, all on 127.0.0.1; open-loop client with at most {} requests in flight",
            opts.time_scale,
            envoy_version(&layout.envoy_bin()),
            opts.filter_build,
            opts.concurrency
        ),
        filter_build: opts.filter_build.to_string(),
        total_wall_s: begun.elapsed().as_secs_f64(),
    };
    if opts.override_host {
        facts.stack.push_str(
            "; the filter's lines routed through Envoy's override_host load balancing on x-kvroute-destinations (the choice, then the runner-up on a retry) instead of the ORIGINAL_DST cluster",
        );
    }
    if opts.fleet.gateways.iter().any(|&n| n > 1) {
        facts.stack.push_str(
            "; lines named `(N gateways, shared|unshared)` ran N Envoy + indexer pairs in front of the same replicas, each indexer following every replica, the client spreading requests over them round robin (by a hash of `x-session-id` when the workload has sessions), the indexers sharing decisions through one local redis-server (`[peers]`) or not; their router CPU and memory sum every gateway's Envoy and indexer (not Redis)",
        );
    }
    drop(redis);
    write_json(&out_dir.join("results.json"), &results)?;
    println!(
        "\nbench: results in {}",
        out_dir.join("results.json").display()
    );
    if !opts.no_report {
        let out = layout.root.join(&opts.out);
        let plot_dir = out.parent().unwrap_or(&layout.root).join("benchmarks");
        let plots = report::write_plots(&plot_dir, &results)?;
        let section = report::render_section(&facts, &results, &plots);
        report::splice_into(&out, PREAMBLE, &section)?;
        println!(
            "bench: wrote {} and {} plots in {}",
            out.display(),
            plots.len(),
            plot_dir.display()
        );
    }
    if !peer_bench.is_empty() {
        let doc = layout.root.join(&opts.out);
        let peer_facts = peers::PeerFacts {
            command: facts.command.clone(),
            date: facts.date.clone(),
            machine: facts.machine.clone(),
        };
        peer_bench.finish(
            &out_dir,
            (!opts.no_report).then_some((doc.as_path(), peer_facts)),
        )?;
    }
    for check in report::check_goals(&results) {
        println!(
            "goal: {} [{}]: {} -> {}",
            check.goal,
            check.scope,
            check.measured,
            match check.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "n/a",
            }
        );
    }
    Ok(())
}

const PREAMBLE: &str = "# Benchmarks\n\nProduced by `cargo xtask bench routing` (see below for the command of the numbers shown).\n";

/// Per-workload inputs of [`run_policy`] computed once for every policy.
struct RunExtras<'a> {
    /// The ceiling's hit tokens of every request.
    hits: &'a [u64],
    /// Prompt tokens every request must compute at best (its tokens minus its ceiling hits).
    uncached: &'a [u64],
    /// The same with the fleet's KV as one LRU cache ([`policies::fleet_cache_hits`]).
    uncached_fleet_kv: &'a [u64],
}

#[allow(clippy::too_many_arguments)]
/// One line of the report: a policy behind its gateways.
#[derive(Clone, Copy)]
struct Line<'a> {
    policy: Policy,
    gateways: GatewaySetup,
    /// The Redis the gateways share through (`gateways.sharing`).
    peers: Option<&'a PeerRedis>,
}

#[allow(clippy::too_many_arguments)]
fn run_policy(
    envoy: &Path,
    stack: &mut Stack,
    line: Line<'_>,
    workload: &Workload,
    ctx: &RunContext,
    opts: &BenchOptions,
    work_dir: &Path,
    extras: &RunExtras<'_>,
    sim_latency: &mut ideal::SimLatency,
) -> Result<RunSummary> {
    // Cold start: fresh replicas and a fresh router for every policy; with a scale-out, the
    // last replica stays down until its time.
    let replica_addrs = stack.replica_addrs();
    let late = opts
        .fleet
        .scale_out_at
        .map(|f| (replica_addrs.len() - 1, f * workload.span_s()));
    let policy = line.policy;
    policy.stop(stack);
    stack.stop_replicas();
    let later: Vec<usize> = late.iter().map(|&(i, _)| i).collect();
    stack.start_replicas_except(&later)?;
    if !sim_latency.from_replica {
        sim_latency.refresh_from(&replica_addrs[0]);
    }
    stack.set_gateways(line.gateways.gateways, line.peers.cloned())?;
    let started_router = policy.start(stack, envoy, work_dir);
    // Later lines start with one gateway, as before.
    let gateway_addrs = stack.kvroute_addrs();
    let indexer_addrs: Vec<String> = (0..stack.gateways())
        .filter_map(|k| stack.gateway_indexer_addr(k))
        .collect();
    stack.set_gateways(1, None)?;
    let router = started_router?;
    // Prompts (event and replay sockets) and admin endpoints stay on loopback.
    stack.check_loopback_only()?;
    if let Some((index, _)) = late {
        if policy.uses_indexer() {
            wait_marked_down(stack, index)?;
        }
    }
    let targets = if line.gateways.gateways > 1 {
        Targets::spread(gateway_addrs, workload, opts.fleet.gateway_spread)
    } else {
        Targets::one(router.addr.clone())
    };
    let up = |i: usize, joined: bool| late.is_none_or(|(l, _)| l != i || joined);
    let scrape = |joined: bool| -> Result<Vec<ReplicaCounters>> {
        replica_addrs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                if up(i, joined) {
                    ReplicaCounters::scrape(a)
                } else {
                    Ok(ReplicaCounters::default())
                }
            })
            .collect()
    };
    let before = scrape(false)?;
    let gateway_facts = (line.gateways.gateways > 1).then(|| GatewayFacts {
        gateways: line.gateways.gateways,
        sharing: line.gateways.sharing,
        spread: targets.mode().to_string(),
    });
    let cfg = ReplayConfig {
        targets,
        model: "qwen3".to_string(),
        time_scale: opts.time_scale,
        concurrency: opts.concurrency,
        io_timeout: Duration::from_secs(120),
        max_wall: Duration::from_secs(opts.max_run_s),
        client: replay::ClientForm::default(),
    };
    let progress = Progress::default();
    let total = workload.requests.len();
    let mut router_groups = stack.router_process_groups();
    router_groups.extend(&router.own_groups);
    let usage_before = router_usage::sample(&router_groups);
    let started = Instant::now();
    let model_s = |at: Instant| at.duration_since(started).as_secs_f64() * opts.time_scale;
    let mut samples: Vec<scaleout::Sample> = Vec::new();
    let mut joined_s: Option<f64> = None;
    let (outcomes, wall) = thread::scope(|scope| -> Result<_> {
        let runner = scope.spawn(|| replay::replay(&cfg, workload, &progress));
        let mut last = Instant::now();
        let mut last_sample: Option<Instant> = None;
        while !runner.is_finished() {
            thread::sleep(Duration::from_millis(200));
            if let Some((index, at_s)) = late {
                if joined_s.is_none() && model_s(Instant::now()) >= at_s {
                    stack.start_replica(index)?;
                    joined_s = Some(model_s(Instant::now()));
                    println!(
                        "    {:<14} replica r{index} joined at {:.0} model s",
                        ctx.policy,
                        joined_s.unwrap_or(0.0)
                    );
                }
                if last_sample.is_none_or(|t| t.elapsed() >= Duration::from_millis(500)) {
                    last_sample = Some(Instant::now());
                    let now = scrape(joined_s.is_some())?;
                    samples.push(scaleout::Sample {
                        model_s: model_s(Instant::now()),
                        counters: now.iter().zip(&before).map(|(a, b)| a.since(b)).collect(),
                    });
                }
            }
            if last.elapsed() >= Duration::from_secs(15) {
                eprintln!(
                    "    {:<14} {:>5}/{total} done, {} errors, {:.0} s",
                    ctx.policy,
                    progress.done.load(Ordering::Relaxed),
                    progress.errors.load(Ordering::Relaxed),
                    started.elapsed().as_secs_f64()
                );
                last = Instant::now();
            }
        }
        runner
            .join()
            .map_err(|_| anyhow::anyhow!("the replay thread panicked"))?
    })?;
    let usage_after = router_usage::sample(&router_groups);
    if supervisor::interrupted() {
        bail!("interrupted");
    }
    stack.check_alive()?;
    let after = scrape(joined_s.is_some())?;
    let routed_by_indexer = policy.uses_indexer() && policy != Policy::Shadow;
    let decisions = if routed_by_indexer {
        // Every gateway's indexer counted the decisions it made.
        let mut d = decision_counts::DecisionCounts::default();
        for addr in &indexer_addrs {
            d.add(&decision_counts::DecisionCounts::scrape(addr)?);
        }
        println!("    {:<14} decisions {d}", ctx.policy);
        Some(d)
    } else {
        None
    };
    let hit_prediction = if routed_by_indexer {
        // Every gateway's indexer predicted the hits of the requests it routed.
        let mut p = prediction::HitPrediction::default();
        for addr in &indexer_addrs {
            p.add(&prediction::HitPrediction::scrape(addr)?);
        }
        if let Some(share) = p.exact_share() {
            println!(
                "    {:<14} hit predictions exact {:.1} % of {} (under {}, over {})",
                ctx.policy,
                share * 100.0,
                p.compared(),
                p.under,
                p.over
            );
        }
        Some(p)
    } else {
        None
    };
    let assessed = if policy == Policy::Shadow {
        // SIGINT ends assess's window; it scrapes once more and writes its report.
        stack.finish_assess()?;
        let path = policies::assess_report_path(work_dir);
        let figures = assess::AssessFigures::read(&path, "qwen3")?;
        // Kept per workload and load beside the request logs.
        let keep = work_dir.join(format!(
            "assess-{}-{}.json",
            workload.name,
            workload.load_label().replace([' ', '/'], "")
        ));
        fs::copy(&path, &keep).with_context(|| format!("copying {}", path.display()))?;
        Some(figures)
    } else {
        None
    };
    let deltas: Vec<ReplicaCounters> = after.iter().zip(&before).map(|(a, b)| a.since(b)).collect();
    let mut summary = RunSummary::new(ctx, &outcomes, wall, &deltas);
    // Nothing sampled (no process found) is reported as unknown, not as free.
    summary.hit_prediction = hit_prediction;
    summary.decisions = decisions;
    summary.router_cost = (usage_after.processes > 0)
        .then(|| router_usage::RouterCost::between(&usage_before, &usage_after, total));
    if let Some(c) = &summary.router_cost {
        println!(
            "    {:<14} router CPU {:.2} s per 1k requests ({}), peak RSS {:.0} MB",
            ctx.policy,
            c.cpu_s_per_1k,
            c.split(),
            c.peak_rss_mb
        );
    }
    if !opts.fleet.replica_speeds.is_empty() {
        summary.replica_shares = Some(fleet::shares(&opts.fleet.replica_speeds, &deltas));
    }
    summary.ideal = ideal::bound(extras.uncached, sim_latency);
    summary.ideal_fleet_kv = ideal::bound(extras.uncached_fleet_kv, sim_latency);
    if opts.fleet.scale_out_at.is_none() {
        let speeds = fleet::speeds_or_ones(&opts.fleet.replica_speeds, ctx.replicas);
        summary.greedy_oracle =
            oracle::greedy_oracle(workload, 16, ctx.gpu_blocks, &speeds, sim_latency);
    }
    summary.assess = assessed;
    summary.gateways = gateway_facts;
    if let (Some((index, _)), Some(joined)) = (late, joined_s) {
        samples.push(scaleout::Sample {
            model_s: model_s(Instant::now()),
            counters: deltas.clone(),
        });
        let (before_w, after_w) = split_ceiling(workload, extras.hits, joined * 1000.0);
        summary.scale_out = Some(scaleout::analyse(
            &samples, index, joined, before_w, after_w,
        ));
    } else if late.is_some() {
        println!(
            "    {:<14} the late replica never joined (the replay ended first)",
            ctx.policy
        );
    }
    let log = work_dir.join(format!(
        "requests-{}-{}-{}.jsonl",
        workload.name,
        workload.load_label().replace([' ', '/'], ""),
        ctx.policy.replace([' ', '(', ')', ','], "")
    ));
    write_outcomes(&log, &outcomes, opts.time_scale)?;
    drop(router);
    policy.stop(stack);
    Ok(summary)
}

/// The ceiling hit rates of the requests arriving before and from `at_ms`.
fn split_ceiling(workload: &Workload, hits: &[u64], at_ms: f64) -> (f64, f64) {
    let mut sums = [(0u64, 0u64); 2];
    for (r, h) in workload.requests.iter().zip(hits) {
        let side = &mut sums[usize::from(r.at_ms >= at_ms)];
        side.0 += h;
        side.1 += r.num_tokens() as u64;
    }
    let rate = |(h, q): (u64, u64)| if q > 0 { h as f64 / q as f64 } else { 0.0 };
    (rate(sums[0]), rate(sums[1]))
}

/// Waits until the indexer counts replica `index` (not started yet) as unhealthy, so the replay
/// starts with the fleet as a router would see it before a scale-out.
fn wait_marked_down(stack: &Stack, index: usize) -> Result<()> {
    let addr = format!("127.0.0.1:{}", stack.ports.indexer);
    let name = format!("r{index}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, text) = crate::http::get(&addr, "/debug/replicas", Duration::from_secs(2))?;
        let list: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let down = status == 200
            && list["replicas"].as_array().is_some_and(|l| {
                l.iter().any(|r| {
                    r.get("name").and_then(|n| n.as_str()) == Some(&name)
                        && r.get("healthy").and_then(|h| h.as_bool()) == Some(false)
                })
            });
        if down {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the indexer still counts the not-started replica {name} as healthy after 20 s");
        }
        if supervisor::interrupted() {
            bail!("interrupted");
        }
        thread::sleep(Duration::from_millis(250));
    }
}

fn print_line(s: &RunSummary) {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    println!(
        "    {:<14} hit {:>5.1} % (ceiling {:>5.1} %)  TTFT p50/p90/p99 {:>6}/{:>6}/{:>6} ms  ITL p50 {:>5} ms  {:>7.0} tok/s  SLO {:>5.1} %  imbalance {:.2}  errors {}  ({:.0} s)",
        s.policy,
        s.hit_rate * 100.0,
        s.ceiling * 100.0,
        ms(s.ttft_p50_ms),
        ms(s.ttft_p90_ms),
        ms(s.ttft_p99_ms),
        ms(s.itl_p50_ms),
        s.output_tokens_per_s,
        s.slo_attainment * 100.0,
        s.imbalance,
        s.errors,
        s.wall_s
    );
    for (name, bound) in [
        ("ideal", s.ideal.as_ref()),
        (
            "ideal with the fleet's KV as one LRU cache,",
            s.ideal_fleet_kv.as_ref(),
        ),
        (
            "greedy oracle on the fleet's separate caches,",
            s.greedy_oracle.as_ref().map(|o| &o.ttft),
        ),
    ] {
        if let (Some(i), Some(p90), Some(p99)) = (bound, s.ttft_p90_ms, s.ttft_p99_ms) {
            println!(
                "      {name} TTFT p90/p99 {:.0}/{:.0} ms: this policy {:.2}x/{:.2}x",
                i.p90_ms,
                i.p99_ms,
                p90 / i.p90_ms.max(f64::MIN_POSITIVE),
                p99 / i.p99_ms.max(f64::MIN_POSITIVE)
            );
        }
    }
    if let Some(shares) = &s.replica_shares {
        let line: Vec<String> = shares
            .iter()
            .enumerate()
            .map(|(i, r)| {
                format!(
                    "r{i} x{}: {:.0} % req, {:.0} % prefill of {:.0} % capacity",
                    r.speed,
                    r.request_share * 100.0,
                    r.prefill_share * 100.0,
                    r.capacity_share * 100.0
                )
            })
            .collect();
        println!("      speeds: {}", line.join("; "));
        if let Some(o) = &s.greedy_oracle {
            let shares: Vec<String> = o
                .prefill_shares
                .iter()
                .enumerate()
                .map(|(i, p)| format!("r{i} {:.0} %", p * 100.0))
                .collect();
            println!(
                "      greedy oracle's prefill shares: {}",
                shares.join(", ")
            );
        }
    }
    if let Some(so) = &s.scale_out {
        println!(
            "      scale-out: r{} joined at {:.0} model s; >= 70 % of a share after {}; hit {:.1} % of ceiling {:.1} % before, {:.1} % of {:.1} % after",
            so.replica,
            so.joined_s,
            so.reached_goal_after_s
                .map_or("never".to_string(), |t| format!("{t:.0} s")),
            so.hit_before * 100.0,
            so.ceiling_before * 100.0,
            so.hit_after * 100.0,
            so.ceiling_after * 100.0
        );
    }
    if let Some(a) = &s.assess {
        println!(
            "      assess: {} ({}); predicted hit {:.1} % (measured {:.1} %); thrash {} (recomputed {:.1} %, {:.1} % beyond the fleet's KV, {:.0} preemptions, {:.1} % without recompute)",
            a.verdict,
            a.summary,
            a.predicted_hit_rate * 100.0,
            a.hit_rate * 100.0,
            if a.thrash { "yes" } else { "no" },
            a.recomputed_share * 100.0,
            a.capacity_recomputed_share * 100.0,
            a.preemptions,
            a.hit_rate_without_recompute * 100.0
        );
        if let Some(sh) = &a.shadow {
            println!(
                "      shadow: {} decisions, would save {:.1} % of prompt tokens with what prefix routing keeps cached ({:.1} % against what the balancer left; {:.0} % within sessions, beyond session affinity {:.1} % of its prefill), kvroute's hit {:.1} % vs the balancer's {:.1} %",
                sh.decisions,
                sh.would_save_retained_share * 100.0,
                sh.would_save_share * 100.0,
                sh.within_session_share * 100.0,
                sh.beyond_session_affinity_share * 100.0,
                sh.predicted_hit_rate * 100.0,
                sh.actual_hit_rate * 100.0
            );
        }
    }
    if let Some(e) = &s.first_error {
        println!(
            "      first error: {}",
            e.chars().take(300).collect::<String>()
        );
    }
}

fn write_json(path: &Path, results: &[WorkloadResults]) -> Result<()> {
    let value: Vec<serde_json::Value> = results
        .iter()
        .map(|w| {
            json!({
                "workload": w.name,
                "description": w.description,
                "notes": w.notes,
                "runs": w.runs,
                "spreads": w.spreads,
            })
        })
        .collect();
    fs::write(path, serde_json::to_string_pretty(&value)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

fn write_outcomes(path: &Path, outcomes: &[replay::RequestOutcome], scale: f64) -> Result<()> {
    let mut out = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    for o in outcomes {
        let line = json!({
            "index": o.index,
            "ttft_model_ms": o.ttft_model_ms(scale),
            "engine_ttft_model_ms": o.engine_ttft_model_ms,
            "engine_queue_model_ms": o.engine_queue_model_ms,
            "engine_prefill_model_ms": o.engine_prefill_model_ms,
            "replica_port": o.replica_port,
            "ttft_wall_ms": o.ttft_wall_ms,
            "itl_model_ms": o.itl_model_ms(scale),
            "itl_wall_ms": o.itl_wall_ms,
            "latency_wall_ms": o.latency_wall_ms,
            "send_lag_ms": o.send_lag_ms,
            "prompt_tokens": o.prompt_tokens,
            "cached_tokens": o.cached_tokens,
            "output_tokens": o.output_tokens,
            "error": o.error,
        });
        writeln!(out, "{line}").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Facts for the report

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("cargo xtask {}", args.join(" "))
}

fn machine_facts() -> String {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kb: f64 = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0);
    format!(
        "{model}, {cores} cores available (nproc), {:.1} GiB memory, {}",
        mem_kb / 1024.0 / 1024.0,
        std::env::consts::OS
    )
}

fn git_revision(root: &Path) -> String {
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let rev = run(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = run(&["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{rev} (with uncommitted changes)")
    } else {
        rev
    }
}

fn envoy_version(envoy: &Path) -> String {
    Command::new(envoy)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            let v = text.split_whitespace().find_map(|w| {
                let w = w.split('/').nth(1)?;
                w.chars().next()?.is_ascii_digit().then(|| w.to_string())
            })?;
            Some(format!("Envoy {v}"))
        })
        .unwrap_or_else(|| "Envoy".into())
}

/// The current UTC time as `YYYY-MM-DD HH:MM UTC`.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn parse_scoring_setting(s: &str) -> std::result::Result<String, String> {
    parse_setting(s, "scoring")
}

fn parse_index_setting(s: &str) -> std::result::Result<String, String> {
    parse_setting(s, "index")
}

/// `key=value` -> a TOML line `key = value` of the `[table]` table (the value must be a number
/// or a boolean).
fn parse_setting(s: &str, table: &str) -> std::result::Result<String, String> {
    let (key, value) = split_setting(s, table)?;
    Ok(format!("{key} = {value}"))
}

/// `key=value` -> a field of the filter's JSON configuration (a number or a boolean).
fn parse_filter_setting(s: &str) -> std::result::Result<(String, serde_json::Value), String> {
    let (key, value) = split_setting(s, "filter")?;
    let value: serde_json::Value =
        serde_json::from_str(value).map_err(|e| format!("{value:?}: {e}"))?;
    Ok((key.to_string(), value))
}

/// Splits and checks `key=value`: a plain key, a number or true/false.
fn split_setting<'a>(s: &'a str, table: &str) -> std::result::Result<(&'a str, &'a str), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected key=value"))?;
    let key = key.trim();
    let value = value.trim();
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("{key:?} is not a [{table}] key"));
    }
    if value.parse::<f64>().is_err() && value != "true" && value != "false" {
        return Err(format!("{value:?}: expected a number or true/false"));
    }
    Ok((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(20_148), (2025, 3, 1));
    }

    #[test]
    fn quick_and_full_plans() {
        let parse = |args: &[&str]| {
            #[derive(clap::Parser)]
            struct Cli {
                #[command(flatten)]
                opts: BenchOptions,
            }
            let mut all = vec!["bench"];
            all.extend_from_slice(args);
            <Cli as clap::Parser>::try_parse_from(all).map(|c| c.opts)
        };
        let quick = Plan::from(&parse(&["routing"]).expect("parse")).expect("plan");
        assert_eq!(quick.replicas, [4]);
        assert_eq!(quick.policies.len(), 6);
        assert_eq!(quick.workloads.len(), 3);
        let full = Plan::from(&parse(&["routing", "--full"]).expect("parse")).expect("plan");
        assert_eq!(full.replicas, [4, 8, 16]);
        assert_eq!(full.workloads.len(), 6);
        assert!(full.rates.len() > 1);
        let picked = parse(&[
            "routing",
            "--policies",
            "kv,round-robin",
            "--workloads",
            "no-sharing",
        ])
        .expect("parse");
        let plan = Plan::from(&picked).expect("plan");
        assert_eq!(plan.policies, [Policy::Kv, Policy::RoundRobin]);
        assert_eq!(plan.workloads, [WorkloadKind::NoSharing]);
        assert!(parse(&["routing", "--policies", "bogus"]).is_err());
        assert!(Plan::from(&parse(&["routing", "--replicas", "0"]).expect("parse")).is_err());
    }

    fn parse(args: &[&str]) -> std::result::Result<BenchOptions, clap::Error> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            opts: BenchOptions,
        }
        let mut all = vec!["bench", "routing"];
        all.extend_from_slice(args);
        <Cli as clap::Parser>::try_parse_from(all).map(|c| c.opts)
    }

    #[test]
    fn filter_settings_become_json_fields() {
        let o = parse(&[
            "--filter",
            "complete_hold_ms=0",
            "--filter",
            "debug_headers=true",
        ])
        .expect("parse");
        assert_eq!(
            o.filter,
            [
                ("complete_hold_ms".to_string(), serde_json::json!(0)),
                ("debug_headers".to_string(), serde_json::json!(true)),
            ]
        );
        assert!(
            parse(&["--filter", "mode=shadow"]).is_err(),
            "numbers and booleans only"
        );
    }

    #[test]
    fn repeat_is_one_unless_asked_and_bounded() {
        assert_eq!(parse(&[]).expect("parse").repeat, 1);
        assert_eq!(parse(&["--repeat", "3"]).expect("parse").repeat, 3);
        assert!(parse(&["--repeat", "0"]).is_err());
        assert!(parse(&["--repeat", "21"]).is_err());
    }

    #[test]
    fn override_host_is_off_unless_asked() {
        assert!(!parse(&[]).expect("parse").override_host);
        assert!(parse(&["--override-host"]).expect("parse").override_host);
    }

    #[test]
    fn the_filter_build_is_wasm_unless_named() {
        assert_eq!(parse(&[]).expect("parse").filter_build, FilterBuild::Wasm);
        let native = parse(&["--filter-build", "native"]).expect("parse");
        assert_eq!(native.filter_build, FilterBuild::Native);
        let err = parse(&["--filter-build", "so"]).expect_err("not a build");
        assert!(err.to_string().contains("expected wasm or native"), "{err}");
    }

    #[test]
    fn trace_speed_and_scale_out_flags_are_validated() {
        let plan = |args: &[&str]| Plan::from(&parse(args).expect("parse"));
        // A trace alone runs only the trace; with --workloads, both. The file is read up front.
        let dir = std::env::temp_dir().join(format!("xtask-trace-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("tool_agent.jsonl");
        fs::write(
            &file,
            "{\"timestamp\":0,\"input_length\":600,\"output_length\":4,\"hash_ids\":[1,2]}\n",
        )
        .expect("write");
        let f = file.to_str().expect("utf-8 path");
        let t = parse(&["--trace", f, "--trace-rate", "2"]).expect("parse");
        assert_eq!(
            (
                t.fleet.trace_block_tokens,
                t.fleet.trace_rate,
                t.fleet.trace_start
            ),
            (512, 2.0, 0)
        );
        assert!(Plan::from(&t).expect("plan").workloads.is_empty());
        let both = plan(&["--trace", f, "--workloads", "agentic"]).expect("plan");
        assert_eq!(both.workloads, [WorkloadKind::Agentic]);
        assert!(plan(&["--trace", f, "--trace-rate", "0"]).is_err());
        assert!(plan(&["--trace", f, "--trace-count", "0"]).is_err());
        assert!(
            plan(&["--trace", f, "--trace-start", "5"]).is_err(),
            "empty window"
        );
        let missing = dir.join("missing.jsonl");
        assert!(plan(&["--trace", missing.to_str().expect("utf-8")]).is_err());
        let _ = fs::remove_dir_all(&dir);
        // One speed per replica of every fleet.
        let s = parse(&["--replica-speeds", "1,1,0.5,0.5"]).expect("parse");
        assert_eq!(s.fleet.replica_speeds, [1.0, 1.0, 0.5, 0.5]);
        assert!(Plan::from(&s).is_ok());
        assert!(plan(&["--replica-speeds", "1,0.5"]).is_err());
        assert!(plan(&["--replica-speeds", "1,1,1,1", "--replicas", "4,8"]).is_err());
        assert!(parse(&["--replica-speeds", "1,0,1,1"]).is_err());
        // Scale-out: a fraction strictly inside (0, 1), fleets of 2 or more.
        assert!(plan(&["--scale-out-at", "0.5"]).is_ok());
        for bad in ["0", "1", "1.5", "-0.2"] {
            let arg = format!("--scale-out-at={bad}");
            assert!(plan(&[arg.as_str()]).is_err(), "{bad}");
        }
        assert!(plan(&["--scale-out-at", "0.5", "--replicas", "1"]).is_err());
    }

    #[test]
    fn gateway_flags_are_validated_and_expand_the_filter_lines() {
        let plan = |args: &[&str]| Plan::from(&parse(args).expect("parse"));
        let one = parse(&[]).expect("parse");
        assert_eq!(one.fleet.gateways, [1]);
        assert_eq!(one.fleet.peer_sharing, [PeerSharing::On]);
        let quick = Plan::from(&one).expect("plan");
        assert_eq!(
            quick.lines(&one).len(),
            quick.policies.len(),
            "N = 1: as before"
        );
        let args = [
            "--policies",
            "kv,round-robin",
            "--gateways",
            "1,2",
            "--peer-sharing",
            "on,off",
        ];
        let opts = parse(&args).expect("parse");
        let lines: Vec<String> = Plan::from(&opts)
            .expect("plan")
            .lines(&opts)
            .iter()
            .map(|(p, s)| s.label(p.name()))
            .collect();
        assert_eq!(
            lines,
            [
                "kv",
                "kv (2 gateways, shared)",
                "kv (2 gateways, unshared)",
                "round-robin"
            ]
        );
        assert!(plan(&["--gateways", "0"]).is_err());
        assert!(plan(&["--gateways", "9"]).is_err());
        assert!(plan(&["--gateways", "2", "--scale-out-at", "0.5"]).is_err());
        assert!(parse(&["--peer-sharing", "maybe"]).is_err());
    }

    #[test]
    fn ceilings_split_at_the_join() {
        use workloads::{BenchRequest, Segment};
        let a = Segment::new("a", 0, 64);
        let req = |at_ms: f64, segments: Vec<Segment>| BenchRequest {
            at_ms,
            segments,
            max_tokens: 1,
            session: String::new(),
        };
        let w = Workload {
            name: "t".into(),
            rate: None,
            description: String::new(),
            requests: vec![
                req(0.0, vec![a]),
                req(10.0, vec![a, Segment::new("b", 0, 16)]),
                req(20.0, vec![Segment::new("c", 0, 32)]),
            ],
            notes: Vec::new(),
        };
        let hits = policies::ceiling_hits(&w, 16);
        assert_eq!(hits, [0, 64, 0]);
        // Before 15 ms: 64 of 144 tokens; after: 0 of 32.
        assert_eq!(split_ceiling(&w, &hits, 15.0), (64.0 / 144.0, 0.0));
        assert_eq!(split_ceiling(&w, &hits, 0.0), (0.0, 64.0 / 176.0));
    }
}
