use super::*;

const BS: u32 = 16;

fn req(prompt_blocks: u32) -> RequestShape {
    RequestShape {
        prompt_tokens: prompt_blocks * BS,
        block_size: BS,
        usable_blocks: prompt_blocks,
        output_tokens: 100,
        expected_successors: 0.0,
        session_blocks: 0.0,
    }
}

fn cand(replica: u32, gpu: u32, running: u32) -> Candidate {
    Candidate {
        replica,
        matched: MatchedBlocks {
            gpu,
            ..MatchedBlocks::default()
        },
        load: Load {
            in_flight: running,
            running,
            ..Load::default()
        },
        rates: ReplicaRates::default(),
        healthy: true,
        stale: false,
    }
}

fn queued(mut c: Candidate, tokens: u64, requests: u32) -> Candidate {
    c.load.pending_prefill_tokens = tokens;
    c.load.pending_prefill_requests = requests;
    c.load.in_flight += requests;
    c
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
    let d = choose(&cfg, &req(110), &cands, 7).expect("a decision");
    assert_eq!(d.replica, 2);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    assert_eq!(d.terms.gpu_hit_tokens, 1600);
    assert_eq!(d.terms.uncached_tokens, 160);
    // 160 tokens at 30k/s plus one step.
    let expect = 160.0 / 30_000.0 + cfg.decode_step_s;
    assert!((d.terms.prefill_s - expect).abs() < 1e-9, "{:?}", d.terms);
    assert_eq!(d.runner_up.map(|r| r.0), Some(3));
    assert_eq!(d.candidates.len(), 4);
}

#[test]
fn faster_tiers_win_and_slow_tiers_still_beat_recomputing() {
    let cfg = ScoringConfig::default();
    let mut cpu = cand(0, 0, 0);
    cpu.matched.cpu = 100;
    let gpu = cand(1, 100, 0);
    let d = choose(&cfg, &req(120), &[cpu, gpu], 1).expect("decision");
    assert_eq!(d.replica, 1);

    let mut storage = cand(1, 0, 0);
    storage.matched.storage = 100;
    let d = choose(&cfg, &req(120), &[cpu, storage], 1).expect("decision");
    assert_eq!(d.replica, 0);
    assert!((d.terms.tier_load_s - 1600.0 / cfg.cpu_load_tokens_per_s).abs() < 1e-12);

    let d = choose(&cfg, &req(120), &[storage, cand(0, 0, 0)], 1).expect("decision");
    assert_eq!(
        d.replica, 1,
        "loading from storage is faster than recomputing"
    );
}

#[test]
fn matches_are_capped_at_the_usable_blocks() {
    let cfg = ScoringConfig::default();
    let mut c = cand(0, 50, 0);
    c.matched.cpu = 50;
    c.matched.storage = 50;
    let d = choose(&cfg, &req(60), &[c], 0).expect("decision");
    assert_eq!(d.terms.gpu_hit_tokens, 50 * 16);
    assert_eq!(d.terms.offload_hit_tokens, 10 * 16);
    assert_eq!(d.terms.uncached_tokens, 0);
}

#[test]
fn a_queued_holder_loses_to_an_idle_replica_once_its_queue_outweighs_the_hit() {
    // Replica 0 holds 300 of 320 blocks; the hit saves 300 * 16 / 30k = 0.16 s of prefill. With
    // little queued there it keeps the request; with seconds of prefill queued, it does not.
    let cfg = ScoringConfig::default();
    let idle = cand(1, 0, 0);
    let short = queued(cand(0, 300, 0), 1_000, 1);
    let d = choose(&cfg, &req(320), &[short, idle], 5).expect("decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    let long = queued(cand(0, 300, 0), 60_000, 10);
    let d = choose(&cfg, &req(320), &[long, idle], 5).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::LoadOverPrefix);
    let holder = d.candidates[0].terms;
    assert!(holder.queue_wait_s > 2.0, "{holder:?}");
}

#[test]
fn a_full_cache_prices_the_copy_a_give_away_makes() {
    // The holder has 300 of 320 blocks and 0.2 s of prefill queued; an idle replica computes the
    // whole prompt (0.17 s) sooner. With room in every cache the prefix is given away; once the
    // caches are full, the 300 blocks the idle replica would compute again push as many cached
    // ones out (0.16 s of prefill were they needed again), and the holder keeps the request.
    let cfg = ScoringConfig::default();
    let holder = queued(cand(0, 300, 0), 6_000, 1);
    let idle = cand(1, 0, 0);
    let d = choose(&cfg, &req(320), &[holder, idle], 5).expect("decision");
    assert_eq!((d.replica, d.reason), (1, DecisionReason::LoadOverPrefix));
    assert_eq!(d.terms.displace_s, 0.0);
    let full = |mut c: Candidate| {
        c.load.cache_fill = 1.0;
        c
    };
    let d = choose(&cfg, &req(320), &[full(holder), full(idle)], 5).expect("decision");
    assert_eq!((d.replica, d.reason), (0, DecisionReason::PrefixHit));
    assert_eq!(d.terms.displace_s, 0.0, "the holder copies nothing");
    let gave = d.candidates[1].terms;
    let copy = 300.0 * 16.0 / cfg.prefill_tokens_per_s;
    assert!((gave.displace_s - copy).abs() < 1e-12, "{gave:?}");
    assert!((gave.cost_s - gave.ttft_s - gave.harm_s - gave.displace_s).abs() < 1e-12);
    // Half full: half the price, and an unreadable fill counts as room.
    let mut half = idle;
    half.load.cache_fill = 0.5;
    let d = choose(&cfg, &req(320), &[full(holder), half], 5).expect("decision");
    assert!((d.candidates[1].terms.displace_s - copy / 2.0).abs() < 1e-12);
    half.load.cache_fill = f32::NAN;
    let d = choose(&cfg, &req(320), &[full(holder), half], 5).expect("decision");
    assert_eq!(d.candidates[1].terms.displace_s, 0.0);
}

