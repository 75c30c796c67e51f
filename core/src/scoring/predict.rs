//! The prediction for one candidate: the time to first token the request would see there, and
//! the slowdown it would cause the requests already running there, in seconds.
//!
//! ```text
//! chunk        = max(max_num_batched_tokens - decoding, block_size)      prefill tokens per step
//! compute(x)   = x / prefill_rate + ceil(x / chunk) * step               x prompt tokens, chunked
//! ahead        = pending_prefill_tokens - its part computed already
//!                + foreign_waiting * mean routed request (uncached)
//! queue_wait   = compute(ahead)
//! prefill      = compute(ahead + uncached) - compute(ahead)
//! tier_load    = cpu_tokens / cpu_load_rate + storage_tokens / storage_load_rate
//! kv_pressure  = the first t from which margin(t) = free + released(t) - grown(t) - need stays
//!                >= 0 for kv_usage_age + queue_wait + prefill (until the first token, counted
//!                from the KV reading), where free is after the queue ahead, released is the
//!                curve of kvroute's running requests' blocks coming back as they finish and
//!                grown the blocks the still-decoding batch adds; without a curve, 0 if the
//!                new blocks fit, else deficit_blocks / used_blocks * remaining_per_running * step
//! ttft         = queue_wait + prefill + tier_load + kv_pressure
//! copied       = longest hit of any candidate - hit                 a prefix another one holds
//! needed       = (uncached - copied) / prefill_rate + min(output, remaining) * per_seq_step
//! slack        = remaining * max(itl_objective - step, 0)     stall a running request absorbs
//! past(s)      = max(s - slack, 0)                            within its ITL objective
//! stalled      = ahead / prefill_rate
//! harm         = decoding * weight * (past(stalled + needed) - past(stalled) + copied / prefill_rate)
//!              + arrival_rate * prefill * (queue_wait + prefill / 2)
//! weight       = ttft_objective / (remaining_per_running * itl_objective)
//! displace     = copied / prefill_rate * cache_fill
//! successors   = expected_successors * wait * (2 - busy) / (1 - busy)
//! wait         = busy * residual / (1 - busy)                 (busy capped at MAX_STATIONARY_BUSY)
//! crowding     = (over(resident + session) - over(resident)) * block_size / prefill_rate
//! over(b)      = max(b - kv_capacity_blocks, 0)
//! cost         = ttft + harm + displace + successors + crowding
//! ```
//!
//! The first harm term is the decoders' share of the prefill's stall. The work some replica must
//! do (`needed`) is counted against their inter-token objective: a running request with
//! `remaining` tokens to go has a budget of `remaining * itl_objective` for them and needs
//! `remaining * step` at the replica's pace, so a stall up to the difference (`slack`) leaves it
//! within its objective. The prefill queued ahead spends that slack first; what this request's
//! stall adds past it is an overrun, weighed as the same share of the TTFT objective as it is of
//! the request's ITL budget. (Taking the mean remaining for every decoder is the approximation:
//! one near its end has less slack, one that has run ahead of its objective more.) A `copied`
//! prefix is work no replica needs to do: its stall is charged in full, from the first second,
//! since the slack it spends is the one the fleet's needed work will want. Set by
//! [`price_copies`], which knows the longest hit; [`predict`] alone counts no copy.
//!
//! The second harm term is the wait this request's prefill adds to the requests that arrive at the
//! replica before it is done: arrivals during `queue_wait + prefill` queue behind it, each delayed
//! by up to `prefill` (those arriving during its own prefill, by half of it on average). Their
//! first token is delayed, so it weighs one for one against this request's.
//!
//! `displace` is what a copy costs the replica's prefix cache: a candidate that does not hold
//! the longest cached prefix computes it again while another replica keeps it, and once its cache
//! is full (`cache_fill` 1) each of those blocks pushes a cached block out, which a later request
//! computes again if it needs it: at most the same prefill once more. Only copies are charged:
//! the blocks every candidate would compute push out as many wherever the request goes, and
//! steering new prefixes by a fill that changes slowly would send every gateway's new prefixes
//! to the same replica. Set by [`price_copies`] once every candidate is predicted.
//!
//! `successors` is what the request's placement costs the turns that will continue it (a
//! session's next turns go wherever its context is): each arrives at a replica whose prefill
//! was recently `busy` that share of the time and waits, on average, Pollaczek-Khinchine's
//! `busy * residual / (1 - busy)` for the prefills it finds there; and its own prefills make
//! the other arrivals there wait longer, by `wait / (1 - busy)` in all per successor (the
//! derivative of that wait in the load it adds). A session's first turn, which a shared system
//! prompt cached on one replica would otherwise send there, prices the queueing its whole
//! session will meet against the prompt's prefill.
//!
//! `crowding` is what a new session's KV footprint does to the sessions already resident at the
//! replica. A session keeps wanting its context back (its next turn is a hit only if the blocks
//! are still there), and it grows turn by turn; `session` and `resident` are the blocks the new
//! session and the resident ones are expected to want again (the caller estimates them from how
//! often requests are continued and by how much). While they fit the replica's KV nothing is
//! lost; past it, LRU pushes out the context of whichever session is idlest, and its next turn
//! computes it again: at least the overflow, once, at the replica's prefill rate. Only the
//! overflow this session adds is charged.

