//! The model's settings: priors for the rates calibration refines, the tiers' load rates, and the
//! operator's latency objectives that weigh one request's wait against the others' slowdown.
//!
//! Every value is a physical quantity (tokens per second, seconds); none is an exchange rate
//! between made-up units. `docs/scoring.md` derives each default.

use serde::{Deserialize, Serialize};

use super::inputs::ReplicaRates;

/// The cost model's settings. `Default` gives the documented defaults; deserialising fills
/// missing fields with them, so a config file may set only some.
///
/// Times are wall-clock seconds as the indexer sees them. For `kvroute-sim` with `--time-scale S`,
/// divide times by `S` and multiply rates by `S` (the local stack does).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Prior prefill throughput of a replica, tokens per second, until calibration has measured it
    /// (and after the replica restarts). Default 30,000: an 8B-class model on one H100.
    pub prefill_tokens_per_s: f64,
    /// Prior duration of one engine step (the inter-token latency of a decoding request), seconds.
    /// Default 0.007.
    pub decode_step_s: f64,
    /// Marginal step time one more decoding sequence adds, seconds. Default 0.00003.
    pub decode_step_per_seq_s: f64,
    /// The engines' `--max-num-batched-tokens`: the token budget of one step, shared by decoding
    /// sequences (one token each) and prefill chunks. Default 8192.
    pub max_num_batched_tokens: u32,
    /// Rate at which a replica loads KV of prefix blocks from host memory (CPU offload), tokens per
    /// second. Default 200,000 (128 KiB of KV per token over ~25 GB/s of PCIe).
    pub cpu_load_tokens_per_s: f64,
    /// Rate at which a replica loads KV of prefix blocks from disk or remote storage, tokens per
    /// second. Default 40,000 (~5 GB/s).
    pub storage_load_tokens_per_s: f64,
    /// The time-to-first-token objective, seconds. With `itl_objective_s` it sets how much one
    /// second of slowdown of a running request weighs against one second of this request's wait.
    /// Default 2.0.
    pub ttft_objective_s: f64,
    /// The inter-token latency objective, seconds per token. A running request's stalls within
    /// `remaining * (itl_objective_s - step)` (its slack) are not charged as harm, except a
    /// copy's. Default 0.05.
    pub itl_objective_s: f64,
    /// Output tokens a running request is assumed to have left when the indexer knows none of
    /// its requests' lengths (requests routed elsewhere, or before any). Default 256.
    pub default_remaining_output_tokens: u32,
    /// Whether a stale replica's matched blocks still count as cached. Default false: the index
    /// may be out of date for it.
    pub stale_credit: bool,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            prefill_tokens_per_s: 30_000.0,
            decode_step_s: 0.007,
            decode_step_per_seq_s: 0.000_03,
            max_num_batched_tokens: 8192,
            cpu_load_tokens_per_s: 200_000.0,
            storage_load_tokens_per_s: 40_000.0,
            ttft_objective_s: 2.0,
            itl_objective_s: 0.05,
            default_remaining_output_tokens: 256,
            stale_credit: false,
        }
    }
}

/// A setting out of range: (field, message).
pub type ConfigError = (&'static str, String);

impl ScoringConfig {
    /// The rates a replica is assumed to have before calibration measured it.
    pub fn prior_rates(&self) -> ReplicaRates {
        ReplicaRates {
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            decode_step_s: self.decode_step_s,
            kv_capacity_blocks: 0,
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("decode_step_s", self.decode_step_s),
            ("cpu_load_tokens_per_s", self.cpu_load_tokens_per_s),
            ("storage_load_tokens_per_s", self.storage_load_tokens_per_s),
            ("ttft_objective_s", self.ttft_objective_s),
            ("itl_objective_s", self.itl_objective_s),
        ];
        for (field, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err((field, format!("must be a number > 0, got {v}")));
            }
        }
        let v = self.decode_step_per_seq_s;
        if !(v.is_finite() && v >= 0.0) {
            return Err((
                "decode_step_per_seq_s",
                format!("must be a number >= 0, got {v}"),
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(("max_num_batched_tokens", "must be > 0".into()));
        }
        if self.default_remaining_output_tokens == 0 {
            return Err(("default_remaining_output_tokens", "must be > 0".into()));
        }
        Ok(())
    }
}

/// The configured priors ([`ScoringConfig::prior_rates`] of the default configuration).
impl Default for ReplicaRates {
    fn default() -> Self {
        super::ScoringConfig::default().prior_rates()
    }
}
