//! In-flight requests per replica, counted from routing decisions and `POST /v1/complete`.
//!
//! Every decision is keyed by an id this indexer makes ([`DecisionId`]: a per-process nonce and a
//! sequence number), returned in the route answer and echoed by the filter in `/v1/complete`. A
//! client's `x-request-id` is never a key, so colliding client ids cannot merge or release each
//! other's counts, and ids from before a restart match nothing.
//!
//! A decision ends (its replica's in-flight count goes down) at the first of:
//! * its completion (`decision_id`; the predicted hit is then compared with `cached_tokens`);
//! * its abandonment by the filter's `callout_id`, when the client left before the route answer
//!   reached it (an abandon that arrives before its route is remembered for `expiry_floor_ms`, and
//!   that route is then not counted);
//! * its deadline: the request's estimated duration (queued and uncached prefill at the prefill
//!   rate, plus `max_tokens` at the per-request decode rate), clamped to
//!   `[inflight] expiry_floor_ms ..= expiry_cap_ms`, so decisions of a filter that died (VM
//!   crash, Envoy killed) go away on their own;
//! * its eviction, when more than `max_pending` are remembered (earliest deadline first).
//!
//! Decisions of peer gateways (`crate::peers`) are counted the same way ([`LoadTracker::routed_remote`]),
//! keyed by their sender's id, ended by the sender's `Ended` message or their own deadline, and
//! bounded separately (oldest first).
//!
//! Each decision also adds the request's uncached prompt blocks to the replica's pending prefill
//! (`Replica::pending_prefill_blocks`, the scorer's queue term) until the prefill is estimated done
//! (uncached tokens at the configured prefill rate, measured from the later of the decision and the
//! end of the prefill already pending there) or the request ends, whichever comes first.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::scoring::KvRelease;

pub use crate::config::InflightConfig;
use crate::decayed::Decayed;
use crate::membership::{lock, Replica};

/// Longest a decision's prefill is estimated to stay pending, queueing included.
pub const MAX_PREFILL_ESTIMATE: Duration = Duration::from_secs(60);
/// How often the server recomputes the KV release curves ([`LoadTracker::refresh_releases`]).
pub const RELEASE_REFRESH: Duration = Duration::from_millis(100);
/// Curves older than this are recomputed by the decision that reads them (no refresher runs).
pub const RELEASE_STALE: Duration = Duration::from_millis(500);
/// Longest accepted `callout_id`.
pub const MAX_CALLOUT_ID_BYTES: usize = 128;

/// Events per second, an exponentially decayed count over `tau_s` (default 10 s).
#[derive(Debug, Clone)]
pub struct RateMeter {
    tau_s: f64,
    count: Decayed,
}

impl Default for RateMeter {
    fn default() -> Self {
        Self::new(10.0)
    }
}

impl RateMeter {
    /// A meter averaging over about `tau_s` seconds.
    pub fn new(tau_s: f64) -> Self {
        Self {
            tau_s: tau_s.max(f64::MIN_POSITIVE),
            count: Decayed::default(),
        }
    }

    /// Counts one event at `now`.
    pub fn record(&mut self, now: Instant) {
        self.count.add(now, self.tau_s, 1.0);
    }

    /// Events per second at `now`.
    pub fn rate(&self, now: Instant) -> f64 {
        self.count.at(now, self.tau_s) / self.tau_s
    }
}

/// The key of one decision, made by this indexer. Its text form (`"{nonce:08x}-{seq:x}"`) is what
/// the route answer carries as `decision_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DecisionId {
    nonce: u32,
    seq: u64,
}

impl fmt::Display for DecisionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:08x}-{:x}", self.nonce, self.seq)
    }
}

/// What was decided for one request.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The decision's id (a peer's decision has one of this process too, never handed out).
    pub id: DecisionId,
    /// The replica.
    pub replica: Arc<Replica>,
    /// Tokens the index said were cached there (usable hit, all tiers).
    pub predicted_tokens: u64,
    /// When it was routed.
    pub at: Instant,
    /// When it stops counting as in flight without a completion.
    pub deadline: Instant,
    /// Uncached prompt blocks still counted as pending prefill on the replica (0 once released).
    pub prefill_blocks: u32,
    /// How long its prefill was scheduled to take on the replica's queue (counted in the
    /// replica's scheduled prefill time while `prefill_blocks` is).
    prefill_duration: Duration,
    /// Uncached prompt blocks it was routed with (counted in the replica's in-flight uncached
    /// blocks until it ends).
    pub uncached_blocks: u32,
    /// Output tokens it is expected to generate (counted in the replica's remaining output).
    pub output_tokens: u64,
    /// KV blocks it frees when it finishes: its uncached prompt and its output.
    pub freed_blocks: u32,
    /// The time to first token the model predicted, seconds (0 for policies that do not predict).
    pub predicted_ttft_s: f64,
    /// Only the prompt's leading tokens were known (a chat with media): the reported hit is not
    /// compared with `predicted_tokens`.
    pub partial: bool,
    callout: Option<Box<str>>,
    /// For a peer's decision, its key (sender and sender's decision id).
    remote: Option<Box<str>>,
}