use serde::{Deserialize, Serialize};

use super::config::ScoringConfig;
use super::inputs::{positive, Candidate, KvRelease, Load, ReleasePoint, RequestShape};

/// Every term of one candidate's prediction, in seconds unless named otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CostTerms {
    /// Prompt tokens served from GPU memory (cached or predicted).
    pub gpu_hit_tokens: u64,
    /// Prompt tokens loaded from host memory or storage.
    pub offload_hit_tokens: u64,
    /// Prompt tokens this replica would compute.
    pub uncached_tokens: u64,
    /// Prefill tokens queued ahead of the request there.
    pub ahead_tokens: u64,
    /// Waiting for the prefill ahead of it.
    pub queue_wait_s: f64,
    /// Computing its uncached tokens.
    pub prefill_s: f64,
    /// Loading its host-memory and storage hits.
    pub tier_load_s: f64,
    /// Waiting for KV blocks to free when its blocks do not fit.
    pub kv_pressure_s: f64,
    /// The predicted time to first token: the four terms above.
    pub ttft_s: f64,
    /// The slowdown it adds to the requests decoding there, weighted against one second of wait,
    /// plus the wait it adds to the requests arriving there while it prefills.
    pub harm_s: f64,
    /// The part of `harm_s` that is the wait of later arrivals.
    #[serde(default)]
    pub arrivals_harm_s: f64,
    /// The prefill of the cached blocks its copy of a prefix another candidate holds would push
    /// out of its full cache, were they needed again ([`price_copies`]; 0 while it has room).
    #[serde(default)]
    pub displace_s: f64,
    /// The waits its successors (later requests continuing its prompt) are expected to meet
    /// and cause there.
    #[serde(default)]
    pub successors_s: f64,
    /// The recomputation its session's KV footprint would force on the sessions resident
    /// there, once it no longer fits beside them.
    #[serde(default)]
    pub crowding_s: f64,
    /// `ttft_s + harm_s + displace_s + successors_s + crowding_s`: what the choice minimises.
    pub cost_s: f64,
    /// True when the replica's event stream is stale (its matches were not counted unless
    /// `stale_credit`).
    pub stale: bool,
}

