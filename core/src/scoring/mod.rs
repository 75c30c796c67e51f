//! Replica scoring: which replica should serve a request, given how many of its leading blocks each
//! replica already holds (per storage tier) and how loaded each replica is.
//!
//! Pure and allocation-light so the indexer and the Envoy filter (wasm32) can run the same code. It
//! uses only `core` and `alloc` items (no clocks, no threads, no OS randomness: the caller passes the
//! random seed), so it is deterministic and testable.
//!
//! # The cost model (all terms in "blocks of prefill work")
//!
//! For every eligible candidate `i` (healthy; stale ones are penalised):
//!
//! ```text
//! raw_credit_i = gpu*credit_gpu + predicted*credit_predicted + cpu*credit_cpu + storage*credit_storage
//!                (capped at prompt_blocks; zero when the replica is stale and stale_credit is false)
//! load_i       = in_flight*w_in_flight + waiting*w_waiting + running*w_running + kv_usage*w_kv_usage
//! overloaded_i = load_i > overload_factor * mean(load) + overload_slack      -> credit_i = 0
//! decay_i      = 1 / (1 + credit_decay * max(0, load_i - min(load)) / w_in_flight)
//! credit_i     = raw_credit_i * decay_i
//! queue_i      = w_pending_prefill * max(0, pending_prefill_blocks - predicted)
//!                (only when no candidate holds any of the prompt: a pure load decision)
//! cost_i       = w_prefill * (prompt_blocks - credit_i) + load_i + queue_i + (stale ? stale_penalty : 0)
//! ```
//!
//! `queue_i` is the prefill work already routed to the replica and not yet done (uncached blocks of
//! recent decisions, see [`Load::pending_prefill_blocks`]): a request's first token waits for it, and
//! request counts alone cannot see it (a request that prefilled long ago and now decodes counts the
//! same as one whose 8k-token prefill has not started). It refines the load of requests that go by
//! load (nothing cached anywhere). Where a prefix is cached, the load terms, overload breaking and
//! credit decay decide as before: counting the queue there too would push the siblings of a burst
//! away from the replica computing their shared prefix. The term is kept out of `load_i`.
//!
//! The cheapest candidate wins. Candidates whose cost is within `tie_tolerance` of the best are tied
//! and the tie is broken by power-of-two random choices (two distinct tied candidates drawn with the
//! caller's seed, the less loaded of the two wins), so a fleet of idle replicas never sends everything
//! to replica 0. Every term is returned in [`Decision::terms`] for debug logs.
//!
//! See `docs/scoring.md` for the rationale and defaults.

use serde::{Deserialize, Serialize};

