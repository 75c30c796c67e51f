//! Carries the sequencer's index actions out for one stream: decodes a batch, learns the model's
//! block size, runs the hash self-check, applies the events under the index lock and updates the
//! stream's state with them; drops the stream's entries on a reset.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::events::{decode_batch, learned_block_size, BlockStored, KvEvent, Medium};

use crate::membership::{lock, Replica, Stream};
use crate::selfcheck;
use crate::state::{AppState, ModelRuntime};

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Applies one stream's batches to the shared index.
pub struct Applier {
    state: Arc<AppState>,
    replica: Arc<Replica>,
    stream: Arc<Stream>,
    model: Arc<ModelRuntime>,
    /// The model's fleet capacity in KV blocks and when it was read (read at most once per
    /// [`CAPACITY_REFRESH`], not per batch: it changes with scrapes, every second at most).
    capacity: std::sync::Mutex<Option<(Instant, u64)>>,
}

/// How long a read of the fleet's KV capacity is used.
const CAPACITY_REFRESH: Duration = Duration::from_secs(1);

impl Applier {
    /// The applier of `stream` (a rank of `replica`, serving `model`).
    pub fn new(
        state: Arc<AppState>,
        replica: Arc<Replica>,
        stream: Arc<Stream>,
        model: Arc<ModelRuntime>,
    ) -> Self {
        Self {
            state,
            replica,
            stream,
            model,
            capacity: std::sync::Mutex::new(None),
        }
    }

