//! The peer lines of the table ([`peer_policies`]): a product with one configuration each, and
//! how one is installed and started.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::install::{self, Product};
use super::launch;
use super::spec::{Launch, PeerEnv, PromptForm, ReplicaInfo, RunningPeer};
use crate::http;
use crate::text_vocab::TextVocab;

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
