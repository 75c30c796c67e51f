use super::*;
use crate::scoring::SplitMix64;

/// An engine following the simulator's step model, scraped every `scrape_s` wall seconds.
struct Engine {
    rate: f64,
    step: f64,
    per_seq: f64,
    totals: EngineTotals,
    rng: SplitMix64,
    /// Decoding sequences: 8 + `extra_decoders` + up to 32 at random.
    extra_decoders: usize,
    /// One step in this many computes a prefill chunk.
    prefill_one_in: usize,
}

impl Engine {
    fn new(rate: f64, step: f64) -> Self {
        Engine {
            rate,
            step,
            per_seq: 0.000_03,
            totals: EngineTotals::default(),
            rng: SplitMix64::new(42),
            extra_decoders: 0,
            prefill_one_in: 6,
        }
    }

    /// The prefill rate a request sees on this engine: its tokens over its step's duration.
    fn effective_rate(&self) -> f64 {
        let mut probe = Engine::new(self.rate, self.step);
        probe.per_seq = self.per_seq;
        probe.extra_decoders = self.extra_decoders;
        probe.prefill_one_in = self.prefill_one_in;
        probe.run(200.0);
        probe.totals.prefill_tokens / probe.totals.prefill_time_s
    }

    /// The mean inter-token latency this engine's steps give (over many steps).
    fn mean_itl(&self) -> f64 {
        let mut probe = Engine::new(self.rate, self.step);
        probe.per_seq = self.per_seq;
        probe.extra_decoders = self.extra_decoders;
        probe.prefill_one_in = self.prefill_one_in;
        probe.run(200.0);
        probe.totals.itl_sum_s / probe.totals.itl_count
    }

    /// Runs steps for `span_s` seconds: each step decodes 8-40 sequences and, one step in six,
    /// computes a prefill chunk of up to 8k tokens.
    fn run(&mut self, span_s: f64) {
        let mut t = 0.0;
        while t < span_s {
            let decoders = (8 + self.extra_decoders + self.rng.below(33)) as f64;
            let prefill = if self.rng.below(self.prefill_one_in) == 0 {
                (256 + self.rng.below(7937)) as f64
            } else {
                0.0
            };
            let dt = self.step + prefill / self.rate + decoders * self.per_seq;
            if prefill > 0.0 {
                self.totals.prefill_tokens += prefill;
                self.totals.prefill_time_s += dt;
                self.totals.prefills += 1.0;
            }
            self.totals.itl_sum_s += dt * decoders;
            self.totals.itl_count += decoders;
            t += dt;
        }
    }
}

fn prior() -> ReplicaRates {
    ReplicaRates {
        prefill_tokens_per_s: 30_000.0,
        decode_step_s: 0.007,
        kv_capacity_blocks: 0,
    }
}

fn within(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= want * tol
}

fn drive(cal: &mut ReplicaCalibration, cfg: &CalibrationConfig, e: &mut Engine, seconds: f64) {
    let scrape = 0.5;
    let mut t = 0.0;
    while t < seconds {
        e.run(scrape);
        cal.observe(cfg, &e.totals, scrape);
        t += scrape;
    }
}

#[test]
fn learns_a_replica_unlike_its_prior() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    assert_eq!(cal.rates(&cfg).prefill_tokens_per_s, 30_000.0);
    let mut e = Engine::new(12_000.0, 0.015);
    e.prefill_one_in = 12;
    drive(&mut cal, &cfg, &mut e, 60.0);
    let r = cal.rates(&cfg);
    assert!(within(r.prefill_tokens_per_s, 12_000.0, 0.10), "{r:?}");
    assert!(
        within(r.prefill_tokens_per_s, e.effective_rate(), 0.05),
        "{r:?}"
    );
    assert!(
        within(r.decode_step_s, e.mean_itl(), 0.10),
        "{r:?} vs {}",
        e.mean_itl()
    );
    assert!(cal.windows() > 10);
}

