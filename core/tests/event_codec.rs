//! KV event codec tests: vLLM 0.33.0's golden batches, every positional layout, the odd encodings
//! real engines send (raw-byte hashes, signed ints, u64 >= 2^63, unknown keys and event types), and
//! hostile input (truncation, mutation, absurd length headers, deep nesting).

use kvroute_core::events::{
    decode_batch, decode_batch_with, encode_batch, BlockRemoved, BlockStored, DecodeError,
    DecodeLimits, EventBatch, ExtraKeyValue, KvEvent, Medium, WireBlockHash, WireLayout,
};
use serde_json::Value;

fn golden() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/golden_hashes.json"
    );
    let text = std::fs::read_to_string(path).expect("testdata/golden_hashes.json is readable");
    serde_json::from_str(&text).expect("golden file is JSON")
}

/// (case name, payload bytes, expected event JSON, expected ts) for every case that has a batch.
fn golden_batches() -> Vec<(String, Vec<u8>, Value, f64)> {
    let g = golden();
    let cases = g["cases"].as_array().expect("cases array");
    assert_eq!(cases.len(), 25, "golden file has 25 cases");
    let mut out = Vec::new();
    for c in cases {
        let o = &c["output"];
        let Some(hex_str) = o.get("kv_event_batch_msgpack_hex").and_then(Value::as_str) else {
            // Prompts without a full block publish nothing.
            assert_eq!(
                o["num_full_blocks"], 0,
                "{}: no batch only when no full block",
                c["name"]
            );
            continue;
        };
        out.push((
            c["name"].as_str().unwrap_or("?").to_owned(),
            hex::decode(hex_str).expect("hex"),
            o["block_stored_event"].clone(),
            o["kv_event_batch_ts"].as_f64().expect("ts"),
        ));
    }
    out
}

fn json_extra(v: &Value) -> ExtraKeyValue {
    match v {
        Value::String(s) => ExtraKeyValue::Str(s.clone()),
        Value::Number(n) => ExtraKeyValue::Int(n.as_i64().expect("i64 extra key")),
        Value::Array(a) => ExtraKeyValue::List(a.iter().map(json_extra).collect()),
        other => panic!("unexpected extra key value {other}"),
    }
}

fn json_hash(v: &Value) -> WireBlockHash {
    WireBlockHash::Int(v.as_u64().expect("u64 hash"))
}

