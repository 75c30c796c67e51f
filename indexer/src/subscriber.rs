//! One ZeroMQ SUB per replica and data-parallel rank, feeding the index. This file drives a
//! stream: it finds the endpoint, keeps a session open and passes what happens on it to the
//! stream's [`Sequencer`], then carries out its actions with the [`transport`] (replays) and the
//! [`Applier`] (the index).
//!
//! * Connect mode (the engine binds `tcp://*:5557`): we connect, with a short connect timeout, and
//!   reconnect ourselves when the socket reports `Disconnected` (the `zeromq` crate's own backoff
//!   grows to 30 s). Bind mode (the engine connects out): we bind once and wait for it.
//! * After every (re)connect we ask the replica's ROUTER for a replay from the next sequence number
//!   we need: the stream may be new (engine restart) or may have moved on while we were away.
//! * Live messages are `[topic, seq (8 B big-endian), payload]`. A gap asks for a replay of the
//!   missing batches through a new DEALER (one per replay, a timeout on every read). A replay that
//!   cannot cover the gap, a stream without replay, or a sequence number that goes backwards (engine
//!   restart) drops this stream's entries and counts a reset.
//! * Undecodable payloads are counted and skipped; the stream goes on.
//! * Every socket (SUB, replay DEALER, bound SUB) refuses messages over
//!   `events.max_message_bytes` before allocating them (the peer is disconnected and counted);
//!   a replay stops at `replay_max_batches` / `replay_max_bytes`; a bound SUB admits only
//!   `events.allowed_peers` (default: the replica's hosts and loopback).

pub mod applier;
pub mod sequencer;
pub mod transport;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::events::frames;

pub use applier::Applier;
pub use kvroute_core::events::frames::END_OF_REPLAY;
pub use sequencer::{fingerprint, Action, DropReason, Input, ReplayCause, Sequencer, Verdict};
pub use transport::{replay, StreamError};
use transport::{LiveEvent, LiveSocket, Replay};

use crate::membership::{discover_event_sources, lock, Replica, Stream};
use crate::state::AppState;

/// Starts the subscriber tasks of a replica (one per rank).
pub fn spawn_replica(state: &Arc<AppState>, replica: &Arc<Replica>) {
    spawn_streams(state, replica, &replica.streams());
}

/// Starts the subscriber tasks of some of a replica's streams (ranks added by discovery).
fn spawn_streams(state: &Arc<AppState>, replica: &Arc<Replica>, streams: &[Arc<Stream>]) {
    let Some(model) = state.models.get(&replica.model).cloned() else {
        tracing::error!(replica = %replica.name, model = %replica.model, "replica of unknown model; not subscribing");
        return;
    };
    let mut tasks = lock(&replica.tasks);
    for stream in streams {
        let ctx = StreamCtx {
            state: state.clone(),
            replica: replica.clone(),
            stream: stream.clone(),
            applier: Applier::new(
                state.clone(),
                replica.clone(),
                stream.clone(),
                model.clone(),
            ),
            seq: {
                let st = lock(&stream.state);
                Sequencer::resume(st.last_seq, st.last_fingerprint)
            },
        };
        tasks.push(match &state.background {
            Some(rt) => rt.spawn(ctx.run()),
            None => tokio::spawn(ctx.run()),
        });
    }
}

struct StreamCtx {
    state: Arc<AppState>,
    replica: Arc<Replica>,
    stream: Arc<Stream>,
    applier: Applier,
    seq: Sequencer<Bytes>,
}

struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(max: Duration) -> Self {
        Self {
            next: Duration::from_millis(50),
            max,
        }
    }
    fn reset(&mut self) {
        self.next = Duration::from_millis(50);
    }
    fn step(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }
}

impl StreamCtx {
    fn cfg(&self) -> &crate::config::EventsSection {
        &self.state.config.events
    }

    fn set_connected(&self, connected: bool) {
        lock(&self.stream.state).connected = connected;
    }

