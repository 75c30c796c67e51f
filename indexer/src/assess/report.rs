//! The assessment itself: from two readings of every replica's counters, what the fleet's traffic
//! reuses, what it computes twice, what it recomputes after evicting, and a verdict in words.
//! Pure: no clocks, no I/O.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::shadow::ShadowTotals;

/// One replica's counters at one moment (totals since its engine started).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReplicaReading {
    /// Replica name.
    pub replica: String,
    /// Model it serves.
    pub model: String,
    /// `vllm:prefix_cache_hits_total`.
    pub cache_hit_tokens: f64,
    /// `vllm:prefix_cache_queries_total`.
    pub cache_query_tokens: f64,
    /// Prompt tokens the engine computed (`vllm:request_prefill_kv_computed_tokens_sum`).
    pub computed_tokens: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: f64,
    /// New block holdings from its KV events.
    pub stored_blocks: u64,
    /// GPU blocks it stored that another replica held on GPU already.
    pub duplicated_blocks: u64,
    /// GPU blocks it stored again soon after removing them.
    pub recomputed_blocks: u64,
    /// GPU blocks it stored that the fleet, seen as one cache, still held.
    pub fleet_repeat_blocks: u64,
    /// Recomputed blocks the fleet cache followed (weighted).
    pub recompute_checked_blocks: u64,
    /// Of those, the ones the fleet, seen as one cache, had evicted too.
    pub recompute_fleet_lost_blocks: u64,
    /// Its prefill rate (its metrics after its model's, else the prior), tokens per second.
    pub prefill_tokens_per_s: f64,
}

/// What makes the verdict; each threshold is printed with the report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Thresholds {
    /// Below this share of computed prompt tokens computed twice, reuse across replicas is too
    /// low for prefix-aware routing to pay. With sessions visible (shadow mode), the same bar
    /// judges kvroute against session affinity: below this share of the prefill session
    /// affinity would still compute, what kvroute adds is too little and session affinity does.
    pub low_reuse_share: f64,
    /// Above this share of computed prompt tokens recomputed after an eviction that the fleet's
    /// whole KV, as one cache, would not have avoided either (or any preemption), the fleet
    /// thrashes: its memory is too small for its traffic, whatever the routing.
    pub thrash_share: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            low_reuse_share: 0.05,
            thrash_share: 0.05,
        }
    }
}

/// One replica over the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaReport {
    /// Replica name.
    pub replica: String,
    /// Prompt tokens looked up in its prefix cache.
    pub query_tokens: f64,
    /// Of those, served from it.
    pub hit_tokens: f64,
    /// `hit_tokens / query_tokens` (0 without queries).
    pub hit_rate: f64,
    /// Prompt tokens it computed.
    pub computed_tokens: f64,
    /// Of those, tokens another replica held already.
    pub duplicated_tokens: f64,
    /// Of those, tokens it had evicted within the recompute window.
    pub recomputed_tokens: f64,
    /// Of those, tokens the fleet's whole KV as one cache would have lost too (estimated from
    /// the recomputations the fleet cache followed; all of them when it followed none).
    pub capacity_recomputed_tokens: f64,
    /// Computed prompt tokens the fleet, seen as one cache, still held (a prefix-aware router
    /// would have served them from cache).
    pub fleet_repeat_tokens: f64,
    /// Preemptions.
    pub preemptions: f64,
    /// Its prefill rate, tokens per second.
    pub prefill_tokens_per_s: f64,
}

/// The verdict for one model's fleet.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Verdict {
    /// One replica: there is no choice to make.
    NothingToRoute,
    /// No prompt reached the replicas in the window.
    NoTraffic,
    /// Too little prefill is computed twice for routing by prefix to pay.
    LowReuse,
    /// The reuse is a session's own earlier prefix: session affinity recovers most of it.
    SessionAffinityWouldDo,
    /// Prefix-aware routing would save this share of prefill.
    WouldSave,
}