fn opt_str(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

/// Compares a decoded BlockStored with vLLM's own JSON of the event, key by key; every key of the
/// JSON must be checked (so a field added to the golden file cannot go unnoticed).
fn assert_stored_matches(name: &str, s: &BlockStored, want: &Value) {
    let obj = want.as_object().expect("event object");
    for (key, v) in obj {
        match key.as_str() {
            "type" => assert_eq!(v, "BlockStored", "{name}"),
            "block_hashes" => {
                let w: Vec<_> = v.as_array().expect("list").iter().map(json_hash).collect();
                assert_eq!(s.block_hashes, w, "{name}: block_hashes");
            }
            "parent_block_hash" => {
                let w = if v.is_null() {
                    None
                } else {
                    Some(json_hash(v))
                };
                assert_eq!(s.parent_block_hash, w, "{name}: parent_block_hash");
            }
            "token_ids" => {
                let w: Vec<u32> = v
                    .as_array()
                    .expect("list")
                    .iter()
                    .map(|t| t.as_u64().expect("token") as u32)
                    .collect();
                assert_eq!(s.token_ids, w, "{name}: token_ids");
            }
            "block_size" => assert_eq!(Some(s.block_size as u64), v.as_u64(), "{name}"),
            "lora_id" => assert_eq!(s.lora_id, v.as_i64(), "{name}: lora_id"),
            "medium" => assert_eq!(
                s.medium.map(|m| m.as_str().to_owned()),
                opt_str(v),
                "{name}: medium"
            ),
            "lora_name" => assert_eq!(s.lora_name, opt_str(v), "{name}: lora_name"),
            "extra_keys" => {
                let w: Option<Vec<Option<Vec<ExtraKeyValue>>>> = v.as_array().map(|entries| {
                    entries
                        .iter()
                        .map(|e| {
                            e.as_array()
                                .map(|vals| vals.iter().map(json_extra).collect::<Vec<_>>())
                        })
                        .collect()
                });
                assert_eq!(s.extra_keys, w, "{name}: extra_keys");
            }
            "group_idx" => assert_eq!(s.group_idx, v.as_i64(), "{name}: group_idx"),
            "kv_cache_spec_kind" => {
                assert_eq!(s.kv_cache_spec_kind, opt_str(v), "{name}: kind")
            }
            "kv_cache_spec_sliding_window" => {
                assert_eq!(s.kv_cache_spec_sliding_window, v.as_i64(), "{name}")
            }
            "session_id" => assert_eq!(s.session_id, opt_str(v), "{name}: session_id"),
            other => panic!("{name}: golden event has key {other} the test does not check"),
        }
    }
    // Fields the JSON omits must have decoded as None.
    for (key, is_none) in [
        (
            "kv_cache_spec_sliding_window",
            s.kv_cache_spec_sliding_window.is_none(),
        ),
        ("locality", s.locality.is_none()),
        ("ownership", s.ownership.is_none()),
        ("session_id", s.session_id.is_none()),
        ("lookahead_token_ids", s.lookahead_token_ids.is_none()),
    ] {
        if !obj.contains_key(key) {
            assert!(is_none, "{name}: {key} should be None");
        }
    }
}

#[test]
fn golden_batches_decode_to_vllms_events() {
    let batches = golden_batches();
    assert_eq!(
        batches.len(),
        23,
        "23 golden cases have at least one full block"
    );
    for (name, payload, want, ts) in &batches {
        let batch = decode_batch(payload).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.ts, *ts, "{name}");
        assert_eq!(batch.data_parallel_rank, Some(0), "{name}");
        assert_eq!(batch.events.len(), 1, "{name}");
        match &batch.events[0] {
            KvEvent::BlockStored(s) => assert_stored_matches(name, s, want),
            other => panic!("{name}: expected BlockStored, got {other:?}"),
        }
    }
}

#[test]
fn golden_batches_reencode_byte_identical() {
    for (name, payload, _, _) in golden_batches() {
        let batch = decode_batch(&payload).unwrap_or_else(|e| panic!("{name}: {e}"));
        let again = encode_batch(&batch, WireLayout::V0_33);
        assert_eq!(hex::encode(&again), hex::encode(&payload), "{name}");
    }
}

/// A batch with every event kind and every optional field somewhere.
fn rich_batch() -> EventBatch {
    let stored_full = BlockStored {
        block_hashes: vec![
            WireBlockHash::Int(1),
            WireBlockHash::Int(u64::MAX),
            WireBlockHash::Int(1 << 63),
        ],
        parent_block_hash: Some(WireBlockHash::Int(0xdead_beef_0000_0001)),
        token_ids: (0..48).map(|i| i * 40_000).collect(),
        block_size: 16,
        lora_id: Some(7),
        medium: Some(Medium::Cpu),
        lora_name: Some("sql-lora".into()),
        extra_keys: Some(vec![
            Some(vec![
                ExtraKeyValue::Str("sql-lora".into()),
                ExtraKeyValue::List(vec![
                    ExtraKeyValue::Str("img-aaaa".into()),
                    ExtraKeyValue::Int(-8),
                ]),
                ExtraKeyValue::Str("tenant-a".into()),
            ]),
            None,
            Some(vec![ExtraKeyValue::Bytes(vec![0xab; 32])]),
        ]),
        group_idx: Some(1),
        kv_cache_spec_kind: Some("sliding_window".into()),
        kv_cache_spec_sliding_window: Some(4096),
        locality: Some("LOCAL".into()),
        ownership: Some("lmcache".into()),
        session_id: Some("sess-1".into()),
        lookahead_token_ids: Some(vec![vec![1, 2], vec![3, 4], vec![]]),
    };
    let stored_raw = BlockStored {
        block_hashes: vec![
            WireBlockHash::Bytes((0u8..32).collect()),
            WireBlockHash::Bytes(vec![0xff; 16]),
        ],
        parent_block_hash: Some(WireBlockHash::Bytes(vec![7; 32])),
        token_ids: (0..8).collect(),
        block_size: 4,
        medium: Some(Medium::Gpu),
        ..Default::default()
    };
    EventBatch {
        ts: 1_712_345_678.125,
        events: vec![
            KvEvent::BlockStored(stored_full),
            KvEvent::BlockStored(stored_raw),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![WireBlockHash::Int(42), WireBlockHash::Int(u64::MAX - 1)],
                medium: Some(Medium::Storage),
                group_idx: Some(2),
                locality: Some("REMOTE".into()),
                ownership: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![WireBlockHash::Bytes(vec![1; 32])],
                ..Default::default()
            }),
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(3),
    }
}

