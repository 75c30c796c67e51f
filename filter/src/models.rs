//! Per-plugin model registry: which models have a tokenizer ready, which are loading, which failed
//! (and when to retry), which the indexer does not know. Pure state machine; time is passed in.
//!
//! Only models the indexer knows take one of the `max_models` slots: a name seen for the first
//! time is a *probe* (at most `max_probes` at once, outside the slots) until the indexer answers
//! with its tokenizer. Negative answers go to a small bounded cache with expiry, never to the
//! slots, so bogus names cannot lock out a model added later. Names longer than
//! `max_name_bytes` are unknown at once, without a lookup.

use std::collections::HashMap;
use std::sync::Arc;

/// Where one model in a slot stands.
#[derive(Debug)]
enum State<T> {
    /// A fetch should start at the next tick.
    Wanted,
    /// A fetch is in flight (started at this time, ms).
    Loading { since_ms: u64 },
    /// Ready to route.
    Ready(Arc<T>),
    /// The last fetch failed; retry at `retry_at_ms`.
    Failed { retry_at_ms: u64 },
    /// The indexer does not know this configured model; ask again after `until_ms`.
    Unknown { until_ms: u64 },
}

#[derive(Debug)]
struct Entry<T> {
    state: State<T>,
    /// Delay used after the last failure (doubles per consecutive failure).
    last_backoff_ms: Option<u64>,
    /// Listed in the configuration (kept when the indexer does not know it).
    configured: bool,
}

/// A discovered name waiting for the indexer's answer.
#[derive(Debug, Clone, Copy)]
enum Probe {
    /// The fetch should start at the next tick.
    Wanted,
    /// The fetch is in flight (started at this time, ms).
    Loading { since_ms: u64 },
}

/// A remembered negative answer.
#[derive(Debug, Clone, Copy)]
struct Negative {
    /// Forgotten at this time (ms).
    until_ms: u64,
    /// The indexer said it does not know the name (else its fetch failed: retry later).
    unknown: bool,
}

/// The answer to "can this model be routed now?".
#[derive(Debug)]
pub enum Lookup<T> {
    /// Yes, with this tokenizer.
    Ready(Arc<T>),
    /// Not yet (loading or retrying): fail open as `tokenizer_not_ready`.
    NotReady,
    /// Never heard of it (or the name is too long): fail open as `unknown_model`.
    Unknown,
}

/// Registry policy.
#[derive(Debug, Clone)]
pub struct RegistryPolicy {
    /// Fetch models that were not configured, on first use.
    pub discover: bool,
    /// Most models held (slots: configured models plus discovered models the indexer knows).
    pub max_models: usize,
    /// Most discovered names asked about at once.
    pub max_probes: usize,
    /// Most negative answers remembered.
    pub max_negative: usize,
    /// Longest name looked up (bytes).
    pub max_name_bytes: usize,
    /// First retry delay (ms).
    pub initial_backoff_ms: u64,
    /// Retry delay cap (ms).
    pub max_backoff_ms: u64,
    /// How long an unknown model stays unknown (ms).
    pub unknown_ttl_ms: u64,
    /// A fetch in flight longer than this is considered lost and retried (ms).
    pub loading_timeout_ms: u64,
}

/// The registry.
#[derive(Debug)]
pub struct ModelRegistry<T> {
    policy: RegistryPolicy,
    entries: HashMap<String, Entry<T>>,
    probes: HashMap<String, Probe>,
    negative: HashMap<String, Negative>,
}

impl<T> ModelRegistry<T> {
    /// A registry that will fetch each of `configured` at the first tick.
    pub fn new(policy: RegistryPolicy, configured: impl IntoIterator<Item = String>) -> Self {
        let entries = configured
            .into_iter()
            .map(|m| {
                (
                    m,
                    Entry {
                        state: State::Wanted,
                        last_backoff_ms: None,
                        configured: true,
                    },
                )
            })
            .collect();
        Self {
            policy,
            entries,
            probes: HashMap::new(),
            negative: HashMap::new(),
        }
    }