#[test]
fn a_new_prefix_is_not_steered_by_cache_fill() {
    // Nobody holds the prompt: every candidate computes all of it and pushes as much out, so no
    // copy is charged and the fill does not choose (several gateways reading the same slowly
    // changing fill would all send their new prefixes to one replica). Equal replicas share.
    let cfg = ScoringConfig::default();
    let mut full = cand(0, 0, 0);
    full.load.cache_fill = 1.0;
    let mut roomy = cand(1, 0, 0);
    roomy.load.cache_fill = 0.25;
    let mut chosen = [0u32; 2];
    for seed in 0..32 {
        let d = choose(&cfg, &req(320), &[full, roomy], seed).expect("decision");
        assert_eq!(d.reason, DecisionReason::Load);
        assert!(d.candidates.iter().all(|c| c.terms.displace_s == 0.0));
        chosen[d.replica as usize] += 1;
    }
    assert!(chosen.iter().all(|&n| n > 0), "{chosen:?}");
}

#[test]
fn a_holder_part_way_through_its_queue_keeps_the_hit() {
    // The holder has one large prefill pending (60,000 tokens: 2 s at 30k tokens/s), enough to
    // give a 300-block hit away while none of it is done. Once most of it is computed, what is
    // left ahead is short and the hit stays.
    let cfg = ScoringConfig::default();
    let idle = cand(1, 0, 0);
    let fresh = queued(cand(0, 300, 0), 60_000, 1);
    let d = choose(&cfg, &req(320), &[fresh, idle], 5).expect("decision");
    assert_eq!(d.reason, DecisionReason::LoadOverPrefix);
    let mut nearly_done = queued(cand(0, 300, 0), 60_000, 1);
    nearly_done.load.pending_prefill_done_tokens = 58_000;
    let d = choose(&cfg, &req(320), &[nearly_done, idle], 5).expect("decision");
    assert_eq!((d.replica, d.reason), (0, DecisionReason::PrefixHit));
    assert_eq!(d.candidates[0].terms.ahead_tokens, 2_000);
    // The mean size of what kvroute sends there (for the engine's other waiting requests) is
    // still the whole pending request's.
    assert_eq!(nearly_done.load.mean_routed_uncached_tokens(), Some(60_000));
}

#[test]
fn no_prefix_goes_where_the_wait_is_shortest() {
    let cfg = ScoringConfig::default();
    let cands = [
        queued(cand(0, 0, 2), 8_000, 1),
        queued(cand(1, 0, 2), 200, 1),
        queued(cand(2, 0, 2), 4_000, 1),
    ];
    for seed in 0..16 {
        let d = choose(&cfg, &req(50), &cands, seed).expect("decision");
        assert_eq!(d.replica, 1, "seed {seed}");
        assert_eq!(d.reason, DecisionReason::Load);
    }
}

#[test]
fn engine_waiting_requests_nobody_routed_count_as_queue() {
    // Replica 0's engine reports 4 waiting requests kvroute did not route (another gateway).
    let cfg = ScoringConfig::default();
    let mut foreign = cand(0, 0, 0);
    foreign.load.waiting = 4;
    let d = choose(&cfg, &req(100), &[foreign, cand(1, 0, 0)], 3).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.candidates[0].terms.ahead_tokens, 4 * 1600);
}

#[test]
fn a_slower_replica_needs_a_longer_hit_to_win() {
    let cfg = ScoringConfig::default();
    let mut slow = cand(0, 40, 0);
    slow.rates.prefill_tokens_per_s = 10_000.0;
    slow.rates.decode_step_s = 0.021;
    let fast = cand(1, 0, 0);
    // 100 blocks: slow computes 60 at 10k/s (0.096 s), fast all 100 at 30k/s (0.053 s).
    let d = choose(&cfg, &req(100), &[slow, fast], 0).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::LoadOverPrefix);
    slow.matched.gpu = 90;
    let d = choose(&cfg, &req(100), &[slow, fast], 0).expect("decision");
    assert_eq!(d.replica, 0);
}

#[test]
fn prefill_harms_decoders_only_past_their_itl_slack() {
    // Same prefix hit nowhere; replica 0 decodes 64 sequences, replica 1 four, both at a step
    // close to the ITL objective, and 256 tokens left each: each absorbs 256 * 1 ms of stall.
    let cfg = ScoringConfig::default();
    let near_objective = |mut c: Candidate| {
        c.rates.decode_step_s = cfg.itl_objective_s - 0.001;
        c
    };
    let (busy, quiet) = (
        near_objective(cand(0, 0, 64)),
        near_objective(cand(1, 0, 4)),
    );
    // A 6,400-token prefill stalls them 0.21 s: within the slack, it harms nobody.
    let d = choose(&cfg, &req(400), &[busy, quiet], 9).expect("d");
    assert!(d.candidates.iter().all(|s| s.terms.harm_s == 0.0), "{d:?}");
    // Behind 3,000 queued tokens (0.1 s more) it runs past the slack: the overrun is charged to
    // every decoder, so the replica decoding more is harmed more and loses.
    let d = choose(
        &cfg,
        &req(400),
        &[queued(busy, 3_000, 1), queued(quiet, 3_000, 1)],
        9,
    )
    .expect("d");
    assert_eq!(d.replica, 1);
    let (busy, quiet) = (d.candidates[0].terms, d.candidates[1].terms);
    assert!(quiet.harm_s > 0.0, "{quiet:?}");
    assert!(
        (busy.harm_s / quiet.harm_s - 16.0).abs() < 1e-6,
        "{busy:?} {quiet:?}"
    );
    // At the prior step (7 ms against 50), the same queue leaves seconds of slack: no harm.
    let d = choose(
        &cfg,
        &req(400),
        &[
            queued(cand(0, 0, 64), 3_000, 1),
            queued(cand(1, 0, 4), 3_000, 1),
        ],
        9,
    )
    .expect("d");
    assert!(d.candidates.iter().all(|s| s.terms.harm_s == 0.0), "{d:?}");
}

