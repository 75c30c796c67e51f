//! The routing policies' names (`--policy`) and the state they keep between decisions: session
//! pins and the approx-prefix guesses (TTL maps, bounded).

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvroute_core::router_key::RouterKey;

use crate::config::PolicySection;
use crate::membership::lock;

/// The `--policy` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Exact index + scoring (default).
    #[default]
    Kv,
    /// Round robin over healthy replicas.
    RoundRobin,
    /// Uniform random.
    Random,
    /// Least loaded (in-flight, queue, running, KV usage).
    LeastLoaded,
    /// Session affinity with TTL.
    Session,
    /// Router-side prefix guess from past decisions.
    ApproxPrefix,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "kv" => Policy::Kv,
            "round-robin" => Policy::RoundRobin,
            "random" => Policy::Random,
            "least-loaded" => Policy::LeastLoaded,
            "session" => Policy::Session,
            "approx-prefix" => Policy::ApproxPrefix,
            other => {
                return Err(format!(
                    "unknown policy {other:?} (kv, round-robin, random, least-loaded, session, approx-prefix)"
                ))
            }
        })
    }
}

impl Policy {
    /// The flag spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least-loaded",
            Policy::Session => "session",
            Policy::ApproxPrefix => "approx-prefix",
        }
    }
}

/// Mutable state of the policies.
#[derive(Debug)]
pub struct PolicyState {
    /// Round-robin counter.
    pub rr: AtomicU64,
    /// Per-request seed counter (tie-breaking, random policy).
    seed: AtomicU64,
    /// Session header name (lower case).
    pub session_header: String,
    sessions: Mutex<TtlMap<String, String>>,
    approx: Mutex<ApproxTable>,
}

impl PolicyState {
    /// From the `[policies]` section.
    pub fn new(cfg: &PolicySection) -> Self {
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5eed);
        Self {
            rr: AtomicU64::new(0),
            seed: AtomicU64::new(boot),
            session_header: cfg.session_header.to_ascii_lowercase(),
            sessions: Mutex::new(TtlMap::new(
                Duration::from_millis(cfg.session_ttl_ms),
                cfg.session_max_entries,
            )),
            approx: Mutex::new(ApproxTable::new(
                Duration::from_millis(cfg.approx_ttl_ms),
                cfg.approx_max_entries,
            )),
        }
    }

    /// A fresh seed per request.
    pub fn next_seed(&self) -> u64 {
        self.seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
    }

    /// The replica (name) a session is bound to, if still valid.
    pub fn session_get(&self, model: &str, key: &str) -> Option<String> {
        lock(&self.sessions).get(&format!("{model}\u{0}{key}"), Instant::now())
    }

    /// Binds (or refreshes) a session.
    pub fn session_put(&self, model: &str, key: &str, replica: &str) {
        lock(&self.sessions).put(
            format!("{model}\u{0}{key}"),
            replica.to_string(),
            Instant::now(),
        );
    }

    /// For each replica index id, how many leading `keys` were routed there recently.
    pub fn approx_matches(&self, keys: &[RouterKey]) -> HashMap<u32, u32> {
        lock(&self.approx).matches(keys, Instant::now())
    }

    /// Remembers that `keys` went to `replica`.
    pub fn approx_record(&self, replica: u32, keys: &[RouterKey]) {
        lock(&self.approx).record(replica, keys, Instant::now());
    }

    /// (key, replica) pairs remembered by approx-prefix.
    pub fn approx_len(&self) -> usize {
        lock(&self.approx).len()
    }
}

/// A map whose entries expire, bounded in size (oldest insertions go first).
#[derive(Debug)]
pub struct TtlMap<K, V> {
    ttl: Duration,
    max: usize,
    map: HashMap<K, (V, Instant)>,
    order: VecDeque<(Instant, K)>,
}

impl<K: std::hash::Hash + Eq + Clone, V: Clone> TtlMap<K, V> {
    /// An empty map.
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            ttl,
            max: max.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// The value, if present and not expired.
    pub fn get(&mut self, k: &K, now: Instant) -> Option<V> {
        self.expire(now);
        self.map.get(k).map(|(v, _)| v.clone())
    }

