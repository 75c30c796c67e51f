//! Interop with vLLM itself: batches written by `encode_batch(.., WireLayout::V0_33)` are decoded
//! by vLLM 0.33.0's own `KVEventBatch` msgspec classes (tests/vllm_reference/decode_with_vllm.py),
//! which must see exactly our events, and whose own encoder must write exactly our bytes.
//!
//! Needs the Python venv (`KVROUTE_PYTHON`, else `target/kvroute-cache/venv/bin/python`) and the
//! fetched vLLM module (tests/vllm_reference/fetch_vllm.py); both come from `cargo xtask setup`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use kvroute_core::events::{
    encode_batch, BlockRemoved, BlockStored, EventBatch, ExtraKeyValue, KvEvent, Medium,
    WireBlockHash, WireLayout,
};
use kvroute_testkit::paths::{python, workspace};
use serde_json::{json, Value};

fn kit(script: &str) -> PathBuf {
    workspace().join("tests/vllm_reference").join(script)
}

/// Runs decode_with_vllm.py on hex lines; returns its JSON lines, failing on a non-zero exit.
fn decode_with_vllm(payloads: &[Vec<u8>]) -> Vec<Value> {
    let mut child = Command::new(python())
        .arg(kit("decode_with_vllm.py"))
        .arg("--require-identical")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start decode_with_vllm.py");
    {
        let mut stdin = child.stdin.take().expect("stdin");
        for p in payloads {
            writeln!(stdin, "{}", hex::encode(p)).expect("write payload");
        }
    }
    let out = child
        .wait_with_output()
        .expect("decode_with_vllm.py output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("is not in") || out.status.success(),
        "vLLM's kv_events.py was not fetched: run `cargo xtask setup`\n{stderr}"
    );
    assert!(
        out.status.success(),
        "vLLM could not decode (or re-encode identically) our bytes:\n{stdout}\n{stderr}"
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect()
}

fn hash_json(h: &WireBlockHash) -> Value {
    match h {
        WireBlockHash::Int(v) => json!(v),
        WireBlockHash::Bytes(b) => json!({ "hex": hex::encode(b) }),
    }
}

fn extra_json(v: &ExtraKeyValue) -> Value {
    match v {
        ExtraKeyValue::Str(s) => json!(s),
        ExtraKeyValue::Int(i) => json!(i),
        ExtraKeyValue::Bytes(b) => json!({ "hex": hex::encode(b) }),
        ExtraKeyValue::List(l) => Value::Array(l.iter().map(extra_json).collect()),
    }
}

/// The JSON decode_with_vllm.py prints for an event (every vLLM field, None as null).
fn expected_event(ev: &KvEvent) -> Value {
    match ev {
        KvEvent::BlockStored(s) => json!({
            "type": "BlockStored",
            "block_hashes": s.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
            "parent_block_hash": s.parent_block_hash.as_ref().map(hash_json),
            "token_ids": s.token_ids,
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "medium": s.medium.map(|m| m.as_str()),
            "lora_name": s.lora_name,
            "extra_keys": s.extra_keys.as_ref().map(|entries| entries
                .iter()
                .map(|e| e.as_ref().map(|vals| vals.iter().map(extra_json).collect::<Vec<_>>()))
                .collect::<Vec<_>>()),
            "group_idx": s.group_idx,
            "kv_cache_spec_kind": s.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
            "locality": s.locality,
            "ownership": s.ownership,
            "session_id": s.session_id,
            "lookahead_token_ids": s.lookahead_token_ids,
        }),
        KvEvent::BlockRemoved(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": r.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
            "medium": r.medium.map(|m| m.as_str()),
            "group_idx": r.group_idx,
            "locality": r.locality,
            "ownership": r.ownership,
        }),
        KvEvent::AllBlocksCleared => json!({ "type": "AllBlocksCleared" }),
        KvEvent::Unknown(name) => panic!("vLLM cannot decode unknown event {name}"),
    }
}

