//! The `shadow` line's measurements: what `kvroute-indexer assess --listen` reported over a run
//! through Envoy's round robin (predicted hit rate, verdict, thrash, and shadow mode's
//! would-have-saved), and the checks of issue 13 that compare them with the `kv` line of the same
//! run (docs/assess.md, "Checking assess against the benchmark").

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::report::GoalCheck;
use crate::summary::RunSummary;

/// How far (hit-rate points, as a fraction) a prediction may be from the `kv` line's measurement.
pub const TOLERANCE: f64 = 0.03;

/// One model's figures from an `assess` JSON report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AssessFigures {
    /// Verdict kind (`would_save`, `low_reuse`, `session_affinity_would_do`, `nothing_to_route`,
    /// `no_traffic`).
    pub verdict: String,
    /// The verdict in words.
    pub summary: String,
    /// The hit rate the engines counted (round robin here).
    pub hit_rate: f64,
    /// (hits + prefill computed twice across replicas) / queries: assess's prediction of what
    /// prefix-aware routing reaches.
    pub predicted_hit_rate: f64,
    /// (hits + recomputed after eviction) / queries: the hit rate without thrash.
    pub hit_rate_without_recompute: f64,
    /// Share of computed prompt tokens another replica held.
    pub duplicated_share: f64,
    /// Share of computed prompt tokens recomputed after an eviction.
    pub recomputed_share: f64,
    /// Preemptions over the fleet.
    pub preemptions: f64,
    /// Whether assess flagged thrash.
    pub thrash: bool,
    /// Shadow mode's figures, when the filter asked during the window.
    pub shadow: Option<ShadowFigures>,
}

/// Shadow mode's counters for one model, as `assess` reports them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowFigures {
    /// Shadow decisions.
    pub decisions: u64,
    /// Their completion reports.
    pub completions: u64,
    /// Share of requests Envoy sent where kvroute would have.
    pub agreed_share: f64,
    /// The hit rate kvroute's choices would have had (predicted tokens / prompt tokens).
    pub predicted_hit_rate: f64,
    /// The hit rate the balancer achieved (cached tokens / prompt tokens).
    pub actual_hit_rate: f64,
    /// Prefill kvroute would have saved, as a share of prompt tokens.
    pub would_save_share: f64,
    /// Of that saving, the share within one session.
    pub within_session_share: f64,
}

/// The parts of the report read here (the JSON schema is in docs/assess.md).
#[derive(Deserialize)]
struct ReportJson {
    models: Vec<ModelJson>,
}

#[derive(Deserialize)]
struct ModelJson {
    model: String,
    hit_rate: f64,
    predicted_hit_rate: f64,
    hit_rate_without_recompute: f64,
    duplicated_share: f64,
    recomputed_share: f64,
    preemptions: f64,
    thrash: bool,
    verdict: VerdictJson,
    summary: String,
    shadow: Option<ShadowFigures>,
}

#[derive(Deserialize)]
struct VerdictJson {
    kind: String,
}

impl AssessFigures {
    /// `model`'s figures from the text of `assess --json`.
    pub fn parse(text: &str, model: &str) -> Result<Self> {
        let report: ReportJson =
            serde_json::from_str(text).context("the assess report is not its JSON schema")?;
        let Some(m) = report.models.into_iter().find(|m| m.model == model) else {
            bail!("the assess report has no model {model:?}");
        };
        Ok(Self {
            verdict: m.verdict.kind,
            summary: m.summary,
            hit_rate: m.hit_rate,
            predicted_hit_rate: m.predicted_hit_rate,
            hit_rate_without_recompute: m.hit_rate_without_recompute,
            duplicated_share: m.duplicated_share,
            recomputed_share: m.recomputed_share,
            preemptions: m.preemptions,
            thrash: m.thrash,
            shadow: m.shadow,
        })
    }

    /// Reads `path` (written by `assess --json`).
    pub fn read(path: &std::path::Path, model: &str) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the assess report {}", path.display()))?;
        Self::parse(&text, model).with_context(|| path.display().to_string())
    }
}

/// The verdict issue 13 expects from assess on a benchmark workload, when it names one.
pub fn expected_verdict(workload: &str, replicas: usize) -> Option<&'static str> {
    if replicas == 1 {
        return Some("nothing_to_route");
    }
    match workload {
        "no-sharing" => Some("low_reuse"),
        "sessions-only" => Some("session_affinity_would_do"),
        "shared-prefix" | "mooncake-synthetic" | "mooncake-conversation" | "multi-turn" => {
            Some("would_save")
        }
        _ => None,
    }
}

