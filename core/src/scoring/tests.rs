use super::*;

fn cand(replica: u32, gpu: u32, in_flight: u32) -> Candidate {
    Candidate {
        replica,
        matched: MatchedBlocks {
            gpu,
            ..MatchedBlocks::default()
        },
        load: Load {
            in_flight,
            ..Load::default()
        },
        healthy: true,
        stale: false,
    }
}

#[test]
fn hit_wins_at_equal_load() {
    let cfg = ScoringConfig::default();
    let cands = [
        cand(0, 0, 1),
        cand(1, 0, 1),
        cand(2, 100, 1),
        cand(3, 10, 1),
    ];
    let d = choose(&cfg, 110, &cands, 7).expect("a decision");
    assert_eq!(d.replica, 2);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    assert_eq!(d.matched.gpu, 100);
    assert!((d.terms.raw_credit - 100.0).abs() < 1e-9);
    assert!((d.terms.prefill_cost - 10.0).abs() < 1e-9);
    assert_eq!(d.runner_up.map(|r| r.0), Some(3));
}

#[test]
fn medium_credit_prefers_faster_tiers() {
    let cfg = ScoringConfig::default();
    let mut cpu = cand(0, 0, 0);
    cpu.matched.cpu = 100;
    let gpu = cand(1, 100, 0);
    let d = choose(&cfg, 120, &[cpu, gpu], 1).expect("decision");
    assert_eq!(d.replica, 1);

    let mut storage = cand(1, 0, 0);
    storage.matched.storage = 100;
    let d = choose(&cfg, 120, &[cpu, storage], 1).expect("decision");
    assert_eq!(d.replica, 0);
    assert!((d.terms.raw_credit - 75.0).abs() < 1e-9);
}

#[test]
fn credit_is_capped_at_prompt_blocks() {
    let cfg = ScoringConfig::default();
    let m = MatchedBlocks {
        gpu: 50,
        cpu: 50,
        storage: 50,
        predicted: 0,
    };
    assert_eq!(cfg.raw_credit(&m, 60), 60.0);
}

#[test]
fn hot_spot_affinity_is_broken() {
    let cfg = ScoringConfig::default();
    let cands = [
        cand(0, 100, 20),
        cand(1, 0, 2),
        cand(2, 0, 2),
        cand(3, 0, 3),
    ];
    let d = choose(&cfg, 110, &cands, 3).expect("decision");
    assert_ne!(d.replica, 0, "the hot replica must not win: {d:?}");
    assert_eq!(d.reason, DecisionReason::OverloadBrokenAffinity);
    // Below the threshold the same prefix wins.
    let cands = [cand(0, 100, 4), cand(1, 0, 2), cand(2, 0, 2), cand(3, 0, 3)];
    let d = choose(&cfg, 110, &cands, 3).expect("decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
}

#[test]
fn no_prefix_goes_to_least_loaded() {
    let cfg = ScoringConfig::default();
    let cands = [cand(0, 0, 3), cand(1, 0, 1), cand(2, 0, 2)];
    let d = choose(&cfg, 50, &cands, 9).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::Load);
    assert_eq!(d.tied, 1);
}

#[test]
fn waiting_queue_and_kv_usage_count_as_load() {
    let cfg = ScoringConfig::default();
    let mut a = cand(0, 0, 0);
    a.load.waiting = 2;
    let mut b = cand(1, 0, 0);
    b.load.kv_usage = 0.5;
    let d = choose(&cfg, 10, &[a, b], 0).expect("decision");
    assert_eq!(d.replica, 1);
    // NaN usage from a broken scrape counts as 0, never poisons the comparison.
    b.load.kv_usage = f32::NAN;
    a.load.waiting = 0;
    a.load.in_flight = 1;
    let d = choose(&cfg, 10, &[a, b], 0).expect("decision");
    assert_eq!(d.replica, 1);
}