/// What a layout can carry of `batch`: fields the release did not have become None.
fn project(batch: &EventBatch, layout: WireLayout) -> EventBatch {
    let keep_medium = layout != WireLayout::Array0_9;
    let keep_lora_name = matches!(
        layout,
        WireLayout::Array0_15 | WireLayout::Array0_23 | WireLayout::V0_33
    );
    let keep_23 = matches!(layout, WireLayout::Array0_23 | WireLayout::V0_33);
    let keep_33 = layout == WireLayout::V0_33;
    let events = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => {
                let mut s = s.clone();
                if !keep_medium {
                    s.medium = None;
                }
                if !keep_lora_name {
                    s.lora_name = None;
                }
                if !keep_23 {
                    s.extra_keys = None;
                    s.group_idx = None;
                    s.kv_cache_spec_kind = None;
                    s.kv_cache_spec_sliding_window = None;
                }
                if !keep_33 {
                    s.locality = None;
                    s.ownership = None;
                    s.session_id = None;
                    s.lookahead_token_ids = None;
                }
                KvEvent::BlockStored(s)
            }
            KvEvent::BlockRemoved(r) => {
                let mut r = r.clone();
                if !keep_medium {
                    r.medium = None;
                }
                if !keep_23 {
                    r.group_idx = None;
                }
                if !keep_33 {
                    r.locality = None;
                    r.ownership = None;
                }
                KvEvent::BlockRemoved(r)
            }
            other => other.clone(),
        })
        .collect();
    EventBatch {
        events,
        ..batch.clone()
    }
}

const ALL_LAYOUTS: [WireLayout; 5] = [
    WireLayout::V0_33,
    WireLayout::Array0_9,
    WireLayout::Array0_11,
    WireLayout::Array0_15,
    WireLayout::Array0_23,
];

#[test]
fn every_layout_round_trips() {
    let batch = rich_batch();
    for layout in ALL_LAYOUTS {
        let bytes = encode_batch(&batch, layout);
        let back = decode_batch(&bytes).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
        assert_eq!(back, project(&batch, layout), "{layout:?}");
        // And the projected batch re-encodes to the same bytes.
        assert_eq!(encode_batch(&back, layout), bytes, "{layout:?}");
    }
}

#[test]
fn array_layouts_have_each_releases_lengths() {
    let batch = rich_batch();
    // [0x93, f64 (9 bytes), events array header 0x95] then the first event's array header.
    for (layout, stored_len, removed_len) in [
        (WireLayout::Array0_9, 6u8, 2u8),
        (WireLayout::Array0_11, 7, 3),
        (WireLayout::Array0_15, 8, 3),
        (WireLayout::Array0_23, 12, 4),
    ] {
        let bytes = encode_batch(&batch, layout);
        assert_eq!(
            bytes[11],
            0x90 | stored_len,
            "{layout:?} BlockStored length"
        );
        let removed = EventBatch {
            events: vec![batch.events[2].clone()],
            ..batch.clone()
        };
        let bytes = encode_batch(&removed, layout);
        assert_eq!(
            bytes[11],
            0x90 | removed_len,
            "{layout:?} BlockRemoved length"
        );
    }
}

#[test]
fn engine_versions_map_to_layouts() {
    for (v, want) in [
        ("0.9.2", Some(WireLayout::Array0_9)),
        ("0.10.1", Some(WireLayout::Array0_11)),
        ("0.11.0", Some(WireLayout::Array0_11)),
        ("0.15.1", Some(WireLayout::Array0_15)),
        ("0.23.0", Some(WireLayout::Array0_23)),
        ("0.24.0", Some(WireLayout::V0_33)),
        ("v0.33.0rc1", Some(WireLayout::V0_33)),
        ("1.0.0", Some(WireLayout::V0_33)),
        ("0.8.5", None),
        ("nonsense", None),
    ] {
        assert_eq!(WireLayout::for_engine_version(v), want, "{v}");
    }
}

