//! Online calibration of one replica's rates from its own Prometheus metrics.
//!
//! vLLM exports, per engine, cumulative histograms. Between two scrapes their deltas describe the
//! requests and steps of that window:
//!
//! * `vllm:request_prefill_kv_computed_tokens` (sum) and `vllm:request_prefill_time_seconds`
//!   (sum, count): the prompt tokens the requests that finished their prefill computed, and how
//!   long those prefills took (first scheduled to first token). Their ratio is the prefill rate a
//!   request sees there, chunking and the decodes it shares its steps with included: what a TTFT
//!   prediction needs.
//! * Prefills that run at the same time (vLLM packs every waiting prompt it can into one step's
//!   token budget) each count the whole shared time, so the sum of prefill times can exceed the
//!   time that passed: k prefills sharing every step would read the rate k times too slow, and
//!   the replica that is busiest would look slowest. An engine cannot spend longer than the
//!   window in prefill, so the time divided into the tokens is `min(sum of prefill times, window
//!   x engines)`: exact when prefills never overlap and when the engine prefilled all the time.
//! * `vllm:inter_token_latency_seconds` (sum, count): the mean gap between two tokens of a
//!   decoding request, the step time a request decoding there sees.
//!
//! (A regression of the mean inter-token latency on computed tokens per step was tried first: on
//! the simulator at load it read the prefill rate 1.5x too fast, because the steps' cost of reading
//! the batch's KV moves with the same windows; the direct ratio was within 11 %.)
//!
//! Each is a ratio of sums faded by age (`half_life_s`), so recent windows weigh more and a replica
//! that slows down is re-learned in a few half-lives. The prior counts as `prior_weight` windows'
//! worth of data that never fades, so it decides only until data arrives.
//!
//! A replica is scored with its own windows, and the windows of every replica of its model
//! ([`RatePool`]) as their prior (weighing `pool_weight` windows), faded by their age when read.
//! Replicas of one deployment mostly run the same engine on the same hardware: a replica without
//! windows of its own (new, or idle) is scored like its measured siblings, not like the
//! configured prior, and one biased by its own traffic (a burst of prefills sharing steps reads
//! slower than the engine is) returns to the model's rates once its windows age, instead of
//! keeping that reading while the router, believing it, sends it nothing. A replica on a slower
//! GPU is still seen as such once its own windows outweigh the pool's.
//!
use serde::{Deserialize, Serialize};

use crate::scoring::ReplicaRates;

/// Calibration settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibrationConfig {
    /// Age at which a window weighs half as much as a new one, engine seconds. Default 10.
    pub half_life_s: f64,
    /// Weight of the prior, in windows, that never fades. Default 0.05.
    pub prior_weight: f64,
    /// Fewest finished prefills that make a window of the prefill rate. Default 2.
    pub min_prefills: f64,
    /// Fewest inter-token gaps that make a window. Default 8.
    pub min_tokens: f64,
    /// A window whose mean latency is this many times off the fit is dropped. Default 8.
    pub outlier_factor: f64,
    /// Estimates stay within this factor of the prior either way. Default 20.
    pub bound_factor: f64,
    /// Engine seconds per wall second: 1 for a real engine; `kvroute-sim --time-scale S` reports
    /// model time, `S` times faster than the wall. Default 1.
    pub engine_time_scale: f64,
    /// Weight of the model's pooled rates in each replica's estimate, in windows of a 2,048-token
    /// prefill / `min_tokens` gaps. Default 2; a large value scores every replica alike.
    pub pool_weight: f64,
}