#[test]
fn ties_are_not_always_replica_zero() {
    let cfg = ScoringConfig::default();
    let cands: Vec<Candidate> = (0..4).map(|r| cand(r, 0, 0)).collect();
    let mut counts = [0u32; 4];
    for seed in 0..400u64 {
        let d = choose(&cfg, 20, &cands, seed).expect("decision");
        assert_eq!(d.tied, 4);
        counts[d.replica as usize] += 1;
    }
    for (r, &c) in counts.iter().enumerate() {
        assert!(c > 60, "replica {r} chosen {c}/400 times: {counts:?}");
    }
}

#[test]
fn tie_break_prefers_the_less_loaded_of_two() {
    // Equal cost (load weights off), but different in-flight: P2C picks the lower in-flight of the
    // two drawn, so the busiest replica can only win when drawn against itself (never).
    let cfg = ScoringConfig {
        w_in_flight: 0.0,
        ..ScoringConfig::default()
    };
    let cands = [cand(0, 0, 9), cand(1, 0, 1), cand(2, 0, 1)];
    for seed in 0..100 {
        let d = choose(&cfg, 10, &cands, seed).expect("decision");
        assert_ne!(d.replica, 0);
    }
}

/// A toy fleet: each request occupies its replica for `service` ticks; one request per tick.
struct ToyFleet {
    in_flight: Vec<u32>,
    finishing: Vec<Vec<usize>>,
    warm: Vec<bool>,
    chosen: Vec<u32>,
}

impl ToyFleet {
    fn new(n: usize, horizon: usize) -> Self {
        ToyFleet {
            in_flight: vec![0; n],
            finishing: vec![Vec::new(); horizon + 64],
            warm: vec![false; n],
            chosen: vec![0; n],
        }
    }

    fn step(&mut self, tick: usize) {
        for r in std::mem::take(&mut self.finishing[tick]) {
            self.in_flight[r] -= 1;
        }
    }

    fn route(
        &mut self,
        cfg: &ScoringConfig,
        tick: usize,
        service: usize,
        prompt: u32,
        prefix: u32,
    ) -> Decision {
        let cands: Vec<Candidate> = (0..self.in_flight.len())
            .map(|r| {
                cand(
                    r as u32,
                    if self.warm[r] { prefix } else { 0 },
                    self.in_flight[r],
                )
            })
            .collect();
        let d = choose(cfg, prompt, &cands, tick as u64 ^ 0xA5A5).expect("decision");
        let r = d.replica as usize;
        self.in_flight[r] += 1;
        self.finishing[tick + service].push(r);
        self.chosen[r] += 1;
        if prefix > 0 {
            self.warm[r] = true;
        }
        d
    }
}

#[test]
fn unique_prompts_spread_evenly() {
    let cfg = ScoringConfig::default();
    let ticks = 2000;
    let mut fleet = ToyFleet::new(4, ticks);
    for t in 0..ticks {
        fleet.step(t);
        let service = 5 + (t * 7919) % 11; // varying service times
        let d = fleet.route(&cfg, t, service, 40, 0);
        assert_eq!(d.reason, DecisionReason::Load);
    }
    let mean = ticks as f64 / 4.0;
    for (r, &c) in fleet.chosen.iter().enumerate() {
        assert!(
            (f64::from(c) - mean).abs() < mean * 0.1,
            "replica {r} got {c} of {ticks}: {:?}",
            fleet.chosen
        );
    }
}

fn run_shared_prefix(cfg: &ScoringConfig, ticks: usize) -> ToyFleet {
    let mut fleet = ToyFleet::new(4, ticks);
    fleet.warm[0] = true; // only replica 0 holds the shared system prompt at start
    for t in 0..ticks {
        fleet.step(t);
        // 80-block prompts sharing a 64-block prefix; each request stays 24 ticks.
        fleet.route(cfg, t, 24, 80, 64);
    }
    fleet
}