#[test]
fn relearns_a_replica_that_slowed_down_within_a_minute() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let mut e = Engine::new(30_000.0, 0.006);
    drive(&mut cal, &cfg, &mut e, 60.0);
    assert!(within(cal.rates(&cfg).prefill_tokens_per_s, 30_000.0, 0.10));
    e.rate /= 2.0;
    e.step *= 2.0;
    e.per_seq *= 2.0;
    drive(&mut cal, &cfg, &mut e, 60.0);
    let r = cal.rates(&cfg);
    assert!(within(r.prefill_tokens_per_s, 15_000.0, 0.10), "{r:?}");
    assert!(
        within(r.decode_step_s, e.mean_itl(), 0.10),
        "{r:?} vs {}",
        e.mean_itl()
    );
}

#[test]
fn an_outlier_window_does_not_swing_the_estimate() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let mut e = Engine::new(30_000.0, 0.006);
    drive(&mut cal, &cfg, &mut e, 30.0);
    let before = cal.rates(&cfg);
    // A scrape whose inter-token gaps sum to an hour (a stalled engine, a broken exporter).
    e.run(2.0);
    e.totals.itl_sum_s += 3600.0;
    cal.observe(&cfg, &e.totals, 2.0);
    assert_eq!(cal.outliers(), 1);
    assert_eq!(cal.rates(&cfg).decode_step_s, before.decode_step_s);
}

#[test]
fn a_restart_returns_to_the_prior_and_dead_scrapes_change_nothing() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let mut e = Engine::new(10_000.0, 0.02);
    drive(&mut cal, &cfg, &mut e, 30.0);
    let learned = cal.rates(&cfg);
    assert!(learned.prefill_tokens_per_s < 15_000.0);
    // The same totals again (nothing ran, or the scrape failed and the caller passes the last).
    cal.observe(&cfg, &e.totals, 0.5);
    assert_eq!(cal.rates(&cfg), learned);
    // Counters start again from zero: a new engine process.
    let mut fresh = Engine::new(10_000.0, 0.02);
    fresh.run(0.5);
    cal.observe(&cfg, &fresh.totals, 0.5);
    assert_eq!(cal.windows(), 0);
    assert_eq!(cal.rates(&cfg).prefill_tokens_per_s, 30_000.0);
}

#[test]
fn the_estimates_stay_within_the_bound_of_the_prior() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let mut e = Engine::new(100.0, 2.0);
    drive(&mut cal, &cfg, &mut e, 600.0);
    let r = cal.rates(&cfg);
    assert!(
        r.prefill_tokens_per_s >= 30_000.0 / cfg.bound_factor - 1e-6,
        "{r:?}"
    );
    assert!(r.decode_step_s <= 0.007 * cfg.bound_factor + 1e-12, "{r:?}");
}

#[test]
fn engine_time_is_converted_to_wall_time() {
    let cfg = CalibrationConfig {
        engine_time_scale: 4.0,
        ..CalibrationConfig::default()
    };
    // Prior in wall units for a 4x simulator: 120k tokens/s, 1.75 ms steps.
    let mut cal = ReplicaCalibration::new(ReplicaRates {
        prefill_tokens_per_s: 120_000.0,
        decode_step_s: 0.00175,
        kv_capacity_blocks: 0,
    });
    let mut e = Engine::new(30_000.0, 0.006);
    // 0.5 wall s per scrape is 2 engine s.
    for _ in 0..60 {
        e.run(2.0);
        cal.observe(&cfg, &e.totals, 0.5);
    }
    let r = cal.rates(&cfg);
    assert!(within(r.prefill_tokens_per_s, 120_000.0, 0.10), "{r:?}");
    assert!(within(r.decode_step_s, e.mean_itl() / 4.0, 0.10), "{r:?}");
}

