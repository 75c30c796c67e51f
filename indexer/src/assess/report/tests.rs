use std::collections::BTreeMap;

use super::*;
use crate::shadow::ShadowTotals;

fn reading(replica: &str, queries: f64, hits: f64, dup: u64, recomputed: u64) -> ReplicaReading {
    ReplicaReading {
        replica: replica.into(),
        model: "m".into(),
        cache_query_tokens: queries,
        cache_hit_tokens: hits,
        computed_tokens: queries - hits,
        duplicated_blocks: dup,
        recomputed_blocks: recomputed,
        prefill_tokens_per_s: 10_000.0,
        ..ReplicaReading::default()
    }
}

fn zero(r: &ReplicaReading) -> ReplicaReading {
    ReplicaReading {
        replica: r.replica.clone(),
        model: r.model.clone(),
        ..ReplicaReading::default()
    }
}

fn one_model(end: &[ReplicaReading]) -> ModelReport {
    let start: Vec<_> = end.iter().map(zero).collect();
    let r = build(
        &start,
        end,
        &[("m".into(), 16)],
        60.0,
        Thresholds::default(),
    );
    assert_eq!(r.models.len(), 1);
    r.models[0].clone()
}

#[test]
fn prefixes_recomputed_after_eviction_that_the_fleet_could_hold_count_as_predicted_hits() {
    // As above, plus 300 blocks each replica computed again after evicting them, which the
    // fleet as one cache still held: 200 + 300 blocks on b, 300 on a.
    let mut end = [
        reading("a", 20_000.0, 4_000.0, 0, 300),
        reading("b", 20_000.0, 4_000.0, 500, 300),
    ];
    end[0].fleet_repeat_blocks = 300;
    end[1].fleet_repeat_blocks = 500;
    let m = one_model(&end);
    // (8,000 hit + 800 x 16 tokens) / 40,000.
    assert!((m.predicted_hit_rate - 0.52).abs() < 1e-9, "{m:?}");
    // Never below what another replica held: a fleet cache that saw fewer repeats.
    end[1].fleet_repeat_blocks = 100;
    end[0].fleet_repeat_blocks = 0;
    let m = one_model(&end);
    assert!((m.predicted_hit_rate - 0.4).abs() < 1e-9, "{m:?}");
}

#[test]
fn prefixes_computed_on_several_replicas_would_be_saved() {
    // Two replicas each computed the same 1,600-token prefix (100 blocks) 10 times over.
    let end = [
        reading("a", 20_000.0, 4_000.0, 0, 0),
        reading("b", 20_000.0, 4_000.0, 500, 0),
    ];
    let m = one_model(&end);
    assert_eq!(m.verdict, Verdict::WouldSave);
    assert!((m.hit_rate - 0.2).abs() < 1e-9);
    // 8,000 duplicated tokens of 32,000 computed; 40,000 queried, 8,000 hit today.
    assert!((m.duplicated_share - 0.25).abs() < 1e-9, "{m:?}");
    assert!((m.predicted_hit_rate - 0.4).abs() < 1e-9, "{m:?}");
    // 8,000 tokens at 10k/s = 0.8 s per minute = 48 s per hour.
    assert!((m.duplicated_gpu_seconds_per_hour - 48.0).abs() < 1e-6);
    assert!(!m.thrash);
    assert!(m.summary.contains("would save ~25 %"), "{}", m.summary);
}

#[test]
fn unique_prompts_are_low_reuse() {
    let end = [
        reading("a", 20_000.0, 0.0, 10, 0),
        reading("b", 20_000.0, 0.0, 0, 0),
    ];
    let m = one_model(&end);
    assert_eq!(m.verdict, Verdict::LowReuse);
    assert!(m.summary.contains("low reuse"), "{}", m.summary);
}

#[test]
fn one_replica_has_nothing_to_route_and_no_traffic_is_said() {
    assert_eq!(
        one_model(&[reading("a", 20_000.0, 0.0, 0, 0)]).verdict,
        Verdict::NothingToRoute
    );
    assert_eq!(
        one_model(&[reading("a", 0.0, 0.0, 0, 0), reading("b", 0.0, 0.0, 0, 0)]).verdict,
        Verdict::NoTraffic
    );
}

