//! Command-line flags. Where the concept is vLLM's, so is the flag name (`vllm serve --help`), so
//! an operator can read one command line as the other.

use std::path::PathBuf;

use clap::Parser;
use kvroute_core::hybrid::GroupKind;
use serde::{Deserialize, Serialize};

use crate::latency::LatencyModel;

/// kvroute-sim: a vLLM-compatible engine simulator (no GPU).
#[derive(Debug, Clone, Parser)]
#[command(name = "kvroute-sim", version, about)]
pub struct Cli {
    /// Address to listen on: the HTTP server, and the event and replay sockets of `tcp://*:PORT`
    /// endpoints (loopback by default: the events carry prompt token ids).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (0 = pick a free one; the bound address is logged and printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name(s) served; the first is reported in responses and metrics.
    #[arg(long = "served-model-name", num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// vLLM's model argument; used as the served name when --served-model-name is absent.
    #[arg(long)]
    pub model: Option<String>,
    /// Directory with tokenizer.json and tokenizer_config.json (chat template).
    #[arg(long = "model-dir", env = "KVROUTE_MODEL_DIR")]
    pub model_dir: PathBuf,
    /// Tokens per KV block.
    #[arg(long = "block-size", default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per engine (including vLLM's reserved null block).
    #[arg(long = "num-gpu-blocks-override", default_value_t = 28_672)]
    pub num_gpu_blocks: usize,
    /// Prefix-cache hash: sha256 (vLLM's default), sha256_cbor, xxhash, xxhash_cbor.
    #[arg(long = "prefix-caching-hash-algo", default_value = "sha256")]
    pub prefix_caching_hash_algo: String,
    /// KV events config, the same JSON as vLLM's.
    #[arg(long = "kv-events-config")]
    pub kv_events_config: Option<String>,
    /// Maximum sequences running at once per engine.
    #[arg(long = "max-num-seqs", default_value_t = 1024)]
    pub max_num_seqs: usize,
    /// Maximum tokens computed per step per engine (chunked prefill).
    #[arg(long = "max-num-batched-tokens", default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Maximum prompt + output length; longer requests get a 400.
    #[arg(long = "max-model-len", default_value_t = 40_960)]
    pub max_model_len: usize,
    /// Engines behind this server; rank r publishes on the events ports + r.
    #[arg(long = "data-parallel-size", default_value_t = 1)]
    pub data_parallel_size: usize,
    /// LoRA adapters, `name=path` (or vLLM's JSON form `{"name":..,"path":..}`).
    #[arg(long = "lora-modules", num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Accepted for compatibility; the simulator always reports
    /// `usage.prompt_tokens_details.cached_tokens`.
    #[arg(long = "enable-prompt-tokens-details")]
    pub enable_prompt_tokens_details: bool,
    /// Run this many times faster than real time (latencies are reported unscaled).
    #[arg(long = "time-scale", default_value_t = 1.0)]
    pub time_scale: f64,
    /// Replica speed factor: every step's modelled time is divided by it (0.5 = half the prefill
    /// throughput and twice the decode step). Changeable at run time: `POST /admin/speed`.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Cost model: prefill throughput, tokens per second.
    #[arg(long = "prefill-tokens-per-s", default_value_t = LatencyModel::default().prefill_tokens_per_s)]
    pub prefill_tokens_per_s: f64,
    /// Cost model: fixed time of every step, milliseconds.
    #[arg(long = "decode-step-ms", default_value_t = LatencyModel::default().decode_step_ms)]
    pub decode_step_ms: f64,
    /// Cost model: time per sequence in the batch, milliseconds.
    #[arg(long = "decode-ms-per-seq", default_value_t = LatencyModel::default().decode_ms_per_seq)]
    pub decode_ms_per_seq: f64,
    /// Cost model: time per 1000 context tokens of decoding sequences, milliseconds.
    #[arg(long = "decode-ms-per-1k-context", default_value_t = LatencyModel::default().decode_ms_per_1k_context)]
    pub decode_ms_per_1k_context: f64,
    /// Event wire layout: 0.33 (maps, default) or an older array layout: 0.23, 0.15, 0.11, 0.9.
    /// Array layouts also drop the topic frame from replay replies (as vLLM <= 0.25).
    #[arg(long = "wire-format", default_value = "0.33")]
    pub wire_format: String,
    /// Overrides the events config's `hwm` (ZeroMQ send high-water mark, in messages).
    #[arg(long)]
    pub hwm: Option<usize>,
    /// Overrides the events config's `buffer_steps` (batches kept for replay).
    #[arg(long = "buffer-steps")]
    pub buffer_steps: Option<usize>,
    /// Seed of the pseudo-random output tokens (a request's `seed` field overrides it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output tokens when a request gives no max_tokens (chat; completions default to 16).
    #[arg(long = "default-max-tokens", default_value_t = 256)]
    pub default_max_tokens: usize,
    /// Output token ids are drawn from `0..N` (keep it below the tokenizer's special tokens).
    #[arg(long = "output-vocab-size", default_value_t = 32_000)]
    pub output_vocab_size: u32,
    /// Largest accepted request body, bytes.
    #[arg(long = "max-body-bytes", default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// KV cache groups, as vLLM derives them from the model: `full` (one full-attention group,
    /// default), `gemma3` (groups 0-4 sliding window 1024, group 5 full attention: Gemma 3's 5:1
    /// layers), `gpt-oss` (group 0 sliding window 128, group 1 full attention), or a list such as
    /// `sliding_window:512,full_attention`. Events carry each group's `group_idx`,
    /// `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`.
    #[arg(long = "kv-cache-layout", default_value = "full")]
    pub kv_cache_layout: String,
    /// Overrides the window (tokens) of the layout's sliding-window groups (the model config's
    /// `sliding_window`).
    #[arg(long = "sliding-window")]
    pub sliding_window: Option<u32>,
    /// vLLM's `--prefix-match-unit` (`hash_block_size`): requests are hashed every N tokens and a
    /// block is keyed by the hash of its last N tokens. With several KV cache groups it must
    /// divide `--block-size`; with one group it must equal it (vLLM refuses anything else).
    #[arg(long = "prefix-match-unit")]
    pub prefix_match_unit: Option<usize>,
    /// Reported by GET /version (it tells routers which event layout to expect).
    #[arg(long = "vllm-version", default_value = "0.33.0")]
    pub vllm_version: String,
}