impl Default for CalibrationConfig {
    fn default() -> Self {
        Self {
            half_life_s: 10.0,
            prior_weight: 0.05,
            min_prefills: 2.0,
            min_tokens: 8.0,
            outlier_factor: 8.0,
            bound_factor: 20.0,
            engine_time_scale: 1.0,
            pool_weight: 2.0,
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
        if !(self.pool_weight.is_finite() && self.pool_weight >= 0.0) {
            return Err((
                "pool_weight",
                format!("must be a number >= 0, got {}", self.pool_weight),
            ));
        }
        for (field, v) in [
            ("min_prefills", self.min_prefills),
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
    /// `vllm:request_prefill_kv_computed_tokens_sum`: prompt tokens computed by finished prefills.
    pub prefill_tokens: f64,
    /// `vllm:request_prefill_time_seconds_sum`, engine seconds.
    pub prefill_time_s: f64,
    /// `vllm:request_prefill_time_seconds_count`: prefills finished.
    pub prefills: f64,
    /// `vllm:inter_token_latency_seconds_sum`, engine seconds.
    pub itl_sum_s: f64,
    /// `vllm:inter_token_latency_seconds_count`.
    pub itl_count: f64,
    /// KV blocks of the replica (`vllm:cache_config_info{num_gpu_blocks}`), if exported.
    pub kv_capacity_blocks: Option<u32>,
    /// Engines (data-parallel ranks) whose prefill times are summed here; 0 is read as 1.
    #[serde(default)]
    pub engines: u32,
}

impl EngineTotals {
    fn went_back(&self, before: &EngineTotals) -> bool {
        self.prefill_tokens < before.prefill_tokens
            || self.prefill_time_s < before.prefill_time_s
            || self.prefills < before.prefills
            || self.itl_sum_s < before.itl_sum_s
            || self.itl_count < before.itl_count
    }
}

/// A ratio of two sums, both faded by age, with a prior that never fades.
///
/// The denominator can be capped by a third faded sum, `cap` (the engine time the windows
/// spanned, for prefill): the ratio then divides by `min(den, cap)`. A ratio fed no cap
/// (`take`'s `cap` 0) is never capped.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
struct FadedRatio {
    num: f64,
    den: f64,
    #[serde(default)]
    cap: f64,
    /// Wall seconds since the last fold (fading applies at the next one).
    age_s: f64,
    /// Not yet folded: (num, den, count).
    partial: (f64, f64, f64),
    /// Not yet folded: cap.
    #[serde(default)]
    partial_cap: f64,
}

/// One scrape's deltas for a [`FadedRatio`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Window {
    num: f64,
    den: f64,
    count: f64,
    /// What bounds `den` (0: unbounded).
    cap: f64,
}

/// `den` bounded by `cap` when a cap is kept.
fn capped(den: f64, cap: f64) -> f64 {
    if cap > 0.0 {
        den.min(cap)
    } else {
        den
    }
}

impl FadedRatio {
    /// Adds one scrape's deltas; folds them in once `min_count` events are gathered, unless
    /// their ratio is `outlier` times off `current`. Returns whether it folded, dropped
    /// (outlier) or waits.
    fn take(
        &mut self,
        cfg: &CalibrationConfig,
        d: Window,
        min_count: f64,
        elapsed_s: f64,
        current: f64,
    ) -> Fold {
        self.partial.0 += d.num.max(0.0);
        self.partial.1 += d.den.max(0.0);
        self.partial.2 += d.count.max(0.0);
        self.partial_cap += d.cap.max(0.0);
        self.age_s += elapsed_s;
        if self.partial.2 < min_count || self.partial.1 <= 0.0 {
            return Fold::Waits;
        }
        let (num, den, _) = std::mem::take(&mut self.partial);
        let cap = std::mem::take(&mut self.partial_cap);
        let ratio = num / capped(den, cap);
        if !ratio.is_finite()
            || (current > 0.0
                && (ratio > current * cfg.outlier_factor || ratio < current / cfg.outlier_factor))
        {
            return Fold::Dropped;
        }
        // Age in engine seconds: what the engine did in a window, not how fast the wall ran.
        let age_s = std::mem::take(&mut self.age_s) * cfg.engine_time_scale;
        let keep = 0.5f64.powf(age_s / cfg.half_life_s);
        self.num = self.num * keep + num;
        self.den = self.den * keep + den;
        self.cap = self.cap * keep + cap;
        Fold::Folded
    }

    /// Its folded sums (numerator, capped denominator), faded by the time since the last fold.
    fn faded_now(&self, cfg: &CalibrationConfig) -> (f64, f64) {
        let age_s = self.age_s * cfg.engine_time_scale;
        let keep = 0.5f64.powf(age_s / cfg.half_life_s);
        (self.num * keep, capped(self.den, self.cap) * keep)
    }
}

/// `(num + prior * weight) / (den + weight)`, or `prior` when there is no weight at all.
fn with_prior(sums: (f64, f64), prior: f64, weight: f64) -> f64 {
    let den = sums.1 + weight;
    if den > 0.0 {
        (sums.0 + prior * weight) / den
    } else {
        prior
    }
}

/// Rates from sums of windows (engine time) after `prior` (wall time), weighing `weight`
/// windows of a 2,048-token prefill / `min_tokens` gaps, within `bound_factor` of `bound`.
fn blend(
    cfg: &CalibrationConfig,
    prior: ReplicaRates,
    weight: f64,
    bound: ReplicaRates,
    (prefill, step): ((f64, f64), (f64, f64)),
    kv_capacity_blocks: u32,
) -> ReplicaRates {
    let scale = cfg.engine_time_scale;
    let k = cfg.bound_factor;
    let rate0 = prior.prefill_tokens_per_s / scale;
    let rate = with_prior(prefill, rate0, weight * 2048.0 / rate0) * scale;
    let step = with_prior(step, prior.decode_step_s * scale, weight * cfg.min_tokens) / scale;
    ReplicaRates {
        prefill_tokens_per_s: rate.clamp(
            bound.prefill_tokens_per_s / k,
            bound.prefill_tokens_per_s * k,
        ),
        decode_step_s: step.clamp(bound.decode_step_s / k, bound.decode_step_s * k),
        kv_capacity_blocks,
    }
}

/// The windows of every replica of one model, each faded by its age, summed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RatePool {
    prefill: (f64, f64),
    step: (f64, f64),
}

impl RatePool {
    /// Adds one replica's windows.
    pub fn add(&mut self, cfg: &CalibrationConfig, c: &ReplicaCalibration) {
        let (prefill, step) = c.faded_now(cfg);
        self.prefill = (self.prefill.0 + prefill.0, self.prefill.1 + prefill.1);
        self.step = (self.step.0 + step.0, self.step.1 + step.1);
    }