#[test]
fn recomputation_after_eviction_is_thrash_and_bounds_the_hit_rate() {
    let end = [
        reading("a", 10_000.0, 5_000.0, 0, 100),
        reading("b", 10_000.0, 5_000.0, 0, 0),
    ];
    // The fleet cache followed none of the recomputations: all of them count.
    let m = one_model(&end);
    assert!(m.thrash);
    // 1,600 of 10,000 computed tokens recomputed.
    assert!((m.recomputed_share - 0.16).abs() < 1e-9);
    assert!((m.capacity_recomputed_share - 0.16).abs() < 1e-9);
    assert!((m.hit_rate_without_recompute - 0.58).abs() < 1e-9);
    assert!(m.summary.contains("The fleet thrashes"), "{}", m.summary);
}

#[test]
fn recomputation_the_fleets_kv_would_have_avoided_is_not_thrash() {
    // a recomputed 100 blocks; the fleet cache followed 80 of them and had lost 4 (5 %): the
    // rest were copies other replicas kept, which routing by prefix removes.
    let mut end = [
        reading("a", 10_000.0, 5_000.0, 0, 100),
        reading("b", 10_000.0, 5_000.0, 0, 0),
    ];
    end[0].recompute_checked_blocks = 80;
    end[0].recompute_fleet_lost_blocks = 4;
    let m = one_model(&end);
    assert!((m.recomputed_share - 0.16).abs() < 1e-9);
    assert!((m.capacity_recomputed_share - 0.008).abs() < 1e-9, "{m:?}");
    assert!(!m.thrash, "{m:?}");
    assert!(m.summary.contains("no thrash"), "{}", m.summary);
    // The same recomputation with the fleet cache having lost half of it: thrash.
    end[0].recompute_fleet_lost_blocks = 40;
    let m = one_model(&end);
    assert!((m.capacity_recomputed_share - 0.08).abs() < 1e-9, "{m:?}");
    assert!(m.thrash);
    // Any preemption is thrash, whatever the recomputation.
    end[0].recompute_fleet_lost_blocks = 0;
    end[1].preemptions = 1.0;
    assert!(one_model(&end).thrash);
}

#[test]
fn the_window_counts_from_the_start_reading_and_survives_a_restart() {
    let start = [
        reading("a", 10_000.0, 1_000.0, 50, 0),
        reading("b", 50_000.0, 0.0, 0, 0),
    ];
    // `b` restarted: its counters went back, so they count from zero.
    let end = [
        reading("a", 30_000.0, 1_000.0, 550, 0),
        reading("b", 20_000.0, 0.0, 0, 0),
    ];
    let r = build(
        &start,
        &end,
        &[("m".into(), 16)],
        60.0,
        Thresholds::default(),
    );
    let m = &r.models[0];
    assert_eq!(m.replicas[0].query_tokens, 20_000.0);
    assert_eq!(m.replicas[0].duplicated_tokens, 8_000.0);
    assert_eq!(m.replicas[1].query_tokens, 20_000.0);
}

fn shadow_totals(would_save: u64, within: u64) -> ShadowTotals {
    ShadowTotals {
        decisions: 100,
        completions: 100,
        agreed: 50,
        measured: 100,
        prompt_tokens: 100_000,
        predicted_hit_tokens: 60_000,
        actual_cached_tokens: 60_000 - would_save,
        would_save_tokens: would_save,
        with_session: 100,
        would_save_within_session_tokens: within,
        ..ShadowTotals::default()
    }
}

fn with_shadow(t: ShadowTotals) -> ModelReport {
    let end = [
        reading("a", 50_000.0, 20_000.0, 0, 0),
        reading("b", 50_000.0, 20_000.0, 200, 0),
    ];
    let start: Vec<_> = end.iter().map(zero).collect();
    let shadow = BTreeMap::from([("m".to_string(), t)]);
    let r = build_full(
        &start,
        &end,
        &[("m".into(), 16)],
        60.0,
        Thresholds::default(),
        &shadow,
        &[],
    );
    r.models[0].clone()
}