/// The prediction for `c` (which must be healthy; the caller filters).
pub fn predict(cfg: &ScoringConfig, req: &RequestShape, c: &Candidate) -> CostTerms {
    let bs = u64::from(req.block_size.max(1));
    let prompt = u64::from(req.prompt_tokens);
    let trusted = !c.stale || cfg.stale_credit;
    let matched = if trusted {
        c.matched
    } else {
        Default::default()
    };
    // Matches are consecutive tiers; cap them at the usable blocks, fastest tier first.
    let mut left = req.usable_blocks;
    let mut take = |blocks: u32| {
        let t = blocks.min(left);
        left -= t;
        u64::from(t) * bs
    };
    let gpu_hit = take(matched.on_gpu());
    let cpu_hit = take(matched.cpu);
    let storage_hit = take(matched.storage);
    let uncached = prompt.saturating_sub(gpu_hit + cpu_hit + storage_hit);

    let rate = c.rates.prefill_rate_or(cfg.prefill_tokens_per_s);
    let step = c.rates.step_or(cfg.decode_step_s);
    let load = &c.load;
    let decoding = load.decoding();
    let chunk = u64::from(cfg.max_num_batched_tokens)
        .saturating_sub(u64::from(decoding))
        .max(bs);
    let compute = |tokens: u64| -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        tokens as f64 / rate + tokens.div_ceil(chunk) as f64 * step
    };

    // Requests the engine holds waiting beyond kvroute's pending ones (another gateway, a direct
    // client, or kvroute's own whose prefill was estimated done but which wait for KV blocks) are
    // assumed the size of what kvroute sends there (its pending requests, else its requests in
    // flight), or of this one's uncached part when kvroute has none there.
    let foreign = load.waiting.saturating_sub(load.pending_prefill_requests);
    let mean_pending = load.mean_routed_uncached_tokens().unwrap_or(uncached);
    let ahead = load
        .pending_prefill_tokens
        .saturating_sub(load.pending_prefill_done_tokens)
        .saturating_add(u64::from(foreign).saturating_mul(mean_pending));
    let queue_wait_s = compute(ahead);
    let prefill_s = compute(ahead.saturating_add(uncached)) - queue_wait_s;
    let tier_load_s = cpu_hit as f64 / positive(cfg.cpu_load_tokens_per_s, 1.0)
        + storage_hit as f64 / positive(cfg.storage_load_tokens_per_s, 1.0);

    let remaining_per_running = remaining_per_running(cfg, load);
    let kv = KvState::of(c, ahead, bs);
    let kv_pressure_s = match c.load.kv_release.points() {
        [] => kv.drain_wait(req, uncached, remaining_per_running * step),
        release => {
            let age = f64::from(load.kv_usage_age_s);
            let horizon =
                if age.is_finite() { age.max(0.0) } else { 0.0 } + queue_wait_s + prefill_s;
            kv.release_wait(uncached.div_ceil(bs), release, decoding, step, horizon)
        }
    };
    let ttft_s = queue_wait_s + prefill_s + tier_load_s + kv_pressure_s;

    let arrival_rate = if load.arrival_rate_per_s.is_finite() {
        load.arrival_rate_per_s.max(0.0)
    } else {
        0.0
    };
    let arrivals_harm_s = arrival_rate * prefill_s * (queue_wait_s + prefill_s / 2.0);
    let harm_s = decoders_harm(cfg, req, c, ahead, uncached, 0) + arrivals_harm_s;
    let successors_s = successors_wait(req, load);
    let crowding_s = crowding(req, c, rate);

    CostTerms {
        gpu_hit_tokens: gpu_hit,
        offload_hit_tokens: cpu_hit + storage_hit,
        uncached_tokens: uncached,
        ahead_tokens: ahead,
        queue_wait_s,
        prefill_s,
        tier_load_s,
        kv_pressure_s,
        ttft_s,
        harm_s,
        arrivals_harm_s,
        displace_s: 0.0,
        successors_s,
        crowding_s,
        cost_s: ttft_s + harm_s + successors_s + crowding_s,
        stale: c.stale,
    }
}

/// Output tokens each request running at the replica has left, on average.
fn remaining_per_running(cfg: &ScoringConfig, load: &Load) -> f64 {
    if load.in_flight > 0 && load.remaining_output_tokens > 0 {
        (load.remaining_output_tokens as f64 / f64::from(load.in_flight)).max(1.0)
    } else {
        f64::from(cfg.default_remaining_output_tokens.max(1))
    }
}