#[test]
fn fresh_replicas_warm_up_under_sustained_shared_prefix_load() {
    let fleet = run_shared_prefix(&ScoringConfig::default(), 1000);
    assert!(fleet.warm.iter().all(|&w| w), "all warm: {:?}", fleet.warm);
    let total: u32 = fleet.chosen.iter().sum();
    for (r, &c) in fleet.chosen.iter().enumerate() {
        assert!(
            f64::from(c) > f64::from(total) * 0.15,
            "replica {r} got {c} of {total}: {:?}",
            fleet.chosen
        );
    }

    // The same traffic without load awareness herds onto replica 0: the test can fail.
    let herding = ScoringConfig {
        w_in_flight: 0.0,
        w_waiting: 0.0,
        w_kv_usage: 0.0,
        overload_factor: f64::MAX,
        credit_decay: 0.0,
        ..ScoringConfig::default()
    };
    let fleet = run_shared_prefix(&herding, 1000);
    assert_eq!(fleet.chosen[0], 1000, "{:?}", fleet.chosen);
}

/// In-flight imbalance at which a fresh replica first beats a warm one holding `prefix` blocks.
fn imbalance_to_win(cfg: &ScoringConfig, prefix: u32) -> u32 {
    for k in 0..1000 {
        let d = choose(cfg, prefix + 16, &[cand(0, prefix, k), cand(1, 0, 0)], 5).expect("d");
        if d.replica == 1 {
            return k;
        }
    }
    u32::MAX
}

#[test]
fn credit_decay_lets_fresh_replicas_win_sooner() {
    let no_overload = ScoringConfig {
        overload_factor: f64::MAX,
        ..ScoringConfig::default()
    };
    let no_decay = ScoringConfig {
        credit_decay: 0.0,
        ..no_overload.clone()
    };
    let with = imbalance_to_win(&no_overload, 256);
    let without = imbalance_to_win(&no_decay, 256);
    assert!(with < without, "decay {with} vs none {without}");
    // Without decay the fresh replica needs 256 blocks' worth of load (32 requests at 8 each; the tie goes to the less loaded).
    assert_eq!(without, 32);
}

#[test]
fn stale_replicas_lose_credit_and_pay_a_penalty() {
    let cfg = ScoringConfig::default();
    let mut stale = cand(0, 100, 0);
    stale.stale = true;
    let fresh = cand(1, 0, 0);
    let d = choose(&cfg, 110, &[stale, fresh], 0).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::Load);

    let trusting = ScoringConfig {
        stale_credit: true,
        ..ScoringConfig::default()
    };
    let d = choose(&trusting, 110, &[stale, fresh], 0).expect("decision");
    assert_eq!(d.replica, 0);
    assert!((d.terms.stale_penalty - 64.0).abs() < 1e-9);
}

#[test]
fn unhealthy_replicas_are_excluded() {
    let cfg = ScoringConfig::default();
    let mut sick = cand(0, 100, 0);
    sick.healthy = false;
    let d = choose(&cfg, 110, &[sick, cand(1, 0, 5)], 0).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.eligible, 1);
    assert!(choose(&cfg, 110, &[sick], 0).is_none());
    assert!(choose(&cfg, 110, &[], 0).is_none());
    assert!(choose_round_robin(&[sick], 3).is_none());
    assert!(choose_random(&[sick], 3).is_none());
}

#[test]
fn predicted_blocks_earn_credit() {
    let cfg = ScoringConfig::default();
    let mut predicted = cand(1, 0, 0);
    predicted.matched.predicted = 50;
    let d = choose(&cfg, 60, &[cand(0, 0, 0), predicted], 4).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    assert!((d.terms.raw_credit - 45.0).abs() < 1e-9);
}

