//! Shadow decisions: route requests the filter asked in `mode = "shadow"`. The indexer decides as
//! it would when routing but counts nothing as load on the chosen replica (the request is not
//! sent there) and records no predicted entries; it keeps what it would have chosen, and the
//! completion report tells it where Envoy's own balancer really sent the request and what the
//! engine really reused. Totals per model feed `/metrics` and `assess` (docs/assess.md).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Mutex;

use serde::Serialize;

use crate::membership::lock;
use crate::reuse::{FleetCache, ReuseConfig};

/// Prefix of shadow decision ids (routed ones have none), so a completion finds its table.
const ID_PREFIX: char = 's';

/// What was decided for one shadowed request.
#[derive(Debug, Clone)]
struct Pending {
    model: String,
    /// The endpoint kvroute would have chosen.
    endpoint: String,
    /// Tokens it predicted cached there (all tiers).
    predicted_tokens: u64,
    /// Prompt tokens.
    prompt_tokens: u64,
    /// Of the prompt's leading tokens, those the same session asked for before (what session
    /// affinity alone would find cached); `None` without a session.
    session_tokens: Option<u64>,
    /// Of the prompt's leading tokens, those the model's fleet would still hold had every
    /// shadowed request been routed by prefix (see [`ShadowBook::decided`]).
    retained_tokens: u64,
}

/// A shadow decision to record.
#[derive(Debug, Clone)]
pub struct NewShadow<'a> {
    /// Model.
    pub model: &'a str,
    /// Endpoint chosen.
    pub endpoint: &'a str,
    /// Tokens predicted cached there.
    pub predicted_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The request's session, if any.
    pub session: Option<&'a str>,
    /// The request's usable router keys, in prompt order.
    pub keys: &'a [u64],
    /// Tokens per key.
    pub block_size: u32,
    /// The model's KV blocks over all its replicas (0: unknown).
    pub fleet_capacity_blocks: u64,
}

/// Per model, what the shadow decisions and their completions add up to.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ShadowTotals {
    /// Shadow decisions made.
    pub decisions: u64,
    /// Their completion reports (abandoned ones excluded).
    pub completions: u64,
    /// Completions whose real upstream was the replica kvroute would have chosen.
    pub agreed: u64,
    /// Completions whose real upstream was not reported or is not a known replica.
    pub unknown_upstream: u64,
    /// Completions that carried the engine's `cached_tokens` (the token sums below count these).
    pub measured: u64,
    /// Prompt tokens of the measured completions.
    pub prompt_tokens: u64,
    /// Tokens kvroute predicted cached on the replica it would have chosen.
    pub predicted_hit_tokens: u64,
    /// Tokens the engine the request really reached served from its cache.
    pub actual_cached_tokens: u64,
    /// Sum over requests of max(0, predicted - actual): prefill kvroute would have saved.
    pub would_save_tokens: u64,
    /// Measured completions whose request carried a session.
    pub with_session: u64,
    /// Of `would_save_tokens`, the part within the request's own session's earlier prefix
    /// (session affinity alone would have found it).
    pub would_save_within_session_tokens: u64,
    /// Tokens the fleet would still have held for these requests had every one been routed by
    /// prefix (the fleet as one cache of all its replicas' blocks, fed by the requests
    /// themselves): unlike `predicted_hit_tokens`, which reads what the current balancer left
    /// cached, this counts what prefix routing keeps by not computing a prefix on every replica.
    #[serde(default)]
    pub retained_hit_tokens: u64,
    /// Sum over requests of max(0, retained - actual): the prefill routing by prefix would save,
    /// with what it retains.
    #[serde(default)]
    pub would_save_retained_tokens: u64,
}

/// Shadow decisions awaiting their completion, the session memory, and the totals.
#[derive(Debug)]
pub struct ShadowBook {
    nonce: u32,
    max_pending: usize,
    inner: Mutex<Inner>,
    sessions: Mutex<SessionBlocks>,
    /// Per model: the fleet as one cache, fed with the shadowed prompts' blocks.
    fleets: Mutex<HashMap<String, FleetCache>>,
    /// Bounds of those caches.
    reuse: ReuseConfig,
    totals: Mutex<BTreeMap<String, ShadowTotals>>,
    hasher: std::collections::hash_map::RandomState,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    pending: HashMap<u64, Pending>,
    order: VecDeque<u64>,
}

/// Bounded set of (session, block) pairs seen, oldest forgotten first.
#[derive(Debug, Default)]
struct SessionBlocks {
    seen: HashSet<u64>,
    order: VecDeque<u64>,
}

/// How a completion of a shadow decision was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowOutcome {
    /// Not a decision of this book (unknown or expired id).
    Unknown,
    /// Counted.
    Counted,
}