    /// Counts an undecodable message and logs it (the first 10, then at powers of two).
    pub fn decode_error(&self, what: &str) {
        let n = self
            .stream
            .stats
            .event_decode_errors
            .fetch_add(1, Ordering::Relaxed);
        if n < 10 || n.is_power_of_two() {
            tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, count = n + 1, "skipping undecodable event message: {what}");
        }
    }

    /// Decodes batch `seq` (payload fingerprint `fp`) and applies it; the stream's seq advances
    /// even when the payload is garbage (the engine will never resend it).
    pub fn apply(&self, seq: u64, fp: u64, payload: &[u8]) {
        let batch = match decode_batch(payload) {
            Ok(b) => Some(b),
            Err(e) => {
                self.decode_error(&e.to_string());
                None
            }
        };
        if let Some(batch) = &batch {
            for ev in &batch.events {
                if let KvEvent::BlockStored(bs) = ev {
                    let known = self.model.block_size();
                    let learned = learned_block_size(known, bs.block_size);
                    let learns = !self.model.block_size_configured && learned != known;
                    if let (Some(b), true) = (learned, learns) {
                        self.model.block_size.store(b, Ordering::Relaxed);
                        tracing::info!(model = %self.model.name, block_size = b, "learned block size from events");
                    }
                    if bs.parent_block_hash.is_none() {
                        selfcheck::maybe_check(
                            &self.state,
                            &self.replica,
                            &self.stream,
                            &self.model,
                            bs,
                        );
                    }
                }
            }
        }
        let now = now_unix();
        let events = batch.as_ref().map_or(&[][..], |b| &b.events[..]);
        // The position is recorded under the index lock so a snapshot sees entries and seq
        // together.
        let (outcome, ()) = self
            .state
            .index
            .apply_batch(self.stream.index_id, events, |_| {
                let mut s = lock(&self.stream.state);
                s.last_seq = Some(seq);
                s.last_fingerprint = Some(fp);
                s.last_message = Some(std::time::Instant::now());
                if let Some(batch) = &batch {
                    s.last_batch_ts = Some(batch.ts);
                    s.lag_seconds = Some((now - batch.ts).max(0.0));
                }
            });
        let stats = &self.stream.stats;
        stats.events.fetch_add(outcome.applied, Ordering::Relaxed);
        if outcome.rejected > 0 {
            let before = stats
                .rejected_events
                .fetch_add(outcome.rejected, Ordering::Relaxed);
            if let (true, Some(e)) = (before < 10, &outcome.first_error) {
                tracing::debug!(replica = %self.replica.name, error = %e, "index rejected an event");
            }
        }
        if let Some(batch) = &batch {
            stats.batches.fetch_add(1, Ordering::Relaxed);
            let counted_from = self.state.reuse_counted_from_ms.load(Ordering::Relaxed);
            let in_window = batch.ts * 1000.0 >= counted_from as f64;
            self.note_recomputation(&batch.events, in_window);
            if !in_window {
                return;
            }
            if let Some(audit) = self.state.audit.get() {
                let mut audit = lock(audit);
                for ev in &batch.events {
                    if let KvEvent::BlockStored(bs) = ev {
                        audit.observe(&self.model.name, bs);
                    }
                }
            }
            stats
                .stored_blocks
                .fetch_add(outcome.stored, Ordering::Relaxed);
            stats
                .duplicated_blocks
                .fetch_add(outcome.duplicated, Ordering::Relaxed);
        }
    }

    /// Remembers this stream's GPU removals and counts (when `counted`) the blocks it stores
    /// again soon after removing them (recomputation after eviction) and those its model's fleet
    /// cache still held.
    fn note_recomputation(&self, events: &[KvEvent], counted: bool) {
        let cfg = &self.state.config.reuse;
        let now_ms = (now_unix() * 1000.0) as u64;
        let on_gpu = |m: Option<Medium>| matches!(m.unwrap_or_default(), Medium::Gpu);
        let mut recomputed = 0u64;
        let mut fleet_repeats = 0u64;
        // Recomputations the fleet cache followed, and of those the ones it had lost too.
        let (mut recompute_checked, mut recompute_fleet_lost) = (0u64, 0u64);
        let mut fleet = None;
        let stream = self.stream.index_id;
        let mut removals = lock(&self.model.removals);
        for ev in events {
            match ev {
                KvEvent::BlockRemoved(r) if on_gpu(r.medium) => {
                    for h in &r.block_hashes {
                        removals.removed(cfg, stream, h.as_u64(), now_ms);
                    }
                }
                KvEvent::BlockStored(s)
                    if on_gpu(s.medium) && !hash_block(s, self.model.block_size()) =>
                {
                    // Every KV cache group stores the same blocks: the fleet cache sees group 0's.
                    let group0 = s.group_idx.unwrap_or(0) == 0;
                    for h in &s.block_hashes {
                        let again = removals.stored_again(cfg, stream, h.as_u64(), now_ms);
                        recomputed += again;
                        if !group0 {
                            continue;
                        }
                        let (cache, capacity) = fleet.get_or_insert_with(|| {
                            (lock(&self.model.fleet_cache), self.fleet_capacity_blocks())
                        });
                        match cache.touch(cfg, h.as_u64(), *capacity) {
                            Some((true, weight)) => {
                                fleet_repeats += weight;
                                recompute_checked += again.saturating_mul(weight);
                            }
                            Some((false, weight)) => {
                                recompute_checked += again.saturating_mul(weight);
                                recompute_fleet_lost += again.saturating_mul(weight);
                            }
                            None => {}
                        }
                    }
                }
                _ => {}
            }
        }
        drop(fleet);
        drop(removals);
        if !counted {
            return;
        }
        let stats = &self.stream.stats;
        for (counter, n) in [
            (&stats.recomputed_blocks, recomputed),
            (&stats.fleet_repeat_blocks, fleet_repeats),
            (&stats.recompute_checked_blocks, recompute_checked),
            (&stats.recompute_fleet_lost_blocks, recompute_fleet_lost),
        ] {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The KV blocks of every replica of this model, as their metrics report them (0: unknown),
    /// read again after [`CAPACITY_REFRESH`].
    fn fleet_capacity_blocks(&self) -> u64 {
        let now = Instant::now();
        let mut cached = lock(&self.capacity);
        match *cached {
            Some((at, blocks)) if now.duration_since(at) < CAPACITY_REFRESH => blocks,
            _ => {
                let blocks = self.state.fleet_kv_capacity_blocks(&self.model.name);
                *cached = Some((now, blocks));
                blocks
            }
        }
    }

    /// Drops this stream's index entries and sequence state; counts and logs it when `counted`
    /// (something was known).
    pub fn reset(&self, counted: bool, why: &str) {
        self.state.index.clear_stream(self.stream.index_id, || {
            let mut s = lock(&self.stream.state);
            s.last_seq = None;
            s.last_fingerprint = None;
        });
        if counted {
            self.stream.stats.resets.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, reason = why, "dropped this stream's index entries");
        }
    }
}

/// A `BlockStored` of one hash block inside a block of the model's size
/// ([`BlockStored::is_hash_block_of`]).
fn hash_block(ev: &BlockStored, block_size: Option<u32>) -> bool {
    block_size.is_some_and(|bs| ev.is_hash_block_of(bs))
}
