//! Test helpers: a ZeroMQ publisher that speaks vLLM's KV event protocol (PUB + ROUTER replay,
//! encoded with kvroute_core's encoder), and an in-process indexer.
#![allow(dead_code, unused_imports)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_core::events::{
    encode_batch, BlockStored, EventBatch, KvEvent, WireBlockHash, WireLayout,
};
use kvroute_indexer::config::Config;
use kvroute_indexer::policies::Policy;
use kvroute_indexer::state::AppState;
pub use kvroute_testkit::ports::free_port;
use zeromq::{Endpoint, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// A replica's event publisher: PUB for live batches, ROUTER for replay, a bounded buffer.
pub struct Publisher {
    pub pub_port: u16,
    pub replay_port: u16,
    pub topic: String,
    sock: PubSocket,
    buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    pub next_seq: u64,
    router_task: tokio::task::JoinHandle<()>,
}

fn port_of(ep: &Endpoint) -> u16 {
    match ep {
        Endpoint::Tcp(_, p) => *p,
        _ => panic!("not tcp"),
    }
}

impl Publisher {
    /// Binds PUB and ROUTER (on the given ports, or ephemeral ones).
    pub async fn start(pub_port: u16, replay_port: u16) -> Publisher {
        let mut sock = PubSocket::new();
        let ep = sock
            .bind(&format!("tcp://127.0.0.1:{pub_port}"))
            .await
            .expect("bind PUB");
        let pub_port = port_of(&ep);
        let mut router = RouterSocket::new();
        let rep = router
            .bind(&format!("tcp://127.0.0.1:{replay_port}"))
            .await
            .expect("bind ROUTER");
        let replay_port = port_of(&rep);
        let buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>> = Arc::default();
        let buf = buffer.clone();
        let topic = "kv-events".to_string();
        let t = topic.clone();
        let router_task = tokio::spawn(async move {
            loop {
                let Ok(msg) = router.recv().await else {
                    continue;
                };
                let frames = msg.into_vec();
                if frames.len() != 3 || frames[2].len() != 8 {
                    continue;
                }
                let id = frames[0].clone();
                let start = u64::from_be_bytes(frames[2][..].try_into().unwrap());
                let items: Vec<(u64, Bytes)> = buf
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, payload) in items {
                    let m = ZmqMessage::try_from(vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::from(t.clone()),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ])
                    .unwrap();
                    let _ = router.send(m).await;
                }
                let end = ZmqMessage::try_from(vec![
                    id,
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
                    Bytes::new(),
                ])
                .unwrap();
                let _ = router.send(end).await;
            }
        });
        Publisher {
            pub_port,
            replay_port,
            topic,
            sock,
            buffer,
            next_seq: 0,
            router_task,
        }
    }

    /// Publishes raw payload bytes as the next batch; returns its seq.
    pub async fn publish_raw(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.buffer_only(payload);
        let payload = self.buffer.lock().unwrap().back().unwrap().1.clone();
        let m = ZmqMessage::try_from(vec![
            Bytes::from(self.topic.clone()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ])
        .unwrap();
        self.sock.send(m).await.expect("PUB send");
        seq
    }

    /// Buffers a batch for replay without sending it live (a dropped message); returns its seq.
    pub fn buffer_only(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut b = self.buffer.lock().unwrap();
        b.push_back((seq, Bytes::from(payload)));
        while b.len() > 10_000 {
            b.pop_front();
        }
        seq
    }

    /// Publishes events as the next batch.
    pub async fn publish(&mut self, events: Vec<KvEvent>) -> u64 {
        self.publish_raw(batch_bytes(events)).await
    }

    /// Forgets buffered batches older than `seq` (a rotated replay buffer).
    pub fn forget_before(&mut self, seq: u64) {
        self.buffer.lock().unwrap().retain(|(s, _)| *s >= seq);
    }

    /// Stops both sockets (an engine going away).
    pub async fn stop(self) {
        self.router_task.abort();
        let _ = self.router_task.await;
        drop(self.sock);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Encodes a batch as vLLM 0.33.0 does.
pub fn batch_bytes(events: Vec<KvEvent>) -> Vec<u8> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    encode_batch(
        &EventBatch {
            ts,
            events,
            data_parallel_rank: Some(0),
        },
        WireLayout::V0_33,
    )
}

/// A BlockStored of `tokens` (whole blocks of `bs`) with the given wire hashes.
pub fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> KvEvent {
    assert_eq!(tokens.len(), hashes.len() * bs as usize);
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| WireBlockHash::Int(*h)).collect(),
        parent_block_hash: parent.map(WireBlockHash::Int),
        token_ids: tokens.to_vec(),
        block_size: bs,
        medium: Some(kvroute_core::events::Medium::Gpu),
        extra_keys: Some(vec![None; hashes.len()]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..Default::default()
    })
}