#[test]
fn a_copy_stalls_the_decoders_for_work_no_replica_needs() {
    // Replica 0 holds 375 of the request's 450 blocks behind 0.5 s of queued prefill; replica 1
    // holds nothing and has no queue. Both decode 100 sequences well within their ITL objective,
    // so the 1,200 tokens some replica must compute harm nobody; the 6,000 replica 1 would
    // compute again stall its decoders for work no replica needs, charged from the first second.
    let cfg = ScoringConfig::default();
    let holder = queued(cand(0, 375, 100), 15_000, 10);
    let d = choose(&cfg, &req(450), &[holder, cand(1, 0, 100)], 3).expect("d");
    assert_eq!(d.replica, 0, "{:#?}", d.candidates);
    let (kept, copy) = (d.candidates[0].terms, d.candidates[1].terms);
    assert_eq!(kept.harm_s, 0.0, "{kept:?}");
    let weight = cfg.ttft_objective_s / (256.0 * cfg.itl_objective_s);
    let expected = 100.0 * weight * 6_000.0 / cfg.prefill_tokens_per_s;
    assert!((copy.harm_s - expected).abs() < 1e-9, "{copy:?}");
    // Its own wait alone would have moved it: the copy is what keeps it.
    assert!(copy.ttft_s < kept.ttft_s, "{copy:?} {kept:?}");
}

#[test]
fn blocks_that_do_not_fit_wait_for_the_batch_to_drain() {
    let cfg = ScoringConfig::default();
    let mut full = cand(0, 0, 8);
    full.rates.kv_capacity_blocks = 1_000;
    full.load.kv_usage = 0.98;
    let mut roomy = cand(1, 0, 8);
    roomy.rates.kv_capacity_blocks = 1_000;
    roomy.load.kv_usage = 0.2;
    let d = choose(&cfg, &req(100), &[full, roomy], 0).expect("decision");
    assert_eq!(d.replica, 1);
    assert!(d.candidates[0].terms.kv_pressure_s > 0.0);
    assert_eq!(d.candidates[1].terms.kv_pressure_s, 0.0);
}

#[test]
fn ties_are_not_always_replica_zero() {
    let cfg = ScoringConfig::default();
    let cands: Vec<Candidate> = (0..4).map(|r| cand(r, 0, 0)).collect();
    let mut seen = [0u32; 4];
    for seed in 0..400 {
        let d = choose(&cfg, &req(10), &cands, seed).expect("decision");
        assert_eq!(d.tied, 4);
        seen[d.replica as usize] += 1;
    }
    assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
}

#[test]
fn tie_break_prefers_the_one_with_fewer_in_flight() {
    // Equal predictions (nothing decoding, nothing queued) but replica 1 has requests in flight.
    let cfg = ScoringConfig::default();
    let mut busy = cand(1, 0, 0);
    busy.load.in_flight = 3;
    for seed in 0..32 {
        let d = choose(&cfg, &req(10), &[cand(0, 0, 0), busy], seed).expect("decision");
        assert_eq!(d.replica, 0, "seed {seed}");
    }
}

#[test]
fn the_idle_one_of_three_tied_wins_every_draw() {
    // Two replicas each with a short prefill queued (well under a step), one idle: their
    // predictions tie within a step, and the idle one must win whatever the seed.
    let cfg = ScoringConfig::default();
    let cands = [
        queued(cand(0, 0, 0), 16, 1),
        queued(cand(1, 0, 0), 16, 1),
        cand(2, 0, 0),
    ];
    for seed in 0..64 {
        let d = choose(&cfg, &req(10), &cands, seed).expect("decision");
        assert_eq!(d.tied, 3, "seed {seed}: {d:?}");
        assert_eq!(d.replica, 2, "seed {seed}");
    }
}

/// A toy fleet in continuous time: each replica prefills in FIFO order at its rate and decodes a
/// request for `decode_s` after its prefill; the decisions see exactly what the indexer would.
struct ToyFleet {
    speed: Vec<f64>,
    /// Per replica: when its prefill queue empties.
    busy_until: Vec<f64>,
    /// Per replica: (prefill end, decode end, uncached tokens) of each request.
    requests: Vec<Vec<(f64, f64, u64)>>,
    warm: Vec<bool>,
    chosen: Vec<u32>,
    ttft: Vec<f64>,
}

impl ToyFleet {
    fn new(speed: &[f64]) -> Self {
        let n = speed.len();
        ToyFleet {
            speed: speed.to_vec(),
            busy_until: vec![0.0; n],
            requests: vec![Vec::new(); n],
            warm: vec![false; n],
            chosen: vec![0; n],
            ttft: Vec::new(),
        }
    }