/// Every weight of the cost model. `Default` gives the documented defaults (see `docs/scoring.md`).
///
/// Deserialising fills missing fields with their defaults, so a config file may set only some.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Cost of one block of prefill the replica still has to compute. Default 1.0.
    pub w_prefill: f64,
    /// Credit for one leading block held in GPU memory. Default 1.0.
    pub credit_gpu: f64,
    /// Credit for one leading block held in host memory (CPU offload). Default 0.75.
    pub credit_cpu: f64,
    /// Credit for one leading block held on disk / remote storage. Default 0.25.
    pub credit_storage: f64,
    /// Credit for one leading block only predicted (written at decision time for a sibling request,
    /// not yet confirmed by an event). Default 0.9.
    pub credit_predicted: f64,
    /// Load cost of one in-flight request (routed by kvroute, not completed yet). Default 8.0.
    pub w_in_flight: f64,
    /// Load cost of one request waiting in the engine's queue (`vllm:num_requests_waiting`). Default 16.0.
    pub w_waiting: f64,
    /// Load cost of one running request as the engine reports it (`vllm:num_requests_running`).
    /// Default 0.0: in-flight already counts kvroute's own requests, and fresher.
    pub w_running: f64,
    /// Load cost of a full KV cache (`vllm:kv_cache_usage_perc`, 0..1). Default 32.0.
    pub w_kv_usage: f64,
    /// Cost of one block of prefill already routed to the replica and not yet computed
    /// ([`Load::pending_prefill_blocks`]). Default 1.0: the same unit as `w_prefill`, since the
    /// request's first token waits behind that work. 0 disables the term.
    pub w_pending_prefill: f64,
    /// Prefill throughput of one replica, in tokens per second, used by the indexer to estimate when
    /// a routed request's prefill is done (its uncached blocks stop counting as pending then, or at
    /// its completion if sooner). Default 30,000 (a mid-size model on one H100); multiply by
    /// `--time-scale` for `kvroute-sim`.
    pub prefill_tokens_per_s: f64,
    /// A replica whose load exceeds `overload_factor * mean load + overload_slack` loses its cache
    /// credit (affinity broken). Default 1.5. Use a very large value to disable.
    pub overload_factor: f64,
    /// Absolute slack (in load-cost units) added to the overload threshold so that a nearly idle
    /// fleet never counts as overloaded. Default 16.0 (two in-flight requests).
    pub overload_slack: f64,
    /// How fast cache credit decays as a replica's load rises above the least-loaded replica's:
    /// credit is multiplied by `1 / (1 + credit_decay * excess)`, with `excess` in in-flight requests.
    /// Default 0.05 (ten extra in-flight requests keep two thirds of the credit). 0 disables.
    pub credit_decay: f64,
    /// Cost added to a stale replica (its event stream is silent or broken). Default 64.0.
    pub stale_penalty: f64,
    /// Whether a stale replica's matched blocks still earn credit. Default false: the index may be
    /// out of date for it.
    pub stale_credit: bool,
    /// Costs closer than this to the best cost are ties. Default 1e-6.
    pub tie_tolerance: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            w_prefill: 1.0,
            credit_gpu: 1.0,
            credit_cpu: 0.75,
            credit_storage: 0.25,
            credit_predicted: 0.9,
            w_in_flight: 8.0,
            w_waiting: 16.0,
            w_running: 0.0,
            w_kv_usage: 32.0,
            w_pending_prefill: 1.0,
            prefill_tokens_per_s: 30_000.0,
            overload_factor: 1.5,
            overload_slack: 16.0,
            credit_decay: 0.05,
            stale_penalty: 64.0,
            stale_credit: false,
            tie_tolerance: 1e-6,
        }
    }
}

/// Leading blocks of the request a replica holds, split by the tier they would be served from.
///
/// The tiers are disjoint and consecutive: first `gpu` blocks on GPU, then `predicted` blocks only
/// predicted (treated as GPU-to-be), then `cpu` blocks from host memory, then `storage` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MatchedBlocks {
    /// Leading blocks in GPU memory.
    pub gpu: u32,
    /// Blocks after those, in host memory.
    pub cpu: u32,
    /// Blocks after those, on storage.
    pub storage: u32,
    /// Blocks only predicted (sibling of a recent decision), counted after `gpu` and before `cpu`.
    #[serde(default)]
    pub predicted: u32,
}

impl MatchedBlocks {
    /// Total matched blocks over every tier.
    pub fn total(&self) -> u32 {
        self.gpu
            .saturating_add(self.cpu)
            .saturating_add(self.storage)
            .saturating_add(self.predicted)
    }
}