/// A decision to record.
#[derive(Debug, Clone)]
pub struct NewDecision {
    /// The chosen replica.
    pub replica: Arc<Replica>,
    /// Tokens predicted cached there.
    pub predicted_tokens: u64,
    /// Uncached prompt blocks (pending prefill).
    pub prefill_blocks: u32,
    /// Estimated prefill time of those blocks.
    pub prefill_time: Duration,
    /// Estimated decode time (see [`InflightConfig::decode_time`]).
    pub decode_time: Duration,
    /// Output tokens expected.
    pub output_tokens: u64,
    /// KV blocks its output takes (`output_tokens` in the model's blocks).
    pub output_blocks: u32,
    /// The predicted time to first token, seconds.
    pub predicted_ttft_s: f64,
    /// The filter's id for this route call (to abandon it before the answer reached it).
    pub callout: Option<String>,
    /// Only the prompt's leading tokens were known (see [`Pending::partial`]).
    pub partial: bool,
}

/// The outcome of [`LoadTracker::routed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routed {
    /// The decision's id.
    pub id: DecisionId,
    /// False when its callout was abandoned before it arrived: nothing was counted.
    pub counted: bool,
}

/// Counters of how decisions ended other than by completion.
#[derive(Debug, Default)]
pub struct LoadStats {
    /// Released at their deadline.
    pub expired: AtomicU64,
    /// Dropped because `max_pending` were remembered.
    pub evicted: AtomicU64,
    /// Released by an abandon (by callout id).
    pub abandoned: AtomicU64,
    /// Abandons that arrived before their route (that route was not counted).
    pub abandoned_before_route: AtomicU64,
    /// Peers' decisions dropped because `[peers] max_remote_pending` were remembered.
    pub remote_evicted: AtomicU64,
}

/// The pending-request table.
#[derive(Debug)]
pub struct LoadTracker {
    cfg: InflightConfig,
    nonce: u32,
    inner: Mutex<Inner>,
    /// Release curves per replica (by name), and when they were computed.
    releases: Mutex<Option<(Instant, HashMap<String, KvRelease>)>>,
    /// How decisions ended other than by completion.
    pub stats: LoadStats,
}

impl Default for LoadTracker {
    fn default() -> Self {
        Self::new(InflightConfig::default())
    }
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    pending: HashMap<u64, Pending>,
    /// (deadline, seq), earliest first; entries of ended decisions are skipped (and compacted).
    deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    /// (estimated prefill end, seq), earliest first.
    prefill_done: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Per replica (by name): when the prefill already routed there is estimated to end.
    busy_until: HashMap<String, Instant>,
    /// Per replica (by name): the summed scheduled time of the prefills still pending there.
    /// They run back to back and end at `busy_until`, so what is left of that time tells how
    /// far the queue has got ([`LoadTracker::pending_prefill_done_blocks`]).
    scheduled: HashMap<String, Duration>,
    /// Callout id -> decision.
    callouts: HashMap<Box<str>, u64>,
    /// Callouts abandoned before their route arrived, with when.
    abandoned: HashMap<Box<str>, Instant>,
    abandoned_order: VecDeque<(Instant, Box<str>)>,
    /// Peer decision key -> decision.
    remote: HashMap<Box<str>, u64>,
    /// Peers' decisions in arrival order (ended ones are skipped and compacted).
    remote_order: VecDeque<u64>,
}