    fn route(&mut self, cfg: &ScoringConfig, now: f64, r: &RequestShape, prefix: u32) -> u32 {
        let cands: Vec<Candidate> = (0..self.speed.len())
            .map(|i| {
                let live: Vec<&(f64, f64, u64)> =
                    self.requests[i].iter().filter(|q| q.1 > now).collect();
                let pending: Vec<&&(f64, f64, u64)> = live.iter().filter(|q| q.0 > now).collect();
                let decoding = (live.len() - pending.len()) as u32;
                Candidate {
                    replica: i as u32,
                    matched: MatchedBlocks {
                        gpu: if self.warm[i] { prefix } else { 0 },
                        ..MatchedBlocks::default()
                    },
                    load: Load {
                        in_flight: live.len() as u32,
                        running: decoding,
                        pending_prefill_tokens: pending.iter().map(|q| q.2).sum(),
                        pending_prefill_requests: pending.len() as u32,
                        remaining_output_tokens: live.len() as u64 * 100,
                        ..Load::default()
                    },
                    rates: ReplicaRates {
                        prefill_tokens_per_s: cfg.prefill_tokens_per_s * self.speed[i],
                        decode_step_s: cfg.decode_step_s / self.speed[i],
                        kv_capacity_blocks: 0,
                    },
                    healthy: true,
                    stale: false,
                }
            })
            .collect();
        let seed = (now * 1e6) as u64 ^ 0xA5A5;
        let d = choose(cfg, r, &cands, seed).expect("decision");
        let i = d.replica as usize;
        let uncached = d.terms.uncached_tokens;
        let start = self.busy_until[i].max(now);
        let done = start + uncached as f64 / (cfg.prefill_tokens_per_s * self.speed[i]);
        self.busy_until[i] = done;
        self.requests[i].push((done, done + 2.0, uncached));
        self.ttft.push(done - now);
        self.chosen[i] += 1;
        if prefix > 0 {
            self.warm[i] = true;
        }
        d.replica
    }
}

#[test]
fn unique_prompts_spread_evenly() {
    // Prompts of seven sizes in turn, every 50 ms: each replica gets the same prefill work (by
    // tokens, the load that queues; the counts may differ, as the periodic sizes line up with
    // the replicas' free moments) and nothing queues behind a full prefill.
    let cfg = ScoringConfig::default();
    let mut fleet = ToyFleet::new(&[1.0; 4]);
    let n = 2000u32;
    let mut work = [0u64; 4];
    for k in 0..n {
        let blocks = 200 + (k % 7) * 30;
        let r = fleet.route(&cfg, f64::from(k) * 0.05, &req(blocks), 0);
        work[r as usize] += u64::from(blocks);
    }
    let mean = work.iter().sum::<u64>() as f64 / 4.0;
    for (r, &w) in work.iter().enumerate() {
        assert!(
            (w as f64 - mean).abs() < mean * 0.1,
            "replica {r} got {w} blocks of prompts: {work:?}, requests {:?}",
            fleet.chosen
        );
    }
    let largest = 380.0 * f64::from(BS) / cfg.prefill_tokens_per_s;
    let worst = fleet.ttft.iter().copied().fold(0.0, f64::max);
    assert!(worst <= largest + 1e-9, "worst TTFT {worst} s");
}

#[test]
fn fresh_replicas_warm_up_under_sustained_shared_prefix_load() {
    // 512-block prompts sharing a 448-block prefix only replica 0 holds at first, at 40 req/s:
    // more prefill than one replica can do (40 * 1024 tokens/s of suffixes alone exceeds its
    // 30k/s), so the holder's queue must push requests to the others, which then warm.
    let cfg = ScoringConfig::default();
    let mut fleet = ToyFleet::new(&[1.0; 4]);
    fleet.warm[0] = true;
    for k in 0..2000 {
        fleet.route(&cfg, k as f64 / 40.0, &req(512), 448);
    }
    assert!(fleet.warm.iter().all(|&w| w), "all warm: {:?}", fleet.warm);
    let total: u32 = fleet.chosen.iter().sum();
    for (r, &c) in fleet.chosen.iter().enumerate() {
        assert!(
            f64::from(c) > f64::from(total) * 0.15,
            "replica {r} got {c} of {total}: {:?}",
            fleet.chosen
        );
    }
    // Queues stay bounded: no request waits more than a few prefills.
    let worst = fleet.ttft.iter().copied().fold(0.0, f64::max);
    assert!(worst < 2.0, "worst TTFT {worst} s");
}

#[test]
fn at_low_load_a_session_stays_where_its_context_is() {
    // One request every 2 s, each holding a 2,000-block context on replica 0: nothing queues, so
    // moving would cost a full prefill for nothing.
    let cfg = ScoringConfig::default();
    let mut fleet = ToyFleet::new(&[1.0; 4]);
    fleet.warm[0] = true;
    for k in 0..100 {
        assert_eq!(fleet.route(&cfg, k as f64 * 2.0, &req(2_100), 2_000), 0);
    }
}

#[test]
fn a_heterogeneous_fleet_gets_work_in_proportion_to_speed() {
    // Unique prompts; two replicas at full speed, two at half. The fast ones should take about
    // two thirds of the prefill work.
    let cfg = ScoringConfig::default();
    let mut fleet = ToyFleet::new(&[1.0, 1.0, 0.5, 0.5]);
    let n = 3000;
    for k in 0..n {
        fleet.route(&cfg, k as f64 * 0.02, &req(300), 0);
    }
    let fast = f64::from(fleet.chosen[0] + fleet.chosen[1]) / n as f64;
    assert!((0.57..0.77).contains(&fast), "{:?}", fleet.chosen);
}

#[test]
fn stale_replicas_lose_their_matches_unless_trusted() {
    let cfg = ScoringConfig::default();
    let mut stale = cand(0, 100, 0);
    stale.stale = true;
    let fresh = cand(1, 0, 0);
    let d = choose(&cfg, &req(110), &[stale, fresh], 0).expect("decision");
    assert_eq!(d.reason, DecisionReason::Load);
    assert!(d.candidates[0].terms.stale);
    assert_eq!(d.candidates[0].terms.gpu_hit_tokens, 0);

    let trusting = ScoringConfig {
        stale_credit: true,
        ..ScoringConfig::default()
    };
    let d = choose(&trusting, &req(110), &[stale, fresh], 0).expect("decision");
    assert_eq!(d.replica, 0);
}