impl ShadowBook {
    /// An empty book remembering at most `max_pending` decisions and `reuse.max_session_blocks`
    /// (session, block) pairs, following at most `reuse.max_fleet_blocks` blocks per model.
    pub fn new(max_pending: usize, reuse: ReuseConfig) -> Self {
        let hasher = std::collections::hash_map::RandomState::new();
        let nonce = hasher.hash_one((std::process::id(), std::time::Instant::now())) as u32;
        Self {
            nonce,
            max_pending: max_pending.max(1),
            inner: Mutex::new(Inner::default()),
            sessions: Mutex::new(SessionBlocks::default()),
            fleets: Mutex::new(HashMap::new()),
            reuse,
            totals: Mutex::new(BTreeMap::new()),
            hasher,
        }
    }

    /// True when `decision_id` names a shadow decision (of any indexer process).
    pub fn is_shadow_id(decision_id: &str) -> bool {
        decision_id.starts_with(ID_PREFIX)
    }

    /// Records a decision; returns its id. Its prompt's blocks also go through the model's fleet
    /// cache ([`FleetCache::held_prefix`]): what it still held of the prompt is what a router
    /// by prefix would have found, with the retention that routing brings.
    pub fn decided(&self, d: NewShadow<'_>) -> String {
        let session_tokens = d
            .session
            .map(|s| u64::from(self.session_prefix(s, d.keys)) * u64::from(d.block_size));
        let retained_blocks = {
            let mut fleets = lock(&self.fleets);
            if !fleets.contains_key(d.model) {
                fleets.insert(d.model.to_string(), FleetCache::default());
            }
            fleets.get_mut(d.model).map_or(0, |f| {
                f.held_prefix(&self.reuse, d.keys, d.fleet_capacity_blocks)
            })
        };
        let retained_tokens =
            (retained_blocks as u64 * u64::from(d.block_size)).min(d.prompt_tokens);
        let mut inner = lock(&self.inner);
        let seq = inner.next;
        inner.next += 1;
        inner.pending.insert(
            seq,
            Pending {
                model: d.model.to_string(),
                endpoint: d.endpoint.to_string(),
                predicted_tokens: d.predicted_tokens,
                prompt_tokens: d.prompt_tokens,
                session_tokens,
                retained_tokens,
            },
        );
        inner.order.push_back(seq);
        while inner.pending.len() > self.max_pending {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            inner.pending.remove(&old);
        }
        while inner.order.len() > self.max_pending.saturating_mul(2) {
            // Ids of completed decisions linger in the order; drop them in bulk.
            let pending = std::mem::take(&mut inner.pending);
            inner.order.retain(|s| pending.contains_key(s));
            inner.pending = pending;
        }
        drop(inner);
        lock(&self.totals)
            .entry(d.model.to_string())
            .or_default()
            .decisions += 1;
        format!("{ID_PREFIX}{:x}-{seq:x}", self.nonce)
    }

    /// Counts the completion of a shadow decision: `upstream` is the replica endpoint Envoy
    /// really chose (`None`: not reported), `known` tells whether an endpoint is a replica of the
    /// model, `cached_tokens` what that engine served from its cache.
    pub fn completed(
        &self,
        decision_id: &str,
        upstream: Option<&str>,
        known: impl Fn(&str) -> bool,
        cached_tokens: Option<u64>,
        abandoned: bool,
    ) -> ShadowOutcome {
        let Some(seq) = self.parse(decision_id) else {
            return ShadowOutcome::Unknown;
        };
        let Some(p) = lock(&self.inner).pending.remove(&seq) else {
            return ShadowOutcome::Unknown;
        };
        if abandoned {
            return ShadowOutcome::Counted;
        }
        let mut totals = lock(&self.totals);
        let t = totals.entry(p.model.clone()).or_default();
        t.completions += 1;
        match upstream.filter(|u| known(u)) {
            Some(u) if u == p.endpoint => t.agreed += 1,
            Some(_) => {}
            None => t.unknown_upstream += 1,
        }
        if let Some(cached) = cached_tokens {
            let would_save = p.predicted_tokens.saturating_sub(cached);
            t.measured += 1;
            t.prompt_tokens += p.prompt_tokens;
            t.predicted_hit_tokens += p.predicted_tokens;
            t.actual_cached_tokens += cached;
            t.would_save_tokens += would_save;
            t.retained_hit_tokens += p.retained_tokens;
            t.would_save_retained_tokens += p.retained_tokens.saturating_sub(cached);
            if let Some(session) = p.session_tokens {
                t.with_session += 1;
                t.would_save_within_session_tokens += session
                    .min(p.predicted_tokens)
                    .saturating_sub(cached)
                    .min(would_save);
            }
        }
        ShadowOutcome::Counted
    }

    /// The totals, per model.
    pub fn totals(&self) -> BTreeMap<String, ShadowTotals> {
        lock(&self.totals).clone()
    }