/// What shadow decisions (the filter in `mode = "shadow"`) showed for one model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShadowReport {
    /// The totals as counted.
    #[serde(flatten)]
    pub totals: ShadowTotals,
    /// Share of completed requests Envoy's balancer sent where kvroute would have.
    pub agreed_share: f64,
    /// Predicted hit tokens / prompt tokens: the hit rate kvroute would have had.
    pub predicted_hit_rate: f64,
    /// Actual cached tokens / prompt tokens: the hit rate the current balancer achieved.
    pub actual_hit_rate: f64,
    /// Would-save tokens / prompt tokens: against what the current balancer left cached.
    pub would_save_share: f64,
    /// Retained hit tokens / prompt tokens: the hit rate routing by prefix would reach, with what
    /// it keeps cached by not computing a prefix on every replica.
    pub retained_hit_rate: f64,
    /// Would-save-retained tokens / prompt tokens: the prefill routing by prefix would save, with
    /// that retention (compare it with the hit-rate gain a switch to kvroute brings).
    pub would_save_retained_share: f64,
    /// Of the would-save tokens, the part within one session.
    pub within_session_tokens: u64,
    /// Of the would-save tokens, the part shared across sessions.
    pub across_sessions_tokens: u64,
    /// `within_session_tokens / would_save_tokens` (0 without savings).
    pub within_session_share: f64,
    /// Prompt tokens session affinity would still compute: those the current balancer computed,
    /// less the would-save part within sessions.
    pub session_affinity_computed_tokens: u64,
    /// `across_sessions_tokens / session_affinity_computed_tokens`: the share of session
    /// affinity's prefill that kvroute would save on top of it (0 when it computes nothing).
    pub beyond_session_affinity_share: f64,
    /// Whether requests carried a session (the split means something).
    pub sessions_visible: bool,
}

impl ShadowReport {
    /// Shares from the totals.
    pub fn from_totals(t: &ShadowTotals) -> Self {
        let prompt = t.prompt_tokens as f64;
        let within = t.would_save_within_session_tokens.min(t.would_save_tokens);
        let across = t.would_save_tokens - within;
        let computed = t.prompt_tokens.saturating_sub(t.actual_cached_tokens);
        let session_affinity_computed = computed.saturating_sub(within);
        ShadowReport {
            agreed_share: ratio(t.agreed as f64, t.completions as f64),
            predicted_hit_rate: ratio(t.predicted_hit_tokens as f64, prompt),
            actual_hit_rate: ratio(t.actual_cached_tokens as f64, prompt),
            would_save_share: ratio(t.would_save_tokens as f64, prompt),
            retained_hit_rate: ratio(t.retained_hit_tokens as f64, prompt),
            would_save_retained_share: ratio(t.would_save_retained_tokens as f64, prompt),
            within_session_tokens: within,
            across_sessions_tokens: across,
            within_session_share: ratio(within as f64, t.would_save_tokens as f64),
            session_affinity_computed_tokens: session_affinity_computed,
            beyond_session_affinity_share: ratio(across as f64, session_affinity_computed as f64),
            sessions_visible: t.with_session > 0,
            totals: t.clone(),
        }
    }
}

/// One interval of the window (between two samples), for the plots.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeriesPoint {
    /// Seconds from the window's start to the end of the interval.
    pub t_s: f64,
    /// Prompt tokens computed in the interval.
    pub computed_tokens: f64,
    /// Of those, computed while another replica held them.
    pub duplicated_tokens: f64,
    /// Of those, recomputed after an eviction.
    pub recomputed_tokens: f64,
    /// Of those, recomputed beyond what the fleet's KV as one cache would have kept.
    pub capacity_recomputed_tokens: f64,
    /// Preemptions in the interval.
    pub preemptions: f64,
    /// Per replica (in `replicas` order), the hit rate in the interval (`None`: no queries).
    pub hit_rate: Vec<Option<f64>>,
}

/// Every replica's counters at one moment of the window.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Seconds since the window's start.
    pub t_s: f64,
    /// The readings.
    pub readings: Vec<ReplicaReading>,
}

/// One model's fleet over the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelReport {
    /// Model name.
    pub model: String,
    /// Block size in tokens (from the events or the config; 0 if unknown).
    pub block_size: u32,
    /// Per replica.
    pub replicas: Vec<ReplicaReport>,
    /// The fleet's prefix-cache hit rate as it is routed today.
    pub hit_rate: f64,
    /// The hit rate had every prefix computed twice or again been found where the fleet, as one
    /// cache of its whole memory, still held it ([`crate::reuse::FleetCache`]).
    pub predicted_hit_rate: f64,
    /// The hit rate had nothing been evicted and recomputed.
    pub hit_rate_without_recompute: f64,
    /// Share of computed prompt tokens another replica held already.
    pub duplicated_share: f64,
    /// Share of computed prompt tokens recomputed after an eviction.
    pub recomputed_share: f64,
    /// Share of computed prompt tokens recomputed after an eviction that one copy per block in
    /// the fleet's whole KV would not have avoided: what only more KV fixes. The rest of
    /// `recomputed_share` is replicas evicting their own copies of prefixes other replicas hold
    /// too, which routing by prefix removes.
    pub capacity_recomputed_share: f64,
    /// Prefill seconds computed twice, per hour of this traffic, at the replicas' rates.
    pub duplicated_gpu_seconds_per_hour: f64,
    /// Preemptions in the window.
    pub preemptions: f64,
    /// True when the fleet's KV is too small for its traffic: `capacity_recomputed_share` over
    /// the threshold, or any preemption.
    pub thrash: bool,
    /// The verdict.
    pub verdict: Verdict,
    /// The verdict in words, with its numbers and thresholds.
    pub summary: String,
    /// What shadow decisions showed (when a filter in shadow mode asked during the window).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowReport>,
    /// The prompt audit (`--audit` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit: Option<super::audit::AuditReport>,
    /// The window interval by interval (for the plots).
    pub series: Vec<SeriesPoint>,
}

