//! Issue 13's checks of the `shadow` line: what `assess` predicted over Envoy's round robin
//! against the `kv` line of the same run (docs/assess.md, "Checking assess against the
//! benchmark").

use crate::goal_check::GoalCheck;
use crate::summary::RunSummary;

/// How far (hit-rate points, as a fraction) a prediction may be from the `kv` line's measurement.
pub const TOLERANCE: f64 = 0.03;

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

/// Whether assess should flag thrash on `workload` with `replicas` x `gpu_blocks` (issue 13: yes
/// on the KV-bound shared-prefix fleet of 4 x 8,192 blocks, no on 4 x 32,768). Thrash is the
/// fleet's KV against the traffic's working set, so what counts is the fleet's total: one replica
/// of 32,768 blocks is as KV-bound as four of 8,192.
pub fn expected_thrash(workload: &str, replicas: usize, gpu_blocks: usize) -> Option<bool> {
    match (workload, replicas.saturating_mul(gpu_blocks)) {
        ("shared-prefix", b) if b <= 4 * 8_192 => Some(true),
        ("shared-prefix", b) if b >= 4 * 32_768 => Some(false),
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
    let thrash = expected_thrash(workload, shadow.replicas, shadow.gpu_blocks);
    out.push(GoalCheck {
        goal: match thrash {
            Some(true) => "assess reports thrash".into(),
            Some(false) => "assess reports no thrash".into(),
            None => "assess thrash (no expectation for this fleet)".into(),
        },
        scope: scope.into(),
        measured: format!(
            "thrash {}: recomputed {} of computed ({} beyond the fleet's KV), {:.0} preemptions; hit rate {} measured, {} without recompute",
            if a.thrash { "yes" } else { "no" },
            pct(a.recomputed_share),
            pct(a.capacity_recomputed_share),
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
            // The retained figure is the one that answers "what would switching save": the
            // decision-time one reads what round robin left cached (shown beside it).
            let diff = s.would_save_retained_share - gain;
            GoalCheck {
                goal: format!(
                    "shadow's would-have-saved within {:.0} points of kv's hit-rate gain over round robin",
                    TOLERANCE * 100.0
                ),
                scope: scope.into(),
                measured: format!(
                    "would save {} of prompt tokens with what prefix routing keeps cached ({} against what round robin left; {} decisions, {} agreed), kv gain {} ({} - {}) ({})",
                    pct(s.would_save_retained_share),
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
    use crate::assess::tests::REPORT;
    use crate::assess::AssessFigures;

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
        assert_eq!(expected_thrash("shared-prefix", 4, 8_192), Some(true));
        assert_eq!(expected_thrash("shared-prefix", 4, 32_768), Some(false));
        assert_eq!(expected_thrash("shared-prefix", 1, 32_768), Some(true));
        assert_eq!(expected_thrash("shared-prefix", 4, 16_384), None);
        assert_eq!(expected_thrash("no-sharing", 4, 8_192), None);
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
        // shadow would save 44.4 % with what routing keeps cached: within 3.
        let kv = line("kv", 0.66);
        let got = checks("shared-prefix", "s", &shadow, Some(&kv));
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|c| c.met == Some(true)), "{got:?}");
        assert!(
            got[2].measured.contains("predicted 65.5 %"),
            "{}",
            got[2].measured
        );
        // kv at 70 %: both miss (4.5 and 3.6 points off).
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