    fn parse(&self, id: &str) -> Option<u64> {
        let (nonce, seq) = id.strip_prefix(ID_PREFIX)?.split_once('-')?;
        let nonce = u32::from_str_radix(nonce, 16).ok()?;
        (nonce == self.nonce)
            .then(|| u64::from_str_radix(seq, 16).ok())
            .flatten()
    }

    /// How many leading `keys` this session asked for before; then remembers all of them.
    fn session_prefix(&self, session: &str, keys: &[u64]) -> u32 {
        if self.reuse.max_session_blocks == 0 {
            return 0;
        }
        let pair = |k: u64| {
            let mut h = self.hasher.build_hasher();
            session.hash(&mut h);
            k.hash(&mut h);
            h.finish()
        };
        let mut s = lock(&self.sessions);
        let hashes: Vec<u64> = keys.iter().map(|k| pair(*k)).collect();
        let prefix = hashes.iter().take_while(|h| s.seen.contains(h)).count();
        for h in hashes {
            if s.seen.insert(h) {
                s.order.push_back(h);
            }
        }
        while s.seen.len() > self.reuse.max_session_blocks {
            let Some(old) = s.order.pop_front() else {
                break;
            };
            s.seen.remove(&old);
        }
        u32::try_from(prefix).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide(
        book: &ShadowBook,
        endpoint: &str,
        predicted: u64,
        session: Option<&str>,
        keys: &[u64],
    ) -> String {
        book.decided(NewShadow {
            model: "m",
            endpoint,
            predicted_tokens: predicted,
            prompt_tokens: 64,
            session,
            keys,
            block_size: 16,
            fleet_capacity_blocks: 1_000,
        })
    }

    #[test]
    fn completions_count_agreement_and_what_would_be_saved() {
        let book = ShadowBook::new(16, ReuseConfig::default());
        let a = decide(&book, "10.0.0.1:1", 48, None, &[1, 2, 3, 4]);
        let b = decide(&book, "10.0.0.1:1", 32, None, &[1, 2, 3, 5]);
        assert!(ShadowBook::is_shadow_id(&a));
        let known = |e: &str| e.starts_with("10.0.0.");
        assert_eq!(
            book.completed(&a, Some("10.0.0.2:1"), known, Some(16), false),
            ShadowOutcome::Counted
        );
        book.completed(&b, Some("10.0.0.1:1"), known, Some(32), false);
        assert_eq!(
            book.completed(&b, Some("10.0.0.1:1"), known, Some(32), false),
            ShadowOutcome::Unknown,
            "a decision completes once"
        );
        let t = &book.totals()["m"];
        assert_eq!((t.decisions, t.completions, t.agreed), (2, 2, 1));
        assert_eq!((t.predicted_hit_tokens, t.actual_cached_tokens), (80, 48));
        assert_eq!(
            t.would_save_tokens, 32,
            "48 - 16 on the first, 0 on the second"
        );
        assert_eq!(t.with_session, 0);
        // Routed by prefix, the fleet would have held nothing for the first and 3 blocks of
        // the second: 48 tokens, 16 more than its engine served.
        assert_eq!(
            (t.retained_hit_tokens, t.would_save_retained_tokens),
            (48, 16)
        );
    }

    #[test]
    fn reuse_within_a_session_is_told_from_reuse_across_sessions() {
        let book = ShadowBook::new(16, ReuseConfig::default());
        let known = |_: &str| true;
        // Turn 1 of session x, then turn 2 reuses its 3 blocks; session y shares only block 1.
        let t1 = decide(&book, "r0", 0, Some("x"), &[1, 2, 3]);
        let t2 = decide(&book, "r0", 48, Some("x"), &[1, 2, 3, 4]);
        let y = decide(&book, "r0", 16, Some("y"), &[1, 9]);
        book.completed(&t1, Some("r1"), known, Some(0), false);
        book.completed(&t2, Some("r1"), known, Some(0), false);
        book.completed(&y, Some("r1"), known, Some(0), false);
        let t = &book.totals()["m"];
        assert_eq!(t.would_save_tokens, 64);
        assert_eq!(t.would_save_within_session_tokens, 48);
        assert_eq!(t.with_session, 3);
    }

    #[test]
    fn memory_is_bounded() {
        let book = ShadowBook::new(
            4,
            ReuseConfig {
                max_session_blocks: 8,
                ..ReuseConfig::default()
            },
        );
        let ids: Vec<String> = (0..10)
            .map(|i| decide(&book, "r", 0, Some("s"), &[i, i + 100]))
            .collect();
        assert!(lock(&book.inner).pending.len() <= 4);
        assert!(lock(&book.sessions).seen.len() <= 8);
        assert_eq!(
            book.completed(&ids[0], None, |_| true, None, false),
            ShadowOutcome::Unknown,
            "the oldest was forgotten"
        );
        assert_eq!(
            book.completed(&ids[9], None, |_| true, None, false),
            ShadowOutcome::Counted
        );
        assert_eq!(book.totals()["m"].unknown_upstream, 1);
    }
}
