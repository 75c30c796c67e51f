//! The routers people run today, as peers in the routing benchmark (issue 7): each installed
//! from PyPI into its own venv under `<cache>/peers/<name>` ([`install`]), started in front of
//! the same `kvroute-sim` replicas on 127.0.0.1 ([`launch`]), and measured with the same client
//! and the replicas' own counters; the router's CPU time and peak memory come from `/proc`
//! ([`usage`]). A peer that cannot be installed or started is reported as such, never dropped.

mod launch;
mod report;
pub mod run;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::router_usage as usage;
pub use crate::router_usage::{RouterCost, Usage};
pub use crate::text_vocab::TextVocab;
pub use install::Product;
use kvroute_testkit::peer_install as install;

use crate::http;
use crate::stack::Stack;
use crate::supervisor::Supervisor;

/// One replica as a peer router sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaInfo {
    /// HTTP `host:port`.
    pub http: String,
    /// ZeroMQ KV-event PUB endpoint to connect to (`tcp://127.0.0.1:PORT`).
    pub events: String,
    /// ZeroMQ replay (ROUTER) endpoint, if the replica has one.
    pub replay: Option<String>,
}

impl ReplicaInfo {
    /// Every replica of `stack`.
    pub fn of_stack(stack: &Stack) -> Vec<ReplicaInfo> {
        stack
            .ports
            .replicas
            .iter()
            .map(|p| ReplicaInfo {
                http: format!("127.0.0.1:{}", p.http),
                events: format!("tcp://127.0.0.1:{}", p.events),
                replay: Some(format!("tcp://127.0.0.1:{}", p.replay)),
            })
            .collect()
    }
}

/// What every peer needs to know about the fleet besides the replicas' addresses.
#[derive(Debug, Clone)]
pub struct PeerEnv {
    /// The workspace root (for `bench/peers/`).
    pub root: PathBuf,
    /// Served model name.
    pub model: String,
    /// The tokenizer directory the replicas use.
    pub model_dir: PathBuf,
    /// KV block size of the replicas.
    pub block_size: usize,
    /// KV blocks per replica (`--num-gpu-blocks-override`).
    pub gpu_blocks: usize,
    /// The replicas' KV-event topic.
    pub topic: String,
    /// Configurations and logs go under `<work_dir>/peers/<name>/`.
    pub work_dir: PathBuf,
    /// kvroute's Envoy listener (`host:port`) for lines on top of it ([`Launch::needs_kvroute`]).
    pub kvroute_addr: Option<String>,
}

/// How a router wants its prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptForm {
    /// Token ids (`"prompt": [1, 2, 3]`), as the routing benchmark sends them.
    TokenIds,
    /// Text ([`TextVocab::render`]): `smg`, `sglang-router` and LiteLLM reject token-id prompts.
    Text,
}

/// How one line of the table is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// `vllm-router --policy <policy>` (`kv_aware` also gets `--kv-event-source` per replica).
    VllmRouter {
        /// vllm-router's `--policy`.
        policy: &'static str,
    },
    /// `smg launch --policy cache_aware`.
    Smg {
        /// With the tuned spill gate.
        tuned: bool,
    },
    /// `sglang-router launch --policy cache_aware`.
    SglangRouter {
        /// With the tuned spill gate.
        tuned: bool,
    },
    /// LiteLLM proxy, `simple-shuffle`.
    Litellm {
        /// With the `session_affinity` pre-call check.
        session_affinity: bool,
    },
    /// LiteLLM proxy with `compose/litellm/config.yaml` (docs/two-layers.md), its one deployment
    /// kvroute's Envoy (filter + indexer, policy `kv`) in front of the replicas.
    TwoLayer,
    /// `python -m dynamo.frontend --router-mode <mode>` + one worker shim per replica.
    Dynamo {
        /// Dynamo's `--router-mode`.
        mode: &'static str,
    },
}

impl Launch {
    /// The product it runs.
    pub fn product(self) -> Product {
        match self {
            Launch::VllmRouter { .. } => Product::VllmRouter,
            Launch::Smg { .. } => Product::Smg,
            Launch::SglangRouter { .. } => Product::SglangRouter,
            Launch::Litellm { .. } | Launch::TwoLayer => Product::Litellm,
            Launch::Dynamo { .. } => Product::Dynamo,
        }
    }

    /// Whether kvroute (indexer + Envoy with the filter) runs below this line.
    pub fn needs_kvroute(self) -> bool {
        matches!(self, Launch::TwoLayer)
    }
}

/// One peer line of the table: a product with one configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerPolicy {
    /// Name in tables and on the command line (`vllm-router:cache_aware`).
    pub name: &'static str,
    /// How it is started.
    pub launch: Launch,
    /// One line on what it does, for the report.
    pub how: &'static str,
    /// Not the product's default configuration.
    pub tuned: bool,
}