/// The whole assessment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Seconds between the two readings.
    pub window_s: f64,
    /// The thresholds used.
    pub thresholds: Thresholds,
    /// Per model.
    pub models: Vec<ModelReport>,
}

/// Builds the report from the readings at the start and the end of the window (matched by
/// replica name; a replica missing from the start counts from zero).
pub fn build(
    start: &[ReplicaReading],
    end: &[ReplicaReading],
    block_sizes: &[(String, u32)],
    window_s: f64,
    thresholds: Thresholds,
) -> Report {
    build_full(
        start,
        end,
        block_sizes,
        window_s,
        thresholds,
        &BTreeMap::new(),
        &[],
    )
}

/// [`build`] with the shadow totals per model and the samples taken during the window (the
/// start and end readings included) for the per-interval series.
pub fn build_full(
    start: &[ReplicaReading],
    end: &[ReplicaReading],
    block_sizes: &[(String, u32)],
    window_s: f64,
    thresholds: Thresholds,
    shadow: &BTreeMap<String, ShadowTotals>,
    samples: &[Sample],
) -> Report {
    let mut models: Vec<String> = end.iter().map(|r| r.model.clone()).collect();
    models.sort();
    models.dedup();
    let models = models
        .into_iter()
        .map(|model| {
            let bs = block_sizes
                .iter()
                .find(|(m, _)| *m == model)
                .map_or(0, |(_, b)| *b);
            let replicas: Vec<ReplicaReport> = end
                .iter()
                .filter(|r| r.model == model)
                .map(|e| {
                    let s = start
                        .iter()
                        .find(|s| s.replica == e.replica)
                        .cloned()
                        .unwrap_or_default();
                    replica_window(&s, e, bs)
                })
                .collect();
            let shadow = shadow
                .get(&model)
                .filter(|t| t.decisions > 0)
                .map(ShadowReport::from_totals);
            let series = series(&model, &replicas, samples, bs);
            let mut m = model_report(model, bs, replicas, window_s, thresholds, shadow);
            m.series = series;
            m
        })
        .collect();
    Report {
        window_s,
        thresholds,
        models,
    }
}

/// Per interval between consecutive samples, the model's totals and each replica's hit rate.
fn series(
    model: &str,
    replicas: &[ReplicaReport],
    samples: &[Sample],
    bs: u32,
) -> Vec<SeriesPoint> {
    samples
        .windows(2)
        .map(|w| {
            let of = |s: &Sample, name: &str| {
                s.readings
                    .iter()
                    .find(|r| r.model == model && r.replica == name)
                    .cloned()
                    .unwrap_or_default()
            };
            let windows: Vec<ReplicaReport> = replicas
                .iter()
                .map(|r| replica_window(&of(&w[0], &r.replica), &of(&w[1], &r.replica), bs))
                .collect();
            SeriesPoint {
                t_s: w[1].t_s,
                computed_tokens: windows.iter().map(|r| r.computed_tokens).sum(),
                duplicated_tokens: windows.iter().map(|r| r.duplicated_tokens).sum(),
                recomputed_tokens: windows.iter().map(|r| r.recomputed_tokens).sum(),
                capacity_recomputed_tokens: windows
                    .iter()
                    .map(|r| r.capacity_recomputed_tokens)
                    .sum(),
                preemptions: windows.iter().map(|r| r.preemptions).sum(),
                hit_rate: windows
                    .iter()
                    .map(|r| (r.query_tokens > 0.0).then_some(r.hit_rate))
                    .collect(),
            }
        })
        .collect()
}

