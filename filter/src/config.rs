//! The plugin configuration (JSON in the Wasm filter's `configuration`), parsed and validated.
//!
//! Every field has a default, so an empty configuration is valid. Unknown fields are rejected so
//! that a typo fails the plugin at load instead of being silently ignored.

use std::collections::BTreeMap;

use kvroute_core::api::MAX_REPORTS_PER_CALL;
use kvroute_core::hashing::ExtraKeyStyle;
use kvroute_core::request::{
    TokenizerOptions, DEFAULT_MAX_PROMPT_TOKENS, MAX_PROMPT_BYTES_PER_TOKEN,
    MAX_SANE_MODEL_MAX_LENGTH,
};
use serde::Deserialize;

/// What to do with a request body larger than `max_body_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OversizedBody {
    /// Forward it unrouted to the fallback cluster (counted as `fail_open.too_large`).
    #[default]
    FailOpen,
    /// Answer 413 from the filter.
    Reject,
}

/// What the filter does with the indexer's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Send each request where the indexer says (`x-envoy-original-dst-host`).
    #[default]
    Routing,
    /// Ask the indexer and report the completion, but never set the destination: Envoy's own
    /// load balancer decides, and the indexer learns what it would have saved (docs/assess.md).
    Shadow,
}

/// Where a model's tokenizer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerSource {
    /// `GET /v1/models/{model}/tokenizer` on the indexer cluster, at VM start and on first use.
    #[default]
    Indexer,
    /// The Wasm VM configuration (`vm_config.configuration`), for offline set-ups: a JSON object
    /// `{"models": {"<name>": {"tokenizer_json": "...", "tokenizer_config_json": "...",
    /// "block_size": 16}}}`.
    VmConfig,
}

/// Per-model settings. Everything is optional: what is missing is learned from the indexer.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// KV block size (tokens). Overrides what the indexer announces.
    pub block_size: Option<usize>,
    /// Engine extra-key style. Overrides what the indexer announces.
    pub extra_key_style: Option<ExtraKeyStyle>,
    /// Where the tokenizer comes from.
    pub tokenizer_source: TokenizerSource,
    /// LoRA adapter name -> path, as the engine was started with (`--lora-modules`).
    pub lora_paths: BTreeMap<String, String>,
    /// Longest prompt tokenised, in tokens (the engines' `--max-model-len`); a longer prompt fails
    /// open as `prompt_too_long`. Default: the indexer's `max_model_len` for the model, else
    /// `model_max_length` from `tokenizer_config.json`, else 131072.
    pub max_prompt_tokens: Option<usize>,
    /// Tokenizer and chat-template settings; must mirror the engine's flags
    /// (`--chat-template`, `--chat-template-content-format`, `--default-chat-template-kwargs`, ...)
    /// and bound the segment cache (`segment_cache_max_bytes`, default 32 MiB per model per VM).
    pub tokenizer_options: Option<TokenizerOptions>,
}

/// Backoff for tokenizer fetches that failed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// First delay after a failure (ms).
    pub initial_ms: u64,
    /// Delay cap (ms); doubles up to this.
    pub max_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            initial_ms: 500,
            max_ms: 30_000,
        }
    }
}

