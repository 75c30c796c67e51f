//! One peer line of the routing benchmark: cold replicas, the peer started in front of them, the
//! workload replayed through it with the benchmark's client, the replicas' counters and the
//! router's CPU and memory read around the replay.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{PeerEnv, PeerPolicy, PromptForm, ReplicaInfo, RouterCost, TextVocab};
use crate::replay::{self, ClientForm, Progress, ReplayConfig};
use crate::replica_counters::ReplicaCounters;
use crate::stack::Stack;
use crate::summary::{RunContext, RunSummary};
use crate::supervisor;
use crate::workloads::Workload;

/// Replay settings shared with the benchmark's own policies.
#[derive(Debug, Clone)]
pub struct PeerRunConfig {
    /// Served model name.
    pub model: String,
    /// The simulator's time scale.
    pub time_scale: f64,
    /// Requests in flight at most.
    pub concurrency: usize,
    /// Longest replay, wall time.
    pub max_wall: Duration,
}

/// What one peer line produced.
#[derive(Debug, Clone)]
pub struct PeerRun {
    /// The same summary as the benchmark's own policies.
    pub summary: RunSummary,
    /// Router CPU per 1,000 requests and peak memory (None when it did not start).
    pub cost: Option<RouterCost>,
    /// CPU and memory of helpers that stand in for engine-side code (Dynamo's worker shims).
    pub helper_cost: Option<RouterCost>,
    /// Wall seconds from launch to ready.
    pub startup_s: Option<f64>,
    /// Requests whose response still carried the simulator's own TTFT (`kvroute_sim.ttft_s`).
    /// Without it the client's wall TTFT is multiplied by the time scale, router overhead too.
    pub engine_ttft_relayed: usize,
}

/// Runs `peer` on `workload`; a peer that cannot be installed or started gives a failed summary
/// whose error says so (the caller reports it, never drops it).
pub fn run_line(
    stack: &mut Stack,
    peer: &PeerPolicy,
    workload: &Workload,
    ctx: &RunContext,
    cfg: &PeerRunConfig,
    cache: &Path,
    env: &PeerEnv,
) -> Result<PeerRun> {
    // Cold start: fresh replicas for every line.
    stack.stop_replicas();
    stack.start_replicas()?;
    let replicas = ReplicaInfo::of_stack(stack);
    let mut env = env.clone();
    if peer.launch.needs_kvroute() {
        stack.start_indexer("kv")?;
        stack.start_kvroute_envoy()?;
        env.kvroute_addr = Some(stack.kvroute_addr());
    }
    let run = run_started(stack, peer, workload, ctx, cfg, cache, &env, &replicas);
    if peer.launch.needs_kvroute() {
        stack.stop("envoy-kvroute");
        stack.stop("indexer");
    }
    run
}

/// [`run_line`] once the replicas (and kvroute, for a line on top of it) run.
#[allow(clippy::too_many_arguments)]
fn run_started(
    stack: &mut Stack,
    peer: &PeerPolicy,
    workload: &Workload,
    ctx: &RunContext,
    cfg: &PeerRunConfig,
    cache: &Path,
    env: &PeerEnv,
    replicas: &[ReplicaInfo],
) -> Result<PeerRun> {
    let mut running = match peer.start(replicas, cache, env) {
        Ok(r) => r,
        Err(e) if supervisor::interrupted() => return Err(e),
        Err(e) => {
            return Ok(PeerRun {
                summary: RunSummary::failed(ctx, workload.requests.len(), format!("{e:#}")),
                cost: None,
                helper_cost: None,
                startup_s: None,
                engine_ttft_relayed: 0,
            })
        }
    };
    if peer.launch.needs_kvroute() {
        // The line's routing cost is both layers': LiteLLM, Envoy and the indexer.
        running.router_groups.extend(stack.router_process_groups());
    }
    let startup_s = running.startup_s;
    println!(
        "    {}: ready at {} in {:.1} s",
        peer.name,
        running.base_url(),
        startup_s
    );
    let client = ClientForm {
        text: match running.prompt {
            PromptForm::Text => Some(Arc::new(TextVocab::load(&env.model_dir)?)),
            PromptForm::TokenIds => None,
        },
        headers: running.headers.clone(),
        session_header: running.session_header,
    };
    let replay_cfg = ReplayConfig {
        targets: crate::spread::Targets::one(running.addr.clone()),
        model: cfg.model.clone(),
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        io_timeout: Duration::from_secs(120),
        max_wall: cfg.max_wall,
        client,
    };
    let addrs: Vec<String> = replicas.iter().map(|r| r.http.clone()).collect();
    let before = addrs
        .iter()
        .map(|a| ReplicaCounters::scrape(a))
        .collect::<Result<Vec<_>>>()?;
    let usage_before = running.router_usage();
    let helpers_before = running.helper_usage();
    let progress = Progress::default();
    let total = workload.requests.len();
    let started = Instant::now();
    let (outcomes, wall) = thread::scope(|scope| {
        let runner = scope.spawn(|| replay::replay(&replay_cfg, workload, &progress));
        let mut last = Instant::now();
        while !runner.is_finished() {
            thread::sleep(Duration::from_millis(200));
            if last.elapsed() >= Duration::from_secs(15) {
                eprintln!(
                    "    {:<26} {:>5}/{total} done, {} errors, {:.0} s",
                    peer.name,
                    progress.done.load(Ordering::Relaxed),
                    progress.errors.load(Ordering::Relaxed),
                    started.elapsed().as_secs_f64()
                );
                last = Instant::now();
            }
        }
        runner.join()
    })
    .map_err(|_| anyhow::anyhow!("the replay thread panicked"))??;
    let usage_after = running.router_usage();
    let helpers_after = running.helper_usage();
    if supervisor::interrupted() {
        bail!("interrupted");
    }
    let alive = running.check_alive();
    stack.check_alive()?;
    let after = addrs
        .iter()
        .map(|a| ReplicaCounters::scrape(a))
        .collect::<Result<Vec<_>>>()?;
    let deltas: Vec<ReplicaCounters> = after.iter().zip(&before).map(|(a, b)| a.since(b)).collect();
    let mut summary = RunSummary::new(ctx, &outcomes, wall, &deltas);
    let engine_ttft_relayed = outcomes
        .iter()
        .filter(|o| o.engine_ttft_model_ms.is_some())
        .count();
    if let Err(e) = alive {
        summary.first_error.get_or_insert(format!("{e:#}"));
    }
    let running_helpers_empty = running.helper_groups.is_empty();
    running.stop();
    Ok(PeerRun {
        summary,
        cost: Some(RouterCost::between(&usage_before, &usage_after, total)),
        helper_cost: (!running_helpers_empty)
            .then(|| RouterCost::between(&helpers_before, &helpers_after, total)),
        startup_s: Some(startup_s),
        engine_ttft_relayed,
    })
}