/// vLLM's `KVEventsConfig` (vllm/config/kv_events.py), same JSON field names and defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvEventsConfig {
    /// Whether events are produced at all.
    pub enable_kv_cache_events: bool,
    /// "zmq" or "null"; defaults to "zmq" when events are enabled.
    pub publisher: Option<String>,
    /// PUB endpoint (bind when it has `*`, `::` or is ipc/inproc; else connect).
    pub endpoint: String,
    /// ROUTER replay endpoint (always bound), or none.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// PUB high-water mark (messages).
    pub hwm: usize,
    /// Batches queued between the engine and the publisher.
    pub max_queue_size: usize,
    /// Topic frame.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

/// A bad flag value.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// `--kv-events-config` is not valid JSON for the config.
    #[error("--kv-events-config: {0}")]
    EventsConfig(String),
    /// A `--lora-modules` entry is malformed.
    #[error("--lora-modules: expected name=path or {{\"name\":..,\"path\":..}}, got {0:?}")]
    Lora(String),
    /// Any other invalid value.
    #[error("{0}")]
    Invalid(String),
}

impl KvEventsConfig {
    /// Parses vLLM's JSON, applying vLLM's publisher default.
    pub fn parse(json: &str) -> Result<Self, CliError> {
        let mut c: KvEventsConfig =
            serde_json::from_str(json).map_err(|e| CliError::EventsConfig(e.to_string()))?;
        if c.publisher.is_none() {
            c.publisher = Some(
                if c.enable_kv_cache_events {
                    "zmq"
                } else {
                    "null"
                }
                .into(),
            );
        }
        match c.publisher.as_deref() {
            Some("zmq") | Some("null") => {}
            Some(other) => {
                return Err(CliError::EventsConfig(format!(
                    "unknown publisher {other:?} (zmq or null)"
                )))
            }
            None => {}
        }
        Ok(c)
    }

    /// Whether a ZMQ publisher runs.
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() == Some("zmq")
    }

    /// The config of data-parallel rank `rank`: tcp ports + rank (port 0 kept), inproc
    /// endpoints suffixed `_dp{rank}`, as vLLM's `offset_endpoint_port`.
    pub fn for_rank(&self, rank: usize) -> Result<Self, CliError> {
        let mut c = self.clone();
        c.endpoint = offset_endpoint_port(&self.endpoint, rank)?;
        c.replay_endpoint = match &self.replay_endpoint {
            Some(e) => Some(offset_endpoint_port(e, rank)?),
            None => None,
        };
        Ok(c)
    }
}