impl LoadTracker {
    /// An empty table.
    pub fn new(cfg: InflightConfig) -> Self {
        use std::hash::BuildHasher;
        let nonce = std::collections::hash_map::RandomState::new()
            .hash_one((std::process::id(), Instant::now())) as u32;
        Self {
            cfg,
            nonce,
            inner: Mutex::new(Inner::default()),
            releases: Mutex::new(None),
            stats: LoadStats::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &InflightConfig {
        &self.cfg
    }

    /// Parses a `decision_id`; `None` when malformed or made by another indexer process.
    pub fn parse_id(&self, text: &str) -> Option<DecisionId> {
        let (nonce, seq) = text.split_once('-')?;
        let nonce = u32::from_str_radix(nonce, 16).ok()?;
        let seq = u64::from_str_radix(seq, 16).ok()?;
        (nonce == self.nonce).then_some(DecisionId { nonce, seq })
    }

    /// Records a routing decision: the replica's in-flight count goes up, and its pending prefill
    /// by `prefill_blocks` for `prefill_time` (queued after the prefill already pending there).
    pub fn routed(&self, d: NewDecision) -> Routed {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        inner.expire(now, &self.cfg, &self.stats);
        let seq = inner.next;
        inner.next += 1;
        let id = DecisionId {
            nonce: self.nonce,
            seq,
        };
        let callout = d
            .callout
            .as_deref()
            .filter(|c| !c.is_empty() && c.len() <= MAX_CALLOUT_ID_BYTES)
            .map(Box::<str>::from);
        if let Some(c) = &callout {
            if inner.abandoned.remove(c).is_some() {
                self.stats
                    .abandoned_before_route
                    .fetch_add(1, Ordering::Relaxed);
                return Routed { id, counted: false };
            }
        }
        if let Some(c) = &callout {
            // A reused callout id (never from one filter VM) keeps only the newest handle; the
            // older decision still ends by its id or its deadline.
            inner.callouts.insert(c.clone(), seq);
        }
        inner.count(id, d, callout, None, now, &self.cfg);
        while inner.pending.len().saturating_sub(inner.remote.len()) > self.cfg.max_pending {
            if !inner.pop_earliest() {
                break;
            }
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        Routed { id, counted: true }
    }

    /// Counts a peer gateway's decision, keyed by `key` (its sender and the sender's decision id),
    /// exactly as a decision of this indexer; at most `max_remote` are remembered (the oldest go
    /// first). Returns false when `key` is already counted (a duplicate delivery).
    pub fn routed_remote(&self, key: &str, d: NewDecision, max_remote: usize) -> bool {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        inner.expire(now, &self.cfg, &self.stats);
        if inner.remote.contains_key(key) {
            return false;
        }
        let seq = inner.next;
        inner.next += 1;
        let id = DecisionId {
            nonce: self.nonce,
            seq,
        };
        let key: Box<str> = key.into();
        inner.remote.insert(key.clone(), seq);
        inner.remote_order.push_back(seq);
        inner.count(id, d, None, Some(key), now, &self.cfg);
        while inner.remote.len() > max_remote {
            let Some(old) = inner.remote_order.pop_front() else {
                break;
            };
            if inner.pending.get(&old).is_some_and(|p| p.remote.is_some())
                && inner.remove(old).is_some()
            {
                self.stats.remote_evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        if inner.remote_order.len() > 2 * inner.remote.len() + 1024 {
            let pending = &inner.pending;
            let live: VecDeque<u64> = inner
                .remote_order
                .iter()
                .copied()
                .filter(|s| pending.get(s).is_some_and(|p| p.remote.is_some()))
                .collect();
            inner.remote_order = live;
        }
        true
    }

    /// Ends a peer's decision by its key; returns it, or `None` when unknown (ended, expired,
    /// evicted, or never received).
    pub fn ended_remote(&self, key: &str) -> Option<Pending> {
        let mut inner = lock(&self.inner);
        inner.expire(Instant::now(), &self.cfg, &self.stats);
        let seq = inner.remote.get(key).copied()?;
        inner.remove(seq)
    }

    /// Peers' decisions currently counted.
    pub fn remote_len(&self) -> usize {
        lock(&self.inner).remote.len()
    }

    /// Releases what is due by `now`: pending prefill estimated done, decisions past their
    /// deadline, old early abandons.
    pub fn expire(&self, now: Instant) {
        lock(&self.inner).expire(now, &self.cfg, &self.stats);
    }

    /// Records a completion; returns the decision it belonged to, or `None` for an unknown id.
    pub fn completed(&self, id: DecisionId) -> Option<Pending> {
        let mut inner = lock(&self.inner);
        inner.expire(Instant::now(), &self.cfg, &self.stats);
        // A peer's decision ends only by its sender's message or its deadline.
        if inner.pending.get(&id.seq)?.remote.is_some() {
            return None;
        }
        inner.remove(id.seq)
    }

    /// Records that the filter's route call `callout` was abandoned before its answer reached the
    /// request. Returns the released decision, or `None` when it has not arrived (yet): then the
    /// route, when it comes, is not counted.
    pub fn abandon_callout(&self, callout: &str) -> Option<Pending> {
        if callout.is_empty() || callout.len() > MAX_CALLOUT_ID_BYTES {
            return None;
        }
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        inner.expire(now, &self.cfg, &self.stats);
        if let Some(seq) = inner.callouts.get(callout).copied() {
            let p = inner.remove(seq);
            if p.is_some() {
                self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            }
            return p;
        }
        if inner.abandoned.contains_key(callout) {
            return None;
        }
        while inner.abandoned.len() >= self.cfg.max_pending {
            let Some((at, c)) = inner.abandoned_order.pop_front() else {
                break;
            };
            if inner.abandoned.get(&c) == Some(&at) {
                inner.abandoned.remove(&c);
            }
        }
        let c: Box<str> = callout.into();
        inner.abandoned.insert(c.clone(), now);
        inner.abandoned_order.push_back((now, c));
        None
    }

    /// When `replica` gets the KV blocks of kvroute's requests back: each decision in flight there
    /// finishes `predicted_ttft_s + output_tokens * step` after it was routed (`step` the replica's
    /// decode step, from `step_s`), freeing its uncached prompt and output blocks. The curves of
    /// every replica are computed in one pass by [`LoadTracker::refresh_releases`], which the
    /// server runs every [`RELEASE_REFRESH`] off the decisions' path (one pass over thousands of
    /// decisions in flight is ~0.25 ms, which a decision paying it would add to its own time);
    /// a decision computes them itself only when they are older than [`RELEASE_STALE`].
    pub fn kv_release(&self, replica: &Replica, step_s: impl Fn(&Replica) -> f64) -> KvRelease {
        let now = Instant::now();
        let mut cache = lock(&self.releases);
        let fresh = cache
            .as_ref()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) < RELEASE_STALE);
        if !fresh {
            *cache = Some((now, self.release_curves(now, step_s)));
        }
        cache
            .as_ref()
            .and_then(|(_, curves)| curves.get(&replica.name).copied())
            .unwrap_or_default()
    }

    /// Computes every replica's release curve now (see [`LoadTracker::kv_release`]).
    pub fn refresh_releases(&self, step_s: impl Fn(&Replica) -> f64) {
        let now = Instant::now();
        // Computed before the cache's lock is taken: decisions keep reading the last curves.
        let curves = self.release_curves(now, step_s);
        *lock(&self.releases) = Some((now, curves));
    }

    fn release_curves(
        &self,
        now: Instant,
        step_s: impl Fn(&Replica) -> f64,
    ) -> HashMap<String, KvRelease> {
        let mut finishes: HashMap<&str, Vec<(f64, u32)>> = HashMap::new();
        let mut steps: HashMap<&str, f64> = HashMap::new();
        let inner = lock(&self.inner);
        for p in inner.pending.values() {
            let name = p.replica.name.as_str();
            let step = *steps.entry(name).or_insert_with(|| step_s(&p.replica));
            let elapsed = now.saturating_duration_since(p.at).as_secs_f64();
            let left = p.predicted_ttft_s.max(0.0) + p.output_tokens as f64 * step - elapsed;
            finishes
                .entry(name)
                .or_default()
                .push((left.max(0.0), p.freed_blocks));
        }
        finishes
            .into_iter()
            .map(|(name, mut f)| (name.to_string(), KvRelease::from_finishes(&mut f)))
            .collect()
    }

    /// Of the prefill kvroute has pending on `replica` (`Replica::pending_prefill_blocks`), the
    /// blocks estimated computed by `now`. The pending prefills were scheduled back to back and
    /// end at the replica's `busy_until`; the share of their scheduled time already behind `now`
    /// is the share of their work done (the head of the queue part way through). Without it, a
    /// request arriving behind a large prefill was predicted to wait for all of it however far
    /// it had got: on the Mooncake trace, decisions predicted >= 0.3 s of queue saw 0.26 s of
    /// TTFT against 0.47 s predicted, and holders gave their prefixes away for it.
    pub fn pending_prefill_done_blocks(&self, replica: &Replica, now: Instant) -> u64 {
        let pending = replica
            .pending_prefill_blocks
            .load(Ordering::Relaxed)
            .max(0) as u64;
        if pending == 0 {
            return 0;
        }
        let inner = lock(&self.inner);
        let left = inner
            .busy_until
            .get(&replica.name)
            .map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
        let Some(scheduled) = inner.scheduled.get(&replica.name).filter(|t| !t.is_zero()) else {
            return 0;
        };
        let left_share = (left.as_secs_f64() / scheduled.as_secs_f64()).clamp(0.0, 1.0);
        // Whole blocks only, rounded towards more work left.
        (pending as f64 * (1.0 - left_share)).floor() as u64
    }

    /// Decisions currently remembered.
    pub fn len(&self) -> usize {
        lock(&self.inner).pending.len()
    }

    /// True when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Releases a decision's in-flight count, expected output and whatever pending prefill it still
/// holds.
fn release(p: &Pending) {
    subtract(&p.replica.in_flight, 1);
    subtract(
        &p.replica.in_flight_uncached_blocks,
        i64::from(p.uncached_blocks),
    );
    subtract(
        &p.replica.remaining_output_tokens,
        i64::try_from(p.output_tokens).unwrap_or(i64::MAX),
    );
    release_prefill(&p.replica, p.prefill_blocks);
}

fn release_prefill(replica: &Replica, blocks: u32) {
    if blocks == 0 {
        return;
    }
    subtract(&replica.pending_prefill_blocks, i64::from(blocks));
    subtract(&replica.pending_prefill_requests, 1);
}

/// Lowers a counter by `by`, never below zero.
fn subtract(counter: &std::sync::atomic::AtomicI64, by: i64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(by).max(0))
    });
}

impl Inner {
    /// Counts one decision: the replica's in-flight count, pending prefill (queued after the
    /// prefill already pending there) and expected output go up until it ends.
    fn count(
        &mut self,
        id: DecisionId,
        d: NewDecision,
        callout: Option<Box<str>>,
        remote: Option<Box<str>>,
        now: Instant,
        cfg: &InflightConfig,
    ) {
        let seq = id.seq;
        let replica = d.replica;
        replica.in_flight.fetch_add(1, Ordering::Relaxed);
        replica
            .in_flight_uncached_blocks
            .fetch_add(i64::from(d.prefill_blocks), Ordering::Relaxed);
        if d.prefill_blocks > 0 {
            replica
                .pending_prefill_blocks
                .fetch_add(i64::from(d.prefill_blocks), Ordering::Relaxed);
            replica
                .pending_prefill_requests
                .fetch_add(1, Ordering::Relaxed);
        }
        replica.remaining_output_tokens.fetch_add(
            i64::try_from(d.output_tokens).unwrap_or(i64::MAX),
            Ordering::Relaxed,
        );
        let start = self
            .busy_until
            .get(&replica.name)
            .copied()
            .filter(|t| *t > now)
            .unwrap_or(now);
        let done = (start + d.prefill_time).min(now + MAX_PREFILL_ESTIMATE);
        self.busy_until.insert(replica.name.clone(), done);
        let prefill_duration = if d.prefill_blocks > 0 {
            self.prefill_done.push(Reverse((done, seq)));
            let duration = done.saturating_duration_since(start);
            *self.scheduled.entry(replica.name.clone()).or_default() += duration;
            duration
        } else {
            Duration::ZERO
        };
        let estimate = done.saturating_duration_since(now) + d.decode_time;
        let deadline = now + estimate.clamp(cfg.floor(), cfg.cap());
        self.deadlines.push(Reverse((deadline, seq)));
        self.pending.insert(
            seq,
            Pending {
                id,
                replica,
                predicted_tokens: d.predicted_tokens,
                at: now,
                deadline,
                prefill_blocks: d.prefill_blocks,
                prefill_duration,
                uncached_blocks: d.prefill_blocks,
                output_tokens: d.output_tokens,
                freed_blocks: d.prefill_blocks.saturating_add(d.output_blocks),
                predicted_ttft_s: d.predicted_ttft_s,
                partial: d.partial,
                callout,
                remote,
            },
        );
    }