/// A replica's load as the indexer knows it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Load {
    /// Requests routed here and not completed yet.
    pub in_flight: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc` (a fraction 0..1).
    pub kv_usage: f32,
    /// Uncached prompt blocks of requests routed here whose prefill is estimated not to be done yet.
    #[serde(default)]
    pub pending_prefill_blocks: u32,
}

/// One replica the request could go to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The caller's replica index (returned in [`Decision::replica`]).
    pub replica: u32,
    /// Leading blocks of the request this replica holds.
    pub matched: MatchedBlocks,
    /// Its load.
    pub load: Load,
    /// False excludes the replica (failed health checks, draining, removed).
    pub healthy: bool,
    /// True when its event stream is silent or broken: its index entries may be out of date.
    pub stale: bool,
}

/// Why a replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionReason {
    /// The chosen replica holds the most credited prefix and was the cheapest.
    PrefixHit,
    /// No eligible replica holds any prefix of the request: chosen by load.
    Load,
    /// Some replica holds a prefix, but load (or credit decay) made a less-cached replica cheaper.
    LoadOverPrefix,
    /// The replica(s) holding the best prefix were overloaded; their affinity was broken.
    OverloadBrokenAffinity,
    /// Round-robin policy.
    RoundRobin,
    /// Uniform random policy.
    Random,
}

impl DecisionReason {
    /// The stable snake_case name used in responses and metrics labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            DecisionReason::PrefixHit => "prefix_hit",
            DecisionReason::Load => "load",
            DecisionReason::LoadOverPrefix => "load_over_prefix",
            DecisionReason::OverloadBrokenAffinity => "overload_broken_affinity",
            DecisionReason::RoundRobin => "round_robin",
            DecisionReason::Random => "random",
        }
    }
}

impl core::fmt::Display for DecisionReason {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every term of one candidate's cost, for debug logs and explanations.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CostTerms {
    /// Credit before overload and decay (blocks, capped at the prompt's blocks).
    pub raw_credit: f64,
    /// Multiplier from credit decay (1.0 = no decay).
    pub decay: f64,
    /// Credit after overload and decay.
    pub credit: f64,
    /// `w_prefill * (prompt_blocks - credit)`.
    pub prefill_cost: f64,
    /// Load cost.
    pub load_cost: f64,
    /// `w_pending_prefill * max(0, pending_prefill_blocks - predicted)`: prefill queued ahead.
    pub queue_cost: f64,
    /// Stale penalty applied (0 when fresh).
    pub stale_penalty: f64,
    /// Whether the replica was over the overload threshold (credit dropped).
    pub overloaded: bool,
    /// The total cost.
    pub cost: f64,
}

/// The choice and everything that explains it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The chosen candidate's `replica`.
    pub replica: u32,
    /// Why it was chosen.
    pub reason: DecisionReason,
    /// Its total cost.
    pub cost: f64,
    /// Its matched blocks.
    pub matched: MatchedBlocks,
    /// Its cost terms.
    pub terms: CostTerms,
    /// Mean load cost over eligible candidates.
    pub mean_load: f64,
    /// Overload threshold used (load cost above it breaks affinity).
    pub overload_threshold: f64,
    /// Second-cheapest candidate and its cost, if any.
    pub runner_up: Option<(u32, f64)>,
    /// How many candidates were tied at the best cost (1 = no tie).
    pub tied: u32,
    /// How many candidates were eligible (healthy).
    pub eligible: u32,
}

/// A small deterministic generator (SplitMix64) for tie-breaking from the caller's seed.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator starting at `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n` (`n > 0`; returns 0 for `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift reduction: bias is negligible for fleet-sized n.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

impl ScoringConfig {
    /// Load cost of one replica.
    pub fn load_cost(&self, load: &Load) -> f64 {
        let kv = f64::from(load.kv_usage);
        let kv = if kv.is_finite() {
            kv.clamp(0.0, 1.0)
        } else {
            0.0
        };
        f64::from(load.in_flight) * self.w_in_flight
            + f64::from(load.waiting) * self.w_waiting
            + f64::from(load.running) * self.w_running
            + kv * self.w_kv_usage
    }

    /// Cost of the prefill queued ahead of this request on a replica: pending blocks not produced
    /// for this request's own predicted match.
    pub fn queue_cost(&self, load: &Load, matched: &MatchedBlocks) -> f64 {
        let ahead = load
            .pending_prefill_blocks
            .saturating_sub(matched.predicted);
        f64::from(ahead) * self.w_pending_prefill.max(0.0)
    }

