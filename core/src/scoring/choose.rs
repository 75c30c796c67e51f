//! The decision: every eligible candidate predicted, the cheapest chosen, near-ties broken as
//! the module documentation says ([`choose`]); why ([`DecisionReason`]).

use serde::{Deserialize, Serialize};

use super::config::ScoringConfig;
use super::inputs::{Candidate, MatchedBlocks, RequestShape};
use super::predict::{predict, price_copies, CostTerms};
use crate::rng::SplitMix64;

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
    let mut terms: Vec<CostTerms> = eligible.iter().map(|c| predict(cfg, req, c)).collect();
    price_copies(cfg, req, &eligible, &mut terms);
    let scored: Vec<Scored> = eligible
        .iter()
        .zip(terms)
        .map(|(c, terms)| Scored {
            replica: c.replica,
            terms,
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
    // Among the tied, the one with the fewest requests in flight wins: a random draw among all
    // tied (power of two choices) missed an idle replica beside two busy ones a third of the time.
    // The seed chooses only among equally busy ones, so equal replicas share the work.
    let fewest = tied
        .iter()
        .map(|&i| eligible[i].load.in_flight)
        .min()
        .unwrap_or(0);
    // Among those, the one whose prefill was least busy recently: a fleet that just started
    // spreads its first requests (and the sessions and prefixes they bring) instead of leaving
    // them to the draw.
    let busy = |i: usize| {
        let b = eligible[i].load.recent_prefill_busy;
        if b.is_finite() {
            b.max(0.0)
        } else {
            0.0
        }
    };
    let least_busy = tied
        .iter()
        .copied()
        .filter(|&i| eligible[i].load.in_flight == fewest)
        .map(busy)
        .fold(f32::INFINITY, f32::min);
    let idlest: Vec<usize> = tied
        .iter()
        .copied()
        .filter(|&i| eligible[i].load.in_flight == fewest && busy(i) <= least_busy)
        .collect();
    let pick = match idlest.len() {
        0 => return None,
        1 => idlest[0],
        len => idlest[SplitMix64::new(rng_seed).below(len)],
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
