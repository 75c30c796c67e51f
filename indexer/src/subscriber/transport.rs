//! The ZeroMQ side of one stream: the SUB socket of the live stream (connect or bind mode) and the
//! DEALER of one replay. Frames in and out, laid out by [`kvroute_core::events::frames`]; no
//! sequencing, no index. Every socket refuses messages over `events.max_message_bytes` before
//! allocating them; a replay is bounded by `replay_max_batches` / `replay_max_bytes` and a timeout
//! on every read; a bound SUB admits only the peers its accept filter allows.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::events::frames::{self, FrameError, ReplayReply};
use tokio::time::timeout;
use zeromq::{
    AcceptFilter, CodecError, DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv,
    SocketSend, SubSocket, ZmqError, ZmqMessage,
};

use crate::config::EventsSection;

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
    BadReply(#[from] FrameError),
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
fn socket_options(cfg: &EventsSection) -> SocketOptions {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(Duration::from_millis(cfg.connect_timeout_ms));
    opts.max_message_size(cfg.max_message_bytes);
    opts
}

/// What the live socket reported.
#[derive(Debug)]
pub enum LiveEvent {
    /// A message (its frames, not yet checked against the live layout).
    Message(Vec<Bytes>),
    /// A receive error (in bind mode the failing peer is dropped and the socket stays bound).
    RecvError(StreamError),
    /// A peer connected to the bound socket.
    Accepted,
    /// A peer failed to connect to the bound socket.
    AcceptFailed(StreamError),
    /// A peer disconnected.
    Disconnected,
    /// The socket's monitor ended.
    Closed,
}

/// The live SUB socket of one stream.
pub struct LiveSocket {
    sock: SubSocket,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
}

impl LiveSocket {
    /// Connects to an engine's PUB (connect timeout from `cfg`) and subscribes to `topic`.
    pub async fn connect(
        endpoint: &str,
        topic: &str,
        cfg: &EventsSection,
    ) -> Result<Self, StreamError> {
        let ct = Duration::from_millis(cfg.connect_timeout_ms);
        let mut sock = SubSocket::with_options(socket_options(cfg));
        let monitor = sock.monitor();
        timeout(ct + Duration::from_millis(250), sock.connect(endpoint))
            .await
            .map_err(|_| StreamError::Timeout("connect"))??;
        sock.subscribe(topic).await?;
        Ok(Self { sock, monitor })
    }

    /// Binds `endpoint` for an engine that connects out, admitting the peers `filter` allows,
    /// and subscribes to `topic`.
    pub async fn bind(
        endpoint: &str,
        topic: &str,
        cfg: &EventsSection,
        filter: AcceptFilter,
    ) -> Result<Self, StreamError> {
        let mut opts = socket_options(cfg);
        opts.accept_filter(filter);
        let mut sock = SubSocket::with_options(opts);
        let monitor = sock.monitor();
        sock.bind(endpoint).await?;
        sock.subscribe(topic).await?;
        Ok(Self { sock, monitor })
    }

    /// The next message or connection event (other monitor events are skipped).
    pub async fn next(&mut self) -> LiveEvent {
        loop {
            tokio::select! {
                msg = self.sock.recv() => return match msg {
                    Ok(m) => LiveEvent::Message(m.into_vec()),
                    Err(e) => LiveEvent::RecvError(e.into()),
                },
                ev = self.monitor.next() => match ev {
                    Some(SocketEvent::Accepted(..)) => return LiveEvent::Accepted,
                    Some(SocketEvent::Disconnected(_)) => return LiveEvent::Disconnected,
                    Some(SocketEvent::AcceptFailed(e)) => return LiveEvent::AcceptFailed(e.into()),
                    Some(_) => {}
                    None => return LiveEvent::Closed,
                },
            }
        }
    }
}

/// One replay through a new DEALER: the request is sent on [`Replay::start`], the replies are
/// read with [`Replay::next`].
pub struct Replay {
    dealer: DealerSocket,
    read_timeout: Duration,
    max_batches: usize,
    max_bytes: usize,
    batches: usize,
    bytes: usize,
}

impl Replay {
    /// Connects to a replica's ROUTER and asks for every buffered batch with seq >= `start`.
    pub async fn start(
        endpoint: &str,
        start: u64,
        cfg: &EventsSection,
    ) -> Result<Self, StreamError> {
        let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms);
        let read_timeout = Duration::from_millis(cfg.replay_read_timeout_ms);
        let mut dealer = DealerSocket::with_options(socket_options(cfg));
        timeout(
            connect_timeout + Duration::from_millis(250),
            dealer.connect(endpoint),
        )
        .await
        .map_err(|_| StreamError::Timeout("replay connect"))??;
        let request = ZmqMessage::try_from(frames::encode_replay_request::<Bytes>(start))
            .map_err(|_| StreamError::Zmq(ZmqError::NoMessage))?;
        timeout(read_timeout, dealer.send(request))
            .await
            .map_err(|_| StreamError::Timeout("replay send"))??;
        Ok(Self {
            dealer,
            read_timeout,
            max_batches: cfg.replay_max_batches,
            max_bytes: cfg.replay_max_bytes,
            batches: 0,
            bytes: 0,
        })
    }

    /// The next replayed `(seq, payload)`, oldest first; `None` at the end marker. Either reply
    /// layout is understood (`[b"", topic, seq, payload]`, vLLM >= 0.26; `[b"", seq, payload]`,
    /// <= 0.25). Fails past `replay_max_batches` or `replay_max_bytes` (payload bytes in total).
    pub async fn next(&mut self) -> Result<Option<(u64, Bytes)>, StreamError> {
        let msg = timeout(self.read_timeout, self.dealer.recv())
            .await
            .map_err(|_| StreamError::Timeout("replay read"))??;
        let frames = msg.into_vec();
        let batch = match frames::decode_replay_reply(&frames)? {
            ReplayReply::End => return Ok(None),
            ReplayReply::Batch(b) => b,
        };
        if self.batches >= self.max_batches {
            return Err(StreamError::TooLarge {
                limit: self.max_batches,
                unit: "batches",
            });
        }
        self.bytes = self.bytes.saturating_add(batch.payload.len());
        if self.bytes > self.max_bytes {
            return Err(StreamError::TooLarge {
                limit: self.max_bytes,
                unit: "bytes",
            });
        }
        self.batches += 1;
        // A copy, so the bound holds for memory too: a slice would keep the whole read buffer
        // it was cut from alive.
        Ok(Some((batch.seq, Bytes::copy_from_slice(batch.payload))))
    }
}

/// Asks a replica's ROUTER for every buffered batch with seq >= `start` and collects the replies
/// ([`Replay`]), oldest first.
pub async fn replay(
    endpoint: &str,
    start: u64,
    cfg: &EventsSection,
) -> Result<Vec<(u64, Bytes)>, StreamError> {
    let mut r = Replay::start(endpoint, start, cfg).await?;
    let mut out = Vec::new();
    while let Some(batch) = r.next().await? {
        out.push(batch);
    }
    Ok(out)
}