/// The whole plugin configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// `routing` (default) or `shadow`.
    pub mode: Mode,
    /// Envoy cluster of the indexer sidecar.
    pub indexer_cluster: String,
    /// `:authority` sent to the indexer.
    pub indexer_authority: String,
    /// Deadline of `POST /v1/route` (ms). On expiry the request fails open.
    pub route_timeout_ms: u64,
    /// Deadline of `POST /v1/complete` (ms).
    pub complete_timeout_ms: u64,
    /// Deadline of a tokenizer fetch (ms).
    pub tokenizer_timeout_ms: u64,
    /// Request paths (without query) that are routed; anything else passes through unrouted.
    pub routed_paths: Vec<String>,
    /// Largest request body the filter buffers and routes (bytes). Must stay below Envoy's
    /// buffer limit (`per_connection_buffer_limit_bytes`) or Envoy answers 413 itself. The
    /// default, 2 MiB, is the default token cap times `MAX_PROMPT_BYTES_PER_TOKEN` (131072 x 16):
    /// a prompt that fits 131072 tokens is at most ~0.9 MB of real text (6.6 bytes per token at
    /// worst), ~1.2 MB JSON-escaped (`\uXXXX` doubles CJK); a larger body fails open without
    /// being parsed. Raise it with `max_prompt_tokens` for longer contexts (tokens x 16).
    pub max_body_bytes: usize,
    /// What to do with a larger body.
    pub oversized_body: OversizedBody,
    /// Largest body the engines accept (bytes; vLLM behind a body limit, kvroute-sim's
    /// `--max-body-bytes`, Envoy's `per_connection_buffer_limit_bytes`: 16 MiB in
    /// `envoy/envoy.yaml`). A larger body gets 413 from the filter, whatever `oversized_body`
    /// says: forwarded, the engine would refuse it too, and refusing mid-upload makes Envoy see a
    /// reset and answer 503. At least `max_body_bytes`.
    pub upstream_max_body_bytes: usize,
    /// Add `"vllm_xargs": {"kv_cache_report_mode": "full"}` to routed bodies.
    pub inject_kv_cache_report_mode: bool,
    /// Add `x-kvroute-*` headers (replica, reason, matched tokens, fail-open reason) to the
    /// upstream request and the response.
    pub debug_headers: bool,
    /// Report each routed request's end to the indexer (`POST /v1/complete`).
    pub report_completion: bool,
    /// Longest a completion report is held to ride on a later route call (ms) before it is sent
    /// by itself (with any others held); 0 sends each at once. Unset (the default): what the
    /// indexer's last route answer allows (`report_hold_ms`: 0 when it shares decisions with other
    /// gateways, whose view of a finished request would lag; else its own setting, 250 ms by
    /// default), 0 until an answer says. The deciding indexer applies carried reports first.
    pub complete_hold_ms: Option<u64>,
    /// Most completion reports held; a full queue is sent at once.
    pub max_held_completions: usize,
    /// Client header whose value is forwarded to the indexer as the request's session (used by the
    /// indexer's `--policy session`; ignored by `kv`). Empty disables it.
    pub session_header: String,
    /// Largest non-streaming response body scanned for `usage` (bytes); larger ones report
    /// `cached_tokens: null`.
    pub max_response_scan_bytes: usize,
    /// Known models. Others are discovered from the indexer when `discover_models` is set.
    pub models: BTreeMap<String, ModelConfig>,
    /// Fetch the tokenizer of a model not listed in `models` on its first request.
    pub discover_models: bool,
    /// Most models one VM holds a tokenizer for (each Qwen3-size tokenizer costs ~100 MiB).
    pub max_models: usize,
    /// Tokenizer fetch backoff.
    pub tokenizer_retry: RetryConfig,
    /// How long a model the indexer does not know is remembered as unknown (ms).
    pub unknown_model_retry_ms: u64,
    /// Most model names remembered as unknown (the oldest is forgotten first). Unknown names never
    /// take one of the `max_models` slots.
    pub unknown_model_cache_entries: usize,
    /// Longest `model` name looked up (bytes); a longer one fails open as `unknown_model` at
    /// once, without asking the indexer.
    pub max_model_name_bytes: usize,
    /// Block size when neither the configuration nor the indexer gives one.
    pub default_block_size: usize,
    /// The online check of the filter's prompt tokens against the engine's.
    pub token_check: crate::token_check::TokenCheckConfig,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Routing,
            indexer_cluster: "kvroute_indexer".into(),
            indexer_authority: "kvroute-indexer".into(),
            route_timeout_ms: 100,
            complete_timeout_ms: 1_000,
            tokenizer_timeout_ms: 30_000,
            routed_paths: vec!["/v1/completions".into(), "/v1/chat/completions".into()],
            max_body_bytes: DEFAULT_MAX_PROMPT_TOKENS * MAX_PROMPT_BYTES_PER_TOKEN,
            oversized_body: OversizedBody::FailOpen,
            upstream_max_body_bytes: 16 * 1024 * 1024,
            inject_kv_cache_report_mode: false,
            debug_headers: false,
            report_completion: true,
            complete_hold_ms: None,
            max_held_completions: 64,
            session_header: "x-session-id".into(),
            max_response_scan_bytes: 1024 * 1024,
            models: BTreeMap::new(),
            discover_models: true,
            max_models: 4,
            tokenizer_retry: RetryConfig::default(),
            unknown_model_retry_ms: 30_000,
            unknown_model_cache_entries: 256,
            max_model_name_bytes: 256,
            default_block_size: 16,
            token_check: crate::token_check::TokenCheckConfig::default(),
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Not JSON, wrong types, or an unknown field.
    #[error("kvroute configuration is not valid JSON for the schema: {0}")]
    Json(String),
    /// A value out of range.
    #[error("kvroute configuration field `{field}` {problem}")]
    Invalid {
        /// Field path.
        field: String,
        /// What is wrong.
        problem: String,
    },
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        problem: problem.into(),
    }
}