/// Every peer line, in report order.
pub fn peer_policies() -> Vec<PeerPolicy> {
    vec![
        PeerPolicy {
            name: "vllm-router:cache_aware",
            launch: Launch::VllmRouter { policy: "cache_aware" },
            how: "vllm-router's default: a prefix tree of the token ids it gets from every request's render call to the replicas (`/v1/completions/render`), least-loaded when imbalanced",
            tuned: false,
        },
        PeerPolicy {
            name: "vllm-router:kv_aware",
            launch: Launch::VllmRouter { policy: "kv_aware" },
            how: "vllm-router `--policy kv_aware`: an index built from the replicas' ZMQ KV events (`--kv-event-source` per replica), token ids from render calls",
            tuned: true,
        },
        PeerPolicy {
            name: "vllm-router:round_robin",
            launch: Launch::VllmRouter { policy: "round_robin" },
            how: "vllm-router `--policy round_robin`",
            tuned: false,
        },
        PeerPolicy {
            name: "smg:cache_aware",
            launch: Launch::Smg { tuned: false },
            how: "Shepherd Model Gateway's default: an approximate prefix tree over request text (characters), spill gate 64 requests / 1.5x",
            tuned: false,
        },
        PeerPolicy {
            name: "smg:cache_aware-spill8",
            launch: Launch::Smg { tuned: true },
            how: "smg cache_aware with `--balance-abs-threshold 8 --balance-rel-threshold 1.25` (spill to the least loaded earlier)",
            tuned: true,
        },
        PeerPolicy {
            name: "sglang-router:cache_aware",
            launch: Launch::SglangRouter { tuned: false },
            how: "SGLang router's default: approximate prefix tree over request text",
            tuned: false,
        },
        PeerPolicy {
            name: "litellm:simple-shuffle",
            launch: Launch::Litellm { session_affinity: false },
            how: "LiteLLM proxy's default `simple-shuffle` over one deployment per replica",
            tuned: false,
        },
        PeerPolicy {
            name: "litellm:session-affinity",
            launch: Launch::Litellm { session_affinity: true },
            how: "LiteLLM `simple-shuffle` + `optional_pre_call_checks: [session_affinity]`, pinned on `x-litellm-session-id`",
            tuned: true,
        },
        PeerPolicy {
            name: "two-layer",
            launch: Launch::TwoLayer,
            how: "LiteLLM on top (compose/litellm/config.yaml: one deployment, num_retries 1, client headers forwarded) of kvroute's Envoy + indexer (`kv`): what the top layer costs over `kv`",
            tuned: false,
        },
        PeerPolicy {
            name: "dynamo:kv",
            launch: Launch::Dynamo { mode: "kv" },
            how: "NVIDIA Dynamo frontend `--router-mode kv`: tokenises, an index from the replicas' KV events (relayed by each worker's `KvEventPublisher`), cost = prefill blocks + decode load",
            tuned: false,
        },
        PeerPolicy {
            name: "dynamo:round-robin",
            launch: Launch::Dynamo { mode: "round-robin" },
            how: "NVIDIA Dynamo frontend `--router-mode round-robin` (its default mode)",
            tuned: false,
        },
    ]
}

impl PeerPolicy {
    /// Installs the product if needed (cached under `cache`), starts it in front of `replicas`
    /// and waits until it routes to all of them. Errors say "could not install" or "could not
    /// start" with the reason.
    pub fn start(
        &self,
        replicas: &[ReplicaInfo],
        cache: &Path,
        env: &PeerEnv,
    ) -> Result<RunningPeer> {
        let product = self.launch.product();
        let installed = install::ensure(cache, product)
            .with_context(|| format!("could not install {}", product.version()))?;
        let peer = launch::start(self.name, self.launch, &installed, replicas, env)
            .with_context(|| format!("could not start {}", self.name))?;
        if peer.prompt == PromptForm::Text {
            check_text_form(&env.model_dir, &env.model, &replicas[0].http)
                .context("the text prompt form does not tokenise one word per token")?;
        }
        Ok(peer)
    }

    /// The product's version, for the report.
    pub fn version(&self) -> &'static str {
        self.launch.product().version()
    }
}