#[test]
fn kv_capacity_comes_from_the_engine() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let t = EngineTotals {
        kv_capacity_blocks: Some(32_768),
        ..EngineTotals::default()
    };
    cal.observe(&cfg, &t, 0.5);
    assert_eq!(cal.rates(&cfg).kv_capacity_blocks, 32_768);
    assert!(CalibrationConfig::default().validate().is_ok());
    let bad = CalibrationConfig {
        half_life_s: -1.0,
        ..CalibrationConfig::default()
    };
    assert_eq!(bad.validate().map_err(|e| e.0), Err("half_life_s"));
}

/// vLLM packs every waiting prompt that fits the step's token budget into one step: each of
/// those prefills records the whole step as its prefill time. On a saturated replica the rate a
/// queued request sees is the engine's throughput, not one prefill's share of a step.
#[test]
fn prefills_sharing_steps_read_the_engines_throughput_not_their_share() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let (rate, step, per_seq) = (30_000.0, 0.006, 0.000_03);
    let (budget, decoders) = (8192.0f64, 24.0);
    let prompt = 400.0;
    let per_step = ((budget - decoders) / prompt).floor();
    let dt = step + per_step * prompt / rate + decoders * per_seq;
    let throughput = per_step * prompt / dt;
    let mut totals = EngineTotals::default();
    let scrape = 0.5;
    let mut clock = 0.0;
    for window in 1..=120 {
        let until = f64::from(window) * scrape;
        while clock + dt <= until {
            totals.prefill_tokens += per_step * prompt;
            totals.prefill_time_s += per_step * dt;
            totals.prefills += per_step;
            totals.itl_sum_s += decoders * dt;
            totals.itl_count += decoders;
            clock += dt;
        }
        // The engine never idles: a step that crosses the scrape lands in the next window.
        cal.observe(&cfg, &totals, scrape);
    }
    let r = cal.rates(&cfg);
    // One prefill's share of a step would read `prompt / dt`, `per_step` (20) times slower.
    assert!(per_step >= 10.0);
    assert!(
        within(r.prefill_tokens_per_s, throughput, 0.10),
        "{r:?} vs {throughput}"
    );
}

/// Data-parallel engines each spend the window: the bound is the window times the engines.
#[test]
fn the_prefill_time_bound_counts_every_engine() {
    let cfg = CalibrationConfig::default();
    let mut cal = ReplicaCalibration::new(prior());
    let mut totals = EngineTotals {
        engines: 2,
        ..EngineTotals::default()
    };
    // Two engines, each prefilling one 3,000-token prompt per 0.1 s without overlap: 60k tokens
    // per second of time in all, 1.0 prefill second per 0.5 s window (twice the window).
    for _ in 0..120 {
        totals.prefill_tokens += 30_000.0;
        totals.prefill_time_s += 1.0;
        totals.prefills += 10.0;
        cal.observe(&cfg, &totals, 0.5);
    }
    let r = cal.rates(&cfg);
    assert!(within(r.prefill_tokens_per_s, 30_000.0, 0.05), "{r:?}");
}

/// `n` calibrations, one per engine, each driven for `seconds` (scraped every 0.5 s).
fn driven(
    cfg: &CalibrationConfig,
    engines: &mut [Engine],
    seconds: f64,
) -> Vec<ReplicaCalibration> {
    engines
        .iter_mut()
        .map(|e| {
            let mut cal = ReplicaCalibration::new(prior());
            drive(&mut cal, cfg, e, seconds);
            cal
        })
        .collect()
}

/// What the indexer scores a replica with: its own windows (if any) after the pool's rates.
fn scored(
    cfg: &CalibrationConfig,
    pool: &RatePool,
    own: Option<&ReplicaCalibration>,
) -> ReplicaRates {
    let model = pool.model_rates(cfg, prior());
    own.map_or(model, |c| c.rates_after(cfg, prior(), model))
}

