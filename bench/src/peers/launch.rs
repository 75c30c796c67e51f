//! Starts one peer router in front of the replicas, on 127.0.0.1, with the flags issue 7 lists
//! (checked against each product's own `--help`), and waits until it can route to every replica.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::install::Installed;
use super::spec::{Launch, PeerEnv, PromptForm, ReplicaInfo, RunningPeer};
use crate::http;
use crate::stack::render;
use crate::supervisor::{self, PortPool, Supervisor};

/// LiteLLM's configuration template (placeholders filled here).
const LITELLM_TEMPLATE: &str = include_str!("../../peers/litellm.yaml");
/// The two-layer recipe's LiteLLM files (config and custom auth), relative to the workspace root.
const TWO_LAYER_DIR: &str = "compose/litellm";
/// Where that config points its deployment (kvroute's Envoy on the compose network).
const TWO_LAYER_API_BASE: &str = "http://172.30.57.10:10000/v1";
/// The Dynamo worker shim, relative to the workspace root.
const DYNAMO_SHIM: &str = "bench/peers/dynamo_worker.py";
/// LiteLLM refuses to start without a master key; requests carry it as a bearer token.
const LITELLM_KEY: &str = "sk-kvroute-bench-loopback-only";
/// A minimal Hugging Face `config.json` for Qwen3-8B (Dynamo's frontend reads the model
/// directory's config for the context length and the architecture; no weights are loaded).
const QWEN3_CONFIG: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "tie_word_embeddings": false}"#;