fn delta(a: f64, b: f64) -> f64 {
    // A counter that went back (an engine restarted) counts from zero.
    if b >= a {
        b - a
    } else {
        b
    }
}

fn delta_u(a: u64, b: u64) -> f64 {
    b.checked_sub(a).unwrap_or(b) as f64
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        (num / den).min(1.0)
    } else {
        0.0
    }
}

fn replica_window(s: &ReplicaReading, e: &ReplicaReading, bs: u32) -> ReplicaReport {
    let bs = f64::from(bs);
    let query_tokens = delta(s.cache_query_tokens, e.cache_query_tokens);
    let hit_tokens = delta(s.cache_hit_tokens, e.cache_hit_tokens);
    let mut computed_tokens = delta(s.computed_tokens, e.computed_tokens);
    if computed_tokens <= 0.0 {
        // Engines without the computed-tokens histogram: what the cache did not serve.
        computed_tokens = (query_tokens - hit_tokens).max(0.0);
    }
    let recomputed_tokens =
        (delta_u(s.recomputed_blocks, e.recomputed_blocks) * bs).min(computed_tokens);
    let checked = delta_u(s.recompute_checked_blocks, e.recompute_checked_blocks);
    let lost = delta_u(s.recompute_fleet_lost_blocks, e.recompute_fleet_lost_blocks);
    let capacity_recomputed_tokens = if checked > 0.0 {
        recomputed_tokens * (lost / checked).min(1.0)
    } else {
        recomputed_tokens
    };
    ReplicaReport {
        replica: e.replica.clone(),
        query_tokens,
        hit_tokens,
        hit_rate: ratio(hit_tokens, query_tokens),
        computed_tokens,
        duplicated_tokens: (delta_u(s.duplicated_blocks, e.duplicated_blocks) * bs)
            .min(computed_tokens),
        recomputed_tokens,
        capacity_recomputed_tokens,
        fleet_repeat_tokens: (delta_u(s.fleet_repeat_blocks, e.fleet_repeat_blocks) * bs)
            .min(computed_tokens),
        preemptions: delta(s.preemptions, e.preemptions),
        prefill_tokens_per_s: e.prefill_tokens_per_s,
    }
}