/// The slowdown the request's prefill and decode at `c` add to the sequences decoding there,
/// weighed against one second of a new request's wait (module docs: `harm`). Of its `uncached`
/// tokens, `copied` are a prefix another candidate holds: work the fleet would not do at all
/// elsewhere, whose stall is charged in full; the rest is work some replica must do, whose
/// stall counts only past the decoders' ITL slack left after the `ahead` tokens queued there.
fn decoders_harm(
    cfg: &ScoringConfig,
    req: &RequestShape,
    c: &Candidate,
    ahead: u64,
    uncached: u64,
    copied: u64,
) -> f64 {
    let rate = c.rates.prefill_rate_or(cfg.prefill_tokens_per_s);
    let step = c.rates.step_or(cfg.decode_step_s);
    let remaining = remaining_per_running(cfg, &c.load);
    // Its decode lengthens each step it shares with a running request, for as long as both run.
    let shared_steps = f64::from(req.output_tokens).min(remaining);
    let needed =
        uncached.saturating_sub(copied) as f64 / rate + shared_steps * cfg.decode_step_per_seq_s;
    let slack = remaining * (cfg.itl_objective_s - step).max(0.0);
    let past = |stall: f64| (stall - slack).max(0.0);
    let stalled = ahead as f64 / rate;
    let weight = cfg.ttft_objective_s / (remaining * cfg.itl_objective_s);
    let per_decoder = past(stalled + needed) - past(stalled) + copied as f64 / rate;
    f64::from(c.load.decoding()) * weight * per_decoder
}

/// Busiest a replica's recent prefill is taken to be in [`successors_wait`]: past it the
/// stationary queue's wait grows without bound, while the queue that is really there is what
/// `queue_wait` already prices.
pub const MAX_STATIONARY_BUSY: f64 = 0.9;

/// The waits the request's successors would meet at the replica, and add to its other arrivals
/// (module docs: `successors`).
fn successors_wait(req: &RequestShape, load: &super::inputs::Load) -> f64 {
    let n = f64::from(req.expected_successors);
    let busy = f64::from(load.recent_prefill_busy);
    let residual = f64::from(load.recent_prefill_residual_s);
    if !(n.is_finite() && n > 0.0 && busy.is_finite() && busy > 0.0 && residual.is_finite()) {
        return 0.0;
    }
    let busy = busy.min(MAX_STATIONARY_BUSY);
    let wait = busy * residual.max(0.0) / (1.0 - busy);
    n * wait * (2.0 - busy) / (1.0 - busy)
}

/// The recomputation the request's session would force at `c` once its footprint no longer
/// fits beside the sessions resident there (module docs: `crowding`).
fn crowding(req: &RequestShape, c: &Candidate, rate: f64) -> f64 {
    let session = f64::from(req.session_blocks);
    let resident = f64::from(c.load.resident_session_blocks);
    let capacity = f64::from(c.rates.kv_capacity_blocks);
    if !(session.is_finite() && session > 0.0 && resident.is_finite() && capacity > 0.0) {
        return 0.0;
    }
    let over = |blocks: f64| (blocks - capacity).max(0.0);
    let resident = resident.max(0.0);
    (over(resident + session) - over(resident)) * f64::from(req.block_size.max(1)) / rate
}