    /// Removes and releases one decision.
    fn remove(&mut self, seq: u64) -> Option<Pending> {
        let p = self.pending.remove(&seq)?;
        if let Some(c) = &p.callout {
            if self.callouts.get(c) == Some(&seq) {
                self.callouts.remove(c);
            }
        }
        if let Some(k) = &p.remote {
            if self.remote.get(k) == Some(&seq) {
                self.remote.remove(k);
            }
        }
        self.unschedule(&p.replica.name, p.prefill_blocks, p.prefill_duration);
        release(&p);
        Some(p)
    }

    /// Takes a decision's prefill (`blocks` still pending, scheduled for `duration`) out of its
    /// replica's scheduled time.
    fn unschedule(&mut self, replica: &str, blocks: u32, duration: Duration) {
        if blocks == 0 {
            return;
        }
        if let Some(t) = self.scheduled.get_mut(replica) {
            *t = t.saturating_sub(duration);
            if t.is_zero() {
                self.scheduled.remove(replica);
            }
        }
    }

    /// Ends the live decision with the earliest deadline; false when none is left.
    fn pop_earliest(&mut self) -> bool {
        while let Some(Reverse((_, seq))) = self.deadlines.pop() {
            if self.remove(seq).is_some() {
                return true;
            }
        }
        false
    }

