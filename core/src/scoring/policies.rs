//! The cache-blind policies: least loaded (the model without matches), round robin, random.

use super::{choose, Candidate, CostTerms, Decision, DecisionReason, MatchedBlocks};
use super::{RequestShape, ScoringConfig, SplitMix64};

/// Least-loaded policy: the model's prediction as if nothing were cached anywhere; ties go to the
/// fewest in flight, then to `rng_seed`.
pub fn choose_least_loaded(
    cfg: &ScoringConfig,
    req: &RequestShape,
    cands: &[Candidate],
    rng_seed: u64,
) -> Option<Decision> {
    let blind: Vec<Candidate> = cands
        .iter()
        .map(|c| Candidate {
            matched: MatchedBlocks::default(),
            ..*c
        })
        .collect();
    let mut d = choose(cfg, req, &blind, rng_seed)?;
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
    Some(blind_decision(c, DecisionReason::RoundRobin, healthy))
}

/// Uniform random policy over healthy candidates, from `rng_seed`.
pub fn choose_random(cands: &[Candidate], rng_seed: u64) -> Option<Decision> {
    let healthy = cands.iter().filter(|c| c.healthy).count();
    if healthy == 0 {
        return None;
    }
    let idx = SplitMix64::new(rng_seed).below(healthy);
    let c = cands.iter().filter(|c| c.healthy).nth(idx)?;
    Some(blind_decision(c, DecisionReason::Random, healthy))
}

fn blind_decision(c: &Candidate, reason: DecisionReason, eligible: usize) -> Decision {
    Decision {
        replica: c.replica,
        reason,
        matched: c.matched,
        terms: CostTerms::default(),
        runner_up: None,
        tied: 1,
        eligible: eligible as u32,
        candidates: Vec::new(),
    }
}
