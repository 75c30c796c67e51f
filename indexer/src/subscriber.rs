//! One ZeroMQ SUB per replica and data-parallel rank, feeding the index.
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

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::events::{decode_batch, KvEvent};
use tokio::time::timeout;
use zeromq::{
    CodecError, DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend,
    SubSocket, ZmqError, ZmqMessage,
};

use crate::membership::{discover_event_sources, lock, Replica, Stream};
use crate::selfcheck;
use crate::state::{AppState, ModelRuntime};

/// The sequence number vLLM sends as the end-of-replay marker.
pub const END_OF_REPLAY: u64 = u64::MAX;

/// Errors of one subscription session or replay.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// ZeroMQ error.
    #[error("zmq: {0}")]
    Zmq(zeromq::ZmqError),
    /// A peer announced a message over `events.max_message_bytes` and was disconnected.
    #[error("peer announced an oversized message: {0}")]
    MessageTooLarge(CodecError),
    /// Connect or read timed out.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The replay reply was malformed.
    #[error("malformed replay reply: {0}")]
    BadReply(String),
    /// The replay was larger than allowed.
    #[error("replay exceeded {limit} {unit}")]
    TooLarge {
        /// The bound.
        limit: usize,
        /// What it counts ("batches", "bytes").
        unit: &'static str,
    },
    /// The stream has no endpoint yet.
    #[error("no event endpoint (discovery failed: {0})")]
    NoEndpoint(String),
}

impl From<ZmqError> for StreamError {
    fn from(e: ZmqError) -> Self {
        match e {
            ZmqError::Codec(c @ CodecError::MessageTooLarge { .. }) => {
                StreamError::MessageTooLarge(c)
            }
            other => StreamError::Zmq(other),
        }
    }
}

/// Options of every ZeroMQ socket the indexer makes: connect timeout and message size bound.
fn socket_options(cfg: &crate::config::EventsSection) -> SocketOptions {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(Duration::from_millis(cfg.connect_timeout_ms));
    opts.max_message_size(cfg.max_message_bytes);
    opts
}

/// What to do with a live message, given the stream's sequence state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch: apply it.
    Apply,
    /// Already applied (seen in a replay): skip it.
    Duplicate,
    /// Batches `from..seq` are missing: replay them.
    Gap {
        /// First missing seq.
        from: u64,
    },
    /// The sequence went backwards outside a replay window: the engine restarted.
    Restart,
}

/// Sequence tracking of one stream (pure logic, no I/O).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqTracker {
    /// Last applied seq.
    pub last: Option<u64>,
    /// Seqs `lo..=hi` were applied from a replay; live copies of them are duplicates.
    pub dup_window: Option<(u64, u64)>,
    /// Fingerprint of the last applied payload (identifies the engine lifetime on reconnect).
    pub last_fingerprint: Option<u64>,
}

/// FNV-1a 64 of a payload: stable across processes and builds (it goes into snapshots).
pub fn fingerprint(payload: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in payload {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl SeqTracker {
    /// Classifies a live seq.
    pub fn classify(&self, seq: u64) -> Verdict {
        let Some(last) = self.last else {
            return Verdict::Apply;
        };
        if seq == last.wrapping_add(1) {
            Verdict::Apply
        } else if seq <= last {
            match self.dup_window {
                Some((lo, hi)) if seq >= lo && seq <= hi => Verdict::Duplicate,
                _ => Verdict::Restart,
            }
        } else {
            Verdict::Gap { from: last + 1 }
        }
    }

    /// The first seq a replay should start from.
    pub fn next_needed(&self) -> u64 {
        self.last.map(|l| l.saturating_add(1)).unwrap_or(0)
    }
}

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
            model: model.clone(),
            tracker: {
                let st = lock(&stream.state);
                SeqTracker {
                    last: st.last_seq,
                    dup_window: None,
                    last_fingerprint: st.last_fingerprint,
                }
            },
        };
        tasks.push(tokio::spawn(ctx.run()));
    }
}