    /// The model's rates: its replicas' windows after the configured `prior`.
    pub fn model_rates(&self, cfg: &CalibrationConfig, prior: ReplicaRates) -> ReplicaRates {
        let sums = (self.prefill, self.step);
        blend(cfg, prior, cfg.prior_weight, prior, sums, 0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    Folded,
    Dropped,
    Waits,
}

/// One replica's learned rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaCalibration {
    prior: ReplicaRates,
    /// Prompt tokens per engine second of prefill.
    prefill: FadedRatio,
    /// Engine seconds per inter-token gap.
    step: FadedRatio,
    last: Option<EngineTotals>,
    /// Windows folded and dropped since the last reset.
    windows: u64,
    outliers: u64,
    kv_capacity_blocks: u32,
}

impl ReplicaCalibration {
    /// A calibration that starts (and restarts) from `prior`.
    pub fn new(prior: ReplicaRates) -> Self {
        Self {
            prior,
            prefill: FadedRatio::default(),
            step: FadedRatio::default(),
            last: None,
            windows: 0,
            outliers: 0,
            kv_capacity_blocks: prior.kv_capacity_blocks,
        }
    }

    /// Forgets everything learned (the replica restarted).
    pub fn reset(&mut self) {
        *self = Self::new(self.prior);
    }

    /// Windows that updated an estimate since the last reset.
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
        let current = self.rates(cfg);
        let scale = cfg.engine_time_scale;
        // Engine-time rates: tokens per engine second, engine seconds per gap.
        // The engine time the window spanned, over every engine: no more prefill time can have
        // passed there.
        let engines = f64::from(totals.engines.max(1));
        let prefill = Window {
            num: totals.prefill_tokens - before.prefill_tokens,
            den: totals.prefill_time_s - before.prefill_time_s,
            count: totals.prefills - before.prefills,
            cap: elapsed_s * scale * engines,
        };
        let fold = self.prefill.take(
            cfg,
            prefill,
            cfg.min_prefills,
            elapsed_s,
            current.prefill_tokens_per_s / scale,
        );
        self.count(fold);
        let step = Window {
            num: totals.itl_sum_s - before.itl_sum_s,
            den: totals.itl_count - before.itl_count,
            count: totals.itl_count - before.itl_count,
            cap: 0.0,
        };
        // The ratio folded is seconds per gap: numerator the time, denominator the gaps.
        let fold = self.step.take(
            cfg,
            step,
            cfg.min_tokens,
            elapsed_s,
            current.decode_step_s * scale,
        );
        self.count(fold);
    }

    fn count(&mut self, fold: Fold) {
        match fold {
            Fold::Folded => self.windows += 1,
            Fold::Dropped => self.outliers += 1,
            Fold::Waits => {}
        }
    }

    /// The rates to score with, wall time: learned where data arrived, the prior elsewhere,
    /// within `bound_factor` of the prior.
    pub fn rates(&self, cfg: &CalibrationConfig) -> ReplicaRates {
        let prefill = (self.prefill.num, capped(self.prefill.den, self.prefill.cap));
        let step = (self.step.num, capped(self.step.den, self.step.cap));
        let sums = (prefill, step);
        blend(
            cfg,
            self.prior,
            cfg.prior_weight,
            self.prior,
            sums,
            self.kv_capacity_blocks,
        )
    }

    /// Its rates after its model's (`model`, from [`RatePool::model_rates`]): its own windows,
    /// faded by their age, after `model` weighing `pool_weight`; within `bound_factor` of `prior`.
    pub fn rates_after(
        &self,
        cfg: &CalibrationConfig,
        prior: ReplicaRates,
        model: ReplicaRates,
    ) -> ReplicaRates {
        let sums = self.faded_now(cfg);
        blend(
            cfg,
            model,
            cfg.pool_weight,
            prior,
            sums,
            self.kv_capacity_blocks,
        )
    }

    /// Its sums (prefill, step), faded by the time since each last folded a window.
    fn faded_now(&self, cfg: &CalibrationConfig) -> ((f64, f64), (f64, f64)) {
        (self.prefill.faded_now(cfg), self.step.faded_now(cfg))
    }
}

#[cfg(test)]
mod tests;