fn batches() -> Vec<EventBatch> {
    let full = BlockStored {
        block_hashes: vec![
            WireBlockHash::Int(0),
            WireBlockHash::Int(127),
            WireBlockHash::Int(1 << 63),
            WireBlockHash::Int(u64::MAX),
        ],
        parent_block_hash: Some(WireBlockHash::Int(0xfedc_ba98_7654_3210)),
        token_ids: (0..64u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % 151_936)
            .collect(),
        block_size: 16,
        lora_id: Some(3),
        medium: Some(Medium::Cpu),
        lora_name: Some("sql-lora".into()),
        extra_keys: Some(vec![
            Some(vec![
                ExtraKeyValue::Str("sql-lora".into()),
                ExtraKeyValue::List(vec![
                    ExtraKeyValue::Str("img-aaaa".into()),
                    ExtraKeyValue::Int(2),
                ]),
                ExtraKeyValue::Str("tenant-a".into()),
                ExtraKeyValue::Bytes(vec![0x5a; 32]),
            ]),
            None,
            Some(vec![ExtraKeyValue::List(vec![
                ExtraKeyValue::Str("img-bbbb".into()),
                ExtraKeyValue::Int(-40_000),
            ])]),
            Some(vec![ExtraKeyValue::Int(i64::MIN), ExtraKeyValue::Int(-200)]),
        ]),
        group_idx: Some(1),
        kv_cache_spec_kind: Some("sliding_window".into()),
        kv_cache_spec_sliding_window: Some(4096),
        locality: Some("LOCAL".into()),
        ownership: Some("offload-tier-2".into()),
        session_id: Some("session-Ω-1".into()),
        lookahead_token_ids: Some(vec![vec![1, 2], vec![70_000], vec![], vec![u32::MAX]]),
    };
    let raw = BlockStored {
        block_hashes: vec![
            WireBlockHash::Bytes((0u8..32).collect()),
            WireBlockHash::Bytes(vec![0xee; 16]),
        ],
        parent_block_hash: Some(WireBlockHash::Bytes(vec![1; 32])),
        token_ids: (0..32).collect(),
        block_size: 16,
        medium: Some(Medium::Gpu),
        extra_keys: Some(vec![None, None]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..Default::default()
    };
    let minimal = BlockStored {
        block_hashes: vec![WireBlockHash::Int(9)],
        token_ids: vec![5; 16],
        block_size: 16,
        ..Default::default()
    };
    // Long strings (str8 / str16) and big arrays (array16 / array32 headers).
    let big = BlockStored {
        block_hashes: (0..1_000u64)
            .map(|i| WireBlockHash::Int(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .collect(),
        token_ids: (0..70_000u32).map(|i| i % 151_936).collect(),
        block_size: 70,
        lora_name: Some("l".repeat(40)),
        session_id: Some("s".repeat(300)),
        medium: Some(Medium::Storage),
        ..Default::default()
    };
    vec![
        EventBatch {
            ts: 1_712_345_678.125,
            events: vec![
                KvEvent::BlockStored(full),
                KvEvent::BlockStored(raw),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![WireBlockHash::Int(1 << 63), WireBlockHash::Int(3)],
                    medium: Some(Medium::Cpu),
                    group_idx: Some(0),
                    locality: Some("REMOTE".into()),
                    ownership: Some("x".into()),
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![WireBlockHash::Bytes(vec![2; 32])],
                    ..Default::default()
                }),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        },
        EventBatch {
            ts: 0.5,
            events: vec![KvEvent::BlockStored(minimal)],
            data_parallel_rank: Some(7),
        },
        EventBatch {
            ts: 1_700_000_000.0,
            events: vec![],
            data_parallel_rank: None,
        },
        EventBatch {
            ts: 1_700_000_001.75,
            events: vec![KvEvent::BlockStored(big)],
            data_parallel_rank: Some(300),
        },
    ]
}

fn assert_same(batch: &EventBatch, got: &Value) {
    assert!(got.get("error").is_none(), "vLLM error: {got}");
    assert_eq!(
        got["reencode_identical"], true,
        "msgspec writes different bytes"
    );
    assert_eq!(got["ts"].as_f64(), Some(batch.ts));
    assert_eq!(got["data_parallel_rank"].as_i64(), batch.data_parallel_rank);
    let want: Vec<Value> = batch.events.iter().map(expected_event).collect();
    assert_eq!(got["events"], Value::Array(want));
}

#[test]
fn vllm_decodes_our_v0_33_bytes_and_would_write_the_same() {
    let batches = batches();
    let payloads: Vec<Vec<u8>> = batches
        .iter()
        .map(|b| encode_batch(b, WireLayout::V0_33))
        .collect();
    let out = decode_with_vllm(&payloads);
    assert_eq!(out.len(), batches.len());
    for (b, got) in batches.iter().zip(&out) {
        assert_same(b, got);
    }
}

#[test]
fn vllm_rejects_what_it_cannot_decode() {
    // The kit must fail loudly, or the test above would prove nothing.
    let garbage = [0x93u8, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0xc0, 0xc0];
    let status = Command::new(python())
        .arg(kit("decode_with_vllm.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .and_then(|mut c| {
            if let Some(mut stdin) = c.stdin.take() {
                writeln!(stdin, "{}", hex::encode(garbage))?;
            }
            c.wait()
        })
        .expect("run decode_with_vllm.py");
    assert!(!status.success());
}

#[test]
fn endpoint_mode_decodes_a_live_zmq_stream() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let batches = batches();
    let sub = Command::new(python())
        .arg(kit("decode_with_vllm.py"))
        .args([
            "--endpoint",
            &endpoint,
            "--topic",
            "kv-events",
            "--timeout",
            "60",
        ])
        .args(["--count", &batches.len().to_string(), "--require-identical"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start subscriber");
    let mut publisher = Command::new(python())
        .arg(kit("publish_hex.py"))
        .args(["--endpoint", &endpoint, "--first-seq", "41"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start publisher");
    {
        let mut stdin = publisher.stdin.take().expect("stdin");
        for b in &batches {
            writeln!(stdin, "{}", hex::encode(encode_batch(b, WireLayout::V0_33))).expect("write");
        }
    }
    let pub_out = publisher.wait_with_output().expect("publisher");
    let sub_out = sub.wait_with_output().expect("subscriber");
    assert!(
        pub_out.status.success(),
        "publisher: {}",
        String::from_utf8_lossy(&pub_out.stderr)
    );
    let stdout = String::from_utf8_lossy(&sub_out.stdout);
    assert!(
        sub_out.status.success(),
        "subscriber: {stdout}\n{}",
        String::from_utf8_lossy(&sub_out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    assert_eq!(lines.len(), batches.len());
    for (i, (b, got)) in batches.iter().zip(&lines).enumerate() {
        assert_eq!(got["seq"].as_u64(), Some(41 + i as u64));
        assert_eq!(got["topic"], "kv-events");
        assert_same(b, got);
    }
}
