//! The ideal TTFT bound of a workload: every request prefills only the tokens the hit-rate
//! ceiling says it must (those not in blocks an earlier request already had) on an idle replica
//! of speed 1, under the simulator's own cost model. Policies' TTFTs are reported against it.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::http;
use crate::stats::percentile;

/// The parts of `kvroute-sim`'s cost model that price one prefill on an idle engine.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimLatency {
    /// Prefill throughput, tokens per model second.
    pub prefill_tokens_per_s: f64,
    /// Fixed time of every step, model ms.
    pub decode_step_ms: f64,
    /// Time per sequence in a step's batch, model ms.
    pub decode_ms_per_seq: f64,
    /// Prompt tokens computed per step at most (chunked prefill).
    pub max_num_batched_tokens: u64,
    /// Where the values were read.
    pub source: String,
    /// Read from a running replica (no need to ask again).
    pub from_replica: bool,
}

impl SimLatency {
    /// The defaults `kvroute-sim --help` prints (the simulator's own, not a copy of them).
    pub fn from_sim_help(sim: &Path) -> Result<Self> {
        let out = Command::new(sim)
            .arg("--help")
            .output()
            .with_context(|| format!("running {} --help", sim.display()))?;
        if !out.status.success() {
            bail!("{} --help failed", sim.display());
        }
        let mut m = Self::from_help(&String::from_utf8_lossy(&out.stdout))?;
        m.source = "`kvroute-sim --help` defaults".to_string();
        Ok(m)
    }

    /// Parses the `[default: ...]` of the cost-model flags in clap's `--help` text.
    pub fn from_help(help: &str) -> Result<Self> {
        let get = |flag: &str| -> Result<f64> {
            let mut lines = help
                .lines()
                .skip_while(|l| !l.trim_start().starts_with(flag));
            let first = lines
                .next()
                .with_context(|| format!("kvroute-sim --help has no {flag}"))?;
            for line in std::iter::once(first).chain(lines.take_while(|l| {
                let t = l.trim_start();
                !t.starts_with("--") && !t.starts_with("-h")
            })) {
                if let Some(v) = line.split("[default: ").nth(1) {
                    let v = v.split(']').next().unwrap_or("").trim();
                    return v
                        .parse()
                        .with_context(|| format!("{flag}: default {v:?} is not a number"));
                }
            }
            bail!("kvroute-sim --help gives no default for {flag}")
        };
        Ok(Self {
            prefill_tokens_per_s: get("--prefill-tokens-per-s")?,
            decode_step_ms: get("--decode-step-ms")?,
            decode_ms_per_seq: get("--decode-ms-per-seq")?,
            max_num_batched_tokens: get("--max-num-batched-tokens")? as u64,
            source: "kvroute-sim --help".to_string(),
            from_replica: false,
        })
    }

    /// Overrides the cost model with a running replica's `GET /admin/latency-model`; false if
    /// it does not answer with one (an older simulator).
    pub fn refresh_from(&mut self, addr: &str) -> bool {
        let Ok((200, text)) = http::get(addr, "/admin/latency-model", Duration::from_secs(2))
        else {
            return false;
        };
        serde_json::from_str::<Value>(&text).is_ok_and(|body| self.apply(&body))
    }

    /// Takes the cost model of a `/admin/latency-model` answer: its speed-1 `base` model if it
    /// has one (the top level has the replica's speed applied), else the top level.
    pub fn apply(&mut self, body: &Value) -> bool {
        let model = body.get("base").filter(|v| v.is_object()).unwrap_or(body);
        let num = |k: &str| model.get(k).or_else(|| body.get(k)).and_then(Value::as_f64);
        let (Some(rate), Some(step)) = (num("prefill_tokens_per_s"), num("decode_step_ms")) else {
            return false;
        };
        if !(rate.is_finite() && rate > 0.0 && step.is_finite() && step >= 0.0) {
            return false;
        }
        self.prefill_tokens_per_s = rate;
        self.decode_step_ms = step;
        if let Some(per_seq) = num("decode_ms_per_seq") {
            self.decode_ms_per_seq = per_seq;
        }
        if let Some(n) = num("max_num_batched_tokens").filter(|n| *n >= 1.0) {
            self.max_num_batched_tokens = n as u64;
        }
        self.source = "`GET /admin/latency-model` (speed 1)".to_string();
        self.from_replica = true;
        true
    }

    /// TTFT of a request that computes `uncached` prompt tokens alone on an idle engine of speed
    /// 1, model ms: one step per prefill chunk, each the step's fixed time + its tokens at the
    /// prefill rate + one sequence; the first token comes with the last chunk.
    pub fn idle_ttft_ms(&self, uncached: u64) -> f64 {
        let uncached = uncached.max(1);
        let chunk = self.max_num_batched_tokens.max(1);
        let steps = uncached.div_ceil(chunk) as f64;
        steps * (self.decode_step_ms + self.decode_ms_per_seq)
            + uncached as f64 * 1000.0 / self.prefill_tokens_per_s.max(1.0)
    }
}

#[cfg(test)]
impl SimLatency {
    /// A model for tests: 1,000 tokens/s and 5 ms per 100-token chunk, so that
    /// `idle_ttft_ms(x) = 5 * ceil(x / 100) + x`.
    pub(crate) fn round_numbers() -> Self {
        SimLatency {
            prefill_tokens_per_s: 1_000.0,
            decode_step_ms: 5.0,
            decode_ms_per_seq: 0.0,
            max_num_batched_tokens: 100,
            source: "test".into(),
            from_replica: false,
        }
    }
}