    /// Credit (in blocks, capped at `prompt_blocks`) for matched blocks, before overload and decay.
    pub fn raw_credit(&self, matched: &MatchedBlocks, prompt_blocks: u32) -> f64 {
        let c = f64::from(matched.gpu) * self.credit_gpu
            + f64::from(matched.predicted) * self.credit_predicted
            + f64::from(matched.cpu) * self.credit_cpu
            + f64::from(matched.storage) * self.credit_storage;
        c.max(0.0).min(f64::from(prompt_blocks))
    }
}

/// Picks the replica for a request of `prompt_blocks` blocks (use the usable hit blocks, see
/// `hashing::usable_hit_blocks`) among `cands`. Returns `None` when no candidate is healthy.
///
/// Deterministic for a given `rng_seed`; pass a per-request seed (e.g. a request counter mixed with
/// the time) so ties spread across replicas.
pub fn choose(
    cfg: &ScoringConfig,
    prompt_blocks: u32,
    cands: &[Candidate],
    rng_seed: u64,
) -> Option<Decision> {
    let eligible: alloc::vec::Vec<&Candidate> = cands.iter().filter(|c| c.healthy).collect();
    if eligible.is_empty() {
        return None;
    }
    let n = eligible.len() as f64;
    let loads: alloc::vec::Vec<f64> = eligible.iter().map(|c| cfg.load_cost(&c.load)).collect();
    let mean_load = loads.iter().sum::<f64>() / n;
    let min_load = loads.iter().copied().fold(f64::INFINITY, f64::min);
    let overload_threshold = cfg.overload_factor * mean_load + cfg.overload_slack;
    let load_unit = if cfg.w_in_flight > 0.0 {
        cfg.w_in_flight
    } else {
        1.0
    };

    // The queue term refines pure load decisions only (see the module docs).
    let any_credit = eligible
        .iter()
        .any(|c| (!c.stale || cfg.stale_credit) && cfg.raw_credit(&c.matched, prompt_blocks) > 0.0);
    let mut terms: alloc::vec::Vec<CostTerms> = alloc::vec::Vec::with_capacity(eligible.len());
    for (c, &load_cost) in eligible.iter().zip(&loads) {
        let raw_credit = if c.stale && !cfg.stale_credit {
            0.0
        } else {
            cfg.raw_credit(&c.matched, prompt_blocks)
        };
        // Only one replica cannot be "overloaded relative to the fleet".
        let overloaded = eligible.len() > 1 && load_cost > overload_threshold;
        let excess = ((load_cost - min_load) / load_unit).max(0.0);
        let decay = 1.0 / (1.0 + cfg.credit_decay.max(0.0) * excess);
        let credit = if overloaded { 0.0 } else { raw_credit * decay };
        let prefill_cost = cfg.w_prefill * (f64::from(prompt_blocks) - credit).max(0.0);
        let stale_penalty = if c.stale { cfg.stale_penalty } else { 0.0 };
        let queue_cost = if any_credit {
            0.0
        } else {
            cfg.queue_cost(&c.load, &c.matched)
        };
        let cost = prefill_cost + load_cost + queue_cost + stale_penalty;
        terms.push(CostTerms {
            raw_credit,
            decay,
            credit,
            prefill_cost,
            load_cost,
            queue_cost,
            stale_penalty,
            overloaded,
            cost,
        });
    }

    let best_cost = terms.iter().map(|t| t.cost).fold(f64::INFINITY, f64::min);
    let tied: alloc::vec::Vec<usize> = (0..eligible.len())
        .filter(|&i| terms[i].cost <= best_cost + cfg.tie_tolerance)
        .collect();
    let mut rng = SplitMix64::new(rng_seed);
    let pick = match tied.len() {
        0 => return None,
        1 => tied[0],
        len => {
            // Power of two choices among the tied: two distinct draws, the less loaded wins.
            let ia = rng.below(len);
            let mut ib = rng.below(len - 1);
            if ib >= ia {
                ib += 1;
            }
            let (a, b) = (tied[ia], tied[ib]);
            if less_loaded(eligible[b], eligible[a], &loads, b, a) {
                b
            } else {
                a
            }
        }
    };

    let max_raw = terms.iter().map(|t| t.raw_credit).fold(0.0, f64::max);
    let chosen = &terms[pick];
    let reason = if max_raw <= 0.0 {
        DecisionReason::Load
    } else if chosen.raw_credit >= max_raw && chosen.credit > 0.0 {
        DecisionReason::PrefixHit
    } else if terms
        .iter()
        .any(|t| t.raw_credit >= max_raw && t.overloaded)
    {
        DecisionReason::OverloadBrokenAffinity
    } else {
        DecisionReason::LoadOverPrefix
    };

    let runner_up = (0..eligible.len())
        .filter(|&i| i != pick)
        .min_by(|&a, &b| terms[a].cost.total_cmp(&terms[b].cost))
        .map(|i| (eligible[i].replica, terms[i].cost));

    Some(Decision {
        replica: eligible[pick].replica,
        reason,
        cost: chosen.cost,
        matched: eligible[pick].matched,
        terms: *chosen,
        mean_load,
        overload_threshold,
        runner_up,
        tied: tied.len() as u32,
        eligible: eligible.len() as u32,
    })
}