fn pool_of(cfg: &CalibrationConfig, cals: &[&ReplicaCalibration]) -> RatePool {
    let mut pool = RatePool::default();
    for c in cals {
        pool.add(cfg, c);
    }
    pool
}

#[test]
fn a_replica_without_windows_is_scored_like_its_measured_siblings() {
    let cfg = CalibrationConfig::default();
    let nothing = scored(&cfg, &RatePool::default(), None);
    assert_eq!(nothing.prefill_tokens_per_s, 30_000.0);

    let busy = driven(&cfg, &mut [Engine::new(10_000.0, 0.02)], 30.0);
    // A sibling scraped as often, which ran nothing.
    let mut idle = ReplicaCalibration::new(prior());
    for _ in 0..60 {
        idle.observe(&cfg, &EngineTotals::default(), 0.5);
    }
    // Alone, it would be the prior, three times faster than the sibling measured.
    assert_eq!(idle.rates(&cfg).prefill_tokens_per_s, 30_000.0);
    let pool = pool_of(&cfg, &[&busy[0], &idle]);
    let measured = busy[0].rates(&cfg);
    for own in [Some(&idle), None] {
        let r = scored(&cfg, &pool, own);
        assert!(
            within(r.prefill_tokens_per_s, measured.prefill_tokens_per_s, 0.03)
                && within(r.decode_step_s, measured.decode_step_s, 0.03),
            "{r:?} vs {measured:?}"
        );
    }
}

#[test]
fn a_slower_replica_is_seen_as_such_once_its_windows_outweigh_the_pool() {
    let cfg = CalibrationConfig::default();
    let mut engines = [
        Engine::new(20_000.0, 0.01),
        Engine::new(20_000.0, 0.01),
        Engine::new(20_000.0, 0.01),
        Engine::new(10_000.0, 0.02),
    ];
    let cals = driven(&cfg, &mut engines, 30.0);
    let pool = pool_of(&cfg, &cals.iter().collect::<Vec<_>>());
    let scored: Vec<ReplicaRates> = cals.iter().map(|c| scored(&cfg, &pool, Some(c))).collect();
    // Each as its own windows say (the pool moves it by a few percent at most)...
    for (r, cal) in scored.iter().zip(&cals) {
        let own = cal.rates(&cfg);
        assert!(
            within(r.prefill_tokens_per_s, own.prefill_tokens_per_s, 0.05)
                && within(r.decode_step_s, own.decode_step_s, 0.05),
            "{r:?} vs {own:?}"
        );
    }
    // ... so the slow one stays about half as fast as its siblings.
    assert!(
        scored[3].prefill_tokens_per_s < 0.65 * scored[0].prefill_tokens_per_s
            && scored[3].decode_step_s > 1.7 * scored[0].decode_step_s,
        "{scored:?}"
    );
}

#[test]
fn a_replica_that_stopped_measuring_returns_to_the_model_rates() {
    let cfg = CalibrationConfig::default();
    let mut old = ReplicaCalibration::new(prior());
    let mut slow = Engine::new(10_000.0, 0.02);
    drive(&mut old, &cfg, &mut slow, 30.0);
    // Two minutes without traffic (the router believed it slow): its scrapes go on, its windows
    // age.
    for _ in 0..240 {
        old.observe(&cfg, &slow.totals, 0.5);
    }
    let recent = driven(&cfg, &mut [Engine::new(20_000.0, 0.01)], 150.0);
    let pool = pool_of(&cfg, &[&old, &recent[0]]);
    let want = recent[0].rates(&cfg).prefill_tokens_per_s;
    // On its own windows, unfaded, it would stay at the reading that starved it.
    assert!(old.rates(&cfg).prefill_tokens_per_s < 0.7 * want);
    let r = scored(&cfg, &pool, Some(&old));
    assert!(
        within(r.prefill_tokens_per_s, want, 0.10),
        "{r:?} vs {want}"
    );
}
