//! Online calibration of one replica's rates from its own Prometheus metrics.
//!
//! vLLM exports, per engine, cumulative histograms and counters. Between two scrapes their deltas
//! describe the steps the engine ran in that window:
//!
//! * `vllm:iteration_tokens_total` (count): how many steps ran;
//! * `vllm:prompt_tokens_total` minus `vllm:prefix_cache_hits_total`: prompt tokens computed;
//! * `vllm:inter_token_latency_seconds` (sum, count): the mean gap between two tokens of a
//!   decoding request, which is the mean duration of the steps that carried decodes.
//!
//! A step computing `p` prompt tokens takes `step + p / rate` (`step`: the step's fixed cost, the
//! weights read once; `rate`: prefill throughput). So per window, with `x` = computed prompt tokens
//! per step and `y` = mean inter-token latency, `y = step + x / rate`. A least-squares line through
//! the windows (recent ones weighted more: exponential forgetting with `half_life_s`) gives the
//! inverse prefill rate as its slope. The step time scored with is the windows' mean inter-token
//! latency (what a decoding request there sees, prefill chunks of others included: the intercept
//! alone is too noisy to learn from a few windows). Two pseudo-windows on the
//! prior's line keep the fit defined before data arrives, or when every window looks alike; they
//! never fade below `prior_weight`, so the prior decides only where the data cannot.
//!
//! Guards: a window with too few steps or tokens is merged with the next; a window whose mean
//! latency is more than `outlier_factor` away from the current fit is dropped; the estimates stay
//! within `prior / bound_factor ..= prior * bound_factor`; a counter going backwards (the engine
//! restarted) or [`ReplicaCalibration::reset`] returns to the prior.

use serde::{Deserialize, Serialize};

use crate::scoring::ReplicaRates;

/// Calibration settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibrationConfig {
    /// Age at which a window weighs half as much as a new one, seconds. Default 10.
    pub half_life_s: f64,
    /// Weight of the prior, in windows, that never fades. Default 0.05.
    pub prior_weight: f64,
    /// Fewest steps that make a window. Default 8.
    pub min_steps: f64,
    /// Fewest inter-token gaps that make a window. Default 8.
    pub min_tokens: f64,
    /// A window whose mean latency is this many times off the fit is dropped. Default 8.
    pub outlier_factor: f64,
    /// Estimates stay within this factor of the prior either way. Default 20.
    pub bound_factor: f64,
    /// Engine seconds per wall second: 1 for a real engine; `kvroute-sim --time-scale S` reports
    /// model time, `S` times faster than the wall. Default 1.
    pub engine_time_scale: f64,
}

impl Default for CalibrationConfig {
    fn default() -> Self {
        Self {
            half_life_s: 10.0,
            prior_weight: 0.05,
            min_steps: 8.0,
            min_tokens: 8.0,
            outlier_factor: 8.0,
            bound_factor: 20.0,
            engine_time_scale: 1.0,
        }
    }
}

impl CalibrationConfig {
    /// Checks every field; the error is (field, message).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let checks = [
            ("half_life_s", self.half_life_s, 0.0),
            ("prior_weight", self.prior_weight, 0.0),
            ("outlier_factor", self.outlier_factor, 1.0),
            ("bound_factor", self.bound_factor, 1.0),
            ("engine_time_scale", self.engine_time_scale, 0.0),
        ];
        for (field, v, above) in checks {
            if !(v.is_finite() && v > above) {
                return Err((field, format!("must be a number > {above}, got {v}")));
            }
        }
        for (field, v) in [
            ("min_steps", self.min_steps),
            ("min_tokens", self.min_tokens),
        ] {
            if !(v.is_finite() && v >= 1.0) {
                return Err((field, format!("must be a number >= 1, got {v}")));
            }
        }
        Ok(())
    }
}

/// Cumulative values read from one scrape of one replica (summed over its engines).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct EngineTotals {
    /// `vllm:iteration_tokens_total_count`: steps run.
    pub steps: f64,
    /// Prompt tokens computed (`prompt_tokens_total - prefix_cache_hits_total`).
    pub computed_prompt_tokens: f64,
    /// `vllm:inter_token_latency_seconds_sum`, engine seconds.
    pub itl_sum_s: f64,
    /// `vllm:inter_token_latency_seconds_count`.
    pub itl_count: f64,
    /// KV blocks of the replica (`vllm:cache_config_info{num_gpu_blocks}`), if exported.
    pub kv_capacity_blocks: Option<u32>,
}

impl EngineTotals {
    fn went_back(&self, before: &EngineTotals) -> bool {
        self.steps < before.steps
            || self.computed_prompt_tokens < before.computed_prompt_tokens - 0.5
            || self.itl_sum_s < before.itl_sum_s
            || self.itl_count < before.itl_count
    }
}

/// Exponentially weighted sums of a line fit `y = a + b x`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
struct LineFit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl LineFit {
    fn add(&mut self, w: f64, x: f64, y: f64) {
        self.w += w;
        self.x += w * x;
        self.y += w * y;
        self.xx += w * x * x;
        self.xy += w * x * y;
    }

    fn fade(&mut self, keep: f64) {
        self.w *= keep;
        self.x *= keep;
        self.y *= keep;
        self.xx *= keep;
        self.xy *= keep;
    }

    fn plus(&self, o: &LineFit) -> LineFit {
        LineFit {
            w: self.w + o.w,
            x: self.x + o.x,
            y: self.y + o.y,
            xx: self.xx + o.xx,
            xy: self.xy + o.xy,
        }
    }