impl fmt::Display for PeerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Parses `--peers`: `all`, a product name (`vllm-router`: all its lines) or a line name.
pub fn select(names: &[String]) -> Result<Vec<PeerPolicy>> {
    let all = peer_policies();
    let mut out: Vec<PeerPolicy> = Vec::new();
    for name in names {
        let picked: Vec<PeerPolicy> = all
            .iter()
            .filter(|p| {
                name == "all"
                    || p.name == name
                    // A product's name picks its own lines, not the ones on top of kvroute.
                    || (p.launch.product().name() == name.as_str() && !p.launch.needs_kvroute())
            })
            .copied()
            .collect();
        if picked.is_empty() {
            bail!(
                "unknown peer {name:?} (one of: all, {}, {})",
                Product::ALL.map(Product::name).join(", "),
                all.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
            );
        }
        for p in picked {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

impl FromStr for PeerPolicy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match peer_policies().into_iter().find(|p| p.name == s) {
            Some(p) => Ok(p),
            None => bail!("unknown peer line {s:?}"),
        }
    }
}

/// A started peer: where clients send, how they must send, and what to sample.
pub struct RunningPeer {
    /// The line's name.
    pub name: String,
    /// `host:port` clients send to.
    pub addr: String,
    /// The prompt form it accepts.
    pub prompt: PromptForm,
    /// Headers every request must carry (LiteLLM's key).
    pub headers: Vec<(String, String)>,
    /// The header the workload's session id goes in.
    pub session_header: &'static str,
    /// Process groups of the router itself (CPU and memory are its cost).
    pub router_groups: Vec<u32>,
    /// Process groups of helpers that stand in for engine-side code (Dynamo's worker shims).
    pub helper_groups: Vec<u32>,
    /// Wall seconds from start to ready.
    pub startup_s: f64,
    /// Configuration and logs.
    pub log_dir: PathBuf,
    sup: Supervisor,
}

impl RunningPeer {
    /// `http://host:port`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// CPU and peak memory of the router's processes now.
    pub fn router_usage(&self) -> Usage {
        usage::sample(&self.router_groups)
    }

    /// CPU and peak memory of the helpers now.
    pub fn helper_usage(&self) -> Usage {
        usage::sample(&self.helper_groups)
    }

    /// Fails if any of its processes has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        let name = self.name.clone();
        self.sup
            .check_alive()
            .with_context(|| format!("{name} stopped during the run"))
    }

    /// Stops every process it started (SIGTERM, then SIGKILL after a grace period).
    pub fn stop(mut self) {
        self.sup.stop_all();
    }
}

