//! The terminal form of an assessment.

use std::fmt::Write;

use super::report::Report;

/// A plain-text report: one table per model, then its verdict.
pub fn text(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvroute assess: {:.0} s window; thresholds: low reuse below {:.0} % of computed prompt \
         tokens computed twice, thrash above {:.0} % recomputed after an eviction the fleet's \
         whole KV would not have avoided, or any preemption, session affinity would do when \
         kvroute saves less than the low-reuse share of the prefill session affinity still \
         computes",
        r.window_s,
        r.thresholds.low_reuse_share * 100.0,
        r.thresholds.thrash_share * 100.0
    );
    for m in &r.models {
        let _ = writeln!(out, "\nmodel {} (block size {})", m.model, m.block_size);
        let _ = writeln!(
            out,
            "  {:<20} {:>12} {:>8} {:>12} {:>12} {:>12} {:>8}",
            "replica", "queried tok", "hit", "computed", "dup tokens", "recomputed", "preempt"
        );
        for x in &m.replicas {
            let _ = writeln!(
                out,
                "  {:<20} {:>12.0} {:>7.1}% {:>12.0} {:>12.0} {:>12.0} {:>8.0}",
                x.replica,
                x.query_tokens,
                x.hit_rate * 100.0,
                x.computed_tokens,
                x.duplicated_tokens,
                x.recomputed_tokens,
                x.preemptions
            );
        }
        let _ = writeln!(
            out,
            "  fleet: hit {:.1} %, routed by prefix ~{:.1} %, without recomputation ~{:.1} %; \
             computed twice {:.1} %, recomputed {:.1} % ({:.1} % beyond the fleet's KV)",
            m.hit_rate * 100.0,
            m.predicted_hit_rate * 100.0,
            m.hit_rate_without_recompute * 100.0,
            m.duplicated_share * 100.0,
            m.recomputed_share * 100.0,
            m.capacity_recomputed_share * 100.0
        );
        if let Some(sh) = &m.shadow {
            let t = &sh.totals;
            let _ = writeln!(
                out,
                "  shadow: {} decisions, {} completed, {:.1} % sent where kvroute would have; hit \
                 {:.1} % actual vs {:.1} % kvroute's choice; would save {} tokens ({:.1} % of \
                 prompt tokens)",
                t.decisions,
                t.completions,
                sh.agreed_share * 100.0,
                sh.actual_hit_rate * 100.0,
                sh.predicted_hit_rate * 100.0,
                t.would_save_tokens,
                sh.would_save_share * 100.0
            );
            let _ = writeln!(
                out,
                "  shadow, routed by prefix with what it keeps cached: hit {:.1} %, would save \
                 {} tokens ({:.1} % of prompt tokens)",
                sh.retained_hit_rate * 100.0,
                t.would_save_retained_tokens,
                sh.would_save_retained_share * 100.0
            );
            if sh.sessions_visible {
                let _ = writeln!(
                    out,
                    "  duplicated prefill by session: within one session {} tokens ({:.1} %), \
                     across sessions {} tokens ({:.1} % of the {} tokens session affinity would \
                     still compute)",
                    sh.within_session_tokens,
                    sh.within_session_share * 100.0,
                    sh.across_sessions_tokens,
                    sh.beyond_session_affinity_share * 100.0,
                    sh.session_affinity_computed_tokens
                );
            }
        }
        if let Some(a) = &m.audit {
            let found = if a.divergences.is_empty() {
                "no early divergence found".to_string()
            } else {
                format!("{} divergence(s):", a.divergences.len())
            };
            let _ = writeln!(out, "  prompt audit: {}; {found}", a.examined());
            for d in &a.divergences {
                let [at, differing, requests, families, again, share] = d.cells();
                let _ = writeln!(
                    out,
                    "    at token {at} ({differing} differing tokens): {requests} request(s) in \
                     {families} famil{}; {again} tokens stored again that would have been reused \
                     ({share} of stored)",
                    if d.families == 1 { "y" } else { "ies" },
                );
                for line in d.text.iter().flatten() {
                    let _ = writeln!(out, "      text: {line:?}");
                }
            }
        }
        let _ = writeln!(out, "  verdict: {}", m.summary);
    }
    out
}