/// Whether assess should flag thrash on `workload` at `gpu_blocks` per replica (issue 13: yes on
/// the KV-bound shared-prefix fleet of 8,192 blocks, no at 32,768).
pub fn expected_thrash(workload: &str, gpu_blocks: usize) -> Option<bool> {
    match (workload, gpu_blocks) {
        ("shared-prefix", b) if b <= 8_192 => Some(true),
        ("shared-prefix", b) if b >= 32_768 => Some(false),
        _ => None,
    }
}

fn pct(v: f64) -> String {
    format!("{:.1} %", v * 100.0)
}

fn points(v: f64) -> String {
    format!("{:+.1} points", v * 100.0)
}

/// Issue 13's checks at one (workload, fleet, load) point: `shadow` is the shadow line (Envoy
/// round robin with assess), `kv` the kv line of the same run when there is one.
pub fn checks(
    workload: &str,
    scope: &str,
    shadow: &RunSummary,
    kv: Option<&RunSummary>,
) -> Vec<GoalCheck> {
    let Some(a) = &shadow.assess else {
        return vec![GoalCheck {
            goal: "assess reported on the shadow line".into(),
            scope: scope.into(),
            measured: "no assess report".into(),
            met: Some(false),
        }];
    };
    let mut out = Vec::new();
    let expected = expected_verdict(workload, shadow.replicas);
    out.push(GoalCheck {
        goal: format!(
            "assess verdict is {}",
            expected.unwrap_or("(no expectation for this workload)")
        ),
        scope: scope.into(),
        measured: format!("{}: {}", a.verdict, a.summary),
        met: expected.map(|e| e == a.verdict),
    });
    let thrash = expected_thrash(workload, shadow.gpu_blocks);
    out.push(GoalCheck {
        goal: match thrash {
            Some(true) => "assess reports thrash".into(),
            Some(false) => "assess reports no thrash".into(),
            None => "assess thrash (no expectation for this fleet)".into(),
        },
        scope: scope.into(),
        measured: format!(
            "thrash {}: recomputed {} of computed, {:.0} preemptions; hit rate {} measured, {} without recompute",
            if a.thrash { "yes" } else { "no" },
            pct(a.recomputed_share),
            a.preemptions,
            pct(a.hit_rate),
            pct(a.hit_rate_without_recompute)
        ),
        met: thrash.map(|t| t == a.thrash),
    });
    let Some(kv) = kv else {
        return out;
    };
    let diff = a.predicted_hit_rate - kv.hit_rate;
    out.push(GoalCheck {
        goal: format!(
            "assess's predicted hit rate within {:.0} points of kv's measured",
            TOLERANCE * 100.0
        ),
        scope: scope.into(),
        measured: format!(
            "predicted {} (round robin measured {}), kv {} ({})",
            pct(a.predicted_hit_rate),
            pct(shadow.hit_rate),
            pct(kv.hit_rate),
            points(diff)
        ),
        met: Some(diff.abs() <= TOLERANCE),
    });
    let gain = kv.hit_rate - shadow.hit_rate;
    out.push(match &a.shadow {
        Some(s) => {
            let diff = s.would_save_share - gain;
            GoalCheck {
                goal: format!(
                    "shadow's would-have-saved within {:.0} points of kv's hit-rate gain over round robin",
                    TOLERANCE * 100.0
                ),
                scope: scope.into(),
                measured: format!(
                    "would save {} of prompt tokens ({} decisions, {} agreed), kv gain {} ({} - {}) ({})",
                    pct(s.would_save_share),
                    s.decisions,
                    pct(s.agreed_share),
                    pct(gain),
                    pct(kv.hit_rate),
                    pct(shadow.hit_rate),
                    points(diff)
                ),
                met: Some(diff.abs() <= TOLERANCE),
            }
        }
        None => GoalCheck {
            goal: "shadow's would-have-saved against kv's gain".into(),
            scope: scope.into(),
            measured: "no shadow decisions reached assess".into(),
            met: Some(false),
        },
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape `kvroute-indexer assess --json` writes (docs/assess.md), trimmed.
    const REPORT: &str = r#"{"window_s": 60.0,
      "thresholds": {"low_reuse_share": 0.05, "thrash_share": 0.05, "session_share": 0.8},
      "models": [{"model": "qwen3", "block_size": 16,
        "hit_rate": 0.22, "predicted_hit_rate": 0.655, "hit_rate_without_recompute": 0.23,
        "duplicated_share": 0.56, "recomputed_share": 0.01, "duplicated_gpu_seconds_per_hour": 410.0,
        "preemptions": 0.0, "thrash": false,
        "verdict": {"kind": "would_save"}, "summary": "qwen3: kvroute would save ~56 %",
        "replicas": [],
        "shadow": {"decisions": 750, "completions": 750, "agreed": 190, "unknown_upstream": 0,
          "measured": 750, "prompt_tokens": 5400000, "predicted_hit_tokens": 3500000,
          "actual_cached_tokens": 1200000, "would_save_tokens": 2300000, "with_session": 750,
          "would_save_within_session_tokens": 0, "agreed_share": 0.253,
          "predicted_hit_rate": 0.648, "actual_hit_rate": 0.222, "would_save_share": 0.426,
          "within_session_tokens": 0, "across_sessions_tokens": 2300000,
          "within_session_share": 0.0, "sessions_visible": true},
        "series": []}]}"#;

    #[test]
    fn the_report_is_read_for_its_model() {
        let a = AssessFigures::parse(REPORT, "qwen3").expect("parse");
        assert_eq!(a.verdict, "would_save");
        assert!((a.predicted_hit_rate - 0.655).abs() < 1e-12);
        assert!(!a.thrash);
        let s = a.shadow.expect("shadow");
        assert_eq!(s.decisions, 750);
        assert!((s.would_save_share - 0.426).abs() < 1e-12);
        assert!(AssessFigures::parse(REPORT, "other").is_err());
        assert!(AssessFigures::parse("{\"models\": 3}", "qwen3").is_err());
        // Without shadow decisions, no shadow section.
        let plain = REPORT.replace("\"shadow\": {", "\"unused\": {");
        assert!(AssessFigures::parse(&plain, "qwen3")
            .expect("parse")
            .shadow
            .is_none());
    }

    #[test]
    fn verdicts_and_thrash_are_expected_per_workload_and_fleet() {
        assert_eq!(
            expected_verdict("shared-prefix", 1),
            Some("nothing_to_route")
        );
        assert_eq!(expected_verdict("shared-prefix", 4), Some("would_save"));
        assert_eq!(expected_verdict("no-sharing", 4), Some("low_reuse"));
        assert_eq!(
            expected_verdict("sessions-only", 4),
            Some("session_affinity_would_do")
        );
        assert_eq!(expected_verdict("agentic", 4), None);
        assert_eq!(expected_thrash("shared-prefix", 8_192), Some(true));
        assert_eq!(expected_thrash("shared-prefix", 32_768), Some(false));
        assert_eq!(expected_thrash("shared-prefix", 16_384), None);
        assert_eq!(expected_thrash("no-sharing", 8_192), None);
    }

    fn line(policy: &str, hit_rate: f64) -> RunSummary {
        let mut r = crate::report::tests::run(policy, "6 req/s", 6.0, hit_rate, 100.0);
        r.replicas = 4;
        r.gpu_blocks = 32_768;
        r
    }

    #[test]
    fn predictions_are_compared_with_the_kv_line_of_the_same_run() {
        let mut shadow = line("shadow", 0.22);
        shadow.assess = Some(AssessFigures::parse(REPORT, "qwen3").expect("parse"));
        // kv measured 66.0 %: predicted 65.5 % is within 3 points; the gain is 44 points and
        // shadow would save 42.6 %: within 3.
        let kv = line("kv", 0.66);
        let got = checks("shared-prefix", "s", &shadow, Some(&kv));
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|c| c.met == Some(true)), "{got:?}");
        assert!(
            got[2].measured.contains("predicted 65.5 %"),
            "{}",
            got[2].measured
        );
        // kv at 70 %: both miss (4.5 and 5.4 points off).
        let far = line("kv", 0.70);
        let got = checks("shared-prefix", "s", &shadow, Some(&far));
        assert_eq!(got[2].met, Some(false));
        assert_eq!(got[3].met, Some(false));
        // Without a kv line only the verdict and thrash are checked; a wrong verdict misses.
        let got = checks("no-sharing", "s", &shadow, None);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].met, Some(false));
        assert_eq!(got[1].met, None);
        // A KV-bound shared-prefix fleet must report thrash.
        shadow.gpu_blocks = 8_192;
        assert_eq!(
            checks("shared-prefix", "s", &shadow, None)[1].met,
            Some(false)
        );
        // No report at all is a miss, not a pass.
        shadow.assess = None;
        let got = checks("shared-prefix", "s", &shadow, Some(&kv));
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].met, Some(false));
    }
}