    /// Whether `model` can be routed now; a new name (when discovery is on and a slot is free)
    /// is queued for a lookup at the indexer.
    pub fn lookup(&mut self, model: &str, now_ms: u64) -> Lookup<T> {
        if model.len() > self.policy.max_name_bytes {
            return Lookup::Unknown;
        }
        if let Some(e) = self.entries.get_mut(model) {
            return match &e.state {
                State::Ready(t) => Lookup::Ready(Arc::clone(t)),
                State::Unknown { until_ms } if now_ms < *until_ms => Lookup::Unknown,
                State::Unknown { .. } => {
                    e.state = State::Wanted;
                    Lookup::NotReady
                }
                _ => Lookup::NotReady,
            };
        }
        if let Some(n) = self.negative.get(model).copied() {
            if now_ms < n.until_ms {
                return if n.unknown {
                    Lookup::Unknown
                } else {
                    Lookup::NotReady
                };
            }
            self.negative.remove(model);
        }
        if self.probes.contains_key(model) {
            return Lookup::NotReady;
        }
        if !self.policy.discover || self.entries.len() >= self.policy.max_models {
            return Lookup::Unknown;
        }
        if self.probes.len() >= self.policy.max_probes {
            return Lookup::NotReady;
        }
        self.probes.insert(model.to_string(), Probe::Wanted);
        Lookup::NotReady
    }

    /// Models whose fetch should start now; they are marked loading.
    pub fn due_fetches(&mut self, now_ms: u64) -> Vec<String> {
        let timeout = self.policy.loading_timeout_ms;
        let lost = |since_ms: u64| now_ms.saturating_sub(since_ms) > timeout;
        let mut due = Vec::new();
        for (name, e) in self.entries.iter_mut() {
            let go = match e.state {
                State::Wanted => true,
                State::Failed { retry_at_ms } => now_ms >= retry_at_ms,
                State::Loading { since_ms } => lost(since_ms),
                State::Ready(_) | State::Unknown { .. } => false,
            };
            if go {
                e.state = State::Loading { since_ms: now_ms };
                due.push(name.clone());
            }
        }
        for (name, p) in self.probes.iter_mut() {
            let go = match *p {
                Probe::Wanted => true,
                Probe::Loading { since_ms } => lost(since_ms),
            };
            if go {
                *p = Probe::Loading { since_ms: now_ms };
                due.push(name.clone());
            }
        }
        due.sort();
        due
    }

    /// The earliest time (ms) [`ModelRegistry::due_fetches`] will return a model: 0 when one is
    /// wanted now, a failed fetch's retry, a fetch in flight's timeout. `None` when only a lookup
    /// can make a fetch due (every model ready or unknown to the indexer, no probe).
    pub fn next_fetch_ms(&self) -> Option<u64> {
        let lost_at = |since_ms: u64| {
            since_ms
                .saturating_add(self.policy.loading_timeout_ms)
                .saturating_add(1)
        };
        let entries = self.entries.values().filter_map(|e| match e.state {
            State::Wanted => Some(0),
            State::Failed { retry_at_ms } => Some(retry_at_ms),
            State::Loading { since_ms } => Some(lost_at(since_ms)),
            State::Ready(_) | State::Unknown { .. } => None,
        });
        let probes = self.probes.values().map(|p| match *p {
            Probe::Wanted => 0,
            Probe::Loading { since_ms } => lost_at(since_ms),
        });
        entries.chain(probes).min()
    }

    /// The fetch succeeded. Returns false when the model was a probe and no slot is free (the
    /// tokenizer is dropped; the name is asked about again later).
    pub fn loaded(&mut self, model: &str, t: T) -> bool {
        self.probes.remove(model);
        self.negative.remove(model);
        if let Some(e) = self.entries.get_mut(model) {
            e.state = State::Ready(Arc::new(t));
            e.last_backoff_ms = None;
            return true;
        }
        if self.entries.len() >= self.policy.max_models {
            return false;
        }
        self.entries.insert(
            model.to_string(),
            Entry {
                state: State::Ready(Arc::new(t)),
                last_backoff_ms: None,
                configured: false,
            },
        );
        true
    }

    /// The fetch failed; schedules a retry with exponential backoff and returns the delay (ms).
    /// A probe leaves the probes and is not asked about again before the delay.
    pub fn failed(&mut self, model: &str, now_ms: u64) -> u64 {
        let (initial, max) = (self.policy.initial_backoff_ms, self.policy.max_backoff_ms);
        let Some(e) = self.entries.get_mut(model) else {
            self.probes.remove(model);
            self.remember(model, now_ms, now_ms.saturating_add(initial), false);
            return initial;
        };
        let backoff = e
            .last_backoff_ms
            .map(|b| b.saturating_mul(2))
            .unwrap_or(initial)
            .min(max);
        e.state = State::Failed {
            retry_at_ms: now_ms.saturating_add(backoff),
        };
        e.last_backoff_ms = Some(backoff);
        backoff
    }