    /// Inserts or refreshes.
    pub fn put(&mut self, k: K, v: V, now: Instant) {
        self.map.insert(k.clone(), (v, now));
        self.order.push_back((now, k));
        self.expire(now);
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, k)) = self.order.front() {
            if now.duration_since(*at) <= self.ttl
                && self.map.len() <= self.max
                && self.order.len() <= self.max * 2
            {
                break;
            }
            let (at, k) = (*at, k.clone());
            self.order.pop_front();
            if self.map.get(&k).is_some_and(|(_, t)| *t == at) {
                self.map.remove(&k);
            }
        }
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// approx-prefix memory: router key -> replicas it was routed to, with expiry.
#[derive(Debug)]
pub struct ApproxTable {
    inner: TtlMap<(u64, u32), ()>,
    by_key: HashMap<u64, Vec<u32>>,
}

impl ApproxTable {
    /// An empty table.
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            inner: TtlMap::new(ttl, max),
            by_key: HashMap::new(),
        }
    }

    fn live(&mut self, key: u64, replica: u32, now: Instant) -> bool {
        self.inner.get(&(key, replica), now).is_some()
    }

    /// Leading matched keys per replica.
    pub fn matches(&mut self, keys: &[RouterKey], now: Instant) -> HashMap<u32, u32> {
        let mut out: HashMap<u32, u32> = HashMap::new();
        let Some(first) = keys.first() else {
            return out;
        };
        let mut alive: Vec<u32> = self.by_key.get(&first.0).cloned().unwrap_or_default();
        alive.retain(|r| self.live(first.0, *r, now));
        for r in &alive {
            out.insert(*r, 1);
        }
        for k in keys.iter().skip(1) {
            if alive.is_empty() {
                break;
            }
            let here = self.by_key.get(&k.0).cloned().unwrap_or_default();
            alive.retain(|r| here.contains(r));
            alive.retain(|r| self.live(k.0, *r, now));
            for r in &alive {
                *out.entry(*r).or_default() += 1;
            }
        }
        // Drop dead replicas from by_key lazily.
        out
    }

    /// Records keys routed to a replica.
    pub fn record(&mut self, replica: u32, keys: &[RouterKey], now: Instant) {
        for k in keys {
            self.inner.put((k.0, replica), (), now);
            let v = self.by_key.entry(k.0).or_default();
            if !v.contains(&replica) {
                v.push(replica);
            }
        }
        // Keep by_key bounded by the live pair count.
        if self.by_key.len() > self.inner.len().saturating_mul(2) + 1024 {
            let inner = &mut self.inner;
            self.by_key.retain(|k, reps| {
                reps.retain(|r| inner.map.contains_key(&(*k, *r)));
                !reps.is_empty()
            });
        }
    }

    /// Live (key, replica) pairs.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approx_counts_leading_keys_and_expires() {
        let mut t = ApproxTable::new(Duration::from_secs(10), 1000);
        let now = Instant::now();
        let keys: Vec<RouterKey> = (1..=4).map(RouterKey).collect();
        t.record(7, &keys[..3], now);
        t.record(8, &keys[..1], now);
        let m = t.matches(&keys, now);
        assert_eq!(m.get(&7), Some(&3));
        assert_eq!(m.get(&8), Some(&1));
        let later = now + Duration::from_secs(11);
        assert!(t.matches(&keys, later).is_empty());
    }

    #[test]
    fn ttl_map_is_bounded() {
        let mut m = TtlMap::new(Duration::from_secs(100), 10);
        let now = Instant::now();
        for i in 0..100 {
            m.put(i, i, now);
        }
        assert!(m.len() <= 10);
        assert_eq!(m.get(&99, now), Some(99));
    }

    #[test]
    fn policy_names_round_trip() {
        for p in [
            "kv",
            "round-robin",
            "random",
            "least-loaded",
            "session",
            "approx-prefix",
        ] {
            assert_eq!(p.parse::<Policy>().unwrap().as_str(), p);
        }
        assert!("nope".parse::<Policy>().is_err());
    }
}
