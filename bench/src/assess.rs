//! The `shadow` line's measurements: what `kvroute-indexer assess --listen` reported over a run
//! through Envoy's round robin (predicted hit rate, verdict, thrash, and shadow mode's
//! would-have-saved). `crate::assess_checks` compares them with the `kv` line of the same run.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

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
    /// Of computed prompt tokens, the share recomputed after an eviction that the fleet's whole
    /// KV as one cache would not have avoided (what thrash is judged on).
    pub capacity_recomputed_share: f64,
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
    /// Prefill kvroute would have saved, as a share of prompt tokens (against what the balancer
    /// left cached).
    pub would_save_share: f64,
    /// The same with what routing by prefix keeps cached (the fleet as one cache).
    #[serde(default)]
    pub would_save_retained_share: f64,
    /// Of that saving, the share within one session.
    pub within_session_share: f64,
    /// What kvroute would save beyond session affinity, as a share of the prefill session
    /// affinity would still compute.
    #[serde(default)]
    pub beyond_session_affinity_share: f64,
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
    #[serde(default)]
    capacity_recomputed_share: f64,
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
            capacity_recomputed_share: m.capacity_recomputed_share,
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The shape `kvroute-indexer assess --json` writes (docs/assess.md), trimmed.
    pub(crate) const REPORT: &str = r#"{"window_s": 60.0,
      "thresholds": {"low_reuse_share": 0.05, "thrash_share": 0.05},
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
          "retained_hit_tokens": 3600000, "would_save_retained_tokens": 2400000,
          "predicted_hit_rate": 0.648, "actual_hit_rate": 0.222, "would_save_share": 0.426,
          "retained_hit_rate": 0.667, "would_save_retained_share": 0.444,
          "within_session_tokens": 0, "across_sessions_tokens": 2300000,
          "within_session_share": 0.0, "session_affinity_computed_tokens": 4200000,
          "beyond_session_affinity_share": 0.548, "sessions_visible": true},
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
        assert!((s.would_save_retained_share - 0.444).abs() < 1e-12);
        assert!((s.beyond_session_affinity_share - 0.548).abs() < 1e-12);
        assert!(AssessFigures::parse(REPORT, "other").is_err());
        assert!(AssessFigures::parse("{\"models\": 3}", "qwen3").is_err());
        // Without shadow decisions, no shadow section.
        let plain = REPORT.replace("\"shadow\": {", "\"unused\": {");
        assert!(AssessFigures::parse(&plain, "qwen3")
            .expect("parse")
            .shadow
            .is_none());
    }
}