/// A msgpack value for hand-built payloads, with explicit control over integer widths.
enum M {
    Nil,
    F64(f64),
    U(u64),
    /// Signed int in its minimal form.
    I(i64),
    /// Exact bytes (for non-minimal encodings).
    Raw(Vec<u8>),
    S(&'static str),
    Bin(Vec<u8>),
    A(Vec<M>),
    Map(Vec<(&'static str, M)>),
}

fn enc(m: &M, out: &mut Vec<u8>) {
    use rmp::encode as e;
    let r = match m {
        M::Nil => e::write_nil(out).map_err(|_| ()),
        M::F64(v) => e::write_f64(out, *v).map_err(|_| ()),
        M::U(v) => e::write_uint(out, *v).map(|_| ()).map_err(|_| ()),
        M::I(v) => e::write_sint(out, *v).map(|_| ()).map_err(|_| ()),
        M::Raw(b) => {
            out.extend_from_slice(b);
            Ok(())
        }
        M::S(s) => e::write_str(out, s).map_err(|_| ()),
        M::Bin(b) => e::write_bin(out, b).map_err(|_| ()),
        M::A(items) => {
            let r = e::write_array_len(out, items.len() as u32).map(|_| ());
            for i in items {
                enc(i, out);
            }
            r.map_err(|_| ())
        }
        M::Map(entries) => {
            let r = e::write_map_len(out, entries.len() as u32).map(|_| ());
            for (k, v) in entries {
                enc(&M::S(k), out);
                enc(v, out);
            }
            r.map_err(|_| ())
        }
    };
    r.expect("writing to a Vec cannot fail");
}

fn bytes(m: M) -> Vec<u8> {
    let mut out = Vec::new();
    enc(&m, &mut out);
    out
}

fn batch_of(events: Vec<M>) -> Vec<u8> {
    bytes(M::A(vec![M::F64(1.5), M::A(events), M::U(0)]))
}

fn only_event(payload: &[u8]) -> KvEvent {
    let b = decode_batch(payload).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(b.events.len(), 1);
    b.events.into_iter().next().expect("one event")
}

#[test]
fn hashes_in_every_integer_width_and_sign() {
    let cases: Vec<(M, u64)> = vec![
        (M::U(5), 5),
        (M::Raw(vec![0xcc, 0xff]), 255),
        (M::Raw(vec![0xcd, 0x01, 0x00]), 256),
        (M::Raw(vec![0xce, 0, 0, 0, 9]), 9),
        (M::Raw(vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 9]), 9),
        (M::U(u64::MAX), u64::MAX),
        (M::U(1 << 63), 1 << 63),
        (M::I(-1), u64::MAX),
        (M::Raw(vec![0xd0, 0xfe]), u64::MAX - 1),
        (M::Raw(vec![0xd1, 0xff, 0xfe]), u64::MAX - 1),
        (M::Raw(vec![0xd2, 0xff, 0xff, 0xff, 0xfe]), u64::MAX - 1),
        (M::I(i64::MIN), 1 << 63),
        (M::Raw(vec![0xd0, 0x05]), 5),
    ];
    for (m, want) in cases {
        let p = batch_of(vec![M::Map(vec![
            ("type", M::S("BlockRemoved")),
            ("block_hashes", M::A(vec![m])),
            ("medium", M::Nil),
        ])]);
        match only_event(&p) {
            KvEvent::BlockRemoved(r) => assert_eq!(r.block_hashes, vec![WireBlockHash::Int(want)]),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn raw_byte_hashes_as_bin_and_legacy_raw_str() {
    let digest: Vec<u8> = (0..32).collect();
    let mut legacy_raw = vec![0xd9, 32];
    legacy_raw.extend_from_slice(&[b'a'; 32]);
    let p = batch_of(vec![M::Map(vec![
        ("type", M::S("BlockStored")),
        (
            "block_hashes",
            M::A(vec![M::Bin(digest.clone()), M::Raw(legacy_raw)]),
        ),
        ("parent_block_hash", M::Bin(vec![9; 16])),
        ("token_ids", M::A(vec![])),
        ("block_size", M::U(16)),
    ])]);
    match only_event(&p) {
        KvEvent::BlockStored(s) => {
            assert_eq!(
                s.block_hashes,
                vec![
                    WireBlockHash::Bytes(digest.clone()),
                    WireBlockHash::Bytes(vec![b'a'; 32])
                ]
            );
            assert_eq!(s.parent_block_hash, Some(WireBlockHash::Bytes(vec![9; 16])));
            // The index key of a raw digest is its last 8 bytes, as vLLM's int form.
            assert_eq!(
                s.block_hashes[0].as_u64(),
                u64::from_be_bytes(digest[24..].try_into().expect("8"))
            );
            // Omitted no-default fields decode as None.
            assert_eq!(s.medium, None);
            assert_eq!(s.lora_id, None);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn token_ids_in_any_width_and_out_of_range_rejected() {
    let tokens = M::A(vec![
        M::U(0),
        M::Raw(vec![0xcc, 200]),
        M::Raw(vec![0xcd, 0x12, 0x34]),
        M::Raw(vec![0xce, 0x7f, 0xff, 0xff, 0xff]),
        M::Raw(vec![0xcf, 0, 0, 0, 0, 0, 0, 0x01, 0x00]),
        M::Raw(vec![0xd0, 0x10]),
        M::Raw(vec![0xd3, 0, 0, 0, 0, 0, 0, 0, 3]),
    ]);
    let p = batch_of(vec![M::Map(vec![
        ("type", M::S("BlockStored")),
        ("block_hashes", M::A(vec![M::U(1)])),
        ("parent_block_hash", M::Nil),
        ("token_ids", tokens),
        ("block_size", M::U(7)),
    ])]);
    match only_event(&p) {
        KvEvent::BlockStored(s) => {
            assert_eq!(s.token_ids, vec![0, 200, 0x1234, 0x7fff_ffff, 256, 16, 3])
        }
        other => panic!("{other:?}"),
    }
    for bad in [M::I(-1), M::U(1 << 32)] {
        let p = batch_of(vec![M::Map(vec![
            ("type", M::S("BlockStored")),
            ("block_hashes", M::A(vec![])),
            ("token_ids", M::A(vec![bad])),
            ("block_size", M::U(16)),
        ])]);
        assert!(
            matches!(decode_batch(&p), Err(DecodeError::IntOutOfRange { .. })),
            "{:?}",
            decode_batch(&p)
        );
    }
}

#[test]
fn map_keys_in_any_order_unknown_keys_skipped_type_last() {
    let p = batch_of(vec![M::Map(vec![
        (
            "future_field",
            M::Map(vec![("nested", M::A(vec![M::U(1), M::Bin(vec![1, 2])]))]),
        ),
        ("block_size", M::U(2)),
        ("token_ids", M::A(vec![M::U(1), M::U(2)])),
        ("medium", M::S("cpu")),
        ("another", M::Raw(vec![0xd6, 0x01, 0, 0, 0, 0])), // fixext4
        ("block_hashes", M::A(vec![M::U(77)])),
        ("session_id", M::S("s")),
        ("type", M::S("BlockStored")),
    ])]);
    match only_event(&p) {
        KvEvent::BlockStored(s) => {
            assert_eq!(s.block_hashes, vec![WireBlockHash::Int(77)]);
            assert_eq!(s.token_ids, vec![1, 2]);
            assert_eq!(s.block_size, 2);
            assert_eq!(s.medium, Some(Medium::Cpu));
            assert_eq!(s.session_id.as_deref(), Some("s"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_event_types_are_kept_by_name_and_skipped() {
    let p = batch_of(vec![
        M::Map(vec![
            ("type", M::S("BlockPinned")),
            ("block_hashes", M::S("not even a list")),
            ("x", M::A(vec![M::Map(vec![("y", M::Nil)])])),
        ]),
        M::A(vec![M::S("FutureArrayEvent"), M::U(1), M::A(vec![M::Nil])]),
        M::Map(vec![("payload", M::U(3)), ("type", M::S("LateTag"))]),
        M::Map(vec![("type", M::S("AllBlocksCleared")), ("extra", M::U(1))]),
        M::A(vec![M::S("AllBlocksCleared")]),
    ]);
    let b = decode_batch(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        b.events,
        vec![
            KvEvent::Unknown("BlockPinned".into()),
            KvEvent::Unknown("FutureArrayEvent".into()),
            KvEvent::Unknown("LateTag".into()),
            KvEvent::AllBlocksCleared,
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn legacy_block_removed_arrays_and_two_element_batch() {
    let events = vec![
        M::A(vec![M::S("BlockRemoved"), M::A(vec![M::U(1)])]),
        M::A(vec![M::S("BlockRemoved"), M::A(vec![M::U(2)]), M::S("CPU")]),
        M::A(vec![
            M::S("BlockRemoved"),
            M::A(vec![M::U(3)]),
            M::S("GPU"),
            M::U(1),
        ]),
    ];
    let p = bytes(M::A(vec![M::F64(2.0), M::A(events)]));
    let b = decode_batch(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(b.data_parallel_rank, None);
    let want = |h, medium, group_idx| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![WireBlockHash::Int(h)],
            medium,
            group_idx,
            ..Default::default()
        })
    };
    assert_eq!(
        b.events,
        vec![
            want(1, None, None),
            want(2, Some(Medium::Cpu), None),
            want(3, Some(Medium::Gpu), Some(1)),
        ]
    );
}

#[test]
fn structural_errors_are_reported() {
    // Missing required fields.
    let p = batch_of(vec![M::Map(vec![
        ("type", M::S("BlockStored")),
        ("block_hashes", M::A(vec![])),
    ])]);
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::MissingField {
            field: "token_ids",
            ..
        })
    ));
    let p = batch_of(vec![M::Map(vec![("block_hashes", M::A(vec![]))])]);
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::MissingEventType { .. })
    ));
    let p = batch_of(vec![M::A(vec![M::S("BlockStored"), M::A(vec![])])]);
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::ShortEventArray { .. })
    ));
    let p = batch_of(vec![M::U(3)]);
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::BadEvent { .. })
    ));
    let p = bytes(M::A(vec![M::F64(1.0)]));
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::BadBatchLength { len: 1 })
    ));
    let mut p = batch_of(vec![]);
    p.push(0xc0);
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::TrailingBytes { count: 1, .. })
    ));
    assert!(matches!(
        decode_batch(&[]),
        Err(DecodeError::Truncated { .. })
    ));
    // Invalid UTF-8 in a string.
    let p = batch_of(vec![M::A(vec![M::Raw(vec![0xa2, 0xff, 0xfe])])]);
    assert!(matches!(
        decode_batch(&p),
        Err(DecodeError::InvalidUtf8 { .. })
    ));
}

