//! The replay transport (`subscriber::replay`, one DEALER per replay) against a ROUTER on
//! 127.0.0.1 that writes its replies with `kvroute_core::events::frames`: both reply layouts,
//! the end marker, malformed replies and the batch bound.

use bytes::Bytes;
use kvroute_core::events::frames::{self, FrameError};
use kvroute_indexer::config::EventsSection;
use kvroute_indexer::subscriber::{replay, StreamError};
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// A ROUTER that answers one replay request with `replies` (each after the peer identity).
struct Router {
    endpoint: String,
    /// The request's start seq, as the ROUTER decoded it.
    start: tokio::sync::oneshot::Receiver<Result<u64, FrameError>>,
    task: tokio::task::JoinHandle<()>,
}

async fn router(replies: Vec<Vec<Bytes>>) -> Router {
    let mut router = RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.expect("bind ROUTER");
    let (start_tx, start) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let request = router.recv().await.expect("a replay request").into_vec();
        let (id, rest) = request.split_first().expect("the peer identity");
        let _ = start_tx.send(frames::decode_replay_request(rest));
        for reply in replies {
            let mut m = vec![id.clone()];
            m.extend(reply);
            router
                .send(ZmqMessage::try_from(m).expect("frames"))
                .await
                .expect("send reply");
        }
        // Keep the socket open until the test ends.
        std::future::pending::<()>().await;
    });
    Router {
        endpoint: ep.to_string(),
        start,
        task,
    }
}

fn payload(seq: u64) -> Bytes {
    Bytes::from(format!("batch {seq}"))
}

fn cfg() -> EventsSection {
    EventsSection::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reads_both_reply_layouts_until_the_end_marker() {
    for with_topic in [true, false] {
        let topic = with_topic.then(|| Bytes::from_static(b"kv-events"));
        let mut replies: Vec<Vec<Bytes>> = (5..8)
            .map(|seq| frames::encode_replay_reply(topic.clone(), seq, payload(seq)))
            .collect();
        replies.push(frames::encode_replay_end(with_topic));
        let r = router(replies).await;
        let got = replay(&r.endpoint, 5, &cfg()).await.expect("replay");
        assert_eq!(
            got,
            (5..8).map(|s| (s, payload(s))).collect::<Vec<_>>(),
            "with_topic = {with_topic}"
        );
        assert_eq!(r.start.await, Ok(Ok(5)));
        r.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_replay_is_just_the_end_marker() {
    let r = router(vec![frames::encode_replay_end(true)]).await;
    assert_eq!(
        replay(&r.endpoint, 42, &cfg()).await.expect("replay"),
        vec![]
    );
    assert_eq!(r.start.await, Ok(Ok(42)));
    r.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_replies_are_typed_errors() {
    let cases: Vec<(Vec<Bytes>, FrameError)> = vec![
        (
            vec![
                Bytes::new(),
                Bytes::from_static(b"kv-events"),
                Bytes::copy_from_slice(&frames::seq_frame(1)),
                payload(1),
                Bytes::from_static(b"extra"),
            ],
            FrameError::FrameCount {
                what: "replay reply",
                count: 4,
            },
        ),
        (
            vec![
                Bytes::new(),
                Bytes::from_static(b"kv-events"),
                Bytes::from_static(&[0, 1]),
                payload(1),
            ],
            FrameError::SeqLength(2),
        ),
    ];
    for (reply, want) in cases {
        let r = router(vec![reply]).await;
        match replay(&r.endpoint, 0, &cfg()).await {
            Err(StreamError::BadReply(e)) => assert_eq!(e, want),
            other => panic!("expected {want:?}, got {other:?}"),
        }
        r.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_stops_at_replay_max_batches() {
    let mut replies: Vec<Vec<Bytes>> = (0..4)
        .map(|seq| frames::encode_replay_reply(None, seq, payload(seq)))
        .collect();
    replies.push(frames::encode_replay_end(false));
    let r = router(replies).await;
    let cfg = EventsSection {
        replay_max_batches: 3,
        ..cfg()
    };
    match replay(&r.endpoint, 0, &cfg).await {
        Err(StreamError::TooLarge {
            limit: 3,
            unit: "batches",
        }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    r.task.abort();
}
