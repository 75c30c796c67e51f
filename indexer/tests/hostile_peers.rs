//! Hostile peers on the indexer's ZeroMQ sockets (issue #16, items 2 and 7), each against the real
//! `kvroute-indexer serve` binary: a raw TCP peer completes the ZMTP 3.0 handshake by hand and then
//! announces a 2^62-byte frame it never sends, on the live SUB (connect mode), on the replay DEALER,
//! and on a bound SUB (bind mode); a peer outside `events.allowed_peers` is refused before the
//! handshake; a replay answered with many 1 MiB batches stops at `events.replay_max_bytes`. After
//! each, the process is still up, answers `/healthz` and `/v1/route`, and a counter shows it.

mod common;
mod procs;

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use common::{config_text, free_port, zmtp, Publisher};
use procs::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::time::timeout;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The announced frame length: 4 EiB.
const BOMB: u64 = 1 << 62;
const OVERSIZED: &str = "kvroute_indexer_event_oversized_messages_total";
const REFUSED: &str = "kvroute_indexer_event_peers_refused_total";
const TOO_LARGE: &str = "kvroute_indexer_replays_too_large_total";
const BOUND: Duration = Duration::from_secs(20);

fn write_config(dir: &TempDir, text: &str) -> PathBuf {
    let p = dir.0.join("indexer.toml");
    std::fs::write(&p, text).expect("write config");
    p
}

async fn metric(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    metric_sum(&get_text(c, &format!("{base}/metrics")).await, name).unwrap_or(0.0)
}