/// The ideal TTFT percentiles of a workload, model ms.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IdealBound {
    /// p50.
    pub p50_ms: f64,
    /// p90.
    pub p90_ms: f64,
    /// p99.
    pub p99_ms: f64,
    /// Where the cost model came from.
    pub source: String,
}

impl IdealBound {
    /// The percentiles of `ttfts` (model ms, any order), priced with `model`; `None` when empty.
    pub fn of(mut ttfts: Vec<f64>, model: &SimLatency) -> Option<Self> {
        ttfts.sort_by(f64::total_cmp);
        Some(IdealBound {
            p50_ms: percentile(&ttfts, 50.0)?,
            p90_ms: percentile(&ttfts, 90.0)?,
            p99_ms: percentile(&ttfts, 99.0)?,
            source: model.source.clone(),
        })
    }
}

/// The bound for requests that must compute `uncached` tokens each (one entry per request).
pub fn bound(uncached: &[u64], model: &SimLatency) -> Option<IdealBound> {
    IdealBound::of(
        uncached.iter().map(|&u| model.idle_ttft_ms(u)).collect(),
        model,
    )
}

#[cfg(test)]
mod tests {
    use super::super::policies::ceiling_hits;
    use super::super::workloads::{workload_of, Segment};
    use super::*;

    const HELP: &str = "Options:
      --max-num-batched-tokens <MAX_NUM_BATCHED_TOKENS>
          Maximum tokens computed per step per engine (chunked prefill) [default: 8192]
      --prefill-tokens-per-s <PREFILL_TOKENS_PER_S>
          Cost model: prefill throughput, tokens per second [default: 30000]
      --decode-step-ms <DECODE_STEP_MS>
          Cost model: fixed time of every step, milliseconds [default: 6]
      --decode-ms-per-seq <DECODE_MS_PER_SEQ>
          Cost model: time per sequence in the batch, milliseconds [default: 0.03]
      --speed <SPEED>
          Every step takes 1/SPEED as long
  -h, --help
          Print help
";

    fn model() -> SimLatency {
        SimLatency::from_help(HELP).expect("help")
    }

    #[test]
    fn the_cost_model_is_read_from_the_simulators_help() {
        let m = model();
        assert_eq!(m.prefill_tokens_per_s, 30_000.0);
        assert_eq!(m.decode_step_ms, 6.0);
        assert_eq!(m.decode_ms_per_seq, 0.03);
        assert_eq!(m.max_num_batched_tokens, 8192);
        assert!(SimLatency::from_help("--decode-step-ms <X>\n   no default\n").is_err());
        // The real binary, when built.
        let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/kvroute-sim");
        if sim.is_file() {
            let real = SimLatency::from_sim_help(&sim).expect("real help");
            assert!(real.prefill_tokens_per_s > 0.0 && real.max_num_batched_tokens > 0);
        }
    }

    #[test]
    fn the_admin_answer_gives_the_speed_1_model() {
        let mut m = model();
        let body = serde_json::json!({
            "speed": 0.5,
            "prefill_tokens_per_s": 10_000.0,
            "decode_step_ms": 12.0,
            "max_num_batched_tokens": 4096,
            "base": {"prefill_tokens_per_s": 20_000.0, "decode_step_ms": 6.0, "decode_ms_per_seq": 0.05},
        });
        assert!(m.apply(&body));
        assert_eq!((m.prefill_tokens_per_s, m.decode_step_ms), (20_000.0, 6.0));
        assert_eq!(
            (m.decode_ms_per_seq, m.max_num_batched_tokens),
            (0.05, 4096)
        );
        assert!(m.source.contains("admin") && m.from_replica);
        assert!(!model().apply(&serde_json::json!({"error": "not found"})));
    }

    #[test]
    fn idle_ttft_is_one_step_per_chunk_plus_the_tokens_at_the_prefill_rate() {
        let m = model();
        // 3,000 tokens: one chunk, 6.03 ms + 100 ms.
        assert!((m.idle_ttft_ms(3_000) - 106.03).abs() < 1e-9);
        // 20,000 tokens: three chunks (8192, 8192, 3616).
        let want = 3.0 * 6.03 + 20_000.0 / 30.0;
        assert!((m.idle_ttft_ms(20_000) - want).abs() < 1e-9);
        // At least one token is computed.
        assert_eq!(m.idle_ttft_ms(0), m.idle_ttft_ms(1));
    }

    #[test]
    fn ideal_bound_of_a_tiny_workload_by_hand() {
        // Three requests, 16-token blocks: A = 48 tokens, B = A's 48 + 32 more, C = unique 160.
        let a = Segment::new("a", 0, 48);
        let b = Segment::new("b", 0, 32);
        let c = Segment::new("c", 0, 160);
        let w = workload_of(vec![vec![a], vec![a, b], vec![c]]);
        let hits = ceiling_hits(&w, 16);
        assert_eq!(hits, [0, 48, 0]);
        let uncached: Vec<u64> = w
            .requests
            .iter()
            .zip(&hits)
            .map(|(r, h)| r.num_tokens() as u64 - h)
            .collect();
        assert_eq!(uncached, [48, 32, 160]);
        let m = SimLatency::round_numbers();
        // 48 -> 5 + 48 = 53; 32 -> 37; 160 -> two chunks: 10 + 160 = 170.
        let b = bound(&uncached, &m).expect("bound");
        // Sorted 37, 53, 170; percentiles interpolate between ranks.
        assert_eq!(b.p50_ms, 53.0);
        assert!((b.p90_ms - (0.2 * 53.0 + 0.8 * 170.0)).abs() < 1e-9);
        assert!((b.p99_ms - (0.02 * 53.0 + 0.98 * 170.0)).abs() < 1e-9);
        assert_eq!(bound(&[], &m), None);
    }
}