const MAX_TIMEOUT_MS: u64 = 600_000;
const MAX_BODY_LIMIT: usize = 256 * 1024 * 1024;
const MAX_BLOCK_SIZE: usize = 4096;

impl FilterConfig {
    /// Parses and validates the plugin configuration. Empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let trimmed = bytes.trim_ascii();
        let cfg: FilterConfig = if trimmed.is_empty() {
            FilterConfig::default()
        } else {
            serde_json::from_slice(trimmed).map_err(|e| ConfigError::Json(e.to_string()))?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.indexer_cluster.trim().is_empty() {
            return Err(invalid("indexer_cluster", "must not be empty"));
        }
        if self.indexer_authority.trim().is_empty() {
            return Err(invalid("indexer_authority", "must not be empty"));
        }
        for (name, v) in [
            ("route_timeout_ms", self.route_timeout_ms),
            ("complete_timeout_ms", self.complete_timeout_ms),
            ("tokenizer_timeout_ms", self.tokenizer_timeout_ms),
        ] {
            if v == 0 || v > MAX_TIMEOUT_MS {
                return Err(invalid(
                    name,
                    format!("must be in 1..={MAX_TIMEOUT_MS}, got {v}"),
                ));
            }
        }
        if self.routed_paths.is_empty() {
            return Err(invalid("routed_paths", "must list at least one path"));
        }
        for p in &self.routed_paths {
            if !p.starts_with('/') || p.contains('?') {
                return Err(invalid(
                    "routed_paths",
                    format!("entry {p:?} must start with '/' and have no query"),
                ));
            }
        }
        if self.max_body_bytes < 1024 || self.max_body_bytes > MAX_BODY_LIMIT {
            return Err(invalid(
                "max_body_bytes",
                format!(
                    "must be in 1024..={MAX_BODY_LIMIT}, got {}",
                    self.max_body_bytes
                ),
            ));
        }
        if self.upstream_max_body_bytes < self.max_body_bytes
            || self.upstream_max_body_bytes > MAX_BODY_LIMIT
        {
            return Err(invalid(
                "upstream_max_body_bytes",
                format!(
                    "must be in max_body_bytes ({})..={MAX_BODY_LIMIT}, got {}",
                    self.max_body_bytes, self.upstream_max_body_bytes
                ),
            ));
        }
        if self.max_response_scan_bytes > MAX_BODY_LIMIT {
            return Err(invalid("max_response_scan_bytes", "is larger than 256 MiB"));
        }
        let tc = &self.token_check;
        if tc.max_response_bytes == 0 || tc.max_response_bytes > MAX_BODY_LIMIT {
            return Err(invalid(
                "token_check.max_response_bytes",
                format!("must be in 1..={MAX_BODY_LIMIT}"),
            ));
        }
        if tc.max_prompt_tokens > MAX_SANE_MODEL_MAX_LENGTH {
            return Err(invalid(
                "token_check.max_prompt_tokens",
                format!("must be at most {MAX_SANE_MODEL_MAX_LENGTH}"),
            ));
        }
        if let Some(hold) = self.complete_hold_ms.filter(|&h| h > MAX_TIMEOUT_MS) {
            return Err(invalid(
                "complete_hold_ms",
                format!("must be in 0..={MAX_TIMEOUT_MS}, got {hold}"),
            ));
        }
        if self.max_held_completions == 0 || self.max_held_completions > MAX_REPORTS_PER_CALL {
            return Err(invalid(
                "max_held_completions",
                format!(
                    "must be in 1..={MAX_REPORTS_PER_CALL}, got {}",
                    self.max_held_completions
                ),
            ));
        }
        if self.max_models == 0 {
            return Err(invalid("max_models", "must be at least 1"));
        }
        if self.models.len() > self.max_models {
            return Err(invalid(
                "models",
                format!(
                    "lists {} models but max_models is {}",
                    self.models.len(),
                    self.max_models
                ),
            ));
        }
        if self.models.is_empty() && !self.discover_models {
            return Err(invalid(
                "models",
                "is empty and discover_models is false: nothing could ever be routed",
            ));
        }
        if self.unknown_model_cache_entries == 0 || self.unknown_model_cache_entries > 1 << 20 {
            return Err(invalid(
                "unknown_model_cache_entries",
                "must be in 1..=1048576",
            ));
        }
        if self.max_model_name_bytes == 0 || self.max_model_name_bytes > 64 * 1024 {
            return Err(invalid("max_model_name_bytes", "must be in 1..=65536"));
        }
        check_block_size("default_block_size", self.default_block_size)?;
        for (name, m) in &self.models {
            if name.is_empty() {
                return Err(invalid("models", "has an empty model name"));
            }
            if name.len() > self.max_model_name_bytes {
                return Err(invalid(
                    "models",
                    format!(
                        "has a name longer than max_model_name_bytes ({})",
                        self.max_model_name_bytes
                    ),
                ));
            }
            if let Some(n) = m.max_prompt_tokens {
                if n == 0 || n > MAX_SANE_MODEL_MAX_LENGTH {
                    return Err(invalid(
                        format!("models.{name}.max_prompt_tokens"),
                        format!("must be in 1..={MAX_SANE_MODEL_MAX_LENGTH}, got {n}"),
                    ));
                }
            }
            if let Some(bs) = m.block_size {
                check_block_size(&format!("models.{name}.block_size"), bs)?;
            }
        }
        let r = &self.tokenizer_retry;
        if r.initial_ms == 0 || r.initial_ms > r.max_ms || r.max_ms > 24 * 3_600_000 {
            return Err(invalid(
                "tokenizer_retry",
                "needs 0 < initial_ms <= max_ms <= 86400000",
            ));
        }
        Ok(())
    }