/// `/metrics`, or `None` when the indexer does not answer (it may have died).
async fn try_metrics(c: &reqwest::Client, base: &str) -> Option<String> {
    c.get(format!("{base}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// Waits (bounded) until `name` is at least 1 or the indexer stops answering.
async fn wait_counter(p: &mut Proc, c: &reqwest::Client, base: &str, name: &str) {
    let deadline = std::time::Instant::now() + BOUND;
    while std::time::Instant::now() < deadline && !p.exited() {
        match try_metrics(c, base).await {
            Some(m) if metric_sum(&m, name).unwrap_or(0.0) >= 1.0 => return,
            Some(_) => {}
            None => return,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The indexer still runs, answers `/healthz` and routes.
async fn assert_serving(p: &mut Proc, c: &reqwest::Client, base: &str) {
    if try_metrics(c, base).await.is_none() {
        // Give a dying process a moment to be reaped, so the log tail shows why.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!p.exited(), "the indexer died:\n{}", p.log_tail());
    assert_eq!(get_text(c, &format!("{base}/healthz")).await.trim(), "ok");
    let (status, body) = post_json(
        c,
        &format!("{base}/v1/route"),
        &json!({"model": "m", "token_ids": (0..16).collect::<Vec<u32>>()}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

async fn accept(listener: &TcpListener) -> TcpStream {
    timeout(BOUND, listener.accept())
        .await
        .expect("the indexer never connected")
        .expect("accept")
        .0
}

async fn connect_retry(port: u16) -> TcpStream {
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        match TcpStream::connect(("127.0.0.1", port)).await {
            Ok(s) => return s,
            Err(e) if std::time::Instant::now() > deadline => panic!("connect {port}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_bomb_on_the_live_sub_is_refused() {
    let dir = TempDir::new("hostile-sub");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let cfg = config_text(&[("r0", free_port(), port, free_port(), false)], "");
    let (mut p, base) = start_indexer(&write_config(&dir, &cfg), &dir.0, &[]);
    let c = client();
    // The indexer connects to our fake PUB; after the handshake we announce 2^62 bytes.
    let mut s = accept(&listener).await;
    zmtp::handshake(&mut s, "PUB").await.expect("handshake");
    s.write_all(&zmtp::long_frame_header(BOMB, false))
        .await
        .unwrap();
    wait_counter(&mut p, &c, &base, OVERSIZED).await;
    assert_serving(&mut p, &c, &base).await;
    assert!(metric(&c, &base, OVERSIZED).await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_bomb_on_the_replay_dealer_is_refused() {
    let dir = TempDir::new("hostile-replay");
    let publisher = Publisher::start(0, 0).await;
    let router = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rport = router.local_addr().unwrap().port();
    let cfg = config_text(&[("r0", free_port(), publisher.pub_port, rport, false)], "");
    let (mut p, base) = start_indexer(&write_config(&dir, &cfg), &dir.0, &[]);
    let c = client();
    // After connecting its SUB the indexer asks our fake ROUTER for a replay.
    let mut s = accept(&router).await;
    zmtp::handshake(&mut s, "ROUTER").await.expect("handshake");
    let (_, delimiter) = zmtp::read_frame(&mut s).await.expect("request delimiter");
    let (_, start) = zmtp::read_frame(&mut s).await.expect("request seq");
    assert!(delimiter.is_empty() && start.len() == 8);
    // The reply: an empty delimiter, then a frame announcing 2^62 bytes.
    s.write_all(&zmtp::short_frame(b"", true)).await.unwrap();
    s.write_all(&zmtp::long_frame_header(BOMB, false))
        .await
        .unwrap();
    wait_counter(&mut p, &c, &base, OVERSIZED).await;
    assert_serving(&mut p, &c, &base).await;
    assert!(metric(&c, &base, OVERSIZED).await >= 1.0);
    publisher.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_bomb_on_a_bound_sub_is_refused() {
    let dir = TempDir::new("hostile-bind");
    let port = free_port();
    let cfg = config_text(&[("r0", free_port(), port, free_port(), true)], "");
    let (mut p, base) = start_indexer(&write_config(&dir, &cfg), &dir.0, &[]);
    let c = client();
    // We connect to the indexer's bound port as a PUB.
    let mut s = connect_retry(port).await;
    zmtp::handshake(&mut s, "PUB").await.expect("handshake");
    s.write_all(&zmtp::long_frame_header(BOMB, false))
        .await
        .unwrap();
    wait_counter(&mut p, &c, &base, OVERSIZED).await;
    assert_serving(&mut p, &c, &base).await;
    assert!(metric(&c, &base, OVERSIZED).await >= 1.0);
    // The bound socket still accepts the next (well-behaved) peer.
    let mut s = connect_retry(port).await;
    zmtp::handshake(&mut s, "PUB")
        .await
        .expect("handshake after a refused bomb");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_outside_allowed_peers_is_refused() {
    let dir = TempDir::new("hostile-allow");
    let port = free_port();
    let cfg = config_text(
        &[("r0", free_port(), port, free_port(), true)],
        "[events]\nallowed_peers = [\"127.0.0.1/32\"]\n",
    );
    let (mut p, base) = start_indexer(&write_config(&dir, &cfg), &dir.0, &[]);
    let c = client();
    connect_retry(port).await; // bound
                               // From 127.0.0.2 (loopback, but not allow-listed): closed before any greeting.
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut s = sock
        .connect(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .expect("TCP connect");
    let _ = s.write_all(&zmtp::greeting()).await;
    let mut buf = [0u8; 64];
    let n = timeout(BOUND, s.read(&mut buf))
        .await
        .expect("the refused connection was never closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "a refused peer got {n} bytes of handshake");
    wait_counter(&mut p, &c, &base, REFUSED).await;
    assert_serving(&mut p, &c, &base).await;
    assert!(metric(&c, &base, REFUSED).await >= 1.0);
    // 127.0.0.1 is allowed: it gets the handshake.
    let mut s = connect_retry(port).await;
    zmtp::handshake(&mut s, "PUB")
        .await
        .expect("allowed peer handshake");
}

/// A ROUTER that answers the first replay request with `n` batches of `size` bytes each (after
/// `go` fires), then the end marker; later requests get only the end marker.
fn flood_router(
    mut router: RouterSocket,
    n: u64,
    size: usize,
    asked: tokio::sync::oneshot::Sender<()>,
    go: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut asked = Some(asked);
        let mut go = Some(go);
        let payload = Bytes::from(vec![0u8; size]);
        loop {
            let Ok(msg) = router.recv().await else {
                continue;
            };
            let id = msg.into_vec()[0].clone();
            let frames = |seq: u64, payload: Bytes| {
                ZmqMessage::try_from(vec![
                    id.clone(),
                    Bytes::new(),
                    Bytes::from_static(b"kv-events"),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ])
                .unwrap()
            };
            if let (Some(a), Some(g)) = (asked.take(), go.take()) {
                let _ = a.send(());
                let _ = g.await;
                for seq in 0..n {
                    if router.send(frames(seq, payload.clone())).await.is_err() {
                        break;
                    }
                }
            }
            let _ = router.send(frames(u64::MAX, Bytes::new())).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_many_large_batches_is_bounded_in_bytes() {
    const BATCHES: u64 = 400;
    const MIB: u64 = 1 << 20;
    let dir = TempDir::new("hostile-replay-bytes");
    let publisher = Publisher::start(0, 0).await;
    let mut router = RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap();
    let rport = match ep {
        zeromq::Endpoint::Tcp(_, p) => p,
        _ => unreachable!(),
    };
    let (asked_tx, asked_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel();
    let task = flood_router(router, BATCHES, MIB as usize, asked_tx, go_rx);
    // The default bounds: replay_max_batches = 200000, replay_max_bytes = 64 MiB.
    let cfg = config_text(&[("r0", free_port(), publisher.pub_port, rport, false)], "");
    let (mut p, base) = start_indexer(&write_config(&dir, &cfg), &dir.0, &[]);
    let c = client();
    timeout(BOUND, asked_rx)
        .await
        .expect("no replay request")
        .unwrap();
    let before = proc_status_bytes(p.pid(), "VmHWM").expect("VmHWM");
    let _ = go_tx.send(());
    // Until the replay is refused, or (unbounded) every batch was taken in and applied.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline && !p.exited() {
        let Some(m) = try_metrics(&c, &base).await else {
            break;
        };
        let done = metric_sum(&m, TOO_LARGE).unwrap_or(0.0) >= 1.0
            || metric_sum(&m, "kvroute_indexer_event_decode_errors_total").unwrap_or(0.0)
                >= BATCHES as f64;
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let peak = proc_status_bytes(p.pid(), "VmHWM").expect("VmHWM");
    assert_serving(&mut p, &c, &base).await;
    let grown = peak.saturating_sub(before);
    eprintln!(
        "indexer peak RSS {} MiB -> {} MiB during a replay of {BATCHES} x 1 MiB",
        before / MIB,
        peak / MIB
    );
    // 64 MiB of buffered batches, one message in flight and read buffers; 400 MiB unbounded.
    assert!(
        grown < 160 * MIB,
        "peak RSS grew by {} MiB during the replay",
        grown / MIB
    );
    assert!(metric(&c, &base, TOO_LARGE).await >= 1.0);
    task.abort();
    publisher.stop().await;
}