    /// (intercept, slope), or `None` when the x values do not vary.
    fn solve(&self) -> Option<(f64, f64)> {
        let var = self.w * self.xx - self.x * self.x;
        if !(var.is_finite() && var > 1e-12 * self.w * self.xx.max(1.0)) {
            return None;
        }
        let b = (self.w * self.xy - self.x * self.y) / var;
        let a = (self.y - b * self.x) / self.w;
        (a.is_finite() && b.is_finite()).then_some((a, b))
    }
}

/// One replica's learned rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaCalibration {
    prior: ReplicaRates,
    fit: LineFit,
    /// Faded sums of inter-token gaps (wall seconds) and their count.
    itl_s: f64,
    itl_n: f64,
    last: Option<EngineTotals>,
    /// Deltas not yet large enough to make a window, and the wall time they span.
    partial: EngineTotals,
    partial_s: f64,
    /// Windows used and dropped since the last reset.
    windows: u64,
    outliers: u64,
    kv_capacity_blocks: u32,
}

impl ReplicaCalibration {
    /// A calibration that starts (and restarts) from `prior`.
    pub fn new(prior: ReplicaRates) -> Self {
        Self {
            prior,
            fit: LineFit::default(),
            itl_s: 0.0,
            itl_n: 0.0,
            last: None,
            partial: EngineTotals::default(),
            partial_s: 0.0,
            windows: 0,
            outliers: 0,
            kv_capacity_blocks: prior.kv_capacity_blocks,
        }
    }

    /// Forgets everything learned (the replica restarted).
    pub fn reset(&mut self) {
        *self = Self::new(self.prior);
    }

    /// Windows that updated the fit since the last reset.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Windows dropped as outliers since the last reset.
    pub fn outliers(&self) -> u64 {
        self.outliers
    }

    /// Takes one scrape's totals, `elapsed_s` wall seconds after the previous one.
    pub fn observe(&mut self, cfg: &CalibrationConfig, totals: &EngineTotals, elapsed_s: f64) {
        if let Some(blocks) = totals.kv_capacity_blocks.filter(|b| *b > 0) {
            self.kv_capacity_blocks = blocks;
        }
        let Some(before) = self.last.replace(*totals) else {
            return;
        };
        if totals.went_back(&before) {
            self.reset();
            self.last = Some(*totals);
            return;
        }
        let elapsed_s = if elapsed_s.is_finite() && elapsed_s > 0.0 {
            elapsed_s
        } else {
            0.0
        };
        self.partial.steps += totals.steps - before.steps;
        self.partial.computed_prompt_tokens +=
            (totals.computed_prompt_tokens - before.computed_prompt_tokens).max(0.0);
        self.partial.itl_sum_s += totals.itl_sum_s - before.itl_sum_s;
        self.partial.itl_count += totals.itl_count - before.itl_count;
        self.partial_s += elapsed_s;
        if self.partial.steps < cfg.min_steps || self.partial.itl_count < cfg.min_tokens {
            return;
        }
        let window = std::mem::take(&mut self.partial);
        let span_s = std::mem::take(&mut self.partial_s);
        let scale = cfg.engine_time_scale;
        let x = window.computed_prompt_tokens / window.steps;
        let y = window.itl_sum_s / window.itl_count / scale;
        if !(x.is_finite() && y.is_finite() && y > 0.0) {
            return;
        }
        let (a, b) = self.line(cfg);
        let expected = a + b * x;
        if expected > 0.0
            && (y > expected * cfg.outlier_factor || y < expected / cfg.outlier_factor)
        {
            self.outliers += 1;
            return;
        }
        let keep = 0.5f64.powf(span_s / cfg.half_life_s);
        self.fit.fade(keep);
        self.fit.add(1.0, x, y);
        self.itl_s = self.itl_s * keep + window.itl_sum_s / scale;
        self.itl_n = self.itl_n * keep + window.itl_count;
        self.windows += 1;
    }

    /// The fitted (step seconds, seconds per prefill token), bounded around the prior.
    fn line(&self, cfg: &CalibrationConfig) -> (f64, f64) {
        let a0 = self.prior.decode_step_s;
        let b0 = 1.0 / self.prior.prefill_tokens_per_s;
        // Two pseudo-windows on the prior's line, at no prefill and at a typical chunk.
        let x_ref = if self.fit.w > 0.0 && self.fit.x > 0.0 {
            (2.0 * self.fit.x / self.fit.w).max(1.0)
        } else {
            2048.0
        };
        let mut prior = LineFit::default();
        let half = cfg.prior_weight / 2.0;
        prior.add(half, 0.0, a0);
        prior.add(half, x_ref, a0 + b0 * x_ref);
        let (a, b) = self.fit.plus(&prior).solve().unwrap_or((a0, b0));
        let k = cfg.bound_factor;
        (a.clamp(a0 / k, a0 * k), b.clamp(b0 / k, b0 * k))
    }

    /// The rates to score with: learned where the data allows, the prior elsewhere.
    pub fn rates(&self, cfg: &CalibrationConfig) -> ReplicaRates {
        let (_, b) = self.line(cfg);
        let a0 = self.prior.decode_step_s;
        let k = cfg.bound_factor;
        let pseudo = cfg.prior_weight * cfg.min_tokens;
        let itl = (self.itl_s + pseudo * a0) / (self.itl_n + pseudo);
        ReplicaRates {
            prefill_tokens_per_s: 1.0 / b,
            decode_step_s: itl.clamp(a0 / k, a0 * k),
            kv_capacity_blocks: self.kv_capacity_blocks,
        }
    }
}

#[cfg(test)]
mod tests;