/// Starts `launch` of `installed` in front of `replicas`.
pub fn start(
    name: &str,
    launch: Launch,
    installed: &Installed,
    replicas: &[ReplicaInfo],
    env: &PeerEnv,
) -> Result<RunningPeer> {
    if replicas.is_empty() {
        bail!("no replicas to route to");
    }
    let started = Instant::now();
    let dir = env.work_dir.join("peers").join(sanitize(name));
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut ports = PortPool::default();
    let port = ports.take()?;
    let addr = format!("127.0.0.1:{port}");
    let sup = Supervisor::new(true);
    let venv = &installed.venv;
    let program = venv.join(launch.product().program());
    let urls: Vec<String> = replicas
        .iter()
        .map(|r| format!("http://{}", r.http))
        .collect();
    let mut peer = RunningPeer {
        name: name.to_string(),
        addr: addr.clone(),
        prompt: PromptForm::TokenIds,
        headers: Vec::new(),
        session_header: "x-session-id",
        router_groups: Vec::new(),
        helper_groups: Vec::new(),
        startup_s: 0.0,
        log_dir: dir.clone(),
        sup,
    };
    match launch {
        Launch::VllmRouter { policy } => {
            let mut cmd = Command::new(&program);
            cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .arg("--worker-urls")
                .args(&urls)
                .args(["--policy", policy])
                .args(["--prometheus-host", "127.0.0.1"])
                .args(["--prometheus-port", &ports.take()?.to_string()])
                .args(["--log-level", "warning"]);
            if policy == "kv_aware" {
                for (url, r) in urls.iter().zip(replicas) {
                    cmd.arg("--kv-event-source")
                        .arg(format!("{url}={}", r.events));
                    if let Some(replay) = &r.replay {
                        cmd.arg("--kv-event-replay-source")
                            .arg(format!("{url}={replay}"));
                    }
                }
                cmd.args(["--kv-event-block-size", &env.block_size.to_string()])
                    .args(["--kv-event-model", &env.model]);
            }
            spawn(&mut peer, "router", cmd, true)?;
            wait_until(&mut peer, Duration::from_secs(60), |addr| {
                let (status, _) = http::get(addr, "/health", Duration::from_secs(2))?;
                Ok(status == 200)
            })?;
        }
        Launch::Smg { tuned } | Launch::SglangRouter { tuned } => {
            let mut cmd = Command::new(&program);
            cmd.arg("launch")
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .arg("--worker-urls")
                .args(&urls)
                .args(["--policy", "cache_aware"])
                .args(["--prometheus-host", "127.0.0.1"])
                .args(["--prometheus-port", &ports.take()?.to_string()]);
            if tuned {
                // The spill gate (help text of --balance-abs-threshold / --balance-rel-threshold):
                // leave a matched worker for the least loaded one earlier than the defaults
                // (64 requests and 1.5x), which a 4-replica fleet never reaches.
                cmd.args([
                    "--balance-abs-threshold",
                    "8",
                    "--balance-rel-threshold",
                    "1.25",
                ]);
            }
            cmd.env("RUST_LOG", "warn");
            peer.prompt = PromptForm::Text;
            spawn(&mut peer, "router", cmd, true)?;
            let want = replicas.len() as u64;
            wait_until(&mut peer, Duration::from_secs(90), move |addr| {
                let (status, body) = http::get(addr, "/readiness", Duration::from_secs(2))?;
                let healthy = serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("healthy_workers")?.as_u64())
                    .unwrap_or(0);
                Ok(status == 200 && healthy >= want)
            })?;
        }
        Launch::Litellm { session_affinity } => {
            let config = dir.join("litellm.yaml");
            fs::write(
                &config,
                litellm_config(&env.model, replicas, session_affinity)?,
            )
            .with_context(|| format!("writing {}", config.display()))?;
            let mut cmd = Command::new(&program);
            cmd.arg("--config")
                .arg(&config)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--num_workers", "1"])
                .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
                .env("LITELLM_MASTER_KEY", LITELLM_KEY)
                .env("LITELLM_LOG", "ERROR");
            peer.prompt = PromptForm::Text;
            peer.headers
                .push(("authorization".into(), format!("Bearer {LITELLM_KEY}")));
            // LiteLLM pins on `x-litellm-session-id`; `x-session-id` only from 8 characters.
            peer.session_header = "x-litellm-session-id";
            spawn(&mut peer, "router", cmd, true)?;
            wait_until(&mut peer, Duration::from_secs(240), |addr| {
                let (status, _) = http::get(addr, "/health/liveliness", Duration::from_secs(2))?;
                Ok(status == 200)
            })?;
        }
        Launch::TwoLayer => {
            let kvroute = env
                .kvroute_addr
                .as_deref()
                .context("the two-layer line needs kvroute's Envoy running below it")?;
            let config = dir.join("config.yaml");
            fs::write(&config, two_layer_config(&env.root, &env.model, kvroute)?)
                .with_context(|| format!("writing {}", config.display()))?;
            let keys = env.root.join(TWO_LAYER_DIR).join("static_keys.py");
            fs::copy(&keys, dir.join("static_keys.py"))
                .with_context(|| format!("copying {}", keys.display()))?;
            let mut cmd = Command::new(&program);
            cmd.arg("--config")
                .arg(&config)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--num_workers", "1"])
                // custom_auth imports static_keys.py from the working directory.
                .current_dir(&dir)
                .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
                .env("LITELLM_MASTER_KEY", LITELLM_KEY)
                .env("LITELLM_LOG", "ERROR");
            peer.prompt = PromptForm::Text;
            peer.headers
                .push(("authorization".into(), format!("Bearer {LITELLM_KEY}")));
            // kvroute's session header; LiteLLM forwards x- headers to its deployment.
            peer.session_header = "x-session-id";
            spawn(&mut peer, "router", cmd, true)?;
            wait_until(&mut peer, Duration::from_secs(240), |addr| {
                let (status, _) = http::get(addr, "/health/liveliness", Duration::from_secs(2))?;
                Ok(status == 200)
            })?;
        }
        Launch::Dynamo { mode } => {
            let model_dir = dynamo_model_dir(&dir, &env.model_dir)?;
            let discovery = dir.join("discovery");
            if discovery.exists() {
                fs::remove_dir_all(&discovery)
                    .with_context(|| format!("clearing {}", discovery.display()))?;
            }
            fs::create_dir_all(&discovery)?;
            let dyn_env = dynamo_env(&discovery);
            let mut frontend = Command::new(&program);
            frontend
                .args(["-m", "dynamo.frontend", "--router-mode", mode])
                .args(["--http-host", "127.0.0.1", "--http-port", &port.to_string()])
                .arg("--model-path")
                .arg(&model_dir)
                .args(["--model-name", &env.model])
                .args(["--kv-cache-block-size", &env.block_size.to_string()])
                .envs(dyn_env.iter().map(|(k, v)| (k, v)));
            spawn(&mut peer, "frontend", frontend, true)?;
            let shim = env.root.join(DYNAMO_SHIM);
            for (index, r) in replicas.iter().enumerate() {
                let mut worker = Command::new(&program);
                worker
                    .arg(&shim)
                    .arg("--sim-url")
                    .arg(format!("http://{}", r.http))
                    .args(["--kv-events", &r.events, "--kv-topic", &env.topic])
                    .arg("--model-path")
                    .arg(&model_dir)
                    .args(["--model-name", &env.model])
                    .args(["--block-size", &env.block_size.to_string()])
                    .args([
                        "--total-kv-blocks",
                        &env.gpu_blocks.saturating_sub(1).to_string(),
                    ])
                    .envs(dyn_env.iter().map(|(k, v)| (k, v)));
                spawn(&mut peer, &format!("worker-r{index}"), worker, false)?;
            }
            let want = replicas.len();
            wait_until(&mut peer, Duration::from_secs(240), move |addr| {
                let (status, body) = http::get(addr, "/health", Duration::from_secs(2))?;
                let instances = serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| Some(v.get("instances")?.as_array()?.len()))
                    .unwrap_or(0);
                if status != 200 || instances < want {
                    return Ok(false);
                }
                let (status, models) = http::get(addr, "/v1/models", Duration::from_secs(2))?;
                Ok(status == 200 && models.contains("\"id\""))
            })?;
        }
    }
    peer.startup_s = started.elapsed().as_secs_f64();
    Ok(peer)
}