#[test]
fn absurd_length_headers_fail_without_allocating() {
    // Claims 4 billion events / hashes / tokens backed by a few bytes.
    let huge_events = [
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    assert!(matches!(
        decode_batch(&huge_events),
        Err(DecodeError::LimitExceeded { what: "events", .. })
    ));
    let unlimited = DecodeLimits {
        max_events: usize::MAX,
        max_block_hashes: usize::MAX,
        max_token_ids: usize::MAX,
        ..DecodeLimits::default()
    };
    assert!(matches!(
        decode_batch_with(&huge_events, &unlimited),
        Err(DecodeError::Truncated { .. })
    ));
    let mut huge_tokens = batch_of(vec![]);
    huge_tokens.truncate(10); // header + ts
    huge_tokens.extend_from_slice(&[0x91, 0x83]);
    enc(&M::S("type"), &mut huge_tokens);
    enc(&M::S("BlockStored"), &mut huge_tokens);
    enc(&M::S("token_ids"), &mut huge_tokens);
    huge_tokens.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xf0, 1, 2, 3]);
    for limits in [DecodeLimits::default(), unlimited.clone()] {
        let r = decode_batch_with(&huge_tokens, &limits);
        assert!(
            matches!(
                r,
                Err(DecodeError::LimitExceeded { .. } | DecodeError::Truncated { .. })
            ),
            "{r:?}"
        );
    }
    // A map announcing 2^32-1 entries inside an unknown event.
    let mut p = batch_of(vec![]);
    p.truncate(10);
    p.extend_from_slice(&[0x91, 0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, b'a']);
    assert!(matches!(
        decode_batch_with(&p, &unlimited),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn configured_limits_are_enforced() {
    let payload = encode_batch(&rich_batch(), WireLayout::V0_33);
    let tight = |f: &dyn Fn(&mut DecodeLimits)| {
        let mut l = DecodeLimits::default();
        f(&mut l);
        decode_batch_with(&payload, &l)
    };
    assert!(matches!(
        tight(&|l| l.max_events = 4),
        Err(DecodeError::LimitExceeded { what: "events", .. })
    ));
    assert!(matches!(
        tight(&|l| l.max_block_hashes = 2),
        Err(DecodeError::LimitExceeded { .. })
    ));
    assert!(matches!(
        tight(&|l| l.max_token_ids = 47),
        Err(DecodeError::LimitExceeded {
            what: "token ids",
            ..
        })
    ));
    assert!(matches!(
        tight(&|l| l.max_hash_bytes = 16),
        Err(DecodeError::LimitExceeded { .. })
    ));
    assert!(matches!(
        tight(&|l| l.max_payload_bytes = 10),
        Err(DecodeError::PayloadTooLarge { .. })
    ));
    assert!(tight(&|l| l.max_events = 5).is_ok());
}

#[test]
fn deep_nesting_is_rejected_not_recursed() {
    for field in ["extra_keys", "unknown_field"] {
        let mut p = batch_of(vec![]);
        p.truncate(10);
        p.extend_from_slice(&[0x91, 0x85]);
        for (k, v) in [
            ("type", M::S("BlockStored")),
            ("block_hashes", M::A(vec![])),
            ("token_ids", M::A(vec![])),
            ("block_size", M::U(1)),
        ] {
            enc(&M::S(k), &mut p);
            enc(&v, &mut p);
        }
        enc(&M::S(field), &mut p);
        p.extend(std::iter::repeat_n(0x91u8, 100_000));
        p.push(0xc0);
        p.push(0x00); // dp rank
        let r = decode_batch(&p);
        assert!(
            matches!(r, Err(DecodeError::TooDeep { .. })),
            "{field}: {r:?}"
        );
    }
}

#[test]
fn every_truncation_of_every_golden_payload_is_an_error() {
    let mut payloads: Vec<Vec<u8>> = golden_batches().into_iter().map(|b| b.1).collect();
    for layout in ALL_LAYOUTS {
        payloads.push(encode_batch(&rich_batch(), layout));
    }
    for p in &payloads {
        for cut in 0..p.len() {
            assert!(
                decode_batch(&p[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
    }
}

struct XorShift(u64);
impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

#[test]
fn mutated_payloads_never_panic_and_valid_results_round_trip() {
    let mut seeds: Vec<Vec<u8>> = golden_batches().into_iter().map(|b| b.1).collect();
    for layout in ALL_LAYOUTS {
        seeds.push(encode_batch(&rich_batch(), layout));
    }
    let mut rng = XorShift(0x5eed_1234_abcd_ef01);
    let interesting = [
        0x00, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc4, 0xcc, 0xcf, 0xd3, 0xd9,
        0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff,
    ];
    let (mut ok, mut err) = (0usize, 0usize);
    for i in 0..6_000 {
        let mut p = seeds[i % seeds.len()].clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(p.len());
            match rng.below(5) {
                0 => p[at] = rng.next() as u8,
                1 => p[at] = interesting[rng.below(interesting.len())],
                2 => p.insert(at, interesting[rng.below(interesting.len())]),
                3 if p.len() > 1 => {
                    p.remove(at);
                }
                _ => p[at] ^= 1 << rng.below(8),
            }
        }
        match decode_batch(&p) {
            Ok(b) => {
                ok += 1;
                // Whatever decoded must survive a re-encode and decode unchanged (ts may be NaN
                // after a mutation, so compare the events).
                let again = decode_batch(&encode_batch(&b, WireLayout::V0_33))
                    .unwrap_or_else(|e| panic!("re-decode failed: {e}"));
                assert_eq!(again.events, b.events);
            }
            Err(_) => err += 1,
        }
    }
    // Most mutations must be caught (guards against a decoder that accepts anything).
    assert!(err > ok, "ok {ok}, err {err}");
    // Pure random garbage.
    for len in 0..2_000 {
        let g: Vec<u8> = (0..len % 300).map(|_| rng.next() as u8).collect();
        let _ = decode_batch(&g);
    }
}
