//! The KV event stream of a real `kvroute-sim` process, read with the zeromq crate and decoded
//! with `kvroute_core::events::decode_batch`; hashes checked against `BlockHasher` and vLLM's
//! golden vectors; replay via DEALER; data-parallel ranks; older wire layouts; vLLM's own decoder.

mod common;

use std::time::Duration;

use common::{events_config, free_port, free_port_run, Sim};
use kvroute_core::events::{decode_batch, encode_batch, EventBatch, KvEvent, WireLayout};
use kvroute_core::hashing::{wire_u64, BlockHasher, HashAlgo, HashConfig};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const BS: usize = 16;

async fn subscribe(port: u16) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        sub.connect(&format!("tcp://127.0.0.1:{port}")),
    )
    .await
    .expect("connect timeout")
    .expect("connect");
    sub.subscribe("").await.expect("subscribe");
    // Let the subscription reach the publisher (ZeroMQ's slow-joiner).
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub
}

/// Receives one live message: (topic, seq, batch).
async fn recv_batch(sub: &mut zeromq::SubSocket) -> (Vec<u8>, u64, EventBatch) {
    let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("no event batch within 10 s")
        .expect("recv");
    let f = m.into_vec();
    assert_eq!(f.len(), 3, "live messages are [topic, seq, payload]");
    assert_eq!(f[1].len(), 8);
    let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
    (f[0].to_vec(), seq, decode_batch(&f[2]).expect("decode"))
}

async fn complete(c: &reqwest::Client, base: &str, body: Value) -> Value {
    let r = c
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.unwrap()
}