struct StreamCtx {
    state: Arc<AppState>,
    replica: Arc<Replica>,
    stream: Arc<Stream>,
    model: Arc<ModelRuntime>,
    tracker: SeqTracker,
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

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
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
        let ct = Duration::from_millis(self.cfg().connect_timeout_ms);
        let mut sock = SubSocket::with_options(socket_options(self.cfg()));
        let mut monitor = sock.monitor();
        let connected = timeout(ct + Duration::from_millis(250), sock.connect(endpoint))
            .await
            .map_err(|_| StreamError::Timeout("connect"))?;
        if let Err(e) = connected {
            return Err(self.note_error(e.into(), endpoint));
        }
        let topic = self.topic();
        sock.subscribe(&topic).await?;
        backoff.reset();
        self.set_connected(true);
        self.stream.stats.connects.fetch_add(1, Ordering::Relaxed);
        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, %endpoint, "event stream connected");
        // The stream may be a new engine, or may have moved on while we were away.
        self.sync_after_connect().await;
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                msg = sock.recv() => match msg {
                    Ok(m) => self.on_live(m).await,
                    Err(e) => return Err(self.note_error(e.into(), endpoint)),
                },
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) | None => return Ok(()),
                    Some(_) => {}
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
        let mut opts = socket_options(self.cfg());
        opts.accept_filter(self.accept_filter());
        let mut sock = SubSocket::with_options(opts);
        let mut monitor = sock.monitor();
        sock.bind(endpoint).await?;
        let topic = self.topic();
        sock.subscribe(&topic).await?;
        backoff.reset();
        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, %endpoint, "event stream bound; waiting for the engine");
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                msg = sock.recv() => match msg {
                    Ok(m) => {
                        self.set_connected(true);
                        self.on_live(m).await
                    }
                    Err(e) => {
                        // The crate drops the failing peer; the socket stays bound for others.
                        let e = self.note_error(e.into(), &format!("a peer of {endpoint}"));
                        tracing::debug!(error = %e, "bound SUB recv error");
                        self.set_connected(false);
                    }
                },
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Accepted(..)) => {
                        self.set_connected(true);
                        self.stream.stats.connects.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(replica = %self.replica.name, rank = self.stream.rank, "engine connected to bound event socket");
                        self.sync_after_connect().await;
                    }
                    Some(SocketEvent::Disconnected(_)) => self.set_connected(false),
                    Some(SocketEvent::AcceptFailed(e)) => {
                        self.note_error(e.into(), &format!("a peer of {endpoint}"));
                    }
                    Some(_) => {}
                    None => return Ok(()),
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
            self.reset_stream("engine restart detected from metrics");
            self.tracker = SeqTracker::default();
            self.replay_and_apply(0, None).await;
        }
    }

    /// After a (re)connect the stream may belong to a new engine whose seq has passed ours, so
    /// sequence numbers alone cannot tell. Replay from our last seq (not the one after): the same
    /// engine sends back the very batch we applied last (same fingerprint), a new one does not.
    async fn sync_after_connect(&mut self) {
        let (Some(last), Some(fp)) = (self.tracker.last, self.tracker.last_fingerprint) else {
            let from = self.tracker.next_needed();
            self.replay_and_apply(from, None).await;
            return;
        };
        let batches = match self.replay_endpoint() {
            Some(ep) => {
                self.stream.stats.replays.fetch_add(1, Ordering::Relaxed);
                match replay(&ep, last, self.cfg()).await {
                    Ok(b) => Some(b),
                    Err(e) => {
                        let e = self.note_error(e, &ep);
                        self.stream
                            .stats
                            .replay_failures
                            .fetch_add(1, Ordering::Relaxed);
                        self.log_replay_failure(&e);
                        None
                    }
                }
            }
            None => None,
        };
        let same_engine = batches
            .as_ref()
            .and_then(|b| b.first())
            .is_some_and(|(seq, payload)| *seq == last && fingerprint(payload) == fp);
        if !same_engine {
            self.reset_stream(
                "reconnected to a different engine lifetime, or replay cannot resume",
            );
            self.replay_and_apply(0, None).await;
            return;
        }
        let mut applied_any = false;
        for (seq, payload) in batches.unwrap_or_default() {
            if self.tracker.last.is_some_and(|l| seq <= l) {
                continue;
            }
            self.apply(seq, &payload);
            applied_any = true;
        }
        if applied_any {
            self.tracker.dup_window = Some((last + 1, self.tracker.last.unwrap_or(last)));
        }
    }

    /// Drops this stream's index entries and sequence state.
    fn reset_stream(&mut self, why: &str) {
        let had_state = self.tracker.last.is_some();
        {
            let mut idx = lock(&self.state.index);
            idx.clear_replica(self.stream.index_id);
            let mut s = lock(&self.stream.state);
            s.last_seq = None;
            s.last_fingerprint = None;
        }
        self.tracker = SeqTracker::default();
        if had_state {
            self.stream.stats.resets.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, reason = why, "dropped this stream's index entries");
        }
    }

    async fn on_live(&mut self, msg: ZmqMessage) {
        let frames = msg.into_vec();
        let (seq_frame, payload) = match frames.len() {
            3 => (&frames[1], &frames[2]),
            2 => (&frames[0], &frames[1]),
            n => {
                self.garbage(&format!("live message with {n} frames"));
                return;
            }
        };
        let Some(seq) = parse_seq(seq_frame) else {
            self.garbage("sequence frame is not 8 bytes");
            return;
        };
        lock(&self.stream.state).last_message = Some(std::time::Instant::now());
        match self.tracker.classify(seq) {
            Verdict::Apply => {
                self.tracker.dup_window = None;
                self.apply(seq, payload);
            }
            Verdict::Duplicate => {
                self.stream.stats.duplicates.fetch_add(1, Ordering::Relaxed);
            }
            Verdict::Gap { from } => {
                self.stream.stats.gaps.fetch_add(1, Ordering::Relaxed);
                tracing::info!(replica = %self.replica.name, rank = self.stream.rank, from, to = seq, "sequence gap; replaying");
                self.replay_and_apply(from, Some((seq, payload.clone())))
                    .await;
            }
            Verdict::Restart => {
                self.reset_stream("sequence went backwards (engine restart)");
                // The new engine's earlier batches are in its replay buffer.
                self.replay_and_apply(0, Some((seq, payload.clone()))).await;
            }
        }
    }

    /// Replays from `from`, applies what it returns, then `live` if it is still new. A replay
    /// that cannot cover `from` (no replay endpoint, failure, or starting later) drops the stream's
    /// entries first, unless nothing was known.
    async fn replay_and_apply(&mut self, from: u64, live: Option<(u64, Bytes)>) {
        let result = match self.replay_endpoint() {
            Some(ep) => {
                self.stream.stats.replays.fetch_add(1, Ordering::Relaxed);
                let r = replay(&ep, from, self.cfg())
                    .await
                    .map_err(|e| self.note_error(e, &ep));
                if let Err(e) = &r {
                    self.stream
                        .stats
                        .replay_failures
                        .fetch_add(1, Ordering::Relaxed);
                    self.log_replay_failure(e);
                }
                r.ok()
            }
            None => None,
        };
        let first = result.as_ref().and_then(|b| b.first()).map(|(s, _)| *s);
        let needs_history = live.is_some() || self.tracker.last.is_some();
        let covered = match (&result, first) {
            (None, _) => false,
            (Some(_), Some(f)) => f <= from,
            // Nothing buffered at or after `from`: fine after a reconnect (nothing new), not when a
            // live batch proves newer ones exist.
            (Some(_), None) => live.as_ref().map(|(s, _)| *s == from).unwrap_or(true),
        };
        let batches = result.unwrap_or_default();
        if !covered && needs_history {
            self.reset_stream("replay cannot cover the missing batches");
        }
        let before = self.tracker.last;
        let mut applied_any = false;
        for (seq, payload) in &batches {
            if self.tracker.last.is_some_and(|l| *seq <= l) {
                continue;
            }
            self.apply(*seq, payload);
            applied_any = true;
        }
        if applied_any {
            self.tracker.dup_window = Some((
                before.map(|b| b + 1).unwrap_or(0),
                self.tracker.last.unwrap_or(0),
            ));
        }
        if let Some((seq, payload)) = live {
            if self.tracker.last.is_none_or(|l| seq > l) {
                self.apply(seq, &payload);
            }
        }
    }

    fn garbage(&self, what: &str) {
        let n = self.stream.stats.garbage.fetch_add(1, Ordering::Relaxed);
        if n < 10 || n.is_power_of_two() {
            tracing::warn!(replica = %self.replica.name, rank = self.stream.rank, count = n + 1, "skipping undecodable event message: {what}");
        }
    }

    /// Decodes one batch and applies it; the stream's seq advances even when the payload is
    /// garbage (the engine will never resend it).
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        let fp = fingerprint(payload);
        self.tracker.last = Some(seq);
        self.tracker.last_fingerprint = Some(fp);
        let batch = match decode_batch(payload) {
            Ok(b) => Some(b),
            Err(e) => {
                self.garbage(&e.to_string());
                None
            }
        };
        if let Some(batch) = &batch {
            for ev in &batch.events {
                if let KvEvent::BlockStored(bs) = ev {
                    if self.model.block_size().is_none() && bs.block_size > 0 {
                        self.model
                            .block_size
                            .store(bs.block_size, Ordering::Relaxed);
                        tracing::info!(model = %self.model.name, block_size = bs.block_size, "learned block size from events");
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
        let mut idx = lock(&self.state.index);
        if let Some(batch) = &batch {
            for ev in &batch.events {
                match idx.apply(self.stream.index_id, ev) {
                    Ok(_) => {
                        self.stream.stats.events.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let n = self
                            .stream
                            .stats
                            .rejected_events
                            .fetch_add(1, Ordering::Relaxed);
                        if n < 10 {
                            tracing::debug!(replica = %self.replica.name, error = %e, "index rejected an event");
                        }
                    }
                }
            }
            self.stream.stats.batches.fetch_add(1, Ordering::Relaxed);
        }
        // Updated under the index lock so a snapshot sees entries and seq together.
        let mut s = lock(&self.stream.state);
        s.last_seq = Some(seq);
        s.last_fingerprint = Some(fp);
        s.last_message = Some(std::time::Instant::now());
        if let Some(batch) = &batch {
            s.last_batch_ts = Some(batch.ts);
            s.lag_seconds = Some((now - batch.ts).max(0.0));
        }
    }
}

fn parse_seq(frame: &[u8]) -> Option<u64> {
    let arr: [u8; 8] = frame.try_into().ok()?;
    Some(u64::from_be_bytes(arr))
}

/// Asks a replica's ROUTER for every buffered batch with seq >= `start`, through a new DEALER.
/// Returns `(seq, payload)` oldest first. Handles both reply layouts: `[b"", topic, seq, payload]`
/// (vLLM >= 0.26) and `[b"", seq, payload]` (<= 0.25). Bounded by `cfg`: timeouts on connect
/// and every read, `max_message_bytes` per message, `replay_max_batches` and `replay_max_bytes`
/// (payload bytes) in total.
pub async fn replay(
    endpoint: &str,
    start: u64,
    cfg: &crate::config::EventsSection,
) -> Result<Vec<(u64, Bytes)>, StreamError> {
    let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms);
    let read_timeout = Duration::from_millis(cfg.replay_read_timeout_ms);
    let mut dealer = DealerSocket::with_options(socket_options(cfg));
    timeout(
        connect_timeout + Duration::from_millis(250),
        dealer.connect(endpoint),
    )
    .await
    .map_err(|_| StreamError::Timeout("replay connect"))??;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .map_err(|e| StreamError::BadReply(e.to_string()))?;
    timeout(read_timeout, dealer.send(request))
        .await
        .map_err(|_| StreamError::Timeout("replay send"))??;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let msg = timeout(read_timeout, dealer.recv())
            .await
            .map_err(|_| StreamError::Timeout("replay read"))??;
        let mut frames = msg.into_vec();
        if frames.first().is_some_and(|f| f.is_empty()) && frames.len() >= 3 {
            frames.remove(0);
        }
        let (seq_frame, payload) = match frames.len() {
            3 => (frames[1].clone(), frames[2].clone()),
            2 => (frames[0].clone(), frames[1].clone()),
            n => return Err(StreamError::BadReply(format!("{n} frames"))),
        };
        let seq = parse_seq(&seq_frame)
            .ok_or_else(|| StreamError::BadReply("sequence frame is not 8 bytes".into()))?;
        if seq == END_OF_REPLAY {
            return Ok(out);
        }
        if out.len() >= cfg.replay_max_batches {
            return Err(StreamError::TooLarge {
                limit: cfg.replay_max_batches,
                unit: "batches",
            });
        }
        bytes = bytes.saturating_add(payload.len());
        if bytes > cfg.replay_max_bytes {
            return Err(StreamError::TooLarge {
                limit: cfg.replay_max_bytes,
                unit: "bytes",
            });
        }
        // A copy, so the bound holds for memory too: a slice would keep the whole read buffer
        // it was cut from alive.
        out.push((seq, Bytes::copy_from_slice(&payload)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_sequences() {
        let mut t = SeqTracker::default();
        assert_eq!(t.classify(5), Verdict::Apply);
        t.last = Some(5);
        assert_eq!(t.classify(6), Verdict::Apply);
        assert_eq!(t.classify(9), Verdict::Gap { from: 6 });
        assert_eq!(t.classify(3), Verdict::Restart);
        t.dup_window = Some((2, 5));
        assert_eq!(t.classify(3), Verdict::Duplicate);
        assert_eq!(t.classify(1), Verdict::Restart);
        assert_eq!(t.next_needed(), 6);
    }
}