/// vLLM's `offset_endpoint_port`.
pub fn offset_endpoint_port(endpoint: &str, rank: usize) -> Result<String, CliError> {
    if endpoint.is_empty() || rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    if endpoint.contains("tcp") {
        if let Some(idx) = endpoint.rfind(':') {
            let base = &endpoint[..idx];
            let port: usize = endpoint[idx + 1..]
                .parse()
                .map_err(|_| CliError::Invalid(format!("bad port in endpoint {endpoint:?}")))?;
            if port == 0 {
                return Ok(endpoint.to_string());
            }
            return Ok(format!("{base}:{}", port + rank));
        }
        return Ok(endpoint.to_string());
    }
    Err(CliError::Invalid(format!(
        "invalid endpoint {endpoint:?}: must contain 'inproc' or 'tcp'"
    )))
}

/// One `--lora-modules` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// Adapter name (the request's `model`).
    pub name: String,
    /// Adapter path (hashed by vLLM, never published).
    pub path: String,
    /// vLLM's integer adapter id (1-based, in flag order).
    pub id: i64,
}

/// Parses `--lora-modules` values.
pub fn parse_lora_modules(values: &[String]) -> Result<Vec<LoraModule>, CliError> {
    let mut out = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let (name, path) = if v.trim_start().starts_with('{') {
            let j: serde_json::Value =
                serde_json::from_str(v).map_err(|_| CliError::Lora(v.clone()))?;
            match (
                j.get("name").and_then(|x| x.as_str()),
                j.get("path").and_then(|x| x.as_str()),
            ) {
                (Some(n), Some(p)) => (n.to_string(), p.to_string()),
                _ => return Err(CliError::Lora(v.clone())),
            }
        } else {
            match v.split_once('=') {
                Some((n, p)) if !n.is_empty() && !p.is_empty() => (n.to_string(), p.to_string()),
                _ => return Err(CliError::Lora(v.clone())),
            }
        };
        out.push(LoraModule {
            name,
            path,
            id: i as i64 + 1,
        });
    }
    Ok(out)
}