fn stored(b: &EventBatch) -> Vec<&kvroute_core::events::BlockStored> {
    b.events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

fn golden_case(name: &str) -> Value {
    let text = std::fs::read_to_string(common::workspace().join("testdata/golden_hashes.json"))
        .expect("testdata/golden_hashes.json");
    let all: Value = serde_json::from_str(&text).unwrap();
    all["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("golden case {name}"))
}

#[tokio::test]
async fn stream_seq_from_zero_hashes_match_block_hasher_and_replay() {
    let (p, r) = (free_port(), free_port());
    let s = Sim::start(&[
        "--time-scale",
        "20",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--kv-events-config",
        &events_config(p, r, ""),
    ]);
    let mut sub = subscribe(p).await;
    let c = reqwest::Client::new();
    let prompt = "Prefix caching stores KV blocks; ".repeat(12);
    let v = complete(
        &c,
        &s.base,
        json!({"model": "qwen3", "prompt": prompt, "max_tokens": 2}),
    )
    .await;
    let n = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;

    let (topic, seq, batch) = recv_batch(&mut sub).await;
    assert_eq!(topic, b"kv-events");
    assert_eq!(seq, 0);
    assert_eq!(batch.data_parallel_rank, Some(0));
    let st = stored(&batch);
    assert_eq!(st.len(), 1);
    let ev = st[0];
    assert_eq!(ev.parent_block_hash, None);
    assert_eq!(ev.block_size, 16);
    assert_eq!(ev.block_hashes.len(), n / BS);
    assert_eq!(ev.token_ids.len(), n / BS * BS);
    assert_eq!(ev.kv_cache_spec_kind.as_deref(), Some("full_attention"));

    // The same hashes from the shared hasher, for the tokens the server rendered.
    let rendered: Value = c
        .post(format!("{}/v1/completions/render", s.base))
        .json(&json!({"model": "qwen3", "prompt": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<u32> = rendered[0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids.len(), n);
    assert_eq!(&ev.token_ids[..], &ids[..n / BS * BS]);
    let hasher = BlockHasher::new(&HashConfig::new(HashAlgo::Sha256Cbor, None)).unwrap();
    let expect: Vec<u64> = hasher
        .block_hashes(&ids, BS, &Default::default())
        .iter()
        .map(wire_u64)
        .collect();
    let got: Vec<u64> = ev.block_hashes.iter().map(|h| h.as_u64()).collect();
    assert_eq!(got, expect);

    // A second, longer request: seq 1, parent = the last shared block.
    let v2 = complete(
        &c,
        &s.base,
        json!({"model": "qwen3", "prompt": format!("{prompt}{}", "and more text ".repeat(10)), "max_tokens": 1}),
    )
    .await;
    assert!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let (_, seq1, b1) = recv_batch(&mut sub).await;
    assert_eq!(seq1, 1);
    let st1 = stored(&b1);
    assert!(st1[0].parent_block_hash.is_some());

    // Replay from 0 over a DEALER: both batches, in order, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{r}"))
        .await
        .unwrap();
    let req = ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .expect("replay timeout")
            .unwrap()
            .into_vec();
        if m.len() == 4 && m[1].is_empty() && m[2][..] == [0xff; 8] {
            assert!(m[0].is_empty() && m[3].is_empty());
            break;
        }
        assert_eq!(m.len(), 4, "replay frames are [b\"\", topic, seq, payload]");
        assert!(m[0].is_empty());
        assert_eq!(&m[1][..], b"kv-events");
        seqs.push(u64::from_be_bytes(m[2][..].try_into().unwrap()));
        decode_batch(&m[3]).expect("replayed payload decodes");
    }
    assert_eq!(seqs, vec![0, 1]);
}

#[tokio::test]
async fn golden_vectors_lora_and_report_full_session() {
    let (p, r) = (free_port(), free_port());
    let s = Sim::start(&[
        "--time-scale",
        "20",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--lora-modules",
        "sql-lora=/models/loras/sql",
        "--kv-events-config",
        &events_config(p, r, ""),
    ]);
    let mut sub = subscribe(p).await;
    let c = reqwest::Client::new();
    let case = golden_case("sha256_cbor_bs16_lora");
    let ids = case["input"]["token_ids"].clone();
    complete(
        &c,
        &s.base,
        json!({"model": "sql-lora", "prompt": ids, "max_tokens": 1}),
    )
    .await;
    let (_, _, batch) = recv_batch(&mut sub).await;
    // Byte-compare with vLLM's own batch once the timestamp is the golden one.
    let golden_hex = case["output"]["kv_event_batch_msgpack_hex"]
        .as_str()
        .unwrap();
    let mut ours = batch.clone();
    ours.ts = case["output"]["kv_event_batch_ts"].as_f64().unwrap();
    assert_eq!(
        hex_of(&encode_batch(&ours, WireLayout::V0_33)),
        golden_hex,
        "BlockStored differs from vLLM 0.33.0's"
    );

    // Base-model golden case, then a repeat with report-full + session: one re-announcement.
    let case = golden_case("sha256_cbor_bs16_40_partial_last");
    let ids = case["input"]["token_ids"].clone();
    complete(
        &c,
        &s.base,
        json!({"model": "qwen3", "prompt": ids, "max_tokens": 1}),
    )
    .await;
    let (_, _, b) = recv_batch(&mut sub).await;
    let got: Vec<u64> = stored(&b)[0]
        .block_hashes
        .iter()
        .map(|h| h.as_u64())
        .collect();
    let want: Vec<u64> = case["output"]["wire_block_hashes_u64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(got, want);
    complete(
        &c,
        &s.base,
        json!({"model": "qwen3", "prompt": ids, "max_tokens": 1,
               "vllm_xargs": {"kv_cache_report_mode": "full", "session_id": "sess-1"}}),
    )
    .await;
    let (_, _, b) = recv_batch(&mut sub).await;
    let st = stored(&b);
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].parent_block_hash, None);
    assert_eq!(st[0].session_id.as_deref(), Some("sess-1"));
    // 40 tokens: hit capped at (40-1)//16 = 2 blocks.
    let re: Vec<u64> = st[0].block_hashes.iter().map(|h| h.as_u64()).collect();
    assert_eq!(re, want[..2].to_vec());
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test]
async fn data_parallel_ranks_publish_on_port_plus_rank() {
    let p = free_port_run(2);
    let r = free_port_run(2);
    let s = Sim::start(&[
        "--time-scale",
        "5",
        "--data-parallel-size",
        "2",
        "--kv-events-config",
        &events_config(p, r, ""),
    ]);
    let c = reqwest::Client::new();
    let src: Value = c
        .get(format!("{}/kv_event_sources", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(src["0"]["endpoint"], format!("tcp://*:{p}"));
    assert_eq!(src["1"]["endpoint"], format!("tcp://*:{}", p + 1));
    assert_eq!(src["1"]["replay_endpoint"], format!("tcp://*:{}", r + 1));
    let mut s0 = subscribe(p).await;
    let mut s1 = subscribe(p + 1).await;
    // Two concurrent requests: the second goes to the less loaded rank. The first decodes long
    // enough (400 tokens, ~0.5 s at x5) to still be running when the second arrives 50 ms later,
    // even on a loaded machine.
    let a = complete(
        &c,
        &s.base,
        json!({"model": "qwen3", "prompt": "alpha ".repeat(40), "max_tokens": 400}),
    );
    let b = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        complete(
            &c,
            &s.base,
            json!({"model": "qwen3", "prompt": "beta ".repeat(40), "max_tokens": 40}),
        )
        .await
    };
    let (va, vb) = tokio::join!(a, b);
    assert_ne!(va["kvroute_sim"]["engine"], vb["kvroute_sim"]["engine"]);
    let (_, q0, b0) = recv_batch(&mut s0).await;
    let (_, q1, b1) = recv_batch(&mut s1).await;
    assert_eq!((q0, q1), (0, 0));
    assert_eq!(b0.data_parallel_rank, Some(0));
    assert_eq!(b1.data_parallel_rank, Some(1));
    let metrics = c
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("vllm:request_success_total{engine=\"1\",model_name=\"qwen3\""));
}

#[tokio::test]
async fn older_wire_layout_and_replay_without_topic() {
    let (p, r) = (free_port(), free_port());
    let s = Sim::start(&[
        "--time-scale",
        "20",
        "--wire-format",
        "0.23",
        "--kv-events-config",
        &events_config(p, r, ""),
    ]);
    let mut sub = subscribe(p).await;
    let c = reqwest::Client::new();
    complete(
        &c,
        &s.base,
        json!({"model": "qwen3", "prompt": "gamma ".repeat(50), "max_tokens": 1}),
    )
    .await;
    let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .unwrap()
        .unwrap()
        .into_vec();
    // Array layout: the event is a msgpack array, not a map (fixarray 0x9X after the batch header).
    let batch = decode_batch(&m[2]).unwrap();
    assert_eq!(stored(&batch).len(), 1);
    assert_eq!(encode_batch(&batch, WireLayout::Array0_23), m[2].to_vec());
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{r}"))
        .await
        .unwrap();
    dealer
        .send(
            ZmqMessage::try_from(vec![
                bytes::Bytes::new(),
                bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
            ])
            .unwrap(),
        )
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
        .await
        .unwrap()
        .unwrap()
        .into_vec();
    assert_eq!(
        first.len(),
        3,
        "legacy replay frames are [b\"\", seq, payload]"
    );
    let end = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
        .await
        .unwrap()
        .unwrap()
        .into_vec();
    assert_eq!(end.len(), 3);
    assert_eq!(&end[1][..], &[0xff; 8]);
}

#[tokio::test]
async fn a_full_event_queue_never_stalls_the_engine() {
    let (p, r) = (free_port(), free_port());
    let s = Sim::start(&[
        "--time-scale",
        "50",
        "--num-gpu-blocks-override",
        "64",
        "--kv-events-config",
        &events_config(p, r, r#","max_queue_size":1,"buffer_steps":4"#),
    ]);
    // A subscriber that never reads.
    let _idle = subscribe(p).await;
    let c = reqwest::Client::new();
    let reqs = (0..24).map(|i| {
        complete(
            &c,
            &s.base,
            json!({"model": "qwen3", "prompt": format!("{i} {}", "delta ".repeat(60)), "max_tokens": 20}),
        )
    });
    let out = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(reqs))
        .await
        .expect("requests stalled");
    assert_eq!(out.len(), 24);
    let m = c
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let l = "{engine=\"0\",model_name=\"qwen3\"}";
    let sent = common::metric(&m, &format!("kvroute_sim:kv_event_batches_total{l}")).unwrap();
    let dropped = common::metric(
        &m,
        &format!("kvroute_sim:kv_event_batches_dropped_total{l}"),
    )
    .unwrap();
    // Every step with events was either published or dropped (never waited for).
    assert!(
        sent >= 1.0 && sent + dropped >= 2.0,
        "sent {sent} dropped {dropped}"
    );
    // The small cache evicted blocks along the way.
    assert!(common::metric(&m, "vllm:request_success_total{engine=\"0\",model_name=\"qwen3\",finished_reason=\"length\"}").unwrap() >= 24.0);
}

#[tokio::test]
async fn vllm_own_msgspec_classes_decode_the_stream() {
    let script = common::workspace().join("tests/vllm_reference/decode_with_vllm.py");
    assert!(script.is_file(), "{} missing", script.display());
    let py = common::python();
    let (p, r) = (free_port(), free_port());
    let s = Sim::start(&[
        "--time-scale",
        "20",
        "--num-gpu-blocks-override",
        "16",
        "--lora-modules",
        "sql-lora=/models/loras/sql",
        "--kv-events-config",
        &events_config(p, r, ""),
    ]);
    let count = 4;
    let ready = std::env::temp_dir().join(format!("kvroute-vllm-decoder-ready-{p}"));
    let _ = std::fs::remove_file(&ready);
    let child = std::process::Command::new(&py)
        .arg(&script)
        .args([
            "--endpoint",
            &format!("tcp://127.0.0.1:{p}"),
            "--topic",
            "kv-events",
        ])
        .args([
            "--count",
            &count.to_string(),
            "--timeout",
            "30",
            "--require-identical",
            "--ready-file",
        ])
        .arg(&ready)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn python");
    // Importing vLLM's modules takes seconds on a busy machine: publish only once the decoder is
    // subscribed (a SUB that connects late misses what was sent before), then give its
    // subscription a moment to reach the publisher.
    let waited = std::time::Instant::now();
    while !ready.exists() {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "vLLM's decoder did not subscribe within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = std::fs::remove_file(&ready);
    let c = reqwest::Client::new();
    // 15 usable blocks. Stored with LoRA + salt (91 tokens); a 202-token prompt that evicts some
    // of those blocks; its repeat with a full re-announcement and a session; a reset.
    complete(&c, &s.base, json!({"model": "sql-lora", "prompt": "lora text ".repeat(30), "max_tokens": 1, "cache_salt": "t1"})).await;
    let big = json!({"model": "qwen3", "prompt": "eviction pressure ".repeat(100), "max_tokens": 1,
                     "vllm_xargs": {"kv_cache_report_mode": "full", "session_id": "s9"}});
    complete(&c, &s.base, big.clone()).await;
    complete(&c, &s.base, big).await;
    let reset: Value = c
        .post(format!("{}/reset_prefix_cache", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(reset["success"], true);
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .expect("decoder timeout")
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "vLLM's decoder failed ({:?}); run `cargo xtask setup` if vLLM's module is missing.\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), count);
    let types: Vec<String> = lines
        .iter()
        .flat_map(|l| l["events"].as_array().unwrap().iter())
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect();
    for t in ["BlockStored", "BlockRemoved", "AllBlocksCleared"] {
        assert!(types.iter().any(|x| x == t), "{t} not seen in {types:?}");
    }
    let first = &lines[0]["events"][0];
    assert_eq!(first["lora_name"], "sql-lora");
    assert_eq!(first["lora_id"], 1);
    assert_eq!(first["extra_keys"][0], json!(["sql-lora", "t1"]));
    assert_eq!(first["extra_keys"][1], json!(["sql-lora"]));
    assert!(lines.iter().all(|l| l["reencode_identical"] == true));
}

/// An endpoint without `*` makes the engine connect out (vLLM's rule); like libzmq, the simulator
/// keeps trying until the subscriber binds, even when the subscriber starts after the engine.
#[tokio::test]
async fn connect_mode_reaches_a_subscriber_that_binds_later() {
    let p = free_port();
    let cfg = connect_config(p);
    let s = Sim::start(&["--time-scale", "5", "--kv-events-config", &cfg]);
    // The subscriber binds only now, after the engine's first connect attempt gave up.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    late_subscriber_gets_a_batch(p, &s).await;
}

/// A first connect that fails outright (the port answers but hangs up before the ZMTP greeting,
/// as a subscriber being torn down or restarted does) does not stop the engine either: libzmq
/// keeps reconnecting, and so does the simulator (it used to exit with the error).
#[tokio::test]
async fn connect_mode_survives_a_peer_that_hangs_up_during_the_handshake() {
    let p = free_port();
    let listener = std::net::TcpListener::bind(("127.0.0.1", p)).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    // Hangs up on every connection until the engine has been refused at least once and a little
    // longer (its retries), then closes the port. The deadline only bounds a broken engine: a
    // loaded machine can take seconds to start the simulator, so no fixed window is assumed.
    let rude = std::thread::spawn(move || {
        let give_up = std::time::Instant::now() + Duration::from_secs(60);
        let mut first_hang_up = None;
        let mut hung_up = 0;
        while std::time::Instant::now() < give_up
            && first_hang_up
                .is_none_or(|t: std::time::Instant| t.elapsed() < Duration::from_millis(300))
        {
            match listener.accept() {
                Ok((conn, _)) => {
                    drop(conn);
                    hung_up += 1;
                    first_hang_up.get_or_insert_with(std::time::Instant::now);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        hung_up
    });
    let cfg = connect_config(p);
    let s = Sim::start(&["--time-scale", "5", "--kv-events-config", &cfg]);
    let hung_up = rude.join().expect("listener thread");
    assert!(hung_up > 0, "the engine never tried to connect");
    late_subscriber_gets_a_batch(p, &s).await;
}

fn connect_config(port: u16) -> String {
    format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:{port}","topic":"kv-events"}}"#
    )
}

/// Binds a subscriber on `p` and publishes until the engine's first batch reaches it.
async fn late_subscriber_gets_a_batch(p: u16, s: &Sim) {
    let mut sub = zeromq::SubSocket::new();
    sub.bind(&format!("tcp://127.0.0.1:{p}"))
        .await
        .expect("bind");
    sub.subscribe("").await.expect("subscribe");
    let c = reqwest::Client::new();
    // Publish until one batch arrives: connection and subscription take a few retry periods.
    let mut got = None;
    for i in 0..40 {
        complete(
            &c,
            &s.base,
            json!({"model": "qwen3", "prompt": format!("late joiner {i} ").repeat(30), "max_tokens": 1}),
        )
        .await;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(250), sub.recv()).await {
            got = Some(m);
            break;
        }
    }
    let m = got.expect("the connect-mode publisher never reached the late subscriber");
    let f = m.into_vec();
    assert_eq!(f.len(), 3);
    let batch = decode_batch(&f[2]).expect("decode");
    assert!(
        !stored(&batch).is_empty(),
        "first batch carries BlockStored"
    );
}
