//! The step-time cost model. One scheduler step of a vLLM engine runs one forward pass over every
//! scheduled token; its time is modelled as
//!
//! ```text
//! step_ms = decode_step_ms                                   (weights read once per step)
//!         + prefill_tokens * 1000 / prefill_tokens_per_s      (compute-bound prefill chunk)
//!         + decode_seqs * decode_ms_per_seq                   (per-sequence sampling/overhead)
//!         + context_tokens / 1000 * decode_ms_per_1k_context  (KV reads of every decode seq)
//! ```
//!
//! Defaults are calibrated to an 8B-class model in bf16 on one H100 SXM; see docs/simulator.md
//! for the derivation and sources. A replica's speed factor (`--speed`, `POST /admin/speed`)
//! divides every step: see [`LatencyModel::scaled`] and [`Speed`].

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Cost-model parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencyModel {
    /// Prefill throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Fixed time of any step (a decode step of one sequence), milliseconds.
    pub decode_step_ms: f64,
    /// Extra time per sequence in the batch, milliseconds.
    pub decode_ms_per_seq: f64,
    /// Extra time per 1000 tokens of context read by decoding sequences, milliseconds.
    pub decode_ms_per_1k_context: f64,
}

impl Default for LatencyModel {
    fn default() -> Self {
        LatencyModel {
            prefill_tokens_per_s: 30_000.0,
            decode_step_ms: 6.0,
            decode_ms_per_seq: 0.03,
            decode_ms_per_1k_context: 0.04,
        }
    }
}

/// What one step computes, as far as the cost model cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Prompt tokens computed this step (prefill chunks).
    pub prefill_tokens: usize,
    /// Sequences decoding one token this step.
    pub decode_seqs: usize,
    /// Total context length of the decoding sequences.
    pub decode_context_tokens: usize,
}

impl LatencyModel {
    /// Simulated (unscaled) duration of a step, in seconds. Zero for an empty step.
    pub fn step_seconds(&self, s: &StepShape) -> f64 {
        if s.prefill_tokens == 0 && s.decode_seqs == 0 {
            return 0.0;
        }
        let rate = self.prefill_tokens_per_s.max(1.0);
        let ms = self.decode_step_ms
            + s.prefill_tokens as f64 * 1000.0 / rate
            + (s.decode_seqs + usize::from(s.prefill_tokens > 0)) as f64 * self.decode_ms_per_seq
            + s.decode_context_tokens as f64 / 1000.0 * self.decode_ms_per_1k_context;
        ms / 1000.0
    }

    /// The model of a replica running at `speed` times this one: every step takes `1/speed` as
    /// long (prefill throughput x speed, every millisecond term / speed).
    pub fn scaled(&self, speed: f64) -> LatencyModel {
        LatencyModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s * speed,
            decode_step_ms: self.decode_step_ms / speed,
            decode_ms_per_seq: self.decode_ms_per_seq / speed,
            decode_ms_per_1k_context: self.decode_ms_per_1k_context / speed,
        }
    }
}

/// A speed factor that is not a finite number > 0.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("speed must be a finite number > 0 (1 = the configured cost model, 0.5 = every step takes twice as long), got {0}")]
pub struct InvalidSpeed(pub f64);

/// Checks a speed factor.
pub fn check_speed(v: f64) -> Result<f64, InvalidSpeed> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(InvalidSpeed(v))
    }
}

/// A replica's speed factor, shared by its engines and changeable at run time.
#[derive(Debug)]
pub struct Speed(AtomicU64);

impl Speed {
    /// A validated speed.
    pub fn new(v: f64) -> Result<Self, InvalidSpeed> {
        Ok(Speed(AtomicU64::new(check_speed(v)?.to_bits())))
    }

    /// The current factor.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    /// Sets a new factor (steps scheduled from now on use it); returns it.
    pub fn set(&self, v: f64) -> Result<f64, InvalidSpeed> {
        let v = check_speed(v)?;
        self.0.store(v.to_bits(), Ordering::Relaxed);
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_land_in_the_documented_ranges() {
        let m = LatencyModel::default();
        // One decode step of a modest batch: 6-8 ms.
        let d = m.step_seconds(&StepShape {
            prefill_tokens: 0,
            decode_seqs: 16,
            decode_context_tokens: 16 * 2000,
        });
        assert!((0.006..0.008).contains(&d), "{d}");
        // An 8k prefill chunk alone: ~25-35k tokens/s effective.
        let p = m.step_seconds(&StepShape {
            prefill_tokens: 8192,
            ..Default::default()
        });
        let rate = 8192.0 / p;
        assert!((25_000.0..35_000.0).contains(&rate), "{rate}");
        assert_eq!(m.step_seconds(&StepShape::default()), 0.0);
    }

    #[test]
    fn speed_divides_every_step() {
        let m = LatencyModel::default();
        let shape = StepShape {
            prefill_tokens: 3000,
            decode_seqs: 7,
            decode_context_tokens: 9000,
        };
        let slow = m.scaled(0.5);
        let ratio = slow.step_seconds(&shape) / m.step_seconds(&shape);
        assert!((ratio - 2.0).abs() < 1e-9, "{ratio}");
        assert_eq!(slow.prefill_tokens_per_s, 15_000.0);
        assert_eq!(slow.decode_step_ms, 12.0);
        let s = Speed::new(1.0).unwrap();
        assert_eq!(s.set(0.25), Ok(0.25));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(s.set(bad).is_err());
            assert!(Speed::new(bad).is_err());
        }
        assert_eq!(s.get(), 0.25);
    }
}
