//! The KV event publisher, as vLLM 0.33.0's `ZmqEventPublisher` (vllm/distributed/kv_events.py):
//!
//! * a PUB socket sending `[topic, seq (u64 big-endian, from 0), payload]`, one message per
//!   scheduler step that produced events; it binds when the endpoint has `*` or `::` or is
//!   ipc/inproc, and connects otherwise;
//! * an optional ROUTER replay socket (always bound): a DEALER sends `[b"", start_seq]` and gets
//!   every buffered batch with `seq >= start_seq`, oldest first, as `[b"", topic, seq, payload]`
//!   (`[b"", seq, payload]` for array layouts, as vLLM <= 0.25), then `[b"", b"", ff*8, b""]`;
//! * the engine never waits for it: batches go through a bounded queue (`max_queue_size`) and
//!   are dropped and counted when it is full. ZeroMQ itself drops for slow subscribers.
//!
//! The frame layouts are [`kvroute_core::events::frames`]'s, shared with the indexer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::events::frames;
use kvroute_core::events::{
    encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium, WireBlockHash, WireLayout,
};
use kvroute_core::hybrid::GroupKind;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::block_pool::PoolEvent;
use crate::cli::KvEventsConfig;

/// Converts pool events to vLLM's event model (integer hashes, GPU medium, the event's group;
/// `BlockStored` annotated with the group's `kv_cache_spec_kind` and
/// `kv_cache_spec_sliding_window` from `groups`, as `KVCacheManager.take_events` does).
pub fn to_kv_events(events: &[PoolEvent], groups: &[GroupKind]) -> Vec<KvEvent> {
    events
        .iter()
        .map(|e| match e {
            PoolEvent::Stored {
                meta,
                parent,
                hashes,
                first_block,
                token_ids,
                block_size,
                group,
            } => KvEvent::BlockStored(BlockStored {
                block_hashes: hashes
                    .iter()
                    .map(|h| WireBlockHash::Int(h.wire_u64()))
                    .collect(),
                parent_block_hash: parent.map(|p| WireBlockHash::Int(p.wire_u64())),
                token_ids: token_ids.clone(),
                block_size: *block_size as u32,
                lora_id: meta.lora_id,
                medium: Some(Medium::Gpu),
                lora_name: meta.lora_name.clone(),
                extra_keys: if hashes.is_empty() {
                    None
                } else {
                    Some(
                        (0..hashes.len())
                            .map(|i| meta.extra_for_block(first_block + i))
                            .collect(),
                    )
                },
                group_idx: Some(i64::from(*group)),
                kv_cache_spec_kind: groups
                    .get(usize::from(*group))
                    .map(|k| k.event_fields().0.to_string()),
                kv_cache_spec_sliding_window: groups
                    .get(usize::from(*group))
                    .and_then(|k| k.event_fields().1),
                session_id: meta.session_id.clone(),
                ..BlockStored::default()
            }),
            PoolEvent::Removed(h, group) => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![WireBlockHash::Int(h.wire_u64())],
                medium: Some(Medium::Gpu),
                group_idx: Some(i64::from(*group)),
                ..BlockRemoved::default()
            }),
            PoolEvent::Cleared => KvEvent::AllBlocksCleared,
        })
        .collect()
}

/// Publisher errors (all at start-up; publishing itself never fails the engine).
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// Binding or connecting a socket failed.
    #[error("kv events socket {endpoint}: {reason}")]
    Socket {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
}

/// The engine's handle to its publisher: never blocks.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: mpsc::Sender<EventBatch>,
    dropped: Arc<AtomicU64>,
}