/// Secondary order for tied candidates: lower load cost, then fewer in-flight requests.
fn less_loaded(x: &Candidate, y: &Candidate, loads: &[f64], xi: usize, yi: usize) -> bool {
    match loads[xi].total_cmp(&loads[yi]) {
        core::cmp::Ordering::Less => true,
        core::cmp::Ordering::Greater => false,
        core::cmp::Ordering::Equal => x.load.in_flight < y.load.in_flight,
    }
}

/// Least-loaded policy: ignores cache state; ties broken by power of two choices with `rng_seed`.
pub fn choose_least_loaded(
    cfg: &ScoringConfig,
    cands: &[Candidate],
    rng_seed: u64,
) -> Option<Decision> {
    let stripped: alloc::vec::Vec<Candidate> = cands
        .iter()
        .map(|c| Candidate {
            matched: MatchedBlocks::default(),
            ..*c
        })
        .collect();
    let mut d = choose(cfg, 0, &stripped, rng_seed)?;
    if let Some(c) = cands.iter().find(|c| c.replica == d.replica) {
        d.matched = c.matched;
    }
    Some(d)
}

/// Round-robin policy over healthy candidates: the `counter`-th healthy one (modulo their count).
pub fn choose_round_robin(cands: &[Candidate], counter: u64) -> Option<Decision> {
    let healthy = cands.iter().filter(|c| c.healthy).count();
    if healthy == 0 {
        return None;
    }
    let idx = (counter % healthy as u64) as usize;
    let c = cands.iter().filter(|c| c.healthy).nth(idx)?;
    Some(policy_decision(c, DecisionReason::RoundRobin, healthy))
}

/// Uniform random policy over healthy candidates, from `rng_seed`.
pub fn choose_random(cands: &[Candidate], rng_seed: u64) -> Option<Decision> {
    let healthy = cands.iter().filter(|c| c.healthy).count();
    if healthy == 0 {
        return None;
    }
    let idx = SplitMix64::new(rng_seed).below(healthy);
    let c = cands.iter().filter(|c| c.healthy).nth(idx)?;
    Some(policy_decision(c, DecisionReason::Random, healthy))
}

fn policy_decision(c: &Candidate, reason: DecisionReason, eligible: usize) -> Decision {
    Decision {
        replica: c.replica,
        reason,
        cost: 0.0,
        matched: c.matched,
        terms: CostTerms::default(),
        mean_load: 0.0,
        overload_threshold: 0.0,
        runner_up: None,
        tied: 1,
        eligible: eligible as u32,
    }
}

extern crate alloc;

#[cfg(test)]
mod tests;
