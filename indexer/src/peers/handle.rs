//! The peer link as the rest of the indexer holds it: the queue to the publisher, the counters
//! and link state (`/metrics`, `/readyz`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use kvroute_core::peers::{PeerEnvelope, PeerMessage};
use tokio::sync::mpsc;

use super::config::PeersSection;
use crate::membership::lock;

/// Counters and link state, exported on `/metrics` and `/readyz`.
#[derive(Debug, Default)]
pub struct PeerStats {
    /// The publishing connection is up.
    pub publisher_up: AtomicBool,
    /// The subscription is up.
    pub subscriber_up: AtomicBool,
    /// Messages published.
    pub published: AtomicU64,
    /// Messages dropped because the queue was full.
    pub dropped_queue_full: AtomicU64,
    /// Messages dropped because the server was unreachable.
    pub dropped_disconnected: AtomicU64,
    /// Failed connects and commands.
    pub errors: AtomicU64,
    /// Messages received from the channel (own included).
    pub received: AtomicU64,
    /// Own messages skipped.
    pub own_skipped: AtomicU64,
    /// Peers' decisions counted.
    pub applied_routed: AtomicU64,
    /// Peers' decision ends applied.
    pub applied_ended: AtomicU64,
    /// Peers' messages refused, by reason.
    pub rejected: Mutex<BTreeMap<&'static str, u64>>,
    /// The last connection error, for `/readyz`.
    pub last_error: Mutex<Option<String>>,
}

impl PeerStats {
    pub(super) fn reject(&self, reason: &'static str) {
        *lock(&self.rejected).entry(reason).or_default() += 1;
    }

    pub(super) fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_error) = Some(what);
    }
}

/// This indexer's end of the peers channel.
#[derive(Debug)]
pub struct PeerLink {
    /// This process's origin id (random per start).
    pub origin: u64,
    /// The settings.
    pub cfg: PeersSection,
    /// Counters.
    pub stats: PeerStats,
    tx: mpsc::Sender<Vec<u8>>,
    rx: Mutex<Option<mpsc::Receiver<Vec<u8>>>>,
}

impl PeerLink {
    /// A link (its tasks are started by [`spawn`]).
    pub fn new(cfg: PeersSection) -> Self {
        use std::hash::BuildHasher;
        let origin = std::collections::hash_map::RandomState::new()
            .hash_one((std::process::id(), std::time::SystemTime::now()));
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        Self {
            origin,
            cfg,
            stats: PeerStats::default(),
            tx,
            rx: Mutex::new(Some(rx)),
        }
    }

    /// Hands a message to the publisher; never waits (dropped and counted when it cannot go).
    pub fn publish(&self, message: PeerMessage) {
        if !self.stats.publisher_up.load(Ordering::Relaxed) {
            self.stats
                .dropped_disconnected
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        let bytes = PeerEnvelope::new(self.origin, message).encode();
        if self.tx.try_send(bytes).is_err() {
            self.stats
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The peer-channel problem for `/readyz`, if any (routing goes on: degraded, not down).
    pub fn problem(&self) -> Option<String> {
        let publishing = self.stats.publisher_up.load(Ordering::Relaxed);
        let subscribed = self.stats.subscriber_up.load(Ordering::Relaxed);
        if publishing && subscribed {
            return None;
        }
        let err = lock(&self.stats.last_error).clone().unwrap_or_default();
        Some(format!(
            "peers: redis {} not connected (publishing: {publishing}, subscribed: {subscribed}){}; routing on this gateway's decisions only",
            self.cfg.redis,
            if err.is_empty() { String::new() } else { format!(", last error: {err}") }
        ))
    }

    pub(super) fn take_rx(&self) -> Option<mpsc::Receiver<Vec<u8>>> {
        lock(&self.rx).take()
    }
}

/// Appends the `kvroute_indexer_peers_*` metrics.
pub fn render_metrics(out: &mut String, link: &PeerLink, remote_pending: usize, p: &str) {
    let s = &link.stats;
    let up = s.publisher_up.load(Ordering::Relaxed) && s.subscriber_up.load(Ordering::Relaxed);
    let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP {p}_{name} {help}\n# TYPE {p}_{name} gauge\n{p}_{name} {v}"
        );
    };
    gauge(
        out,
        "peers_connected",
        "1 while both the publishing and the subscribing connection to the peers' Redis are up.",
        u64::from(up),
    );
    gauge(
        out,
        "peers_remote_pending",
        "Peers' decisions counted in the load now.",
        remote_pending as u64,
    );
    let counters: [(&str, &str, &AtomicU64); 8] = [
        (
            "peers_published_total",
            "Decisions and ends published to peers.",
            &s.published,
        ),
        (
            "peers_dropped_queue_full_total",
            "Messages not published because the [peers] queue was full.",
            &s.dropped_queue_full,
        ),
        (
            "peers_dropped_disconnected_total",
            "Messages not published because the peers' Redis was unreachable.",
            &s.dropped_disconnected,
        ),
        (
            "peers_errors_total",
            "Failed connects and commands to the peers' Redis.",
            &s.errors,
        ),
        (
            "peers_received_total",
            "Messages received on the peers channel (own included).",
            &s.received,
        ),
        (
            "peers_own_skipped_total",
            "Own messages received back and skipped.",
            &s.own_skipped,
        ),
        (
            "peers_applied_decisions_total",
            "Peers' decisions counted as if made here.",
            &s.applied_routed,
        ),
        (
            "peers_applied_ends_total",
            "Peers' decision ends applied.",
            &s.applied_ended,
        ),
    ];
    for (name, help, v) in counters {
        let _ = writeln!(
            out,
            "# HELP {p}_{name} {help}\n# TYPE {p}_{name} counter\n{p}_{name} {}",
            v.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP {p}_peers_rejected_total Peers' messages refused, by reason.\n# TYPE {p}_peers_rejected_total counter"
    );
    for (reason, n) in lock(&s.rejected).iter() {
        let _ = writeln!(out, "{p}_peers_rejected_total{{reason=\"{reason}\"}} {n}");
    }
}