/// Starts `cmd` under the peer's supervisor, logging to `<dir>/<what>.log`; `router` says
/// whether its process group counts as the router's (CPU and memory) or as a helper's.
fn spawn(peer: &mut RunningPeer, what: &str, cmd: Command, router: bool) -> Result<()> {
    let log = peer.log_dir.join(format!("{what}.log"));
    let pid = peer.sup.spawn(what, cmd, &log)?;
    if router {
        peer.router_groups.push(pid);
    } else {
        peer.helper_groups.push(pid);
    }
    Ok(())
}

/// Polls `ready(addr)` every 250 ms until it says yes, failing when a process exits, on Ctrl-C,
/// or after `timeout`.
fn wait_until(
    peer: &mut RunningPeer,
    timeout: Duration,
    ready: impl Fn(&str) -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no answer yet");
    while Instant::now() < deadline {
        if supervisor::interrupted() {
            bail!("interrupted");
        }
        peer.sup.check_alive()?;
        match ready(&peer.addr) {
            Ok(true) => return Ok(()),
            Ok(false) => last = "answering, not ready".into(),
            Err(e) => last = format!("{e:#}"),
        }
        thread::sleep(Duration::from_millis(250));
    }
    bail!(
        "not ready on http://{} within {} s (last: {last}); logs in {}",
        peer.addr,
        timeout.as_secs(),
        peer.log_dir.display()
    )
}

/// `compose/litellm/config.yaml` (the two-layer recipe) with its deployment at `kvroute`
/// (`host:port` of kvroute's Envoy); the file is written for model `qwen3`.
fn two_layer_config(root: &Path, model: &str, kvroute: &str) -> Result<String> {
    let path = root.join(TWO_LAYER_DIR).join("config.yaml");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    if model != "qwen3" {
        bail!(
            "{} serves model qwen3, the benchmark {model}",
            path.display()
        );
    }
    if text.matches(TWO_LAYER_API_BASE).count() != 1 {
        bail!(
            "{} no longer has one deployment at {TWO_LAYER_API_BASE}",
            path.display()
        );
    }
    Ok(text.replace(TWO_LAYER_API_BASE, &format!("http://{kvroute}/v1")))
}