/// Charges each candidate the copy it would make: the cached prefix it lacks against the longest
/// any candidate holds, at its prefill rate, times its cache fill ([`CostTerms::displace_s`]),
/// and the stall that copy adds to its decoders, in full ([`CostTerms::harm_s`]).
/// `terms[i]` belongs to `cands[i]`.
pub fn price_copies(
    cfg: &ScoringConfig,
    req: &RequestShape,
    cands: &[&Candidate],
    terms: &mut [CostTerms],
) {
    let hit = |t: &CostTerms| t.gpu_hit_tokens + t.offload_hit_tokens;
    let longest = terms.iter().map(hit).max().unwrap_or(0);
    for (c, t) in cands.iter().zip(terms.iter_mut()) {
        let fill = if c.load.cache_fill.is_finite() {
            f64::from(c.load.cache_fill).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let copied = longest.saturating_sub(hit(t));
        let rate = c.rates.prefill_rate_or(cfg.prefill_tokens_per_s);
        t.displace_s = copied as f64 / rate * fill;
        t.harm_s = decoders_harm(cfg, req, c, t.ahead_tokens, t.uncached_tokens, copied)
            + t.arrivals_harm_s;
        t.cost_s = t.ttft_s + t.harm_s + t.displace_s + t.successors_s + t.crowding_s;
    }
}

/// A replica's KV blocks as the request would find them: capacity, and what is used once the
/// prefill queued ahead of it (`ahead` tokens: kvroute's pending requests and the engine's other
/// waiting ones) has taken its blocks.
struct KvState {
    capacity: u64,
    used: u64,
    bs: u64,
}

impl KvState {
    fn of(c: &Candidate, ahead: u64, bs: u64) -> Self {
        let capacity = u64::from(c.rates.kv_capacity_blocks);
        let scraped = (c.load.kv_fraction() * capacity as f64).round() as u64;
        let used = scraped.saturating_add(ahead.div_ceil(bs)).min(capacity);
        KvState { capacity, used, bs }
    }

    fn free(&self) -> u64 {
        self.capacity - self.used
    }

    /// Without a release curve: when the request's new blocks (its uncached prompt and its
    /// output) do not fit, it waits for running requests to free theirs, which free `used` blocks
    /// over the time they still decode (`drain_s`), so the deficit takes `deficit / used * drain_s`.
    fn drain_wait(&self, req: &RequestShape, uncached: u64, drain_s: f64) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        let need = uncached.div_ceil(self.bs) + u64::from(req.output_tokens).div_ceil(self.bs);
        if need <= self.free() {
            return 0.0;
        }
        if self.used == 0 {
            // It cannot fit even an empty replica: it will be refused there, whatever the cost.
            return f64::MAX / 4.0;
        }
        (need - self.free()) as f64 / self.used as f64 * drain_s
    }

    /// With the release curve of kvroute's running requests: the engine admits the request when
    /// its `need` prompt blocks are free, and keeps it running if they stay free until its first
    /// token (`horizon` seconds; a batch that runs out of blocks before then preempts, and admits
    /// nothing meanwhile). Blocks come back as the running requests finish, while the batch keeps
    /// growing by one block per `bs` tokens of each sequence still decoding. The margin at `t` is
    /// `free + released(t) - grown(t) - need`; the request waits until the first `t0` from which
    /// it stays non-negative for `horizon`. (A shortfall after the first token preempts whoever
    /// the engine admitted last, wherever this request goes: it is not this request's wait.)
    fn release_wait(
        &self,
        need: u64,
        release: &[ReleasePoint],
        decoding: u32,
        step: f64,
        horizon: f64,
    ) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        if need > self.capacity {
            return f64::MAX / 4.0;
        }
        let per_seq = 1.0 / (self.bs as f64 * step);
        let decoding = f64::from(decoding);
        let base = self.free() as f64 - need as f64;
        // (time, margin) at now and at each point of the curve; constant after the last.
        let mut samples = [(0.0f64, base); KvRelease::MAX_POINTS + 1];
        let (mut t_prev, mut done_prev, mut grown) = (0.0f64, 0.0f64, 0.0f64);
        for (slot, p) in samples[1..].iter_mut().zip(release) {
            let t = f64::from(p.after_s).max(t_prev);
            let done = f64::from(p.requests).max(done_prev);
            // Sequences still decoding fall linearly from one point to the next.
            let before = (decoding - done_prev).max(0.0);
            let after = (decoding - done).max(0.0);
            grown += (before + after) / 2.0 * (t - t_prev) * per_seq;
            *slot = (t, base + f64::from(p.blocks) - grown);
            (t_prev, done_prev) = (t, done);
        }
        let samples = &samples[..=release.len()];
        let horizon = if horizon.is_finite() {
            horizon.max(0.0)
        } else {
            0.0
        };
        // Walk the stretches where the margin is negative, in time order; each one that starts
        // before the current start plus the horizon moves the start to its end. A margin still
        // negative at the curve's last point stays negative.
        let last = samples.len() - 1;
        let mut start = 0.0f64;
        for (i, w) in samples.windows(2).enumerate() {
            let ((t0, m0), (t1, m1)) = (w[0], w[1]);
            if m0 >= 0.0 && m1 >= 0.0 {
                continue;
            }
            let crossing = |from: f64, to: f64| t0 + from / (from - to) * (t1 - t0);
            let neg_from = if m0 < 0.0 { t0 } else { crossing(m0, m1) };
            let neg_to = match (m1 < 0.0, i + 1 == last) {
                (true, true) => f64::INFINITY,
                (true, false) => t1,
                (false, _) => crossing(m0, m1),
            };
            if neg_from > start + horizon {
                break;
            }
            start = start.max(neg_to);
        }
        if start.is_infinite() {
            // Short even when kvroute's requests have finished: others hold the blocks; wait
            // as long again as the curve lasted, at least.
            return samples[last].0.max(f64::MIN_POSITIVE) * 2.0;
        }
        start
    }
}
