//! Routing policies besides the default `kv` (exact index + scoring), for comparison and for
//! set-ups that need them:
//!
//! * `round-robin`, `random`, `least-loaded`: ignore the cache;
//! * `session`: requests with the same session key (body `"session"` or a header) stick to one
//!   replica for a TTL; new sessions go to the least-loaded replica;
//! * `approx-prefix`: for engines without KV events, a router-side guess: the router keys of every
//!   routed request are remembered for the replica it went to (TTL, bounded size), and later
//!   requests are scored as if those blocks were cached there.

use std::sync::atomic::Ordering;

use kvroute_core::router_key::RouterKey;
use kvroute_core::scoring::{self, Candidate, Decision, MatchedBlocks};

use crate::lookup::{exact_matches, now_ms, Lookup, RemoteRecord, RoutePolicy};
use crate::membership::Replica;
pub use crate::policy_state::{ApproxTable, Policy, PolicyState, TtlMap};
use crate::state::AppState;

/// The implementation of `policy`.
pub fn route_policy(policy: Policy) -> &'static dyn RoutePolicy {
    match policy {
        Policy::Kv => &KvPolicy,
        Policy::ApproxPrefix => &ApproxPrefixPolicy,
        Policy::RoundRobin => &RoundRobinPolicy,
        Policy::Random => &RandomPolicy,
        Policy::LeastLoaded => &LeastLoadedPolicy,
        Policy::Session => &SessionPolicy,
    }
}

/// `kv`: the exact index and the cost model; predicted entries for the siblings that follow.
struct KvPolicy;

impl RoutePolicy for KvPolicy {
    fn matches(&self, l: &Lookup<'_>) -> Vec<MatchedBlocks> {
        exact_matches(l.state, &l.replicas, l.usable())
    }

    fn choose(&self, l: &Lookup<'_>, c: &[Candidate]) -> Option<(Decision, Option<&'static str>)> {
        scoring::choose(&l.state.config.scoring, &l.shape, c, l.seed).map(|d| (d, None))
    }

    /// Predicts the blocks after the chosen replica's GPU-held prefix ([`Self::shared_keys`]):
    /// the prefix is in the index already, and probing it again for every decision (a prompt of
    /// 48k tokens is 3,000 keys, under the index lock) only found it there.
    fn record(&self, l: &Lookup<'_>, chosen: &Replica, matched: &MatchedBlocks) {
        let (_, keys) = self.shared_keys(l, matched);
        if keys.is_empty() {
            return;
        }
        if let Some(first) = chosen.streams().first() {
            let ttl = l.state.config.index.predicted_ttl_ms;
            l.state
                .index
                .insert_predicted(first.index_id, keys, now_ms(), ttl);
        }
    }

    /// The blocks after the replica's GPU-held prefix: what this gateway and its peers predict
    /// (the GPU prefix is in every exact index already).
    fn shared_keys<'a>(&self, l: &'a Lookup<'_>, m: &MatchedBlocks) -> (u32, &'a [RouterKey]) {
        let usable = l.usable();
        let skip = (m.gpu as usize).min(usable.len());
        (skip as u32, &usable[skip..])
    }

    fn record_remote(&self, state: &AppState, r: &RemoteRecord<'_>) {
        if r.keys.is_empty() {
            return;
        }
        if let Some(first) = r.replica.streams().first() {
            let ttl = state.config.index.predicted_ttl_ms;
            state
                .index
                .insert_predicted(first.index_id, r.keys, now_ms(), ttl);
        }
    }
}

/// `approx-prefix`: the cost model over a router-side guess of what each replica holds.
struct ApproxPrefixPolicy;

impl RoutePolicy for ApproxPrefixPolicy {
    fn matches(&self, l: &Lookup<'_>) -> Vec<MatchedBlocks> {
        let guessed = l.state.policy_state.approx_matches(l.usable());
        l.replicas
            .iter()
            .map(|r| MatchedBlocks {
                gpu: r
                    .index_ids()
                    .iter()
                    .filter_map(|id| guessed.get(id))
                    .copied()
                    .max()
                    .unwrap_or(0),
                ..Default::default()
            })
            .collect()
    }

    fn choose(&self, l: &Lookup<'_>, c: &[Candidate]) -> Option<(Decision, Option<&'static str>)> {
        scoring::choose(&l.state.config.scoring, &l.shape, c, l.seed).map(|d| (d, None))
    }

    fn record(&self, l: &Lookup<'_>, chosen: &Replica, _matched: &MatchedBlocks) {
        if let Some(first) = chosen.streams().first() {
            if !l.usable().is_empty() {
                l.state
                    .policy_state
                    .approx_record(first.index_id, l.usable());
            }
        }
    }

    fn shared_keys<'a>(&self, l: &'a Lookup<'_>, _m: &MatchedBlocks) -> (u32, &'a [RouterKey]) {
        (0, l.usable())
    }

    fn record_remote(&self, state: &AppState, r: &RemoteRecord<'_>) {
        if let Some(first) = r.replica.streams().first() {
            if !r.keys.is_empty() {
                state.policy_state.approx_record(first.index_id, r.keys);
            }
        }
    }
}

struct RoundRobinPolicy;

impl RoutePolicy for RoundRobinPolicy {
    fn choose(&self, l: &Lookup<'_>, c: &[Candidate]) -> Option<(Decision, Option<&'static str>)> {
        let n = l.state.policy_state.rr.fetch_add(1, Ordering::Relaxed);
        scoring::choose_round_robin(c, n).map(|d| (d, None))
    }
}

struct RandomPolicy;

impl RoutePolicy for RandomPolicy {
    fn choose(&self, l: &Lookup<'_>, c: &[Candidate]) -> Option<(Decision, Option<&'static str>)> {
        scoring::choose_random(c, l.seed).map(|d| (d, None))
    }
}

/// `least-loaded`: the cost model as if nothing were cached.
struct LeastLoadedPolicy;

impl RoutePolicy for LeastLoadedPolicy {
    fn choose(&self, l: &Lookup<'_>, c: &[Candidate]) -> Option<(Decision, Option<&'static str>)> {
        scoring::choose_least_loaded(&l.state.config.scoring, &l.shape, c, l.seed)
            .map(|d| (d, None))
    }
}

/// `session`: a known session goes to its replica while healthy; a new one to the least loaded.
struct SessionPolicy;

impl RoutePolicy for SessionPolicy {
    fn choose(&self, l: &Lookup<'_>, c: &[Candidate]) -> Option<(Decision, Option<&'static str>)> {
        let bound = l
            .session
            .and_then(|s| l.state.policy_state.session_get(&l.keys.model.name, s))
            .and_then(|name| l.replicas.iter().position(|r| r.name == name))
            .filter(|&i| c.get(i).is_some_and(|c| c.healthy));
        match bound {
            Some(i) => {
                let mut d = scoring::choose_round_robin(&c[i..=i], 0)?;
                d.replica = i as u32;
                Some((d, Some("session")))
            }
            None => scoring::choose_least_loaded(&l.state.config.scoring, &l.shape, c, l.seed)
                .map(|d| (d, Some("session_new"))),
        }
    }

    fn record(&self, l: &Lookup<'_>, chosen: &Replica, _matched: &MatchedBlocks) {
        if let Some(s) = l.session {
            l.state
                .policy_state
                .session_put(&l.keys.model.name, s, &chosen.name);
        }
    }

    fn record_remote(&self, state: &AppState, r: &RemoteRecord<'_>) {
        if let Some(s) = r.session {
            state.policy_state.session_put(r.model, s, &r.replica.name);
        }
    }
}