/// LiteLLM's config: one deployment per replica in one model group; with `session_affinity`
/// the `session_affinity` pre-call check pins a session to the deployment it first went to.
fn litellm_config(model: &str, replicas: &[ReplicaInfo], session_affinity: bool) -> Result<String> {
    let mut deployments = String::new();
    for r in replicas {
        deployments.push_str(&format!(
            "  - model_name: {model}\n    litellm_params:\n      model: hosted_vllm/{model}\n      api_base: http://{}/v1\n      api_key: none\n",
            r.http
        ));
    }
    let checks = if session_affinity {
        "  optional_pre_call_checks: [\"session_affinity\"]".to_string()
    } else {
        String::new()
    };
    render(
        LITELLM_TEMPLATE,
        &[
            ("DEPLOYMENTS", deployments.trim_end().to_string()),
            ("PRE_CALL_CHECKS", checks),
        ],
    )
}

/// Dynamo without etcd or NATS: file discovery in `discovery`, TCP requests, ZMQ events, every
/// listener on 127.0.0.1, and nothing fetched from a model hub.
fn dynamo_env(discovery: &Path) -> Vec<(String, String)> {
    [
        ("DYN_DISCOVERY_BACKEND", "file".to_string()),
        ("DYN_FILE_KV", discovery.display().to_string()),
        ("DYN_REQUEST_PLANE", "tcp".into()),
        ("DYN_EVENT_PLANE", "zmq".into()),
        ("DYN_TCP_RPC_HOST", "127.0.0.1".into()),
        ("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1".into()),
        ("DYN_EVENT_PLANE_HOST", "127.0.0.1".into()),
        ("DYN_SYSTEM_HOST", "127.0.0.1".into()),
        ("DYN_SYSTEM_ENABLED", "false".into()),
        ("DYN_LOG", "warn".into()),
        ("HF_HUB_OFFLINE", "1".into()),
        ("TRANSFORMERS_OFFLINE", "1".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A model directory Dynamo accepts: the tokenizer files plus a `config.json`.
fn dynamo_model_dir(dir: &Path, model_dir: &Path) -> Result<PathBuf> {
    let out = dir.join("model");
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        fs::copy(model_dir.join(file), out.join(file))
            .with_context(|| format!("copying {file} from {}", model_dir.display()))?;
    }
    fs::write(out.join("config.json"), QWEN3_CONFIG)
        .with_context(|| format!("writing {}", out.join("config.json").display()))?;
    Ok(out)
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn litellm_config_lists_every_replica_once() {
        let replicas: Vec<ReplicaInfo> = (0..3)
            .map(|i| ReplicaInfo {
                http: format!("127.0.0.1:{}", 8000 + i),
                events: format!("tcp://127.0.0.1:{}", 9000 + i),
                replay: None,
            })
            .collect();
        let plain = litellm_config("qwen3", &replicas, false).expect("config");
        assert_eq!(plain.matches("model_name: qwen3").count(), 3);
        assert!(plain.contains("api_base: http://127.0.0.1:8002/v1"));
        assert!(plain.contains("routing_strategy: simple-shuffle"));
        assert!(!plain.contains("session_affinity"));
        let pinned = litellm_config("qwen3", &replicas, true).expect("config");
        assert!(pinned.contains("optional_pre_call_checks: [\"session_affinity\"]"));
        assert!(!pinned.contains("{{"));
    }

    #[test]
    fn dynamo_runs_on_loopback_without_etcd_or_nats() {
        let env = dynamo_env(Path::new("/tmp/d"));
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("DYN_DISCOVERY_BACKEND"), Some("file"));
        assert_eq!(get("DYN_EVENT_PLANE"), Some("zmq"));
        assert_eq!(get("DYN_REQUEST_PLANE"), Some("tcp"));
        for (k, v) in &env {
            if k.ends_with("_HOST") {
                assert_eq!(v, "127.0.0.1", "{k}");
            }
        }
        let config: Value = serde_json::from_str(QWEN3_CONFIG).expect("config.json");
        assert_eq!(config["model_type"], "qwen3");
    }

    #[test]
    fn names_become_directory_names() {
        assert_eq!(sanitize("vllm-router/kv_aware"), "vllm-router_kv_aware");
    }
}
