//! [`SharedIndex`]: the one index of a running indexer, shared by the event streams, the route
//! handler, the snapshotter, the admin API and the metrics.
//!
//! # Locking contract
//!
//! * One **fair** mutex guards the whole [`KvIndex`]; only this module takes it. Waiters get it in
//!   the order they came: a route decision that arrives while the event streams apply a burst of
//!   batches (every replica's engine step lands at once) waits for the batch being applied and
//!   the ones queued before it, not for the whole burst, as it did behind an unfair mutex whose
//!   writers took it back before the woken reader ran (route p99 2-3 ms with 100 replicas;
//!   docs/performance.md). Every operation below holds
//!   it for its own duration and never across an `.await`, an I/O call or a callback into other
//!   code, except the `then` closures, which run **under** it on purpose.
//! * Lock order: **index, then a replica's own locks** (a stream's `state`, the replica's
//!   `scraped`). A `then` closure may take them (the applier records the sequence number, the
//!   snapshot reads every stream's position), so that entries and positions change and are read
//!   together; no code may hold a replica's lock while calling into this handle.
//! * A `then` closure must be short and must not call back into this handle (the mutex is not
//!   reentrant: that would deadlock).
//! * A route decision takes the index once: its lookup. The predicted entries it then writes
//!   ([`SharedIndex::insert_predicted`]) wait in a short queue under a lock of their own and are
//!   written by the next holder of the index, before anything else it does, so every later lookup
//!   sees them; a decision no longer queues a second time behind the event streams.
//!   Lock order: index, then that queue.
//! * The mutex is not poisoned by a panic while holding it: every operation leaves the index
//!   consistent between events, and an indexer that stopped routing would be worse than one
//!   serving the last consistent state.

use std::sync::Mutex;

use parking_lot::{FairMutex, FairMutexGuard};

use kvroute_core::events::KvEvent;
use kvroute_core::router_key::RouterKey;

use super::export::IndexSnapshot;
use super::kv_index::{IndexConfig, IndexError, IndexStats, KvIndex, ReplicaId, ReplicaMatch};

thread_local! {
    /// Time this thread spent in [`SharedIndex::lookup`] since the last [`take_lookup_time`].
    static LOOKUP_TIME: std::cell::Cell<std::time::Duration> =
        const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// The calling thread's time in [`SharedIndex::lookup`] (waiting for the index and looking up)
/// since the last call, reset to zero: a route handler takes it before and after its decision,
/// which runs on its thread, to tell waiting on event intake from its own work.
pub fn take_lookup_time() -> std::time::Duration {
    LOOKUP_TIME.with(|t| t.replace(std::time::Duration::ZERO))
}

/// What applying one batch of events did.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// Events the index took.
    pub applied: u64,
    /// Events it refused (unknown parent, over budget, ...).
    pub rejected: u64,
    /// New holdings ([`super::ApplyOutcome::stored`]), summed.
    pub stored: u64,
    /// New GPU holdings of blocks another replica held on GPU
    /// ([`super::ApplyOutcome::duplicated`]), summed.
    pub duplicated: u64,
    /// The first refusal, for the log.
    pub first_error: Option<IndexError>,
}

/// The index behind its lock (see the module's locking contract).
pub struct SharedIndex {
    inner: FairMutex<KvIndex>,
    /// Predictions not yet written into the index (see the locking contract).
    pending: Mutex<Vec<Prediction>>,
}

/// Decisions whose predictions may wait for the next holder of the index at once.
const MAX_PENDING_PREDICTIONS: usize = 256;

/// One decision's predicted entries ([`KvIndex::insert_predicted`]'s arguments).
struct Prediction {
    replica: ReplicaId,
    keys: Vec<RouterKey>,
    now_ms: u64,
    ttl_ms: u64,
}

impl SharedIndex {
    /// An empty index.
    pub fn new(cfg: IndexConfig) -> Self {
        SharedIndex {
            inner: FairMutex::new(KvIndex::new(cfg)),
            pending: Mutex::new(Vec::new()),
        }
    }

    /// The index, with every queued prediction written.
    fn lock(&self) -> FairMutexGuard<'_, KvIndex> {
        let mut idx = self.inner.lock();
        let queued = std::mem::take(&mut *self.lock_pending());
        for p in queued {
            if let Err(e) = idx.insert_predicted(p.replica, &p.keys, p.now_ms, p.ttl_ms) {
                tracing::debug!(error = %e, "predicted entries not written");
            }
        }
        idx
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Vec<Prediction>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Longest cached prefix of `keys` per replica. The time it took, waiting for the index
    /// included, is added to the calling thread's [`take_lookup_time`].
    pub fn lookup(&self, keys: &[RouterKey], now_ms: u64) -> Vec<ReplicaMatch> {
        if keys.is_empty() {
            return Vec::new();
        }
        let started = std::time::Instant::now();
        let found = self.lock().lookup(keys, now_ms);
        LOOKUP_TIME.with(|t| t.set(t.get() + started.elapsed()));
        found
    }