    /// The indexer does not know `model`: a configured model is asked about again after
    /// `unknown_ttl_ms`; any other name leaves the slots and probes for the negative cache.
    pub fn unknown(&mut self, model: &str, now_ms: u64) {
        let until_ms = now_ms.saturating_add(self.policy.unknown_ttl_ms);
        self.probes.remove(model);
        if let Some(e) = self.entries.get_mut(model) {
            if e.configured {
                e.state = State::Unknown { until_ms };
                return;
            }
            self.entries.remove(model);
        }
        self.remember(model, now_ms, until_ms, true);
    }

    /// Stores a negative answer, forgetting expired ones, then the soonest to expire, when full.
    fn remember(&mut self, model: &str, now_ms: u64, until_ms: u64, unknown: bool) {
        if self.policy.max_negative == 0 {
            return;
        }
        if !self.negative.contains_key(model) && self.negative.len() >= self.policy.max_negative {
            self.negative.retain(|_, n| n.until_ms > now_ms);
            if self.negative.len() >= self.policy.max_negative {
                if let Some(oldest) = self
                    .negative
                    .iter()
                    .min_by_key(|(_, n)| n.until_ms)
                    .map(|(k, _)| k.clone())
                {
                    self.negative.remove(&oldest);
                }
            }
        }
        self.negative
            .insert(model.to_string(), Negative { until_ms, unknown });
    }

    /// Number of ready models.
    pub fn ready_count(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e.state, State::Ready(_)))
            .count()
    }

    /// Slots taken, probes in flight or queued, negative answers held.
    pub fn sizes(&self) -> (usize, usize, usize) {
        (self.entries.len(), self.probes.len(), self.negative.len())
    }
}