#[test]
fn unhealthy_replicas_are_excluded() {
    let cfg = ScoringConfig::default();
    let mut sick = cand(0, 100, 0);
    sick.healthy = false;
    let d = choose(&cfg, &req(110), &[sick, cand(1, 0, 5)], 0).expect("decision");
    assert_eq!(d.replica, 1);
    assert_eq!(d.eligible, 1);
    assert!(choose(&cfg, &req(110), &[sick], 0).is_none());
    assert!(choose(&cfg, &req(110), &[], 0).is_none());
    assert!(choose_round_robin(&[sick], 3).is_none());
    assert!(choose_random(&[sick], 3).is_none());
}

#[test]
fn a_sibling_waits_for_the_prefix_being_built_rather_than_rebuild_it_on_a_busy_fleet() {
    // Replica 0 is computing a 400-block prefix for the first of a burst of siblings; the next
    // sibling's match there is predicted. Both replicas decode 32 sequences: rebuilding the
    // prefix on replica 1 would slow its batch more than waiting costs.
    let cfg = ScoringConfig::default();
    let mut busy = queued(cand(0, 0, 32), 400 * 16, 1);
    busy.matched.predicted = 400;
    let d = choose(&cfg, &req(420), &[busy, cand(1, 0, 32)], 3).expect("decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    assert_eq!(d.terms.uncached_tokens, 20 * 16);
    assert!(d.terms.queue_wait_s > 0.2);
}

#[test]
fn on_an_idle_fleet_siblings_wait_for_the_prefix_being_built_when_rebuilding_it_saves_under_a_step()
{
    // The first sibling (a 400-block prefix and a 4-block tail) is pending on replica 0. The next
    // sibling there waits for it (400 + 4 blocks ahead) and computes its own 4 blocks; on the idle
    // replica 1 it computes all 404. The idle replica is faster by the first sibling's tail
    // (64 tokens, ~2 ms): less than one engine step, so the two cannot be told apart and the
    // replica computing 4 blocks, not 404, wins, for every seed.
    let cfg = ScoringConfig::default();
    let mut building = queued(cand(0, 0, 0), 404 * 16, 1);
    building.matched.predicted = 400;
    for seed in 0..32 {
        let d = choose(&cfg, &req(404), &[cand(1, 0, 0), building], seed).expect("decision");
        assert_eq!(d.replica, 0, "seed {seed}: {:?}", d.candidates);
        assert_eq!(d.terms.uncached_tokens, 4 * 16);
        assert_eq!(d.tied, 1);
    }
    // A tail longer than a step's worth of prefill (here 40 blocks, 21 ms at 30k tokens/s) makes
    // waiting measurably slower on an idle fleet: the sibling is computed on the idle replica.
    let mut building = queued(cand(0, 0, 0), 440 * 16, 1);
    building.matched.predicted = 400;
    let d = choose(&cfg, &req(440), &[cand(1, 0, 0), building], 1).expect("decision");
    assert_eq!(d.replica, 1, "{:?}", d.candidates);
}

#[test]
fn within_a_step_the_candidate_computing_less_wins_before_load_breaks_the_tie() {
    // Replica 1 holds 2 blocks more than replica 0 and has 3 requests in flight more; their costs
    // differ by far less than a step. The one computing less wins; only equal work goes to the
    // load tie-break.
    let cfg = ScoringConfig::default();
    let cands = [cand(0, 10, 0), cand(1, 12, 3)];
    for seed in 0..16 {
        let d = choose(&cfg, &req(20), &cands, seed).expect("decision");
        assert_eq!(d.replica, 1, "seed {seed}");
    }
}

#[test]
fn config_defaults_fill_missing_fields_and_reject_unknown() {
    let cfg: ScoringConfig =
        serde_json::from_str(r#"{"prefill_tokens_per_s": 12000}"#).expect("parse");
    assert_eq!(cfg.prefill_tokens_per_s, 12_000.0);
    assert_eq!(cfg.decode_step_s, 0.007);
    assert!(cfg.validate().is_ok());
    assert!(serde_json::from_str::<ScoringConfig>(r#"{"credit_decay": 1}"#).is_err());
    let bad = ScoringConfig {
        itl_objective_s: 0.0,
        ..ScoringConfig::default()
    };
    assert_eq!(bad.validate().map_err(|e| e.0), Err("itl_objective_s"));
}

#[test]
fn reasons_have_stable_names() {
    assert_eq!(DecisionReason::PrefixHit.as_str(), "prefix_hit");
    assert_eq!(
        serde_json::to_string(&DecisionReason::LoadOverPrefix).expect("json"),
        "\"load_over_prefix\""
    );
    for r in DecisionReason::ALL {
        assert_eq!(serde_json::to_string(&r).expect("json"), format!("\"{r}\""));
    }
}

#[test]
fn policy_helpers() {
    let mut cands: Vec<Candidate> = (0..3).map(|r| cand(r, 0, r * 4)).collect();
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
    let d = choose_least_loaded(&cfg, &req(1010), &cached, 0).expect("ll");
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::Load);
}

#[test]
fn at_a_high_arrival_rate_recomputing_a_prefix_delays_the_requests_that_follow() {
    // Replica 0 holds 400 of 420 blocks with 0.3 s of prefill queued; replica 1 is idle. Without
    // arrivals, recomputing the prefix on replica 1 (0.22 s) beats waiting; when requests arrive
    // at 10 per second per replica, the 0.22 s of work delays the ones behind it more than the
    // wait saves.
    let cfg = ScoringConfig::default();
    let holder = queued(cand(0, 400, 0), 9_000, 2);
    let idle = cand(1, 0, 0);
    let d = choose(&cfg, &req(420), &[holder, idle], 1).expect("decision");
    assert_eq!(d.replica, 1, "{:?}", d.candidates);
    let mut busy = [holder, idle];
    for c in &mut busy {
        c.load.arrival_rate_per_s = 10.0;
    }
    let d = choose(&cfg, &req(420), &busy, 1).expect("decision");
    assert_eq!(d.replica, 0, "{:?}", d.candidates);
    assert!(d.candidates[1].terms.arrivals_harm_s > d.candidates[0].terms.arrivals_harm_s);
}

#[test]
fn a_kv_bound_holders_waiting_queue_is_sized_like_what_kvroute_sends_it() {
    // Both replicas are KV-bound (99 % used): their engines hold requests waiting for blocks whose
    // prefill kvroute already estimated done. Those are kvroute's own requests, mostly hits of
    // 75 uncached blocks; sizing each as a whole 450-block prompt made the holder's queue look
    // six times longer than it is, and gave its 375-block hit away to a replica just as full
    // (seen at 18 req/s on shared-prefix).
    let cfg = ScoringConfig::default();
    let busy = |replica: u32, gpu: u32, waiting: u32| {
        let mut c = cand(replica, gpu, 180);
        c.load.waiting = waiting;
        c.load.kv_usage = 0.99;
        c.load.in_flight_uncached_tokens = 180 * 75 * u64::from(BS);
        c.load.remaining_output_tokens = 180 * 500;
        c.rates.kv_capacity_blocks = 32_768;
        // 18 req/s over four replicas.
        c.load.arrival_rate_per_s = 4.5;
        c
    };
    let holder = busy(0, 375, 27);
    let other = busy(1, 0, 20);
    let d = choose(&cfg, &req(450), &[holder, other], 5).expect("decision");
    assert_eq!(d.replica, 0, "{:#?}", d.candidates);
    assert_eq!(d.reason, DecisionReason::PrefixHit);
    assert_eq!(d.candidates[0].terms.ahead_tokens, 27 * 75 * u64::from(BS));
    // Without anything routed there, a waiting request is assumed this request's uncached size.
    let mut unknown = busy(1, 0, 20);
    unknown.load.in_flight_uncached_tokens = 0;
    let t = predict(&cfg, &req(450), &unknown);
    assert_eq!(t.ahead_tokens, 20 * 450 * u64::from(BS));
}

#[test]
fn release_curves_sample_the_first_finishes_densely_and_keep_the_last() {
    assert!(KvRelease::from_finishes(&mut []).points().is_empty());
    let mut finishes: Vec<(f64, u32)> = (0..300).rev().map(|i| (f64::from(i), 10)).collect();
    finishes.push((-3.0, 10));
    let curve = KvRelease::from_finishes(&mut finishes);
    let points = curve.points();
    assert_eq!(points.len(), KvRelease::MAX_POINTS);
    let requests: Vec<u32> = points.iter().map(|p| p.requests).collect();
    assert_eq!(requests, [1, 2, 4, 8, 16, 32, 64, 301]);
    assert_eq!(points[0].after_s, 0.0, "a past finish counts as now");
    assert_eq!(points[7].blocks, 3_010);
    assert_eq!(points[7].after_s, 299.0);
    assert!(points.windows(2).all(|w| w[0].after_s <= w[1].after_s));
}

/// A replica whose KV is full of kvroute's requests, which finish from `first_s` on.
fn full_until(replica: u32, gpu: u32, first_s: f64) -> Candidate {
    let mut c = cand(replica, gpu, 180);
    c.rates.kv_capacity_blocks = 32_768;
    c.rates.decode_step_s = 0.06;
    c.load.kv_usage = 0.999;
    c.load.in_flight_uncached_tokens = 180 * 75 * u64::from(BS);
    c.load.remaining_output_tokens = 180 * 500;
    let mut finishes: Vec<(f64, u32)> = (0..180)
        .map(|i| (first_s + f64::from(i) * 0.2, 140))
        .collect();
    c.load.kv_release = KvRelease::from_finishes(&mut finishes);
    c
}

#[test]
fn a_full_replica_waits_until_its_running_requests_free_enough_blocks() {
    let cfg = ScoringConfig::default();
    // Nothing finishes for 12 s, and 180 decoding sequences grow by ~190 blocks a second: the
    // request waits at least until the first finishes, and longer than the uniform-drain guess.
    let holder = full_until(0, 375, 12.0);
    let t = predict(&cfg, &req(450), &holder);
    assert!(t.kv_pressure_s > 12.0, "{t:?}");
    let mut no_curve = holder;
    no_curve.load.kv_release = KvRelease::default();
    let guess = predict(&cfg, &req(450), &no_curve);
    assert!(guess.kv_pressure_s < 1.0, "{guess:?}");
    // Finishing soon, it waits only until then.
    let soon = predict(&cfg, &req(450), &full_until(0, 375, 0.5));
    assert!(soon.kv_pressure_s < t.kv_pressure_s, "{soon:?}");
    // With room for its prompt and for the batch's growth until its requests finish: no wait.
    let mut roomy = full_until(0, 375, 1.0);
    roomy.load.kv_usage = 0.5;
    assert_eq!(predict(&cfg, &req(450), &roomy).kv_pressure_s, 0.0);
}

#[test]
fn a_holder_whose_kv_runs_out_gives_the_request_to_a_replica_with_room() {
    // Seen at 18 req/s on shared-prefix: every replica near full KV, none of kvroute's requests
    // finishing for another 12 s; the holder of the 375-block prefix had no free block, and its
    // waiting requests then waited ~30 s. A replica with 1,500 free blocks serves it sooner even
    // if it must compute the whole prompt.
    let cfg = ScoringConfig::default();
    let holder = full_until(0, 375, 12.0);
    let mut roomy = full_until(1, 0, 12.0);
    roomy.load.kv_usage = 0.9;
    let d = choose(&cfg, &req(450), &[holder, roomy], 3).expect("decision");
    assert_eq!(d.replica, 1, "{:#?}", d.candidates);
    assert_eq!(d.reason, DecisionReason::LoadOverPrefix);
    // With its blocks coming back soon, the holder keeps its hit.
    let d = choose(&cfg, &req(450), &[full_until(0, 375, 0.2), roomy], 3).expect("decision");
    assert_eq!(d.replica, 0, "{:#?}", d.candidates);
}

#[test]
fn a_holder_whose_batch_outgrows_its_kv_before_the_first_token_gives_the_request_away() {
    // Seen at 18 req/s on shared-prefix: the holder had 113 free blocks at its last reading, room
    // for the hit's 75 new ones, but 180 sequences decoding add ~190 blocks a second and none of
    // kvroute's requests there finish for 12 s. Read just now, the request's first token comes
    // before the blocks run out: it keeps its hit. Read half a second ago, the engine is already
    // out of blocks (it preempts and admits nothing): the request would wait ~12 s there.
    let cfg = ScoringConfig::default();
    let holder = |age_s: f32| {
        let mut c = full_until(0, 375, 12.0);
        c.load.kv_usage = 1.0 - 113.0 / 32_768.0;
        c.load.kv_usage_age_s = age_s;
        c
    };
    let mut roomy = full_until(1, 0, 12.0);
    roomy.load.kv_usage = 0.9;
    let fresh = choose(&cfg, &req(450), &[holder(0.0), roomy], 3).expect("decision");
    assert_eq!(fresh.replica, 0, "{:#?}", fresh.candidates);
    assert_eq!(fresh.candidates[0].terms.kv_pressure_s, 0.0);
    let old = choose(&cfg, &req(450), &[holder(0.5), roomy], 3).expect("decision");
    assert_eq!(old.replica, 1, "{:#?}", old.candidates);
    assert!(
        old.candidates[0].terms.kv_pressure_s > 10.0,
        "{:#?}",
        old.candidates
    );
    // A margin that runs out only after the first token is not this request's wait.
    let mut late = holder(0.0);
    late.load.kv_usage = 1.0 - 600.0 / 32_768.0;
    assert_eq!(predict(&cfg, &req(450), &late).kv_pressure_s, 0.0);
}

/// A replica whose prefill was recently busy `busy` of the time with prefills of mean residual
/// `residual_s`.
fn recently_busy(mut c: Candidate, busy: f32, residual_s: f32) -> Candidate {
    c.load.recent_prefill_busy = busy;
    c.load.recent_prefill_residual_s = residual_s;
    c
}

#[test]
fn a_session_s_first_turn_weighs_its_successors_waits_against_a_shared_prompt_s_hit() {
    // A first turn: 150 blocks of a shared system prompt cached on replica 0 (80 ms of prefill
    // at 30k tokens/s), 100 blocks of its own. Replica 0's prefill was busy 40 % of the recent
    // time with the sessions already there, replica 1 10 %; prefills of ~0.2 s residual.
    let cfg = ScoringConfig::default();
    let holder = recently_busy(cand(0, 150, 0), 0.4, 0.2);
    let quiet = recently_busy(cand(1, 0, 0), 0.1, 0.2);
    let mut first_turn = req(250);

    // Without successors (a one-off request), the hit wins: the queue it meets is the one there
    // now, empty on both.
    let d = choose(&cfg, &first_turn, &[holder, quiet], 1).expect("a decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.terms.successors_s, 0.0);

    // With 20 turns to follow it, each expected to wait 0.4 * 0.2 / 0.6 = 0.133 s at replica 0
    // and 0.022 s at replica 1 (and to make the others there wait as much again and more), the
    // session starts where its turns will queue less.
    first_turn.expected_successors = 20.0;
    let d = choose(&cfg, &first_turn, &[holder, quiet], 1).expect("a decision");
    assert_eq!(d.replica, 1, "{:?}", d.candidates);
    assert_eq!(d.reason, DecisionReason::LoadOverPrefix);
    let at = |r: usize| d.candidates[r].terms.successors_s;
    let expect = |busy: f64| 20.0 * busy * 0.2 / (1.0 - busy) * (2.0 - busy) / (1.0 - busy);
    assert!((at(0) - expect(0.4)).abs() < 1e-6, "{}", at(0));
    assert!((at(1) - expect(0.1)).abs() < 1e-6, "{}", at(1));
    assert!((d.terms.cost_s - (d.terms.ttft_s + d.terms.harm_s + at(1))).abs() < 1e-9);

    // Equally busy replicas: the successors cost the same everywhere, the hit decides.
    let even = recently_busy(cand(1, 0, 0), 0.4, 0.2);
    let d = choose(&cfg, &first_turn, &[holder, even], 1).expect("a decision");
    assert_eq!(d.replica, 0);
}

#[test]
fn a_late_turn_stays_with_its_context_on_a_busier_replica() {
    // Turn 20 of a session whose 2,000-block context is on replica 0: moving it to a quieter
    // replica would save its successors some queueing but costs 1 s of prefill now; it stays.
    let cfg = ScoringConfig::default();
    let mut turn = req(2_100);
    turn.expected_successors = 20.0;
    let holder = recently_busy(cand(0, 2_000, 0), 0.2, 0.05);
    let quiet = recently_busy(cand(1, 0, 0), 0.05, 0.05);
    let d = choose(&cfg, &turn, &[holder, quiet], 3).expect("a decision");
    assert_eq!(d.replica, 0, "{:?}", d.candidates);
}

#[test]
fn the_stationary_wait_stays_finite_on_a_saturated_replica() {
    let cfg = ScoringConfig::default();
    let mut turn = req(100);
    turn.expected_successors = 1.0;
    for busy in [0.95f32, 1.0, 3.0, f32::INFINITY, f32::NAN] {
        let c = recently_busy(cand(0, 0, 0), busy, 0.1);
        let t = predict(&cfg, &turn, &c);
        assert!(t.successors_s.is_finite(), "{busy}: {t:?}");
        // Capped at 0.9 busy: 0.9 * 0.1 / 0.1 = 0.9 s of wait, times 1.1 / 0.1.
        assert!(t.successors_s <= 0.9 * 11.0 * (1.0 + 1e-6), "{busy}: {t:?}");
    }
}

/// `c` with `blocks` of KV capacity and its resident sessions wanting `resident` of them again.
fn with_sessions(mut c: Candidate, blocks: u32, resident: f32) -> Candidate {
    c.rates.kv_capacity_blocks = blocks;
    c.load.resident_session_blocks = resident;
    c
}

#[test]
fn a_new_session_starts_where_its_footprint_fits_beside_the_resident_ones() {
    // A session's first turn: 150 blocks of a shared system prompt cached on replica 0 (80 ms of
    // prefill at 30k tokens/s), 100 of its own. Both replicas hold 32,768 blocks. The sessions
    // resident on replica 0 will want 32,000 of them again, on replica 1 10,000. The new one is
    // expected to want 2,800 (a context that grows turn by turn).
    let cfg = ScoringConfig::default();
    let crowded = with_sessions(cand(0, 150, 0), 32_768, 32_000.0);
    let roomy = with_sessions(cand(1, 0, 0), 32_768, 10_000.0);
    let mut first_turn = req(250);

    // A one-off request (or a later turn, already placed): nothing to price, the hit wins.
    let d = choose(&cfg, &first_turn, &[crowded, roomy], 1).expect("a decision");
    assert_eq!(d.replica, 0);
    assert_eq!(d.terms.crowding_s, 0.0);

    // A session: on replica 0 it pushes 2,032 blocks of the resident contexts out, which their
    // next turns compute again (1.08 s); on replica 1 it fits.
    first_turn.session_blocks = 2_800.0;
    let d = choose(&cfg, &first_turn, &[crowded, roomy], 1).expect("a decision");
    assert_eq!(d.replica, 1, "{:?}", d.candidates);
    let at = |r: usize| d.candidates[r].terms.crowding_s;
    let expect = (32_000.0 + 2_800.0 - 32_768.0) * f64::from(BS) / cfg.prefill_tokens_per_s;
    assert!((at(0) - expect).abs() < 1e-6, "{}", at(0));
    assert_eq!(at(1), 0.0);
    assert!((d.terms.cost_s - (d.terms.ttft_s + d.terms.harm_s)).abs() < 1e-9);

    // Both full already: the session pushes out as much wherever it goes, the hit decides.
    let full = with_sessions(cand(1, 0, 0), 32_768, 40_000.0);
    let d = choose(&cfg, &first_turn, &[crowded, full], 1).expect("a decision");
    assert_eq!(d.replica, 0, "{:?}", d.candidates);
}

#[test]
fn crowding_charges_only_the_overflow_the_session_adds() {
    let cfg = ScoringConfig::default();
    let mut turn = req(10);
    turn.session_blocks = 1_000.0;
    let per_block = f64::from(BS) / cfg.prefill_tokens_per_s;
    let crowding = |turn: &RequestShape, capacity: u32, resident: f32| {
        predict(
            &cfg,
            turn,
            &with_sessions(cand(0, 0, 0), capacity, resident),
        )
        .crowding_s
    };
    assert_eq!(crowding(&turn, 10_000, 8_000.0), 0.0, "fits");
    assert!((crowding(&turn, 10_000, 9_500.0) - 500.0 * per_block).abs() < 1e-9);
    assert!((crowding(&turn, 10_000, 12_000.0) - 1_000.0 * per_block).abs() < 1e-9);
    assert_eq!(
        crowding(&turn, 0, 12_000.0),
        0.0,
        "unknown capacity: no term"
    );
    for nonsense in [f32::NAN, f32::INFINITY, -5.0] {
        assert!(crowding(&turn, 10_000, nonsense).is_finite());
    }
    turn.session_blocks = f32::NAN;
    assert_eq!(crowding(&turn, 10_000, 12_000.0), 0.0);
}

#[test]
fn of_equally_idle_tied_replicas_the_least_recently_busy_wins_every_draw() {
    // A fleet that has just started: nothing in flight anywhere, no hits, equal predictions
    // (the prefill a replica did recently adds a successor-free request nothing). The one whose
    // prefill did the least recently takes the new request, whatever the seed: the first
    // requests (and the sessions and system prompts they bring) spread over the fleet.
    let cfg = ScoringConfig::default();
    let cands = [
        recently_busy(cand(0, 0, 0), 0.02, 0.05),
        recently_busy(cand(1, 0, 0), 0.0, 0.0),
        recently_busy(cand(2, 0, 0), 0.01, 0.05),
    ];
    for seed in 0..64 {
        let d = choose(&cfg, &req(200), &cands, seed).expect("decision");
        assert_eq!(d.tied, 3, "seed {seed}: {d:?}");
        assert_eq!(d.replica, 1, "seed {seed}");
    }
    // Equally busy: the seed still shares the work.
    let even = [
        recently_busy(cand(0, 0, 0), 0.01, 0.05),
        recently_busy(cand(1, 0, 0), 0.01, 0.05),
        recently_busy(cand(2, 0, 0), 0.01, 0.05),
    ];
    let picked: std::collections::HashSet<u32> = (0..64)
        .map(|seed| {
            choose(&cfg, &req(200), &even, seed)
                .expect("decision")
                .replica
        })
        .collect();
    assert!(picked.len() >= 2, "{picked:?}");
    // A reading that is not a number counts as idle, not as the busiest.
    let nan = [
        recently_busy(cand(0, 0, 0), 0.01, 0.05),
        recently_busy(cand(1, 0, 0), f32::NAN, 0.05),
    ];
    let d = choose(&cfg, &req(200), &nan, 7).expect("decision");
    assert_eq!(d.replica, 1);
}