#[test]
fn config_defaults_fill_missing_fields_and_reject_unknown() {
    let cfg: ScoringConfig =
        serde_json::from_str(r#"{"credit_cpu": 0.5, "credit_decay": 0}"#).expect("parse");
    assert_eq!(cfg.credit_cpu, 0.5);
    assert_eq!(cfg.credit_decay, 0.0);
    assert_eq!(cfg.credit_storage, 0.25);
    assert_eq!(cfg.overload_factor, 1.5);
    assert!(serde_json::from_str::<ScoringConfig>(r#"{"credit_gpo": 1}"#).is_err());
}

#[test]
fn reasons_have_stable_names() {
    assert_eq!(DecisionReason::PrefixHit.as_str(), "prefix_hit");
    assert_eq!(
        serde_json::to_string(&DecisionReason::OverloadBrokenAffinity).expect("json"),
        "\"overload_broken_affinity\""
    );
}

#[test]
fn policy_helpers() {
    let mut cands: Vec<Candidate> = (0..3).map(|r| cand(r, 0, r)).collect();
    cands[1].healthy = false;
    let picks: Vec<u32> = (0..4)
        .map(|i| choose_round_robin(&cands, i).expect("rr").replica)
        .collect();
    assert_eq!(picks, vec![0, 2, 0, 2]);
    let mut seen = [false; 3];
    for s in 0..50 {
        let d = choose_random(&cands, s).expect("random");
        seen[d.replica as usize] = true;
    }
    assert_eq!(seen, [true, false, true]);
    let cfg = ScoringConfig::default();
    let mut cached = cands.clone();
    cached[2].matched.gpu = 1000;
    let d = choose_least_loaded(&cfg, &cached, 0).expect("ll");
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::Load);
}

fn with_pending(mut c: Candidate, pending: u32) -> Candidate {
    c.load.pending_prefill_blocks = pending;
    c
}

#[test]
fn unique_prompt_avoids_the_replica_with_prefill_queued() {
    // Equal request counts, but replica 0 still has a long prefill ahead of any new request.
    let cfg = ScoringConfig::default();
    let cands = [
        with_pending(cand(0, 0, 1), 400),
        with_pending(cand(1, 0, 1), 10),
    ];
    for seed in 0..32 {
        let d = choose(&cfg, 50, &cands, seed).expect("decision");
        assert_eq!(d.replica, 1, "seed {seed}");
        assert_eq!(d.reason, DecisionReason::Load);
    }
    let d = choose(&cfg, 50, &cands, 0).expect("decision");
    assert!((d.terms.queue_cost - 10.0).abs() < 1e-9);
}

#[test]
fn queued_work_that_builds_the_siblings_prefix_is_not_held_against_it() {
    // Replica 0 is computing a new 400-block prefix for the first of a burst of siblings; the next
    // sibling's match there is predicted. It must still go there, not to the idle replica 1.
    let cfg = ScoringConfig::default();
    let mut busy = with_pending(cand(0, 0, 1), 400);
    busy.matched.predicted = 400;
    let idle = cand(1, 0, 0);
    let d = choose(&cfg, 420, &[busy, idle], 3).expect("decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    assert_eq!(d.terms.queue_cost, 0.0);
    // The queue term does not count as load: the busy replica is not "overloaded" by it.
    assert!(!d.terms.overloaded);
    // Nor does other queued work on the holder push a prefix hit away: cached prefixes are
    // decided by the load terms, overload breaking and decay alone.
    let mut holder = with_pending(cand(0, 300, 1), 2_000);
    holder.matched.gpu = 300;
    let d = choose(&cfg, 320, &[holder, cand(1, 0, 0)], 5).expect("decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.terms.queue_cost, 0.0);
}

#[test]
fn pending_prefill_weight_zero_disables_the_term() {
    let cfg = ScoringConfig {
        w_pending_prefill: 0.0,
        ..ScoringConfig::default()
    };
    let cands = [
        with_pending(cand(0, 0, 0), 400),
        with_pending(cand(1, 0, 1), 0),
    ];
    let d = choose(&cfg, 50, &cands, 0).expect("decision");
    assert_eq!(
        d.replica, 0,
        "in-flight count decides when the queue term is off"
    );
}