/// Checks on a replica that the text form of a sample tokenises to one token per word.
fn check_text_form(model_dir: &Path, model: &str, replica: &str) -> Result<()> {
    let vocab = TextVocab::load(model_dir)?;
    let ids: Vec<u32> = (0..512u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let body = json!({"model": model, "prompt": vocab.render(&ids)}).to_string();
    let resp = http::request(
        "POST",
        replica,
        "/v1/completions/render",
        &[("content-type", "application/json")],
        body.as_bytes(),
        Duration::from_secs(10),
    )?;
    let status = resp.status;
    let text = resp.text(1 << 20)?;
    if status != 200 {
        bail!("render answered HTTP {status}: {}", text.trim());
    }
    let v: Value = serde_json::from_str(&text).context("render reply")?;
    let n = v
        .pointer("/0/token_ids")
        .and_then(Value::as_array)
        .map(Vec::len)
        .context("render reply without token_ids")?;
    if n != ids.len() {
        bail!("{} words became {n} tokens", ids.len());
    }
    Ok(())
}

/// The peer part of one benchmark invocation: the selected lines, run after the benchmark's
/// own policies on every workload, and the Peers section written at the end.
pub struct PeerBench {
    lines: Vec<PeerPolicy>,
    cache: PathBuf,
    env: PeerEnv,
    cfg: run::PeerRunConfig,
    /// Per workload: kvroute's own summaries of the same run, then the peers'.
    results: Vec<report::WorkloadPeers>,
}

impl PeerBench {
    /// `lines` from `--peers` (empty: nothing runs).
    pub fn new(
        lines: Vec<PeerPolicy>,
        cache: PathBuf,
        env: PeerEnv,
        cfg: run::PeerRunConfig,
    ) -> Self {
        Self {
            lines,
            cache,
            env,
            cfg,
            results: Vec::new(),
        }
    }

    /// The fleet the next workloads run on (KV blocks per replica, work directory).
    pub fn set_fleet(&mut self, gpu_blocks: usize, work_dir: &Path) {
        self.env.gpu_blocks = gpu_blocks;
        self.env.work_dir = work_dir.to_path_buf();
    }

    /// Whether any peer line was selected.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Runs every selected line on `workload` (ctx names the workload and fleet; its policy is
    /// replaced by the line's name); `ours` are the benchmark's own summaries of the same workload.
    /// Prints one line per peer through `print`.
    pub fn run_workload(
        &mut self,
        stack: &mut Stack,
        workload: &crate::workloads::Workload,
        ctx: &crate::summary::RunContext,
        ours: &[crate::summary::RunSummary],
        print: impl Fn(&crate::summary::RunSummary),
    ) -> Result<()> {
        let mut runs = Vec::new();
        for line in self.lines.clone() {
            let mut ctx = ctx.clone();
            ctx.policy = line.name.to_string();
            let run = run::run_line(
                stack,
                &line,
                workload,
                &ctx,
                &self.cfg,
                &self.cache,
                &self.env,
            )?;
            print(&run.summary);
            if let Some(c) = &run.cost {
                println!(
                    "      router CPU {:.2} s / 1k requests, peak RSS {:.0} MB, ready in {:.1} s, engine TTFT relayed in {}/{} responses",
                    c.cpu_s_per_1k,
                    c.peak_rss_mb,
                    run.startup_s.unwrap_or(0.0),
                    run.engine_ttft_relayed,
                    run.summary.requests
                );
            }
            if let Some(h) = &run.helper_cost {
                println!(
                    "      helpers (not the router): CPU {:.2} s / 1k requests, peak RSS {:.0} MB",
                    h.cpu_s_per_1k, h.peak_rss_mb
                );
            }
            runs.push((line, run));
        }
        let label = format!("{} at {}", workload.name, workload.load_label());
        self.results.push(report::WorkloadPeers {
            name: label,
            ours: ours.to_vec(),
            peers: runs,
        });
        Ok(())
    }

    /// Writes `peers.json` into `out_dir` and, unless `report` is None, the Peers section of it.
    pub fn finish(&self, out_dir: &Path, report: Option<(&Path, report::PeerFacts)>) -> Result<()> {
        let json: Vec<Value> = self
            .results
            .iter()
            .map(|w| {
                let (name, runs) = (&w.name, &w.peers);
                json!({
                    "workload": name,
                    "peers": runs.iter().map(|(p, r)| json!({
                        "line": p.name,
                        "version": p.version(),
                        "tuned": p.tuned,
                        "summary": r.summary,
                        "router_cost": r.cost,
                        "helper_cost": r.helper_cost,
                        "startup_s": r.startup_s,
                        "engine_ttft_relayed": r.engine_ttft_relayed,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let path = out_dir.join("peers.json");
        std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("bench: peer results in {}", path.display());
        if let Some((doc, facts)) = report {
            report::splice(doc, &report::render_section(&facts, &self.results))?;
            println!("bench: wrote the Peers section of {}", doc.display());
        }
        Ok(())
    }
}

pub use report::PeerFacts;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_product_has_a_line_and_names_are_unique() {
        let all = peer_policies();
        for p in Product::ALL {
            assert!(all.iter().any(|l| l.launch.product() == p), "{}", p.name());
        }
        let mut names: Vec<&str> = all.iter().map(|p| p.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for p in &all {
            assert_eq!(p.name.parse::<PeerPolicy>().expect("parse"), *p);
        }
    }

    #[test]
    fn selection_by_product_line_or_all() {
        let s = |v: &[&str]| select(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(s(&["all"]).expect("all").len(), peer_policies().len());
        let vr = s(&["vllm-router"]).expect("product");
        assert_eq!(vr.len(), 3);
        assert!(vr.iter().all(|p| p.launch.product() == Product::VllmRouter));
        let two = s(&["dynamo:kv", "dynamo"]).expect("dedup");
        assert_eq!(two.len(), 2);
        assert!(s(&["nginx"]).is_err());
        // `litellm` is LiteLLM's own lines; `two-layer` (LiteLLM on kvroute) is asked for by name.
        let litellm = s(&["litellm"]).expect("product");
        assert_eq!(litellm.len(), 2);
        assert!(litellm.iter().all(|p| !p.launch.needs_kvroute()));
        let two_layer = s(&["two-layer"]).expect("line");
        assert_eq!(two_layer.len(), 1);
        assert!(two_layer[0].launch.needs_kvroute());
        assert_eq!(two_layer[0].launch.product(), Product::Litellm);
    }

    #[test]
    fn cost_per_thousand_requests() {
        let before = Usage {
            cpu_s: 10.0,
            peak_rss_mb: 50.0,
            processes: 1,
        };
        let after = Usage {
            cpu_s: 13.0,
            peak_rss_mb: 80.0,
            processes: 1,
        };
        let c = RouterCost::between(&before, &after, 500);
        assert!((c.cpu_s_per_1k - 6.0).abs() < 1e-9);
        assert_eq!(c.peak_rss_mb, 80.0);
        assert_eq!(RouterCost::between(&before, &after, 0).cpu_s_per_1k, 0.0);
    }
}