    async fn run(mut self) {
        let mut backoff = Backoff::new(Duration::from_millis(self.cfg().max_backoff_ms.max(50)));
        loop {
            let endpoint = match self.endpoint().await {
                Ok(ep) => ep,
                Err(e) => {
                    tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, error = %e, "no event endpoint yet");
                    tokio::time::sleep(backoff.step()).await;
                    continue;
                }
            };
            let bind = self.replica.config.read().map(|c| c.bind).unwrap_or(false);
            let result = if bind {
                self.bind_session(&endpoint, &mut backoff).await
            } else {
                self.connect_session(&endpoint, &mut backoff).await
            };
            self.set_connected(false);
            match result {
                Ok(()) => {
                    tracing::info!(replica = %self.replica.name, rank = self.stream.rank, %endpoint, "event stream disconnected; reconnecting")
                }
                Err(e) => {
                    tracing::debug!(replica = %self.replica.name, rank = self.stream.rank, %endpoint, error = %e, "event stream connect failed")
                }
            }
            tokio::time::sleep(backoff.step()).await;
        }
    }

    /// The endpoint of this rank, discovering it from the replica when not configured.
    async fn endpoint(&self) -> Result<String, StreamError> {
        let current = lock(&self.stream.state).endpoint.clone();
        if !current.is_empty() {
            return Ok(current);
        }
        let mut cfg = self
            .replica
            .config
            .read()
            .map(|c| c.clone())
            .map_err(|_| StreamError::NoEndpoint("poisoned".into()))?;
        discover_event_sources(&self.state.http, &mut cfg, &self.cfg().bind_address)
            .await
            .map_err(|e| StreamError::NoEndpoint(e.to_string()))?;
        // The engine may run more DP ranks than configured: each gets its own stream.
        let added = self.state.fleet.apply_discovery(&self.replica, &cfg);
        if !added.is_empty() {
            tracing::info!(replica = %self.replica.name, ranks = cfg.data_parallel_size, "discovered more data-parallel ranks; subscribing to them");
            spawn_streams(&self.state, &self.replica, &added);
        }
        let events = cfg.event_endpoints();
        let replays = cfg.replay_endpoints();
        let rank = self.stream.rank as usize;
        let ep = events.get(rank).cloned().ok_or_else(|| {
            StreamError::NoEndpoint(format!(
                "replica lists {} ranks, need rank {rank}",
                events.len()
            ))
        })?;
        {
            let mut s = lock(&self.stream.state);
            s.endpoint = ep.clone();
            s.replay = replays.get(rank).cloned().flatten();
        }
        tracing::info!(replica = %self.replica.name, rank, endpoint = %ep, "discovered event endpoint");
        Ok(ep)
    }

    async fn connect_session(
        &mut self,
        endpoint: &str,
        backoff: &mut Backoff,
    ) -> Result<(), StreamError> {
        let topic = self.topic();
        let mut sock = match LiveSocket::connect(endpoint, &topic, self.cfg()).await {
            Ok(s) => s,
            Err(e @ StreamError::Timeout(_)) => return Err(e),
            Err(e) => return Err(self.note_error(e, endpoint)),
        };
        backoff.reset();
        self.set_connected(true);
        self.stream.stats.connects.fetch_add(1, Ordering::Relaxed);
        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, %endpoint, "event stream connected");
        // The stream may be a new engine, or may have moved on while we were away.
        self.feed(Input::Connected).await;
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                ev = sock.next() => match ev {
                    LiveEvent::Message(m) => self.on_live(&m).await,
                    LiveEvent::RecvError(e) => return Err(self.note_error(e, endpoint)),
                    LiveEvent::Disconnected | LiveEvent::Closed => return Ok(()),
                    LiveEvent::Accepted | LiveEvent::AcceptFailed(_) => {}
                },
                _ = tick.tick() => self.check_resync().await,
            }
        }
    }

    async fn bind_session(
        &mut self,
        endpoint: &str,
        backoff: &mut Backoff,
    ) -> Result<(), StreamError> {
        let topic = self.topic();
        let mut sock = LiveSocket::bind(endpoint, &topic, self.cfg(), self.accept_filter()).await?;
        backoff.reset();
        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, %endpoint, "event stream bound; waiting for the engine");
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                ev = sock.next() => match ev {
                    LiveEvent::Message(m) => {
                        self.set_connected(true);
                        self.on_live(&m).await
                    }
                    LiveEvent::RecvError(e) => {
                        // The crate drops the failing peer; the socket stays bound for others.
                        let e = self.note_error(e, &format!("a peer of {endpoint}"));
                        tracing::debug!(error = %e, "bound SUB recv error");
                        self.set_connected(false);
                    }
                    LiveEvent::Accepted => {
                        self.set_connected(true);
                        self.stream.stats.connects.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, "engine connected to bound event socket");
                        self.feed(Input::Connected).await;
                    }
                    LiveEvent::Disconnected => self.set_connected(false),
                    LiveEvent::AcceptFailed(e) => {
                        self.note_error(e, &format!("a peer of {endpoint}"));
                    }
                    LiveEvent::Closed => return Ok(()),
                },
                _ = tick.tick() => self.check_resync().await,
            }
        }
    }

    /// Admits the peers of `events.allowed_peers` (default: the replica's hosts and loopback) to
    /// the bound SUB; counts and logs (once per address) the others.
    fn accept_filter(&self) -> zeromq::AcceptFilter {
        let nets = self
            .replica
            .config
            .read()
            .map(|c| self.cfg().allowed_peer_nets(&c))
            .unwrap_or_default();
        let stream = self.stream.clone();
        let replica = self.replica.name.clone();
        Arc::new(move |peer: SocketAddr| {
            if nets.iter().any(|n| n.contains(peer.ip())) {
                return true;
            }
            stream.stats.refused_peers.fetch_add(1, Ordering::Relaxed);
            if stream
                .stats
                .first_warning(&format!("refused {}", peer.ip()))
            {
                tracing::warn!(replica = %replica, rank = stream.rank, %peer, "refused a connection to the bound event socket: peer not in events.allowed_peers");
            }
            false
        })
    }

    /// Counts the error when a peer sent an oversized message (logged at warn once per peer) or a
    /// replay was too large; returns it.
    fn note_error(&self, e: StreamError, peer: &str) -> StreamError {
        match &e {
            StreamError::MessageTooLarge(c) => {
                self.stream.stats.oversized.fetch_add(1, Ordering::Relaxed);
                if self
                    .stream
                    .stats
                    .first_warning(&format!("oversized {peer}"))
                {
                    tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, %peer, error = %c, "disconnected a peer that announced a message over events.max_message_bytes");
                }
            }
            StreamError::TooLarge { .. } => {
                self.stream
                    .stats
                    .replays_too_large
                    .fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        e
    }

    /// Logs a failed replay at warn, except an oversized message ([`Self::note_error`] already
    /// warned once for that peer).
    fn log_replay_failure(&self, e: &StreamError) {
        if matches!(e, StreamError::MessageTooLarge(_)) {
            tracing::debug!(replica = %self.replica.name, rank = self.stream.rank, error = %e, "replay failed");
        } else {
            tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, error = %e, "replay failed");
        }
    }

    fn topic(&self) -> String {
        self.replica
            .config
            .read()
            .map(|c| c.topic.clone())
            .unwrap_or_default()
    }

    fn replay_endpoint(&self) -> Option<String> {
        lock(&self.stream.state).replay.clone()
    }

    /// Restart detected elsewhere (scrape): start over from seq 0.
    async fn check_resync(&mut self) {
        if self.stream.resync.swap(false, Ordering::Relaxed) {
            self.feed(Input::RestartDetected).await;
        }
    }

    async fn on_live(&mut self, frames: &[Bytes]) {
        let live = match frames::decode_live(frames) {
            Ok(l) => l,
            Err(e) => {
                self.applier.decode_error(&e.to_string());
                return;
            }
        };
        lock(&self.stream.state).last_message = Some(std::time::Instant::now());
        let input = Input::Frame {
            seq: live.seq,
            payload: live.payload.clone(),
        };
        self.feed(input).await;
    }

    /// Passes `input` to the sequencer and carries out its actions, and those of the replays
    /// they start, in order.
    async fn feed(&mut self, input: Input<Bytes>) {
        let mut actions: VecDeque<Action<Bytes>> = self.seq.step(input).into();
        while let Some(action) = actions.pop_front() {
            match action {
                Action::Apply {
                    seq,
                    fingerprint,
                    payload,
                } => {
                    self.applier.apply(seq, fingerprint, &payload);
                    if let Some(after) = self.state.config.scheduling.event_yield_after() {
                        // Let a route handler queued on this CPU run now, not after a burst.
                        crate::scheduling::yield_if_awake_for(after);
                    }
                }
                Action::Drop {
                    why: DropReason::Duplicate,
                    ..
                } => {
                    self.stream.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                }
                Action::Drop {
                    why: DropReason::Stale,
                    ..
                }
                | Action::Buffer { .. } => {}
                Action::ResetStream { counted, reason } => self.applier.reset(counted, reason),
                Action::RequestReplay { from, cause } => {
                    if let ReplayCause::Gap { to } = cause {
                        self.stream.stats.gaps.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, from, to, "sequence gap; replaying");
                    }
                    let end = self.replay_into_sequencer(from).await;
                    actions.extend(self.seq.step(end));
                }
            }
        }
    }

    /// Runs a replay from `from`, passing every reply to the sequencer; returns how it ended
    /// ([`Input::ReplayEnd`], or [`Input::ReplayFailed`] also without a replay endpoint).
    async fn replay_into_sequencer(&mut self, from: u64) -> Input<Bytes> {
        let Some(ep) = self.replay_endpoint() else {
            return Input::ReplayFailed;
        };
        self.stream.stats.replays.fetch_add(1, Ordering::Relaxed);
        let result = async {
            let mut replay = Replay::start(&ep, from, self.cfg()).await?;
            while let Some((seq, payload)) = replay.next().await? {
                // Replies only accumulate: no actions until the end.
                let none = self.seq.step(Input::ReplayReply { seq, payload });
                debug_assert!(none.is_empty());
            }
            Ok::<_, StreamError>(())
        }
        .await;
        match result {
            Ok(()) => Input::ReplayEnd,
            Err(e) => {
                let e = self.note_error(e, &ep);
                self.stream
                    .stats
                    .replay_failures
                    .fetch_add(1, Ordering::Relaxed);
                self.log_replay_failure(&e);
                Input::ReplayFailed
            }
        }
    }
}