/// A model name for a log line: at most 64 bytes of it, then its length.
pub fn log_name(model: &str) -> String {
    const SHOWN: usize = 64;
    if model.len() <= SHOWN {
        return format!("{model:?}");
    }
    let mut cut = SHOWN;
    while !model.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{:?}... ({} bytes)", &model[..cut], model.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(discover: bool) -> RegistryPolicy {
        RegistryPolicy {
            discover,
            max_models: 2,
            max_probes: 2,
            max_negative: 3,
            max_name_bytes: 16,
            initial_backoff_ms: 100,
            max_backoff_ms: 350,
            unknown_ttl_ms: 1000,
            loading_timeout_ms: 5000,
        }
    }

    #[test]
    fn configured_models_load_then_route() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(false), ["a".to_string()]);
        assert!(matches!(r.lookup("a", 0), Lookup::NotReady));
        assert_eq!(r.due_fetches(0), vec!["a"]);
        assert!(r.due_fetches(1).is_empty(), "already loading");
        assert!(r.loaded("a", 7));
        assert!(matches!(r.lookup("a", 2), Lookup::Ready(t) if *t == 7));
        assert!(matches!(r.lookup("b", 2), Lookup::Unknown), "no discovery");
    }

    #[test]
    fn the_next_fetch_is_due_when_due_fetches_would_return_it() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), ["a".to_string()]);
        assert_eq!(
            r.next_fetch_ms(),
            Some(0),
            "a configured model is wanted at once"
        );
        r.due_fetches(10);
        assert_eq!(r.next_fetch_ms(), Some(5011), "loading: due once lost");
        assert!(r.due_fetches(5010).is_empty());
        r.failed("a", 20);
        assert_eq!(r.next_fetch_ms(), Some(120), "its retry");
        assert!(r.due_fetches(119).is_empty());
        assert_eq!(r.due_fetches(120), vec!["a"]);
        r.loaded("a", 1);
        assert_eq!(r.next_fetch_ms(), None, "ready: nothing to fetch");
        // A discovered name is a probe, wanted at once, then watched while it loads.
        assert!(matches!(r.lookup("b", 200), Lookup::NotReady));
        assert_eq!(r.next_fetch_ms(), Some(0));
        assert_eq!(r.due_fetches(200), vec!["b"]);
        assert_eq!(r.next_fetch_ms(), Some(5201));
        r.unknown("b", 300);
        assert_eq!(
            r.next_fetch_ms(),
            None,
            "a negative answer waits for a lookup"
        );
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), ["a".to_string()]);
        r.due_fetches(0);
        assert_eq!(r.failed("a", 0), 100);
        assert!(r.due_fetches(99).is_empty());
        assert_eq!(r.due_fetches(100), vec!["a"]);
        assert_eq!(r.failed("a", 100), 200);
        assert_eq!(r.due_fetches(300), vec!["a"]);
        assert_eq!(r.failed("a", 300), 350);
        r.due_fetches(650);
        r.loaded("a", 1);
        r.due_fetches(700);
        assert_eq!(r.ready_count(), 1);
    }

    #[test]
    fn discovery_is_bounded_and_unknown_expires() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), Vec::<String>::new());
        assert!(matches!(r.lookup("a", 0), Lookup::NotReady));
        assert!(matches!(r.lookup("b", 0), Lookup::NotReady));
        assert!(
            matches!(r.lookup("c", 0), Lookup::NotReady),
            "probes full: not queued"
        );
        assert_eq!(r.due_fetches(0), vec!["a", "b"]);
        r.unknown("a", 0);
        assert!(matches!(r.lookup("a", 999), Lookup::Unknown));
        assert!(matches!(r.lookup("a", 1000), Lookup::NotReady));
        assert_eq!(r.due_fetches(1000), vec!["a"]);
    }

    #[test]
    fn bogus_names_never_take_a_slot() {
        // Before: every new name took a slot for good, so a model added later stayed unknown.
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), Vec::<String>::new());
        for i in 0..50u64 {
            let name = format!("bogus-{i}");
            let _ = r.lookup(&name, i);
            for n in r.due_fetches(i) {
                r.unknown(&n, i);
            }
        }
        let (slots, probes, negative) = r.sizes();
        assert_eq!((slots, probes), (0, 0));
        assert!(negative <= 3, "negative cache bounded: {negative}");
        assert!(matches!(r.lookup("real", 60), Lookup::NotReady));
        assert_eq!(r.due_fetches(60), vec!["real"]);
        assert!(r.loaded("real", 9));
        assert!(matches!(r.lookup("real", 61), Lookup::Ready(t) if *t == 9));
        // A negative answer is cached: no second lookup before it expires.
        let _ = r.lookup("gone", 70);
        r.due_fetches(70);
        r.unknown("gone", 70);
        assert!(matches!(r.lookup("gone", 80), Lookup::Unknown));
        assert!(r.due_fetches(80).is_empty());
    }

    #[test]
    fn long_names_are_unknown_at_once() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), Vec::<String>::new());
        let long = "x".repeat(17);
        assert!(matches!(r.lookup(&long, 0), Lookup::Unknown));
        assert!(r.due_fetches(0).is_empty(), "no indexer call");
        let shown = log_name(&"y".repeat(100_000));
        assert!(shown.len() < 100, "{shown}");
        assert!(shown.contains("100000 bytes"));
        assert_eq!(log_name("qwen3"), "\"qwen3\"");
    }

    #[test]
    fn a_failed_probe_waits_then_is_asked_again() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), Vec::<String>::new());
        let _ = r.lookup("m", 0);
        r.due_fetches(0);
        assert_eq!(r.failed("m", 0), 100);
        assert!(matches!(r.lookup("m", 50), Lookup::NotReady));
        assert!(r.due_fetches(50).is_empty());
        assert!(matches!(r.lookup("m", 100), Lookup::NotReady));
        assert_eq!(r.due_fetches(100), vec!["m"]);
    }

    #[test]
    fn probes_that_succeed_past_the_slots_are_dropped() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), ["a".to_string()]);
        let _ = r.lookup("b", 0);
        r.due_fetches(0);
        assert!(r.loaded("a", 1));
        assert!(r.loaded("b", 2));
        assert!(matches!(r.lookup("c", 1), Lookup::Unknown), "slots full");
        assert!(!r.loaded("c", 3));
        assert_eq!(r.ready_count(), 2);
    }

    #[test]
    fn lost_fetches_are_retried() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), ["a".to_string()]);
        assert_eq!(r.due_fetches(0), vec!["a"]);
        assert!(r.due_fetches(5000).is_empty());
        assert_eq!(r.due_fetches(5001), vec!["a"]);
    }
}