/// A BlockRemoved.
pub fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(kvroute_core::events::BlockRemoved {
        block_hashes: hashes.iter().map(|h| WireBlockHash::Int(*h)).collect(),
        medium: Some(kvroute_core::events::Medium::Gpu),
        group_idx: Some(0),
        ..Default::default()
    })
}

/// Config text for one model `m` (block size 4) with the given replicas
/// `(name, http_port, pub_port, replay_port, bind)`.
pub fn config_text(replicas: &[(&str, u16, u16, u16, bool)], extra: &str) -> String {
    let mut s = format!(
        "scrape_interval_ms = 0\nadmin_token = \"sekret\"\n{extra}\n[[models]]\nname = \"m\"\nblock_size = 4\n"
    );
    for (name, http, p, r, bind) in replicas {
        s.push_str(&format!(
            "[[models.replicas]]\nname = \"{name}\"\nhttp = \"127.0.0.1:{http}\"\nevents = [\"tcp://127.0.0.1:{p}\"]\nreplay = [\"tcp://127.0.0.1:{r}\"]\nbind = {bind}\ntopic = \"kv-events\"\n"
        ));
    }
    s
}

/// Starts an in-process indexer (subscribers, no HTTP) from config text.
pub fn start_indexer(text: &str, policy: Policy) -> Arc<AppState> {
    let cfg = Config::parse(text, "test").expect("valid test config");
    kvroute_indexer::server::start(cfg, policy).expect("start")
}

/// Serves the HTTP API of `state` on an ephemeral port; returns the base URL.
pub async fn serve_http(state: Arc<AppState>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, kvroute_indexer::api::router(state)).await;
    });
    format!("http://{addr}")
}

/// The text of `GET {base}/metrics`.
pub async fn metrics_text(c: &reqwest::Client, base: &str) -> String {
    c.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {base}/metrics: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {base}/metrics body: {e}"))
}