fn model_report(
    model: String,
    block_size: u32,
    replicas: Vec<ReplicaReport>,
    window_s: f64,
    t: Thresholds,
    shadow: Option<ShadowReport>,
) -> ModelReport {
    let sum = |f: fn(&ReplicaReport) -> f64| replicas.iter().map(f).sum::<f64>();
    let queries = sum(|r| r.query_tokens);
    let hits = sum(|r| r.hit_tokens);
    let computed = sum(|r| r.computed_tokens);
    let duplicated = sum(|r| r.duplicated_tokens);
    let recomputed = sum(|r| r.recomputed_tokens);
    let capacity_recomputed = sum(|r| r.capacity_recomputed_tokens);
    let fleet_repeats = sum(|r| r.fleet_repeat_tokens);
    let preemptions = sum(|r| r.preemptions);
    let duplicated_seconds: f64 = replicas
        .iter()
        .filter(|r| r.prefill_tokens_per_s > 0.0)
        .map(|r| r.duplicated_tokens / r.prefill_tokens_per_s)
        .sum();
    let per_hour = if window_s > 0.0 {
        3600.0 / window_s
    } else {
        0.0
    };
    let hit_rate = ratio(hits, queries);
    // Every prefix computed twice or again that the fleet's memory could have kept; at least
    // what another replica held at that moment (the fleet cache's store-only recency can miss
    // a block that hits kept hot).
    let predicted_hit_rate = ratio(hits + fleet_repeats.max(duplicated).min(computed), queries);
    let duplicated_share = ratio(duplicated, computed);
    let recomputed_share = ratio(recomputed, computed);
    let capacity_recomputed_share = ratio(capacity_recomputed, computed);
    let thrash = capacity_recomputed_share > t.thrash_share || preemptions > 0.0;
    let verdict = if replicas.len() < 2 {
        Verdict::NothingToRoute
    } else if queries <= 0.0 {
        Verdict::NoTraffic
    } else if shadow.as_ref().is_some_and(|s| {
        s.sessions_visible
            && s.would_save_share >= t.low_reuse_share
            && s.beyond_session_affinity_share < t.low_reuse_share
    }) {
        Verdict::SessionAffinityWouldDo
    } else if duplicated_share < t.low_reuse_share
        && shadow
            .as_ref()
            .is_none_or(|s| s.would_save_share < t.low_reuse_share)
    {
        Verdict::LowReuse
    } else {
        Verdict::WouldSave
    };
    let mut summary = match verdict {
        Verdict::NothingToRoute => format!(
            "{model}: {} replica, nothing to route: every request can only go there.",
            replicas.len()
        ),
        Verdict::NoTraffic => format!("{model}: no prompts reached the replicas in the window."),
        Verdict::LowReuse => format!(
            "{model}: low reuse. {:.1} % of the prompt tokens computed were already cached on \
             another replica (below the {:.0} % threshold): prefix-aware routing would save \
             little here; load balancing is what matters.",
            duplicated_share * 100.0,
            t.low_reuse_share * 100.0
        ),
        Verdict::SessionAffinityWouldDo => {
            let sh = shadow.as_ref().map_or_else(
                || ShadowReport::from_totals(&ShadowTotals::default()),
                Clone::clone,
            );
            let prompt = sh.totals.prompt_tokens as f64;
            format!(
                "{model}: session affinity would do. {:.0} % of the prefill kvroute would save \
                 ({:.1} % of prompt tokens) is a session's own earlier prefix: sending each \
                 session back to its replica recovers ~{:.1} % of prompt tokens; kvroute would \
                 add ~{:.1} points more (prefixes shared across sessions), {:.1} % of the prefill \
                 session affinity still computes (below the {:.0} % threshold).",
                sh.within_session_share * 100.0,
                sh.would_save_share * 100.0,
                ratio(sh.within_session_tokens as f64, prompt) * 100.0,
                ratio(sh.across_sessions_tokens as f64, prompt) * 100.0,
                sh.beyond_session_affinity_share * 100.0,
                t.low_reuse_share * 100.0
            )
        }
        Verdict::WouldSave => format!(
            "{model}: kvroute would save ~{:.0} % of prefill tokens ({:.1} % were computed on one \
             replica while another held them, at or above the {:.0} % threshold), ~{:.0} \
             GPU-seconds per hour at the replicas' measured prefill rates; hit rate {:.1} % \
             today, ~{:.1} % routed by prefix.",
            duplicated_share * 100.0,
            duplicated_share * 100.0,
            t.low_reuse_share * 100.0,
            duplicated_seconds * per_hour,
            hit_rate * 100.0,
            predicted_hit_rate * 100.0
        ),
    };
    if let Some(sh) = shadow
        .as_ref()
        .filter(|s| verdict == Verdict::WouldSave && s.sessions_visible)
    {
        summary.push_str(&format!(
            " Against session affinity: it would recover ~{:.1} % of prompt tokens (the \
             sessions' own earlier prefixes); kvroute would save {:.1} % of the prefill session \
             affinity still computes on top of that (at or above the {:.0} % threshold).",
            ratio(
                sh.within_session_tokens as f64,
                sh.totals.prompt_tokens as f64
            ) * 100.0,
            sh.beyond_session_affinity_share * 100.0,
            t.low_reuse_share * 100.0
        ));
    }
    if thrash {
        summary.push_str(&format!(
            " The fleet thrashes: {:.1} % of computed tokens were recomputed after an eviction \
             that one copy per block in the fleet's whole KV would not have avoided either \
             (threshold {:.0} %; {:.1} % recomputed in all), {preemptions:.0} preemptions; more KV \
             capacity would raise the hit rate to ~{:.1} %.",
            capacity_recomputed_share * 100.0,
            t.thrash_share * 100.0,
            recomputed_share * 100.0,
            ratio(hits + recomputed, queries) * 100.0
        ));
    } else if recomputed_share > t.thrash_share {
        summary.push_str(&format!(
            " The replicas evict and recompute {:.1} % of computed tokens, but the fleet's KV \
             would hold them once each ({:.1} % would be recomputed even so, under the {:.0} % \
             thrash threshold): each replica evicts its own copies of prefixes the others hold \
             too, which routing by prefix removes; no thrash.",
            recomputed_share * 100.0,
            capacity_recomputed_share * 100.0,
            t.thrash_share * 100.0
        ));
    }
    ModelReport {
        model,
        block_size,
        hit_rate,
        predicted_hit_rate,
        hit_rate_without_recompute: ratio(hits + recomputed, queries),
        duplicated_share,
        recomputed_share,
        capacity_recomputed_share,
        duplicated_gpu_seconds_per_hour: duplicated_seconds * per_hour,
        preemptions,
        thrash,
        verdict,
        summary,
        replicas,
        shadow,
        audit: None,
        series: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