    /// True when `path` (query and fragment ignored) is one of the routed paths.
    pub fn routes_path(&self, path: &str) -> bool {
        let bare = path.split(['?', '#']).next().unwrap_or(path);
        self.routed_paths.iter().any(|p| p == bare)
    }
}

fn check_block_size(field: &str, bs: usize) -> Result<(), ConfigError> {
    if bs == 0 || bs > MAX_BLOCK_SIZE {
        return Err(invalid(
            field,
            format!("must be in 1..={MAX_BLOCK_SIZE}, got {bs}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_configuration_means_defaults() {
        assert_eq!(FilterConfig::parse(b"").unwrap(), FilterConfig::default());
        assert_eq!(
            FilterConfig::parse(b"  {} ").unwrap(),
            FilterConfig::default()
        );
    }

    #[test]
    fn the_default_body_limit_holds_the_default_prompt_cap() {
        assert_eq!(FilterConfig::default().max_body_bytes, 2 * 1024 * 1024);
    }

    #[test]
    fn full_configuration_parses() {
        let cfg = FilterConfig::parse(
            br#"{"indexer_cluster":"idx","route_timeout_ms":25,"max_body_bytes":2048,
                 "oversized_body":"reject","inject_kv_cache_report_mode":true,
                 "models":{"qwen3":{"block_size":32,"extra_key_style":"plain",
                 "tokenizer_source":"vm_config","lora_paths":{"a":"/p"},
                 "tokenizer_options":{"segment_cache_max_bytes":1024}}},
                 "discover_models":false}"#,
        )
        .unwrap();
        assert_eq!(cfg.indexer_cluster, "idx");
        assert_eq!(cfg.oversized_body, OversizedBody::Reject);
        let m = &cfg.models["qwen3"];
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.extra_key_style, Some(ExtraKeyStyle::Plain));
        assert_eq!(m.tokenizer_source, TokenizerSource::VmConfig);
        assert_eq!(m.lora_paths["a"], "/p");
        let opts = m.tokenizer_options.as_ref().unwrap();
        assert_eq!(opts.segment_cache_max_bytes, 1024);
        assert_eq!(
            opts.segment_cache_max_entries,
            TokenizerOptions::default().segment_cache_max_entries
        );
    }

    #[test]
    fn typos_and_bad_values_are_refused_with_the_field_name() {
        let e = FilterConfig::parse(br#"{"route_timeout":5}"#).unwrap_err();
        assert!(e.to_string().contains("route_timeout"), "{e}");
        let e = FilterConfig::parse(br#"{"route_timeout_ms":0}"#).unwrap_err();
        assert!(e.to_string().contains("route_timeout_ms"), "{e}");
        let e = FilterConfig::parse(br#"{"max_body_bytes":10}"#).unwrap_err();
        assert!(e.to_string().contains("max_body_bytes"), "{e}");
        let e = FilterConfig::parse(br#"{"routed_paths":["v1/x"]}"#).unwrap_err();
        assert!(e.to_string().contains("routed_paths"), "{e}");
        let e = FilterConfig::parse(br#"{"models":{"m":{"block_size":0}}}"#).unwrap_err();
        assert!(e.to_string().contains("models.m.block_size"), "{e}");
        let e = FilterConfig::parse(br#"{"discover_models":false}"#).unwrap_err();
        assert!(e.to_string().contains("discover_models"), "{e}");
        let e = FilterConfig::parse(br#"{"models":{"m":{"tokenizer_options":{"nope":1}}}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let e = FilterConfig::parse(br#"{"oversized_body":"drop"}"#).unwrap_err();
        assert!(matches!(e, ConfigError::Json(_)));
        let e = FilterConfig::parse(b"not json").unwrap_err();
        assert!(matches!(e, ConfigError::Json(_)));
        let e = FilterConfig::parse(br#"{"tokenizer_retry":{"initial_ms":10,"max_ms":5}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("tokenizer_retry"), "{e}");
        let e = FilterConfig::parse(br#"{"models":{"m":{"max_prompt_tokens":0}}}"#).unwrap_err();
        assert!(e.to_string().contains("models.m.max_prompt_tokens"), "{e}");
        let e = FilterConfig::parse(br#"{"max_body_bytes":8192,"upstream_max_body_bytes":4096}"#)
            .unwrap_err();
        assert!(e.to_string().contains("upstream_max_body_bytes"), "{e}");
        let e = FilterConfig::parse(br#"{"max_model_name_bytes":0}"#).unwrap_err();
        assert!(e.to_string().contains("max_model_name_bytes"), "{e}");
    }

    #[test]
    fn path_matching_ignores_the_query() {
        let cfg = FilterConfig::default();
        assert!(cfg.routes_path("/v1/chat/completions"));
        assert!(cfg.routes_path("/v1/completions?x=1"));
        assert!(!cfg.routes_path("/v1/completions/extra"));
        assert!(!cfg.routes_path("/v1/models"));
    }
}