/// One metric of a route answer's `Server-Timing` (`route;dur=<ms>, index;dur=<ms>`): `name`'s
/// duration (`None` when the header or that metric is missing or malformed).
pub fn server_timing(headers: &reqwest::header::HeaderMap, name: &str) -> Option<Duration> {
    let value = headers.get("server-timing")?.to_str().ok()?;
    let ms: f64 = value
        .split(',')
        .map(str::trim)
        .find_map(|m| m.strip_prefix(name)?.strip_prefix(";dur="))?
        .parse()
        .ok()?;
    (ms.is_finite() && ms >= 0.0).then(|| Duration::from_secs_f64(ms / 1000.0))
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// Waits until every stream of the replica is connected.
pub async fn wait_connected(state: &AppState, replica: &str) {
    let ok = wait_until(Duration::from_secs(10), || {
        state.fleet.get(replica).is_some_and(|r| {
            r.streams()
                .iter()
                .all(|s| s.state.lock().unwrap().connected)
        })
    })
    .await;
    assert!(ok, "replica {replica} never connected");
    // Let the subscription reach the publisher.
    tokio::time::sleep(Duration::from_millis(150)).await;
}

/// Leading blocks per replica name for a token prompt (usable blocks only).
pub fn matched(state: &AppState, tokens: &[u32]) -> Vec<(String, u32)> {
    let req = kvroute_indexer::route::RouteRequest {
        model: "m".into(),
        token_ids: Some(tokens.to_vec()),
        ..Default::default()
    };
    let keys = kvroute_indexer::route::request_router_keys(state, &req).unwrap();
    let reps = state.fleet.of_model("m");
    let m = kvroute_indexer::route::exact_matches(state, &reps, keys.usable());
    reps.iter()
        .zip(m)
        .map(|(r, m)| (r.name.clone(), m.gpu + m.cpu + m.storage))
        .collect()
}

/// Blocks of `tokens` held by `replica`.
pub fn held(state: &AppState, replica: &str, tokens: &[u32]) -> u32 {
    matched(state, tokens)
        .into_iter()
        .find(|(n, _)| n == replica)
        .map(|(_, b)| b)
        .unwrap_or(0)
}

/// Stream counter of rank 0.
pub fn stat(
    state: &AppState,
    replica: &str,
    f: impl Fn(&kvroute_indexer::membership::StreamStats) -> u64,
) -> u64 {
    let r = state.fleet.get(replica).unwrap();
    f(&r.streams()[0].stats)
}

/// Raw ZMTP 3.0 over a tokio `TcpStream`, for tests that play a hostile peer byte by byte: the
/// NULL-mechanism greeting, a READY command, and frame headers that announce lengths the peer
/// never sends.
pub mod zmtp {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// The 64-byte greeting: signature, version 3.0, mechanism NULL, as-server 0.
    pub fn greeting() -> [u8; 64] {
        let mut g = [0u8; 64];
        g[0] = 0xff;
        g[9] = 0x7f;
        g[10] = 3;
        g[12..16].copy_from_slice(b"NULL");
        g
    }

    /// A READY command frame announcing `socket_type` ("PUB", "ROUTER", ...).
    pub fn ready(socket_type: &str) -> Vec<u8> {
        let mut body = vec![5u8];
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        body.extend_from_slice(socket_type.as_bytes());
        let mut frame = vec![0x04, body.len() as u8];
        frame.extend(body);
        frame
    }

    /// A long message-frame header announcing `len` bytes (flags: long, plus MORE if `more`).
    pub fn long_frame_header(len: u64, more: bool) -> [u8; 9] {
        let mut h = [0u8; 9];
        h[0] = 0x02 | u8::from(more);
        h[1..].copy_from_slice(&len.to_be_bytes());
        h
    }

    /// A short message frame carrying `body` (at most 255 bytes).
    pub fn short_frame(body: &[u8], more: bool) -> Vec<u8> {
        let mut f = vec![
            u8::from(more),
            u8::try_from(body.len()).expect("short frame"),
        ];
        f.extend_from_slice(body);
        f
    }

    /// Reads one frame: `(flags, body)`; refuses bodies over 1 MiB (this is a test peer).
    pub async fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
        let flags = s.read_u8().await?;
        let len = if flags & 0x02 != 0 {
            s.read_u64().await?
        } else {
            u64::from(s.read_u8().await?)
        };
        if len > 1 << 20 {
            return Err(std::io::Error::other("test peer: frame over 1 MiB"));
        }
        let mut body = vec![0u8; len as usize];
        s.read_exact(&mut body).await?;
        Ok((flags, body))
    }

    /// Sends our greeting and READY as `socket_type`, then reads the other side's greeting and
    /// its READY command.
    pub async fn handshake(s: &mut TcpStream, socket_type: &str) -> std::io::Result<()> {
        s.write_all(&greeting()).await?;
        s.write_all(&ready(socket_type)).await?;
        let mut g = [0u8; 64];
        s.read_exact(&mut g).await?;
        if g[0] != 0xff || g[9] != 0x7f {
            return Err(std::io::Error::other("not a ZMTP greeting"));
        }
        let (flags, body) = read_frame(s).await?;
        if flags & 0x04 == 0 || !body.starts_with(b"\x05READY") {
            return Err(std::io::Error::other("expected a READY command"));
        }
        Ok(())
    }
}
