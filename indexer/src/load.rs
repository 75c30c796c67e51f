//! In-flight requests per replica, counted from routing decisions and `POST /v1/complete`.
//!
//! Every decision is remembered by request id until its completion arrives (then the replica's
//! in-flight count goes down and the predicted hit is compared with the engine's `cached_tokens`).
//! The table is bounded: entries older than [`PENDING_TTL`] or beyond [`MAX_PENDING`] are dropped
//! (and their in-flight count released), so a filter that never reports cannot leak memory or pin a
//! replica as busy forever.
//!
//! Each decision also adds the request's uncached prompt blocks to the replica's pending prefill
//! (`Replica::pending_prefill_blocks`, the scorer's queue term) until the prefill is estimated done
//! (uncached tokens at the configured prefill rate, measured from the later of the decision and the
//! end of the prefill already pending there) or the request completes, whichever comes first.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::membership::{lock, Replica};

/// Longest a routed request is considered in flight without a completion.
pub const PENDING_TTL: Duration = Duration::from_secs(600);
/// Most routed requests remembered.
pub const MAX_PENDING: usize = 200_000;
/// Longest a decision's prefill is estimated to stay pending, queueing included.
pub const MAX_PREFILL_ESTIMATE: Duration = Duration::from_secs(60);

/// What was decided for one request.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The replica.
    pub replica: Arc<Replica>,
    /// Tokens the index said were cached there (usable hit, all tiers).
    pub predicted_tokens: u64,
    /// When it was routed.
    pub at: Instant,
    /// Uncached prompt blocks still counted as pending prefill on the replica (0 once released).
    pub prefill_blocks: u32,
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
    /// (estimated prefill end, routed at, request id), earliest first.
    prefill_done: BinaryHeap<Reverse<(Instant, Instant, String)>>,
    /// Per replica (by name): when the prefill already routed there is estimated to end.
    busy_until: HashMap<String, Instant>,
}

impl LoadTracker {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a routing decision: the replica's in-flight count goes up, and its pending prefill
    /// by `prefill_blocks` for `prefill_time` (queued after the prefill already pending there).
    pub fn routed(
        &self,
        request_id: String,
        replica: Arc<Replica>,
        predicted_tokens: u64,
        prefill_blocks: u32,
        prefill_time: Duration,
    ) {
        let now = Instant::now();
        replica.in_flight.fetch_add(1, Ordering::Relaxed);
        replica
            .pending_prefill_blocks
            .fetch_add(i64::from(prefill_blocks), Ordering::Relaxed);
        let mut inner = lock(&self.inner);
        inner.expire(now);
        let start = inner
            .busy_until
            .get(&replica.name)
            .copied()
            .filter(|t| *t > now)
            .unwrap_or(now);
        let done = (start + prefill_time).min(now + MAX_PREFILL_ESTIMATE);
        inner.busy_until.insert(replica.name.clone(), done);
        inner
            .prefill_done
            .push(Reverse((done, now, request_id.clone())));
        if let Some(old) = inner.pending.insert(
            request_id.clone(),
            Pending {
                replica,
                predicted_tokens,
                at: now,
                prefill_blocks,
            },
        ) {
            // The same id routed twice (a retry): release the first one.
            release(&old);
        }
        inner.order.push_back((now, request_id));
    }

    /// Releases the pending prefill of requests whose prefill is estimated done by now.
    pub fn expire(&self, now: Instant) {
        lock(&self.inner).expire(now);
    }

    /// Records a completion; returns the decision it belonged to, or `None` for an unknown id.
    pub fn completed(&self, request_id: &str) -> Option<Pending> {
        let mut inner = lock(&self.inner);
        inner.expire(Instant::now());
        let p = inner.pending.remove(request_id)?;
        release(&p);
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

/// Releases a decision's in-flight count and whatever pending prefill it still holds.
fn release(p: &Pending) {
    let _ = p
        .replica
        .in_flight
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some((v - 1).max(0))
        });
    release_prefill(&p.replica, p.prefill_blocks);
}

fn release_prefill(replica: &Replica, blocks: u32) {
    if blocks == 0 {
        return;
    }
    let _ =
        replica
            .pending_prefill_blocks
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some((v - i64::from(blocks)).max(0))
            });
}

impl Inner {
    fn expire(&mut self, now: Instant) {
        while let Some(Reverse((done, at, _))) = self.prefill_done.peek() {
            if *done > now && self.prefill_done.len() <= MAX_PENDING {
                break;
            }
            let at = *at;
            let Some(Reverse((_, _, id))) = self.prefill_done.pop() else {
                break;
            };
            if let Some(p) = self.pending.get_mut(&id).filter(|p| p.at == at) {
                release_prefill(&p.replica, p.prefill_blocks);
                p.prefill_blocks = 0;
            }
        }
        self.busy_until.retain(|_, t| *t > now);
        self.expire_pending(now);
    }

    fn expire_pending(&mut self, now: Instant) {
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
                    release(&p);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn pending_prefill_is_released_when_estimated_done_or_completed() {
        let fleet = Fleet::new();
        let r = replica(&fleet, "r0");
        let t = LoadTracker::new();
        t.routed("a".into(), r.clone(), 0, 100, Duration::from_millis(40));
        t.routed("b".into(), r.clone(), 0, 30, Duration::from_millis(40));
        assert_eq!(pending(&r), 130);
        assert_eq!(r.in_flight.load(Ordering::Relaxed), 2);
        // "b" queues behind "a": estimated done at ~80 ms, "a" at ~40 ms.
        t.expire(Instant::now() + Duration::from_millis(60));
        assert_eq!(pending(&r), 30, "a's prefill is done, b's is still queued");
        assert_eq!(
            r.in_flight.load(Ordering::Relaxed),
            2,
            "both still in flight"
        );
        // Completing "b" before its estimate releases its prefill and its in-flight count once.
        assert!(t.completed("b").is_some());
        assert_eq!(pending(&r), 0);
        t.expire(Instant::now() + Duration::from_millis(200));
        assert_eq!(pending(&r), 0, "never released twice");
        assert!(t.completed("a").is_some());
        assert_eq!(r.in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_retried_request_id_does_not_leak_pending_prefill() {
        let fleet = Fleet::new();
        let r0 = replica(&fleet, "r0");
        let r1 = replica(&fleet, "r1");
        let t = LoadTracker::new();
        t.routed("x".into(), r0.clone(), 0, 50, Duration::from_secs(30));
        t.routed("x".into(), r1.clone(), 0, 20, Duration::from_secs(30));
        assert_eq!((pending(&r0), pending(&r1)), (0, 20));
        t.expire(Instant::now() + Duration::from_secs(31));
        assert_eq!((pending(&r0), pending(&r1)), (0, 0));
    }
}