    fn expire(&mut self, now: Instant, cfg: &InflightConfig, stats: &LoadStats) {
        while let Some(Reverse((done, seq))) = self.prefill_done.peek().copied() {
            if done > now {
                break;
            }
            self.prefill_done.pop();
            if let Some(p) = self.pending.get_mut(&seq) {
                let (replica, blocks) = (p.replica.clone(), p.prefill_blocks);
                let duration = p.prefill_duration;
                p.prefill_blocks = 0;
                self.unschedule(&replica.name, blocks, duration);
                release_prefill(&replica, blocks);
            }
        }
        self.busy_until.retain(|_, t| *t > now);
        let busy = &self.busy_until;
        self.scheduled.retain(|name, _| busy.contains_key(name));
        while let Some(Reverse((deadline, seq))) = self.deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            if self.remove(seq).is_some() {
                stats.expired.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Heap entries of decisions that already ended: compact once they outnumber the live ones.
        let live = self.pending.len();
        if self.deadlines.len() > 2 * live + 1024 {
            let pending = &self.pending;
            self.deadlines
                .retain(|Reverse((_, s))| pending.contains_key(s));
        }
        if self.prefill_done.len() > 2 * live + 1024 {
            let pending = &self.pending;
            self.prefill_done
                .retain(|Reverse((_, s))| pending.get(s).is_some_and(|p| p.prefill_blocks > 0));
        }
        let keep = cfg.floor();
        while let Some((at, _)) = self.abandoned_order.front() {
            if now.saturating_duration_since(*at) < keep {
                break;
            }
            if let Some((at, c)) = self.abandoned_order.pop_front() {
                if self.abandoned.get(&c) == Some(&at) {
                    self.abandoned.remove(&c);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_meter_follows_a_steady_rate_and_decays() {
        let mut m = RateMeter::new(10.0);
        let t0 = Instant::now();
        for i in 0..600 {
            m.record(t0 + Duration::from_millis(100 * i));
        }
        let rate = m.rate(t0 + Duration::from_millis(60_000));
        assert!((rate - 10.0).abs() < 0.5, "{rate}");
        let later = m.rate(t0 + Duration::from_secs(90));
        assert!(later < rate * 0.1, "{later}");
        assert_eq!(RateMeter::default().rate(t0), 0.0);
    }
    use crate::config::ReplicaConfig;
    use crate::membership::Fleet;

    fn replica(fleet: &Fleet, name: &str) -> Arc<Replica> {
        let cfg: ReplicaConfig = toml::from_str(&format!(
            "name = \"{name}\"\nhttp = \"127.0.0.1:1\"\nevents = [\"tcp://127.0.0.1:2\"]"
        ))
        .expect("replica config");
        fleet.add("m", cfg).expect("add replica")
    }

    fn pending(r: &Replica) -> i64 {
        r.pending_prefill_blocks.load(Ordering::Relaxed)
    }

    fn in_flight(r: &Replica) -> i64 {
        r.in_flight.load(Ordering::Relaxed)
    }

    fn decision(r: &Arc<Replica>, blocks: u32, prefill: Duration) -> NewDecision {
        NewDecision {
            replica: r.clone(),
            predicted_tokens: 0,
            prefill_blocks: blocks,
            prefill_time: prefill,
            decode_time: Duration::ZERO,
            output_tokens: 100,
            output_blocks: 7,
            predicted_ttft_s: 0.0,
            partial: false,
            callout: None,
        }
    }

    /// Requests a curve counts as releasing blocks.
    fn releasing(t: &LoadTracker, r: &Replica) -> u32 {
        t.kv_release(r, |_| 0.01)
            .points()
            .last()
            .map_or(0, |p| p.requests)
    }

    #[test]
    fn decisions_read_the_refreshed_release_curves_without_recomputing_them() {
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::default();
        t.routed(decision(&r, 10, Duration::from_millis(40)));
        t.refresh_releases(|_| 0.01);
        assert_eq!(releasing(&t, &r), 1);
        // A decision made since is in the next refresh, not in what decisions read until then.
        t.routed(decision(&r, 10, Duration::from_millis(40)));
        assert_eq!(releasing(&t, &r), 1, "read from the last refresh");
        t.refresh_releases(|_| 0.01);
        assert_eq!(releasing(&t, &r), 2);
        // Without a refresher, curves older than RELEASE_STALE are recomputed by the reader.
        t.routed(decision(&r, 10, Duration::from_millis(40)));
        if let (Some((when, _)), Some(at)) = (
            lock(&t.releases).as_mut(),
            Instant::now().checked_sub(RELEASE_STALE),
        ) {
            *when = at;
        }
        assert_eq!(releasing(&t, &r), 3);
    }

    #[test]
    fn pending_prefill_is_released_when_estimated_done_or_completed() {
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::default();
        let a = t.routed(decision(&r, 100, Duration::from_millis(40))).id;
        let b = t.routed(decision(&r, 30, Duration::from_millis(40))).id;
        assert_eq!(pending(&r), 130);
        assert_eq!(in_flight(&r), 2);
        // "b" queues behind "a": estimated done at ~80 ms, "a" at ~40 ms.
        t.expire(Instant::now() + Duration::from_millis(60));
        assert_eq!(pending(&r), 30, "a's prefill is done, b's is still queued");
        assert_eq!(in_flight(&r), 2, "both still in flight");
        // Completing "b" before its estimate releases its prefill and its in-flight count once.
        assert!(t.completed(b).is_some());
        assert_eq!(pending(&r), 0);
        t.expire(Instant::now() + Duration::from_millis(200));
        assert_eq!(pending(&r), 0, "never released twice");
        assert!(t.completed(a).is_some());
        assert!(t.completed(a).is_none(), "a completion counts once");
        assert_eq!(in_flight(&r), 0);
    }

    #[test]
    fn the_head_of_the_prefill_queue_counts_as_part_done() {
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::default();
        let t0 = Instant::now();
        // 100 blocks over 10 s, then 50 more over 5 s behind them: 15 s scheduled.
        let a = t.routed(decision(&r, 100, Duration::from_secs(10))).id;
        t.routed(decision(&r, 50, Duration::from_secs(5)));
        assert_eq!(pending(&r), 150);
        assert!(
            t.pending_prefill_done_blocks(&r, t0) <= 1,
            "nothing done yet"
        );
        // 6 s in: 6 of the 15 scheduled seconds are behind, so 60 of the first 100 blocks.
        let at6 = t.pending_prefill_done_blocks(&r, t0 + Duration::from_secs(6));
        assert!((58..=60).contains(&at6), "{at6}");
        // "a" completing early takes its blocks and its time out: "b" is the queue now and has
        // not started by the schedule (it was to start at 10 s), so none of it counts as done.
        assert!(t.completed(a).is_some());
        assert_eq!(pending(&r), 50);
        let after = t.pending_prefill_done_blocks(&r, t0 + Duration::from_secs(6));
        assert_eq!(
            after, 0,
            "b's 5 s are still all ahead (its end is 9 s away)"
        );
        // Past the schedule's end everything still counted is done (until expired).
        let late = t.pending_prefill_done_blocks(&r, t0 + Duration::from_secs(20));
        assert_eq!(late, 50);
        t.expire(t0 + Duration::from_secs(20));
        assert_eq!(pending(&r), 0);
        assert_eq!(
            t.pending_prefill_done_blocks(&r, t0 + Duration::from_secs(20)),
            0
        );
    }

    #[test]
    fn every_decision_has_its_own_id() {
        // Two requests that a client gave the same x-request-id: two decisions, two releases.
        let fleet = Fleet::new();
        let (r0, r1) = (replica(&fleet, "r0"), replica(&fleet, "r1"));
        let t = LoadTracker::default();
        let a = t.routed(decision(&r0, 50, Duration::from_secs(30))).id;
        let b = t.routed(decision(&r1, 20, Duration::from_secs(30))).id;
        assert_ne!(a, b);
        assert_eq!((in_flight(&r0), in_flight(&r1)), (1, 1));
        assert_eq!((pending(&r0), pending(&r1)), (50, 20));
        assert!(t.completed(a).is_some());
        assert_eq!((in_flight(&r0), in_flight(&r1)), (0, 1), "b still counts");
        assert_eq!(t.parse_id(&b.to_string()), Some(b));
        assert_eq!(t.parse_id("0-1"), None, "another process's id");
        assert_eq!(t.parse_id("garbage"), None);
        assert_eq!(LoadTracker::default().parse_id(&b.to_string()), None);
    }

    #[test]
    fn deadlines_follow_the_request_between_floor_and_cap() {
        let cfg = InflightConfig {
            expiry_floor_ms: 1_000,
            expiry_cap_ms: 10_000,
            decode_tokens_per_s: 100.0,
            ..Default::default()
        };
        assert_eq!(cfg.decode_time(Some(300)), Duration::from_secs(3));
        assert_eq!(
            cfg.decode_time(None),
            Duration::from_secs(10),
            "2048 tokens, capped"
        );
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::new(cfg.clone());
        let short = NewDecision {
            decode_time: cfg.decode_time(Some(10)),
            ..decision(&r, 0, Duration::ZERO)
        };
        let mid = NewDecision {
            decode_time: cfg.decode_time(Some(300)),
            ..decision(&r, 0, Duration::ZERO)
        };
        let long = NewDecision {
            decode_time: cfg.decode_time(Some(1_000_000)),
            ..decision(&r, 0, Duration::ZERO)
        };
        for d in [short, mid, long] {
            assert!(t.routed(d).counted);
        }
        let now = Instant::now();
        assert_eq!(in_flight(&r), 3);
        t.expire(now + Duration::from_millis(1_100));
        assert_eq!(in_flight(&r), 2, "0.1 s of decode: the 1 s floor");
        t.expire(now + Duration::from_millis(3_100));
        assert_eq!(in_flight(&r), 1, "3 s of decode");
        t.expire(now + Duration::from_millis(9_000));
        assert_eq!(in_flight(&r), 1, "10000 s of decode: not yet");
        t.expire(now + Duration::from_millis(10_100));
        assert_eq!(in_flight(&r), 0, "the 10 s cap");
        assert_eq!(t.stats.expired.load(Ordering::Relaxed), 3);
        assert!(t.is_empty());
    }

    #[test]
    fn abandoned_callouts_release_before_or_after_their_route() {
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::default();
        let with = |c: &str| NewDecision {
            callout: Some(c.into()),
            ..decision(&r, 10, Duration::from_secs(5))
        };
        assert!(t.routed(with("c1")).counted);
        assert_eq!(in_flight(&r), 1);
        assert!(t.abandon_callout("c1").is_some());
        assert_eq!((in_flight(&r), pending(&r)), (0, 0));
        // The abandon overtook its route: the route is not counted.
        assert!(t.abandon_callout("c2").is_none());
        assert!(!t.routed(with("c2")).counted);
        assert_eq!(in_flight(&r), 0);
        // ... only once.
        assert!(t.routed(with("c2")).counted);
        assert_eq!(in_flight(&r), 1);
        assert_eq!(t.stats.abandoned_before_route.load(Ordering::Relaxed), 1);
        assert_eq!(t.stats.abandoned.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn peer_decisions_count_end_once_and_are_bounded_apart() {
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::default();
        let local = t.routed(decision(&r, 5, Duration::from_secs(5))).id;
        assert!(t.routed_remote("a/1", decision(&r, 10, Duration::from_secs(5)), 2));
        assert!(
            !t.routed_remote("a/1", decision(&r, 10, Duration::from_secs(5)), 2),
            "a duplicate delivery counts once"
        );
        assert_eq!((in_flight(&r), pending(&r)), (2, 15));
        assert!(t.routed_remote("a/2", decision(&r, 1, Duration::from_secs(5)), 2));
        assert!(t.routed_remote("b/1", decision(&r, 1, Duration::from_secs(5)), 2));
        assert_eq!(t.remote_len(), 2, "the oldest peer decision went");
        assert_eq!(t.stats.remote_evicted.load(Ordering::Relaxed), 1);
        assert!(t.ended_remote("a/1").is_none(), "evicted");
        assert_eq!((in_flight(&r), pending(&r)), (3, 7));
        // A peer's decision is not ended by a local id of the same sequence number.
        let guessed = DecisionId {
            nonce: local.nonce,
            seq: local.seq + 2,
        };
        assert!(t.completed(guessed).is_none());
        assert!(t.ended_remote("a/2").is_some());
        assert!(t.ended_remote("a/2").is_none(), "ends once");
        assert!(t.completed(local).is_some());
        assert_eq!((in_flight(&r), pending(&r)), (1, 1));
        t.expire(Instant::now() + Duration::from_secs(31));
        assert_eq!(
            (in_flight(&r), t.remote_len()),
            (0, 0),
            "peer decisions expire too"
        );
    }

    #[test]
    fn the_table_is_bounded() {
        let cfg = InflightConfig {
            max_pending: 3,
            ..Default::default()
        };
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::new(cfg);
        let ids: Vec<DecisionId> = (0..5)
            .map(|_| t.routed(decision(&r, 1, Duration::from_secs(1))).id)
            .collect();
        assert_eq!(t.len(), 3);
        assert_eq!(in_flight(&r), 3);
        assert_eq!(pending(&r), 3);
        assert!(
            t.completed(ids[0]).is_none(),
            "the earliest deadline went first"
        );
        for i in 0..10 {
            let _ = t.abandon_callout(&format!("x{i}"));
            let _ = t.abandon_callout("again");
        }
        let inner = lock(&t.inner);
        assert!(inner.abandoned.len() <= 3 && inner.abandoned_order.len() <= 3);
        drop(inner);
        for id in &ids[2..] {
            assert!(t.completed(*id).is_some());
        }
        assert_eq!((in_flight(&r), pending(&r)), (0, 0));
    }
}