    /// [`KvIndex::insert_predicted`], written before the index's next use by anyone. The
    /// decision that fills the queue to [`MAX_PENDING_PREDICTIONS`] takes the index itself, which
    /// writes the queue. Errors are logged at debug: a prediction is an optimisation.
    pub fn insert_predicted(
        &self,
        replica: ReplicaId,
        keys: &[RouterKey],
        now_ms: u64,
        ttl_ms: u64,
    ) {
        if keys.is_empty() {
            return;
        }
        let full = {
            let mut pending = self.lock_pending();
            pending.push(Prediction {
                replica,
                keys: keys.to_vec(),
                now_ms,
                ttl_ms,
            });
            pending.len() >= MAX_PENDING_PREDICTIONS
        };
        if full {
            drop(self.lock());
        }
    }

    /// Applies `events` from one stream, then runs `then` under the same lock (the caller records
    /// the stream's position there, so a snapshot sees entries and position together).
    pub fn apply_batch<T>(
        &self,
        replica: ReplicaId,
        events: &[KvEvent],
        then: impl FnOnce(&BatchOutcome) -> T,
    ) -> (BatchOutcome, T) {
        let mut idx = self.lock();
        let mut out = BatchOutcome::default();
        for ev in events {
            match idx.apply(replica, ev) {
                Ok(o) => {
                    out.applied += 1;
                    out.stored += u64::from(o.stored);
                    out.duplicated += u64::from(o.duplicated);
                }
                Err(e) => {
                    out.rejected += 1;
                    out.first_error.get_or_insert(e);
                }
            }
        }
        let after = then(&out);
        (out, after)
    }

    /// Drops every entry of one stream, then runs `then` under the same lock (the caller forgets
    /// the stream's position there). Returns the holdings dropped.
    pub fn clear_stream<T>(&self, replica: ReplicaId, then: impl FnOnce() -> T) -> (u64, T) {
        let mut idx = self.lock();
        let dropped = idx.clear_replica(replica);
        (dropped, then())
    }

    /// Forgets the given streams entirely (their slots included): a replica left the fleet.
    pub fn remove_streams(&self, replicas: impl IntoIterator<Item = ReplicaId>) {
        let mut idx = self.lock();
        for id in replicas {
            idx.remove_replica(id);
        }
    }

    /// A copy of the whole index, and `then`'s result read under the same lock (the streams'
    /// positions, for a consistent snapshot). Only the copy is made under the lock.
    pub fn export<T>(&self, then: impl FnOnce() -> T) -> (IndexSnapshot, T) {
        let idx = self.lock();
        let snap = idx.export();
        (snap, then())
    }

    /// Replaces the index with an exported one (same configuration as now); then runs `then`
    /// under the same lock. On error the index is unchanged.
    pub fn import<T>(
        &self,
        snap: &IndexSnapshot,
        then: impl FnOnce() -> T,
    ) -> Result<T, IndexError> {
        let mut idx = self.lock();
        let imported = KvIndex::import(idx.config().clone(), snap)?;
        *idx = imported;
        Ok(then())
    }

    /// Counters and memory.
    pub fn stats(&self) -> IndexStats {
        self.lock().stats()
    }

    /// Blocks held per stream in its largest KV cache group ([`KvIndex::held_blocks`]).
    pub fn held_blocks(&self) -> std::collections::HashMap<ReplicaId, u64, super::IdBuildHasher> {
        self.lock().held_blocks()
    }

    /// Entries held per stream.
    pub fn entries_by_stream(&self) -> Vec<(ReplicaId, u64)> {
        self.lock().replicas()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::events::{BlockStored, WireBlockHash};

    fn keys(n: u64) -> Vec<RouterKey> {
        (1..=n)
            .map(|i| RouterKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect()
    }

    #[test]
    fn queued_predictions_are_written_before_the_next_lookup_sees_the_index() {
        let idx = SharedIndex::new(IndexConfig::default());
        // Replica 0 is registered by an event; its predictions are queued, not written yet.
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![WireBlockHash::Int(7)],
            parent_block_hash: None,
            token_ids: vec![1; 16],
            block_size: 16,
            ..BlockStored::default()
        });
        let (out, ()) = idx.apply_batch(0, &[stored], |_| ());
        assert_eq!(out.applied, 1);
        for _ in 0..MAX_PENDING_PREDICTIONS + 10 {
            idx.insert_predicted(0, &keys(4), 1_000, 10_000);
        }
        // The decision that filled the queue wrote it; the ten after it wait.
        assert_eq!(idx.lock_pending().len(), 10);
        let found = idx.lookup(&keys(4), 1_001);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].predicted, 4);
        assert!(idx.lock_pending().is_empty());
    }
}
