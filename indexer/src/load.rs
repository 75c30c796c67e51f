//! In-flight requests per replica, counted from routing decisions and `POST /v1/complete`.
//!
//! Every decision is remembered by request id until its completion arrives (then the replica's
//! in-flight count goes down and the predicted hit is compared with the engine's `cached_tokens`).
//! The table is bounded: entries older than [`PENDING_TTL`] or beyond [`MAX_PENDING`] are dropped
//! (and their in-flight count released), so a filter that never reports cannot leak memory or pin a
//! replica as busy forever.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::membership::{lock, Replica};

/// Longest a routed request is considered in flight without a completion.
pub const PENDING_TTL: Duration = Duration::from_secs(600);
/// Most routed requests remembered.
pub const MAX_PENDING: usize = 200_000;

/// What was decided for one request.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The replica.
    pub replica: Arc<Replica>,
    /// Tokens the index said were cached there (usable hit, all tiers).
    pub predicted_tokens: u64,
    /// When it was routed.
    pub at: Instant,
}

/// The pending-request table.
#[derive(Debug, Default)]
pub struct LoadTracker {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    pending: HashMap<String, Pending>,
    order: VecDeque<(Instant, String)>,
}

impl LoadTracker {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a routing decision: the replica's in-flight count goes up.
    pub fn routed(&self, request_id: String, replica: Arc<Replica>, predicted_tokens: u64) {
        let now = Instant::now();
        replica.in_flight.fetch_add(1, Ordering::Relaxed);
        let mut inner = lock(&self.inner);
        inner.expire(now);
        if let Some(old) = inner.pending.insert(
            request_id.clone(),
            Pending {
                replica,
                predicted_tokens,
                at: now,
            },
        ) {
            // The same id routed twice (a retry): release the first one.
            release(&old.replica);
        }
        inner.order.push_back((now, request_id));
    }

    /// Records a completion; returns the decision it belonged to, or `None` for an unknown id.
    pub fn completed(&self, request_id: &str) -> Option<Pending> {
        let mut inner = lock(&self.inner);
        inner.expire(Instant::now());
        let p = inner.pending.remove(request_id)?;
        release(&p.replica);
        Some(p)
    }

    /// Requests currently remembered.
    pub fn len(&self) -> usize {
        lock(&self.inner).pending.len()
    }

    /// True when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn release(replica: &Replica) {
    let _ = replica
        .in_flight
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some((v - 1).max(0))
        });
}

impl Inner {
    fn expire(&mut self, now: Instant) {
        while let Some((at, id)) = self.order.front() {
            let too_old = now.duration_since(*at) > PENDING_TTL;
            let too_many = self.order.len() > MAX_PENDING;
            if !too_old && !too_many {
                break;
            }
            let (at, id) = (*at, id.clone());
            self.order.pop_front();
            // Only drop the entry if it is the one this queue slot recorded (ids can be re-routed).
            if self.pending.get(&id).is_some_and(|p| p.at == at) {
                if let Some(p) = self.pending.remove(&id) {
                    release(&p.replica);
                }
            }
        }
    }
}
