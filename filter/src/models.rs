//! Per-VM model registry: which models have a tokenizer ready, which are loading, which failed
//! (and when to retry), which the indexer does not know. Pure state machine; time is passed in.

use std::collections::HashMap;
use std::rc::Rc;

/// Where one model stands.
#[derive(Debug)]
enum State<T> {
    /// A fetch should start at the next tick.
    Wanted,
    /// A fetch is in flight (started at this time, ms).
    Loading { since_ms: u64 },
    /// Ready to route.
    Ready(Rc<T>),
    /// The last fetch failed; retry at `retry_at_ms`.
    Failed { retry_at_ms: u64 },
    /// The indexer does not know the model; ask again after `until_ms`.
    Unknown { until_ms: u64 },
}

#[derive(Debug)]
struct Entry<T> {
    state: State<T>,
    /// Delay used after the last failure (doubles per consecutive failure).
    last_backoff_ms: Option<u64>,
}

/// The answer to "can this model be routed now?".
#[derive(Debug)]
pub enum Lookup<T> {
    /// Yes, with this tokenizer.
    Ready(Rc<T>),
    /// Not yet (loading or retrying): fail open as `tokenizer_not_ready`.
    NotReady,
    /// Never heard of it: fail open as `unknown_model`.
    Unknown,
}

/// Registry policy.
#[derive(Debug, Clone)]
pub struct RegistryPolicy {
    /// Fetch models that were not configured, on first use.
    pub discover: bool,
    /// Most models held.
    pub max_models: usize,
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
                    },
                )
            })
            .collect();
        Self { policy, entries }
    }

    fn set(&mut self, model: &str, state: State<T>) -> &mut Entry<T> {
        let e = self.entries.entry(model.to_string()).or_insert(Entry {
            state: State::Wanted,
            last_backoff_ms: None,
        });
        e.state = state;
        e
    }

    /// Whether `model` can be routed now; a new model (when discovery is on and there is room)
    /// is queued for fetching.
    pub fn lookup(&mut self, model: &str, now_ms: u64) -> Lookup<T> {
        match self.entries.get_mut(model) {
            Some(Entry {
                state: State::Ready(t),
                ..
            }) => Lookup::Ready(Rc::clone(t)),
            Some(e) => match e.state {
                State::Unknown { until_ms } if now_ms < until_ms => Lookup::Unknown,
                State::Unknown { .. } => {
                    e.state = State::Wanted;
                    Lookup::NotReady
                }
                _ => Lookup::NotReady,
            },
            None => {
                if self.policy.discover && self.entries.len() < self.policy.max_models {
                    self.set(model, State::Wanted);
                    Lookup::NotReady
                } else {
                    Lookup::Unknown
                }
            }
        }
    }

    /// Models whose fetch should start now; they are marked loading.
    pub fn due_fetches(&mut self, now_ms: u64) -> Vec<String> {
        let mut due = Vec::new();
        for (name, e) in self.entries.iter_mut() {
            let go = match e.state {
                State::Wanted => true,
                State::Failed { retry_at_ms } => now_ms >= retry_at_ms,
                State::Loading { since_ms } => {
                    now_ms.saturating_sub(since_ms) > self.policy.loading_timeout_ms
                }
                State::Ready(_) | State::Unknown { .. } => false,
            };
            if go {
                e.state = State::Loading { since_ms: now_ms };
                due.push(name.clone());
            }
        }
        due.sort();
        due
    }

    /// The fetch succeeded.
    pub fn loaded(&mut self, model: &str, t: T) {
        let e = self.set(model, State::Ready(Rc::new(t)));
        e.last_backoff_ms = None;
    }

    /// The fetch failed; schedules a retry with exponential backoff and returns the delay (ms).
    pub fn failed(&mut self, model: &str, now_ms: u64) -> u64 {
        let (initial, max) = (self.policy.initial_backoff_ms, self.policy.max_backoff_ms);
        let previous = self.entries.get(model).and_then(|e| e.last_backoff_ms);
        let backoff = previous
            .map(|b| b.saturating_mul(2))
            .unwrap_or(initial)
            .min(max);
        let e = self.set(
            model,
            State::Failed {
                retry_at_ms: now_ms.saturating_add(backoff),
            },
        );
        e.last_backoff_ms = Some(backoff);
        backoff
    }

    /// The indexer does not know `model`.
    pub fn unknown(&mut self, model: &str, now_ms: u64) {
        let until_ms = now_ms.saturating_add(self.policy.unknown_ttl_ms);
        self.set(model, State::Unknown { until_ms });
    }

    /// Number of ready models.
    pub fn ready_count(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e.state, State::Ready(_)))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(discover: bool) -> RegistryPolicy {
        RegistryPolicy {
            discover,
            max_models: 2,
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
        r.loaded("a", 7);
        assert!(matches!(r.lookup("a", 2), Lookup::Ready(t) if *t == 7));
        assert!(matches!(r.lookup("b", 2), Lookup::Unknown), "no discovery");
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
            matches!(r.lookup("c", 0), Lookup::Unknown),
            "max_models reached"
        );
        assert_eq!(r.due_fetches(0), vec!["a", "b"]);
        r.unknown("a", 0);
        assert!(matches!(r.lookup("a", 999), Lookup::Unknown));
        assert!(matches!(r.lookup("a", 1000), Lookup::NotReady));
        assert_eq!(r.due_fetches(1000), vec!["a"]);
    }

    #[test]
    fn lost_fetches_are_retried() {
        let mut r: ModelRegistry<u32> = ModelRegistry::new(policy(true), ["a".to_string()]);
        assert_eq!(r.due_fetches(0), vec!["a"]);
        assert!(r.due_fetches(5000).is_empty());
        assert_eq!(r.due_fetches(5001), vec!["a"]);
    }
}
