//! The subscriber against a real ZeroMQ publisher (PUB + ROUTER replay) on 127.0.0.1.

mod common;

use std::time::Duration;

use common::*;
use kvroute_indexer::policies::Policy;

const T: Duration = Duration::from_secs(10);

fn toks(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_events_are_indexed_and_removed() {
    let mut p = Publisher::start(0, 0).await;
    let state = start_indexer(
        &config_text(&[("r0", free_port(), p.pub_port, p.replay_port, false)], ""),
        Policy::Kv,
    );
    wait_connected(&state, "r0").await;
    let prompt = toks(1, 17); // 4 full blocks of 4 + 1 token: all 4 usable
    p.publish(vec![stored(&[11, 12, 13, 14], None, &prompt[..16], 4)])
        .await;
    assert!(
        wait_until(T, || held(&state, "r0", &prompt) == 4).await,
        "4 blocks indexed"
    );
    p.publish(vec![removed(&[14])]).await;
    assert!(
        wait_until(T, || held(&state, "r0", &prompt) == 3).await,
        "tail block removed"
    );
    assert_eq!(
        stat(&state, "r0", |s| s
            .gaps
            .load(std::sync::atomic::Ordering::Relaxed)),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_is_filled_by_replay() {
    let mut p = Publisher::start(0, 0).await;
    let state = start_indexer(
        &config_text(&[("r0", free_port(), p.pub_port, p.replay_port, false)], ""),
        Policy::Kv,
    );
    wait_connected(&state, "r0").await;
    let prompt = toks(100, 13);
    p.publish(vec![stored(&[1], None, &prompt[..4], 4)]).await;
    // Lost on the wire (as above the HWM), but in the replay buffer.
    p.buffer_only(batch_bytes(vec![stored(&[2], Some(1), &prompt[4..8], 4)]));
    p.publish(vec![stored(&[3], Some(2), &prompt[8..12], 4)])
        .await;
    assert!(
        wait_until(T, || held(&state, "r0", &prompt) == 3).await,
        "gap filled: {:?}",
        matched(&state, &prompt)
    );
    let gaps = stat(&state, "r0", |s| {
        s.gaps.load(std::sync::atomic::Ordering::Relaxed)
    });
    assert_eq!(gaps, 1);
    assert_eq!(
        stat(&state, "r0", |s| s
            .resets
            .load(std::sync::atomic::Ordering::Relaxed)),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncoverable_gap_drops_the_replica() {
    let mut p = Publisher::start(0, 0).await;
    let state = start_indexer(
        &config_text(&[("r0", free_port(), p.pub_port, p.replay_port, false)], ""),
        Policy::Kv,
    );
    wait_connected(&state, "r0").await;
    let a = toks(100, 9);
    p.publish(vec![stored(&[1, 2], None, &a[..8], 4)]).await;
    assert!(wait_until(T, || held(&state, "r0", &a) == 2).await);
    let lost = p.buffer_only(batch_bytes(vec![removed(&[2])]));
    p.forget_before(lost + 1); // the replay buffer rotated past the lost batch
    let b = toks(500, 5);
    p.publish(vec![stored(&[9], None, &b[..4], 4)]).await;
    assert!(
        wait_until(T, || held(&state, "r0", &b) == 1
            && held(&state, "r0", &a) == 0)
        .await,
        "old entries dropped, new one kept: a={:?} b={:?}",
        matched(&state, &a),
        matched(&state, &b)
    );
    assert_eq!(
        stat(&state, "r0", |s| s
            .resets
            .load(std::sync::atomic::Ordering::Relaxed)),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_going_backwards_clears_the_replica() {
    let mut p = Publisher::start(0, 0).await;
    let state = start_indexer(
        &config_text(&[("r0", free_port(), p.pub_port, p.replay_port, false)], ""),
        Policy::Kv,
    );
    wait_connected(&state, "r0").await;
    let a = toks(1, 9);
    for i in 0..5u64 {
        let t = toks(1000 + 10 * i as u32, 4);
        p.publish(vec![stored(&[200 + i], None, &t, 4)]).await;
    }
    p.publish(vec![stored(&[1, 2], None, &a[..8], 4)]).await;
    assert!(wait_until(T, || held(&state, "r0", &a) == 2).await);
    // The engine restarts: seq starts again at 0 with a fresh cache.
    p.next_seq = 0;
    p.forget_before(u64::MAX);
    let b = toks(50, 5);
    p.publish(vec![stored(&[7], None, &b[..4], 4)]).await;
    assert!(
        wait_until(T, || held(&state, "r0", &a) == 0
            && held(&state, "r0", &b) == 1)
        .await,
        "a={:?} b={:?}",
        matched(&state, &a),
        matched(&state, &b)
    );
    assert_eq!(
        stat(&state, "r0", |s| s
            .resets
            .load(std::sync::atomic::Ordering::Relaxed)),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_payload_is_counted_and_skipped() {
    let mut p = Publisher::start(0, 0).await;
    let state = start_indexer(
        &config_text(&[("r0", free_port(), p.pub_port, p.replay_port, false)], ""),
        Policy::Kv,
    );
    wait_connected(&state, "r0").await;
    p.publish_raw(b"\xc1\xff not msgpack at all".to_vec()).await;
    let a = toks(1, 5);
    p.publish(vec![stored(&[1], None, &a[..4], 4)]).await;
    assert!(
        wait_until(T, || held(&state, "r0", &a) == 1).await,
        "stream continues after garbage"
    );
    assert_eq!(
        stat(&state, "r0", |s| s
            .event_decode_errors
            .load(std::sync::atomic::Ordering::Relaxed)),
        1
    );
    assert_eq!(
        stat(&state, "r0", |s| s
            .gaps
            .load(std::sync::atomic::Ordering::Relaxed)),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_publisher_restart_on_same_port() {
    let mut p = Publisher::start(0, 0).await;
    let (pp, rp) = (p.pub_port, p.replay_port);
    let state = start_indexer(
        &config_text(&[("r0", free_port(), pp, rp, false)], ""),
        Policy::Kv,
    );
    wait_connected(&state, "r0").await;
    let a = toks(1, 5);
    p.publish(vec![stored(&[1], None, &a[..4], 4)]).await;
    assert!(wait_until(T, || held(&state, "r0", &a) == 1).await);
    p.stop().await;
    assert!(
        wait_until(T, || !state.fleet.get("r0").unwrap().streams()[0]
            .state
            .lock()
            .unwrap()
            .connected)
        .await,
        "disconnect noticed"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A new engine on the same ports, seq from 0, fresh cache; its first batch is published
    // before we reconnect and must arrive through the replay after connect.
    let mut p2 = Publisher::start(pp, rp).await;
    let b = toks(300, 5);
    p2.buffer_only(batch_bytes(vec![stored(&[5], None, &b[..4], 4)]));
    let c = toks(600, 5);
    let start = std::time::Instant::now();
    assert!(
        wait_until(T, || state.fleet.get("r0").unwrap().streams()[0]
            .state
            .lock()
            .unwrap()
            .connected)
        .await,
        "reconnected"
    );
    let reconnect_ms = start.elapsed().as_millis();
    tokio::time::sleep(Duration::from_millis(150)).await;
    p2.publish(vec![stored(&[6], None, &c[..4], 4)]).await;
    assert!(
        wait_until(T, || held(&state, "r0", &b) == 1
            && held(&state, "r0", &c) == 1
            && held(&state, "r0", &a) == 0)
        .await,
        "a={:?} b={:?} c={:?}",
        matched(&state, &a),
        matched(&state, &b),
        matched(&state, &c)
    );
    eprintln!("reconnected {reconnect_ms} ms after the publisher came back");
    assert!(
        stat(&state, "r0", |s| s
            .connects
            .load(std::sync::atomic::Ordering::Relaxed))
            >= 2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_mode_receives_from_a_connecting_publisher() {
    use zeromq::{Socket, SocketSend};
    let port = free_port();
    let state = start_indexer(
        &config_text(&[("r0", free_port(), port, free_port(), true)], ""),
        Policy::Kv,
    );
    // The engine connects out to us.
    let mut sock = zeromq::PubSocket::new();
    let mut connected = false;
    for _ in 0..100 {
        if tokio::time::timeout(
            Duration::from_millis(500),
            sock.connect(&format!("tcp://127.0.0.1:{port}")),
        )
        .await
        .is_ok_and(|r| r.is_ok())
        {
            connected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connected);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = toks(1, 9);
    let payload = batch_bytes(vec![stored(&[1, 2], None, &a[..8], 4)]);
    let msg = zeromq::ZmqMessage::try_from(kvroute_core::events::frames::encode_live(
        bytes::Bytes::from_static(b"kv-events"),
        0,
        bytes::Bytes::from(payload),
    ))
    .unwrap();
    sock.send(msg).await.unwrap();
    assert!(
        wait_until(T, || held(&state, "r0", &a) == 2).await,
        "{:?}",
        matched(&state, &a)
    );
}
