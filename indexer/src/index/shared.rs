//! [`SharedIndex`]: the one index of a running indexer, shared by the event streams, the route
//! handler, the snapshotter, the admin API and the metrics.
//!
//! # Locking contract
//!
//! * One mutex guards the whole [`KvIndex`]; only this module takes it. Every operation below holds
//!   it for its own duration and never across an `.await`, an I/O call or a callback into other
//!   code, except the `then` closures, which run **under** it on purpose.
//! * Lock order: **index, then a replica's own locks** (a stream's `state`, the replica's
//!   `scraped`). A `then` closure may take them (the applier records the sequence number, the
//!   snapshot reads every stream's position), so that entries and positions change and are read
//!   together; no code may hold a replica's lock while calling into this handle.
//! * A `then` closure must be short and must not call back into this handle (the mutex is not
//!   reentrant: that would deadlock).
//! * A poisoned mutex (a panic while holding it) is taken over rather than propagated: every
//!   operation leaves the index consistent between events, and an indexer that stopped routing
//!   would be worse than one serving the last consistent state.

use std::sync::{Mutex, MutexGuard};

use kvroute_core::events::KvEvent;
use kvroute_core::router_key::RouterKey;

use super::export::IndexSnapshot;
use super::kv_index::{IndexConfig, IndexError, IndexStats, KvIndex, ReplicaId, ReplicaMatch};

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
    inner: Mutex<KvIndex>,
}

impl SharedIndex {
    /// An empty index.
    pub fn new(cfg: IndexConfig) -> Self {
        SharedIndex {
            inner: Mutex::new(KvIndex::new(cfg)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, KvIndex> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Longest cached prefix of `keys` per replica.
    pub fn lookup(&self, keys: &[RouterKey], now_ms: u64) -> Vec<ReplicaMatch> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.lock().lookup(keys, now_ms)
    }

    /// [`KvIndex::insert_predicted`].
    pub fn insert_predicted(
        &self,
        replica: ReplicaId,
        keys: &[RouterKey],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<usize, IndexError> {
        self.lock().insert_predicted(replica, keys, now_ms, ttl_ms)
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

    /// Entries held per stream.
    pub fn entries_by_stream(&self) -> Vec<(ReplicaId, u64)> {
        self.lock().replicas()
    }
}
