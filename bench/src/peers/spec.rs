//! What a peer line is made of: the fleet it fronts ([`ReplicaInfo`], [`PeerEnv`]), how it is
//! started ([`Launch`]) and sent to ([`PromptForm`]), and a started one ([`RunningPeer`]).

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::install::Product;
use crate::router_usage::{self as usage, Usage};
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
    pub(super) sup: Supervisor,
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
