//! Replica scoring: for every healthy replica, predict the time to first token the request would
//! see there and the slowdown it would cause the requests already running there, in seconds, and
//! pick the cheapest.
//!
//! Pure and allocation-light so the indexer, the benchmark and tests share it; it uses only `core`
//! and `alloc` (no clocks, no threads, no OS randomness: the caller passes the seed), so a decision
//! is a function of its inputs and can be replayed.
//!
//! The inputs are physical: the request's prompt length and what each replica holds of it
//! ([`MatchedBlocks`]), what is already asked of each replica ([`Load`]), and how fast each replica
//! is ([`ReplicaRates`], calibrated online from the engines' own metrics). The terms are in
//! [`predict`]; `docs/scoring.md` derives them.
//!
//! The cheapest candidate wins. Candidates within one engine step of the best cannot be told apart
//! (the engine's time moves in steps): among them the one computing the fewest tokens wins, and
//! a remaining tie is broken by power-of-two random choices (two distinct tied candidates drawn
//! with the caller's seed, the one with fewer in-flight requests wins), so a fleet of idle
//! replicas never sends everything to replica 0. Every candidate's terms are returned in [`Decision::candidates`]
//! for explanations.

mod config;
mod inputs;
mod policies;
mod predict;

pub use crate::rng::SplitMix64;
pub use config::{ConfigError, ScoringConfig};
pub use inputs::{
    Candidate, KvRelease, Load, MatchedBlocks, ReleasePoint, ReplicaRates, RequestShape,
};
pub use policies::{choose_least_loaded, choose_random, choose_round_robin};
pub use predict::{predict, CostTerms};

use serde::{Deserialize, Serialize};

/// Why a replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionReason {
    /// The chosen replica holds the longest prefix and was predicted fastest.
    PrefixHit,
    /// No eligible replica holds any prefix of the request: chosen by predicted wait alone.
    Load,
    /// A replica holding a longer prefix was predicted slower (queue, KV pressure, harm).
    LoadOverPrefix,
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
            DecisionReason::RoundRobin => "round_robin",
            DecisionReason::Random => "random",
        }
    }

    /// Every reason, for metrics that list each.
    pub const ALL: [DecisionReason; 5] = [
        DecisionReason::PrefixHit,
        DecisionReason::Load,
        DecisionReason::LoadOverPrefix,
        DecisionReason::RoundRobin,
        DecisionReason::Random,
    ];
}

impl core::fmt::Display for DecisionReason {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One eligible candidate's prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Scored {
    /// The candidate's `replica`.
    pub replica: u32,
    /// Its terms.
    pub terms: CostTerms,
}

/// The choice and everything that explains it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The chosen candidate's `replica`.
    pub replica: u32,
    /// Why it was chosen.
    pub reason: DecisionReason,
    /// Its matched blocks.
    pub matched: MatchedBlocks,
    /// Its terms (zero for the policies that do not predict).
    pub terms: CostTerms,
    /// Second-cheapest candidate and its cost in seconds, if any.
    pub runner_up: Option<(u32, f64)>,
    /// How many candidates were tied at the best cost (1 = no tie).
    pub tied: u32,
    /// How many candidates were eligible (healthy).
    pub eligible: u32,
    /// Every eligible candidate's prediction, in input order (empty for round robin and random).
    pub candidates: Vec<Scored>,
}

/// Picks the replica for `req` among `cands`. Returns `None` when no candidate is healthy.
///
/// Deterministic for a given `rng_seed`; pass a per-request seed so ties spread across replicas.
pub fn choose(
    cfg: &ScoringConfig,
    req: &RequestShape,
    cands: &[Candidate],
    rng_seed: u64,
) -> Option<Decision> {
    let eligible: Vec<&Candidate> = cands.iter().filter(|c| c.healthy).collect();
    if eligible.is_empty() {
        return None;
    }
    let scored: Vec<Scored> = eligible
        .iter()
        .map(|c| Scored {
            replica: c.replica,
            terms: predict(cfg, req, c),
        })
        .collect();
    let best = (0..scored.len())
        .min_by(|&a, &b| scored[a].terms.cost_s.total_cmp(&scored[b].terms.cost_s))?;
    // The engine moves in steps: predictions closer than one step of the best candidate's engine
    // cannot be told apart. Among them, the one that computes the fewest tokens wins (it leaves
    // the most capacity and KV to the fleet), and only then the replicas' loads break the tie.
    let resolution = eligible[best].rates.step_or(cfg.decode_step_s);
    let within = |i: &usize| scored[*i].terms.cost_s <= scored[best].terms.cost_s + resolution;
    let least_work = (0..scored.len())
        .filter(within)
        .map(|i| scored[i].terms.uncached_tokens)
        .min()
        .unwrap_or(0);
    let tied: Vec<usize> = (0..scored.len())
        .filter(|i| within(i) && scored[*i].terms.uncached_tokens == least_work)
        .collect();
    let pick = match tied.len() {
        0 => return None,
        1 => tied[0],
        len => {
            // Power of two choices among the tied: two distinct draws, the less busy wins.
            let mut rng = SplitMix64::new(rng_seed);
            let ia = rng.below(len);
            let mut ib = rng.below(len - 1);
            if ib >= ia {
                ib += 1;
            }
            let (a, b) = (tied[ia], tied[ib]);
            if eligible[b].load.in_flight < eligible[a].load.in_flight {
                b
            } else {
                a
            }
        }
    };

    let hit = |s: &Scored| s.terms.gpu_hit_tokens + s.terms.offload_hit_tokens;
    let longest = scored.iter().map(hit).max().unwrap_or(0);
    let chosen = scored[pick];
    let reason = if longest == 0 {
        DecisionReason::Load
    } else if hit(&chosen) >= longest {
        DecisionReason::PrefixHit
    } else {
        DecisionReason::LoadOverPrefix
    };
    let runner_up = (0..scored.len())
        .filter(|&i| i != pick)
        .min_by(|&a, &b| scored[a].terms.cost_s.total_cmp(&scored[b].terms.cost_s))
        .map(|i| (scored[i].replica, scored[i].terms.cost_s));

    Some(Decision {
        replica: chosen.replica,
        reason,
        matched: eligible[pick].matched,
        terms: chosen.terms,
        runner_up,
        tied: tied.len() as u32,
        eligible: eligible.len() as u32,
        candidates: scored,
    })
}

#[cfg(test)]
mod tests;