/// The KV cache groups of `--kv-cache-layout` (see the flag), with `--sliding-window` applied.
pub fn parse_kv_cache_layout(
    layout: &str,
    sliding_window: Option<u32>,
) -> Result<Vec<GroupKind>, CliError> {
    let sw = |w: u32| GroupKind::SlidingWindow {
        window: sliding_window.unwrap_or(w),
    };
    let groups = match layout.trim() {
        "full" => vec![GroupKind::FullAttention],
        "gemma3" => {
            let mut g = vec![sw(1024); 5];
            g.push(GroupKind::FullAttention);
            g
        }
        "gpt-oss" => vec![sw(128), GroupKind::FullAttention],
        list => list
            .split(',')
            .map(|item| {
                let item = item.trim();
                let (kind, window) = match item.split_once(':') {
                    Some((k, w)) => (
                        k,
                        Some(w.parse::<i64>().map_err(|_| {
                            CliError::Invalid(format!("--kv-cache-layout: bad window in {item:?}"))
                        })?),
                    ),
                    None => (item, None),
                };
                match GroupKind::from_event(Some(kind), window) {
                    Ok(GroupKind::SlidingWindow { window }) => Ok(sw(window)),
                    Ok(k) => Ok(k),
                    Err(e) => Err(CliError::Invalid(format!(
                        "--kv-cache-layout: {item:?}: {e} (use full, gemma3, gpt-oss or a list \
                         of full_attention / sliding_window:N)"
                    ))),
                }
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    if groups.len() > 32 {
        return Err(CliError::Invalid(
            "--kv-cache-layout: at most 32 KV cache groups".into(),
        ));
    }
    if sliding_window == Some(0) {
        return Err(CliError::Invalid(
            "--sliding-window must be positive".into(),
        ));
    }
    Ok(groups)
}

impl Cli {
    /// The KV cache groups of `--kv-cache-layout` and `--sliding-window`.
    pub fn kv_cache_groups(&self) -> Result<Vec<GroupKind>, CliError> {
        parse_kv_cache_layout(&self.kv_cache_layout, self.sliding_window)
    }

    /// vLLM's `resolve_kv_cache_block_sizes` for one block size: the hash block size.
    pub fn hash_block_size(&self, num_groups: usize) -> Result<usize, CliError> {
        let bs = self.block_size;
        match self.prefix_match_unit {
            None => Ok(bs),
            Some(u) if u == bs => Ok(bs),
            Some(u) if num_groups <= 1 => Err(CliError::Invalid(format!(
                "--prefix-match-unit {u}: with a single KV cache group, prefix-cache hits land on \
                 the block size ({bs}); unset it or set it to {bs}"
            ))),
            Some(u) if u == 0 || !bs.is_multiple_of(u) => Err(CliError::Invalid(format!(
                "--prefix-match-unit {u} must divide --block-size {bs}"
            ))),
            Some(u) => Ok(u),
        }
    }

    /// The cost model from the flags.
    pub fn latency_model(&self) -> LatencyModel {
        LatencyModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            decode_step_ms: self.decode_step_ms,
            decode_ms_per_seq: self.decode_ms_per_seq,
            decode_ms_per_1k_context: self.decode_ms_per_1k_context,
        }
    }

    /// The served model names (at least one).
    pub fn served_names(&self) -> Vec<String> {
        if !self.served_model_name.is_empty() {
            return self.served_model_name.clone();
        }
        if let Some(m) = &self.model {
            return vec![m.clone()];
        }
        let dir_name = self
            .model_dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        vec![dir_name]
    }

    /// The events config with `--hwm` / `--buffer-steps` applied; `None` when events are off.
    pub fn events_config(&self) -> Result<Option<KvEventsConfig>, CliError> {
        let Some(json) = &self.kv_events_config else {
            return Ok(None);
        };
        let mut c = KvEventsConfig::parse(json)?;
        if let Some(h) = self.hwm {
            c.hwm = h;
        }
        if let Some(b) = self.buffer_steps {
            c.buffer_steps = b;
        }
        Ok(Some(c))
    }

    /// Checks values that clap cannot.
    pub fn validate(&self) -> Result<(), CliError> {
        if self.block_size == 0 {
            return Err(CliError::Invalid("--block-size must be > 0".into()));
        }
        if self.num_gpu_blocks < 2 {
            return Err(CliError::Invalid(
                "--num-gpu-blocks-override must be >= 2".into(),
            ));
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err(CliError::Invalid(
                "--max-num-seqs and --max-num-batched-tokens must be > 0".into(),
            ));
        }
        if self.data_parallel_size == 0 || self.data_parallel_size > 64 {
            return Err(CliError::Invalid(
                "--data-parallel-size must be 1..=64".into(),
            ));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(CliError::Invalid("--time-scale must be > 0".into()));
        }
        crate::latency::check_speed(self.speed)
            .map_err(|e| CliError::Invalid(format!("--speed: {e}")))?;
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return Err(CliError::Invalid(
                "--prefill-tokens-per-s must be > 0".into(),
            ));
        }
        for v in [
            self.decode_step_ms,
            self.decode_ms_per_seq,
            self.decode_ms_per_1k_context,
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(CliError::Invalid("latency flags must be >= 0".into()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_config_defaults_and_rank_offsets() {
        let c = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}"#).unwrap();
        assert!(c.publishes());
        assert_eq!(c.buffer_steps, 10_000);
        let r1 = c.for_rank(1).unwrap();
        assert_eq!(r1.endpoint, "tcp://*:5558");
        assert_eq!(r1.replay_endpoint.as_deref(), Some("tcp://*:5559"));
        assert_eq!(
            offset_endpoint_port("inproc://x", 2).unwrap(),
            "inproc://x_dp2"
        );
        assert_eq!(offset_endpoint_port("tcp://*:0", 2).unwrap(), "tcp://*:0");
        assert!(KvEventsConfig::parse("{").is_err());
        let off = KvEventsConfig::parse(r#"{"endpoint":"tcp://*:1"}"#).unwrap();
        assert!(!off.publishes());
    }

    #[test]
    fn lora_modules_both_forms() {
        let l =
            parse_lora_modules(&["sql=/a/b".into(), r#"{"name":"x","path":"/p"}"#.into()]).unwrap();
        assert_eq!(l[0].name, "sql");
        assert_eq!(l[1].id, 2);
        assert!(parse_lora_modules(&["nopath".into()]).is_err());
    }

    #[test]
    fn prefix_match_unit_as_vllm_resolves_it() {
        use clap::Parser;
        let cli = |extra: &[&str]| {
            let mut args = vec!["kvroute-sim", "--model-dir", "/m", "--block-size", "16"];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args).unwrap()
        };
        assert_eq!(cli(&[]).hash_block_size(1).unwrap(), 16);
        assert_eq!(
            cli(&["--prefix-match-unit", "16"])
                .hash_block_size(1)
                .unwrap(),
            16
        );
        assert_eq!(
            cli(&["--prefix-match-unit", "4"])
                .hash_block_size(2)
                .unwrap(),
            4
        );
        let one_group = cli(&["--prefix-match-unit", "4"])
            .hash_block_size(1)
            .unwrap_err();
        assert!(
            one_group.to_string().contains("single KV cache group"),
            "{one_group}"
        );
        assert!(cli(&["--prefix-match-unit", "5"])
            .hash_block_size(2)
            .is_err());
        assert!(cli(&["--prefix-match-unit", "0"])
            .hash_block_size(2)
            .is_err());
    }
}