#[test]
fn reuse_within_sessions_is_judged_session_affinity() {
    // Of 100k prompt tokens the balancer computed 70k; kvroute would save 30k, 29k of them a
    // session's own earlier prefix: session affinity would still compute 41k, and kvroute's
    // 1k more is 2.4 % of that, under the 5 % bar.
    let m = with_shadow(shadow_totals(30_000, 29_000));
    assert_eq!(m.verdict, Verdict::SessionAffinityWouldDo, "{}", m.summary);
    let sh = m.shadow.as_ref().expect("shadow section");
    assert_eq!(
        (sh.within_session_tokens, sh.across_sessions_tokens),
        (29_000, 1_000)
    );
    assert_eq!(sh.session_affinity_computed_tokens, 41_000);
    assert!((sh.beyond_session_affinity_share - 1.0 / 41.0).abs() < 1e-9);
    assert!((sh.agreed_share - 0.5).abs() < 1e-9);
    assert!(
        m.summary.contains("~29.0 %") && m.summary.contains("~1.0 points"),
        "{}",
        m.summary
    );
    assert!(
        m.summary.contains("2.4 %") && m.summary.contains("5 % threshold"),
        "{}",
        m.summary
    );
}

#[test]
fn a_large_share_within_sessions_still_leaves_kvroute_worth_it() {
    // Multi-turn chat under shared system prompts: most of the saving (86 %) is within sessions,
    // but what crosses them (the shared system prompts session affinity computes once per
    // replica) is 15 % of the prefill session affinity still computes: kvroute pays.
    let mut t = shadow_totals(15_700, 13_500);
    t.actual_cached_tokens = 71_700;
    let m = with_shadow(t);
    assert_eq!(m.verdict, Verdict::WouldSave, "{}", m.summary);
    let sh = m.shadow.as_ref().expect("shadow section");
    assert!(
        sh.within_session_share > 0.85,
        "{}",
        sh.within_session_share
    );
    assert_eq!(sh.session_affinity_computed_tokens, 28_300 - 13_500);
    assert!(
        m.summary.contains("Against session affinity") && m.summary.contains("14.9 %"),
        "{}",
        m.summary
    );
}

#[test]
fn reuse_across_sessions_is_judged_would_save() {
    let m = with_shadow(shadow_totals(30_000, 6_000));
    assert_eq!(m.verdict, Verdict::WouldSave, "{}", m.summary);
    // Without sessions the split means nothing: never session affinity.
    let mut t = shadow_totals(30_000, 0);
    t.with_session = 0;
    assert_eq!(with_shadow(t).verdict, Verdict::WouldSave);
}

#[test]
fn samples_become_per_interval_series() {
    let z = [reading("a", 0.0, 0.0, 0, 0), reading("b", 0.0, 0.0, 0, 0)];
    let mid = [
        reading("a", 1_000.0, 500.0, 0, 0),
        reading("b", 1_000.0, 0.0, 10, 2),
    ];
    let end = [
        reading("a", 1_000.0, 500.0, 0, 0),
        reading("b", 2_000.0, 0.0, 30, 2),
    ];
    let samples = [
        Sample {
            t_s: 0.0,
            readings: z.to_vec(),
        },
        Sample {
            t_s: 10.0,
            readings: mid.to_vec(),
        },
        Sample {
            t_s: 20.0,
            readings: end.to_vec(),
        },
    ];
    let r = build_full(
        &z,
        &end,
        &[("m".into(), 16)],
        20.0,
        Thresholds::default(),
        &BTreeMap::new(),
        &samples,
    );
    let s = &r.models[0].series;
    assert_eq!(s.len(), 2);
    assert_eq!(
        (s[0].t_s, s[0].duplicated_tokens, s[0].recomputed_tokens),
        (10.0, 160.0, 32.0)
    );
    assert_eq!(s[1].duplicated_tokens, 320.0);
    assert_eq!(s[0].hit_rate, vec![Some(0.5), Some(0.0)]);
    assert_eq!(
        s[1].hit_rate,
        vec![None, Some(0.0)],
        "a had no queries in the second interval"
    );
}
