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

mod choose;
mod config;
mod inputs;
mod policies;
mod predict;

pub use crate::rng::SplitMix64;
pub use choose::{choose, Decision, DecisionReason, Scored};
pub use config::{ConfigError, ScoringConfig};
pub use inputs::{
    Candidate, KvRelease, Load, MatchedBlocks, ReleasePoint, ReplicaRates, RequestShape,
};
pub use policies::{choose_least_loaded, choose_random, choose_round_robin};
pub use predict::{predict, CostTerms};

#[cfg(test)]
mod tests;