impl EventSink {
    /// Queues a batch; returns false (and counts it) when the queue is full or closed.
    pub fn try_publish(&self, batch: EventBatch) -> bool {
        match self.tx.try_send(batch) {
            Ok(()) => true,
            Err(_) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Batches dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A running publisher.
pub struct Publisher {
    /// The engine side.
    pub sink: EventSink,
    /// The resolved config (what `/kv_event_sources` reports).
    pub config: KvEventsConfig,
    task: JoinHandle<()>,
}

impl Publisher {
    /// Waits for the publisher to flush and exit (after every sink clone is dropped).
    pub async fn join(self) {
        drop(self.sink);
        let _ = self.task.await;
    }
}

/// Whether vLLM would bind (rather than connect) this endpoint.
pub fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The address the zeromq crate binds for `endpoint`: `*` becomes `host`, the simulator's
/// `--host` (127.0.0.1 unless set). vLLM binds `*` on every interface; the simulator keeps its
/// event and replay sockets on the interface of its HTTP server instead, because `BlockStored`
/// carries prompt token ids: `--host 0.0.0.0` opts into every interface. (The zeromq crate's
/// resolver does not know `*` anyway.)
pub fn bindable(endpoint: &str, host: &str) -> String {
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    endpoint.replace("tcp://*:", &format!("tcp://{host}:"))
}

fn sock_err(endpoint: &str, e: impl std::fmt::Display) -> EventsError {
    EventsError::Socket {
        endpoint: endpoint.to_string(),
        reason: e.to_string(),
    }
}

/// Starts the publisher for one engine rank (`cfg` already offset for the rank); `*` endpoints
/// bind on `bind_host` ([`bindable`]).
pub async fn start(
    cfg: KvEventsConfig,
    layout: WireLayout,
    data_parallel_rank: i64,
    bind_host: &str,
) -> Result<Publisher, EventsError> {
    let mut publisher = zeromq::PubSocket::new();
    let mut pending_connect = None;
    if is_bind_endpoint(&cfg.endpoint) {
        publisher
            .bind(&bindable(&cfg.endpoint, bind_host))
            .await
            .map_err(|e| sock_err(&cfg.endpoint, e))?;
    } else {
        // vLLM's connect (libzmq) never fails: it keeps reconnecting. The zeromq crate's connect
        // retries a refused connection itself but fails on a peer that hangs up during the ZMTP
        // handshake (a subscriber closing or restarting its socket). Try briefly here, then keep
        // retrying from the publisher task, whatever the first attempt met, so a subscriber
        // that binds or settles later is still reached.
        let ep = cfg.endpoint.clone();
        let connect = tokio::time::timeout(
            std::time::Duration::from_millis(500),
            publisher.connect(&ep),
        )
        .await;
        let unreachable = match connect {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("no answer in 500 ms".to_string()),
        };
        if let Some(reason) = unreachable {
            tracing::warn!(endpoint = %ep, %reason, "kv events: subscriber not reachable yet, retrying");
            pending_connect = Some(ep);
        }
    }
    let replay = match &cfg.replay_endpoint {
        Some(ep) => {
            let mut r = zeromq::RouterSocket::new();
            r.bind(&bindable(ep, bind_host))
                .await
                .map_err(|e| sock_err(ep, e))?;
            Some(r)
        }
        None => None,
    };
    let (tx, rx) = mpsc::channel(cfg.max_queue_size.max(1));
    let dropped = Arc::new(AtomicU64::new(0));
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let task = tokio::spawn(run(
        publisher,
        replay,
        rx,
        RunCfg {
            topic,
            layout,
            buffer_steps: cfg.buffer_steps,
            rank: data_parallel_rank,
            pending_connect,
        },
    ));
    tracing::info!(endpoint = %cfg.endpoint, replay = ?cfg.replay_endpoint, "kv events publisher started");
    Ok(Publisher {
        sink: EventSink { tx, dropped },
        config: cfg,
        task,
    })
}

struct RunCfg {
    topic: Bytes,
    layout: WireLayout,
    buffer_steps: usize,
    rank: i64,
    /// A connect-mode endpoint not reached yet: retried every [`CONNECT_RETRY`].
    pending_connect: Option<String>,
}

/// How often a connect-mode publisher retries reaching its subscriber.
const CONNECT_RETRY: std::time::Duration = std::time::Duration::from_millis(250);

async fn run(
    mut publisher: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    mut rx: mpsc::Receiver<EventBatch>,
    mut cfg: RunCfg,
) {
    let mut retry = tokio::time::interval(CONNECT_RETRY);
    let legacy_replay = cfg.layout != WireLayout::V0_33;
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    let mut seq: u64 = 0;
    let (mut replay_tx, mut replay_rx) = match replay {
        Some(r) => {
            let (send, mut recv) = r.split();
            let (req_tx, req_rx) = mpsc::channel::<ZmqMessage>(64);
            tokio::spawn(async move {
                while let Ok(m) = recv.recv().await {
                    if req_tx.send(m).await.is_err() {
                        break;
                    }
                }
            });
            (Some(send), Some(req_rx))
        }
        None => (None, None),
    };
    loop {
        tokio::select! {
            batch = rx.recv() => {
                let Some(mut batch) = batch else { break };
                if batch.data_parallel_rank.is_none() {
                    batch.data_parallel_rank = Some(cfg.rank);
                }
                let payload = Bytes::from(encode_batch(&batch, cfg.layout));
                let live = frames::encode_live(cfg.topic.clone(), seq, payload.clone());
                match ZmqMessage::try_from(live) {
                    Ok(m) => {
                        if let Err(e) = publisher.send(m).await {
                            tracing::warn!(error = %e, "kv events: publish failed");
                        }
                    }
                    Err(e) => tracing::warn!(error = ?e, "kv events: bad message"),
                }
                if cfg.buffer_steps > 0 {
                    if buffer.len() >= cfg.buffer_steps {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload));
                }
                seq += 1;
            }
            req = recv_opt(&mut replay_rx) => {
                let (Some(req), Some(send)) = (req, replay_tx.as_mut()) else {
                    replay_rx = None;
                    continue;
                };
                serve_replay(send, req, &buffer, &cfg.topic, legacy_replay).await;
            }
            _ = retry.tick(), if cfg.pending_connect.is_some() => {
                if let Some(ep) = cfg.pending_connect.clone() {
                    if let Ok(Ok(())) = tokio::time::timeout(CONNECT_RETRY, publisher.connect(&ep)).await {
                        tracing::info!(endpoint = %ep, "kv events: connected to subscriber");
                        cfg.pending_connect = None;
                    }
                }
            }
        }
    }
    tracing::debug!("kv events publisher stopped");
}

async fn recv_opt(rx: &mut Option<mpsc::Receiver<ZmqMessage>>) -> Option<ZmqMessage> {
    match rx {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

async fn serve_replay(
    send: &mut zeromq::RouterSendHalf,
    req: ZmqMessage,
    buffer: &VecDeque<(u64, Bytes)>,
    topic: &Bytes,
    legacy: bool,
) {
    let parts = req.into_vec();
    // [identity, b"", start_seq]: anything else is ignored, as vLLM does.
    let request = parts
        .split_first()
        .map(|(id, rest)| (id, frames::decode_replay_request(rest)));
    let (id, start_seq) = match request {
        Some((id, Ok(start))) => (id.clone(), start),
        Some((_, Err(e))) => {
            tracing::warn!(frames = parts.len(), error = %e, "kv events: invalid replay request");
            return;
        }
        None => {
            tracing::warn!(frames = 0, "kv events: invalid replay request");
            return;
        }
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start_seq) {
        let mut f = vec![id.clone()];
        f.extend(frames::encode_replay_reply(
            (!legacy).then(|| topic.clone()),
            *seq,
            payload.clone(),
        ));
        if !send_frames(send, f).await {
            return;
        }
    }
    let mut end = vec![id];
    end.extend(frames::encode_replay_end::<Bytes>(!legacy));
    send_frames(send, end).await;
}

async fn send_frames(send: &mut zeromq::RouterSendHalf, frames: Vec<Bytes>) -> bool {
    match ZmqMessage::try_from(frames) {
        Ok(m) => match send.send(m).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "kv events: replay send failed");
                false
            }
        },
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn wildcard_endpoints_bind_on_the_http_host() {
        assert_eq!(
            bindable("tcp://*:5557", "127.0.0.1"),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(bindable("tcp://*:5557", "::1"), "tcp://[::1]:5557");
        assert_eq!(bindable("tcp://*:5557", "0.0.0.0"), "tcp://0.0.0.0:5557");
        assert_eq!(
            bindable("tcp://10.0.0.1:5558", "127.0.0.1"),
            "tcp://10.0.0.1:5558"
        );
    }

    /// The local addresses of the listening TCP sockets on `port` (Linux `/proc/net/tcp`).
    #[cfg(target_os = "linux")]
    fn listeners_on(port: u16) -> Vec<std::net::Ipv4Addr> {
        let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        table
            .lines()
            .skip(1)
            .filter_map(|line| {
                let cols: Vec<&str> = line.split_whitespace().collect();
                let (addr, p) = cols.get(1)?.split_once(':')?;
                (cols.get(3) == Some(&"0A") && u16::from_str_radix(p, 16).ok()? == port).then(
                    || {
                        std::net::Ipv4Addr::from(
                            u32::from_str_radix(addr, 16).unwrap_or(0).swap_bytes(),
                        )
                    },
                )
            })
            .collect()
    }

    /// Prompts leak through the event stream (`BlockStored` carries token ids): with the default
    /// flags and vLLM's usual `tcp://*:PORT` endpoints, both sockets listen on loopback only.
    #[cfg(target_os = "linux")]
    #[test]
    fn default_event_sockets_listen_on_loopback_only() {
        let cli = crate::cli::Cli::parse_from(["kvroute-sim", "--model-dir", "/unused"]);
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port")
        };
        let (events, replay) = (free(), free());
        let cfg = KvEventsConfig::parse(&format!(
            r#"{{"enable_kv_cache_events":true,"endpoint":"tcp://*:{events}","replay_endpoint":"tcp://*:{replay}"}}"#
        ))
        .expect("config");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let publisher = start(cfg, WireLayout::V0_33, 0, &cli.host)
                .await
                .expect("publisher");
            for (what, port) in [("PUB", events), ("replay ROUTER", replay)] {
                let addrs = listeners_on(port);
                assert!(
                    !addrs.is_empty() && addrs.iter().all(|a| a.is_loopback()),
                    "the {what} socket on port {port} listens on {addrs:?}, not loopback only"
                );
            }
            publisher.join().await;
        });
    }
}
