//! vLLM-exact block hashing against vectors computed by vLLM 0.33.0's own code.
//!
//! * `testdata/golden_hashes.json`: the 25 shared golden cases (vllmref/make_golden.py).
//! * `testdata/extra_hashes.json`: more cases for gaps in the golden set, same format, made with
//!   the same harness (`/work/shared/vllm/harness` copied to /tmp/harness, `./fetch_vllm.sh &&
//!   ./setup.sh`, then `./venv/bin/python make_extra.py > extra_hashes.json`, where make_extra.py
//!   feeds each case's `input` object to `vllmref_common.compute(input, with_event=True)`, which
//!   is exactly what `hashes.py` prints for it).
//!
//! Every case checks NONE_HASH and its preimage, each block's hashed and published extra keys,
//! preimage bytes, digest and wire value, the whole chain, the usable-hit rule, and that the
//! router keys of the request equal those of the `BlockStored` event vLLM emitted for it.

use std::path::PathBuf;

use kvroute_core::events::{BlockStored, ExtraKeyValue, WireBlockHash};
use kvroute_core::hashing::{
    usable_hit_blocks, wire_u64, BlockHasher, ExtraKeyStyle, HashAlgo, HashConfig, HashExtraKey,
    LoraRef, MmFeature, RequestExtras,
};
use kvroute_core::router_key::{event_keys, request_keys, ROOT};
use serde_json::Value;

fn load(name: &str) -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let doc: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()));
    doc["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("{name} has no cases"))
        .clone()
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn extras_of(input: &Value) -> RequestExtras {
    let lora = match (str_of(input, "lora_name"), str_of(input, "lora_path")) {
        (Some(name), Some(path)) => Some(LoraRef {
            name: name.into(),
            path: path.into(),
        }),
        (None, None) => None,
        other => panic!("lora_name without lora_path: {other:?}"),
    };
    let mm_features = input
        .get("mm_features")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .map(|m| MmFeature {
                    identifier: str_of(m, "identifier").expect("identifier").into(),
                    offset: m["offset"].as_u64().expect("offset") as usize,
                    length: m["length"].as_u64().expect("length") as usize,
                })
                .collect()
        })
        .unwrap_or_default();
    RequestExtras {
        lora,
        cache_salt: str_of(input, "cache_salt").map(str::to_owned),
        mm_features,
    }
}

fn tokens_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token array")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token id")).expect("u32 token"))
        .collect()
}

/// The JSON vLLM's harness prints for a hashed extra key (tuples as arrays).
fn hash_key_json(k: &HashExtraKey) -> Value {
    match k {
        HashExtraKey::Str(s) => Value::from(s.as_str()),
        HashExtraKey::Tag(s) => Value::from(*s),
        HashExtraKey::Int(i) => Value::from(*i),
        HashExtraKey::Bytes(b) => Value::from(hex::encode(b)),
        HashExtraKey::Tuple(items) => Value::Array(items.iter().map(hash_key_json).collect()),
    }
}

fn event_value_json(v: &ExtraKeyValue) -> Value {
    match v {
        ExtraKeyValue::Str(s) => Value::from(s.as_str()),
        ExtraKeyValue::Int(i) => Value::from(*i),
        ExtraKeyValue::Bytes(b) => Value::from(hex::encode(b)),
        ExtraKeyValue::List(items) => Value::Array(items.iter().map(event_value_json).collect()),
    }
}

fn event_value_from_json(v: &Value) -> ExtraKeyValue {
    match v {
        Value::String(s) => ExtraKeyValue::Str(s.clone()),
        Value::Number(n) => ExtraKeyValue::Int(n.as_i64().expect("i64 extra key")),
        Value::Array(items) => {
            ExtraKeyValue::List(items.iter().map(event_value_from_json).collect())
        }
        other => panic!("unexpected event extra key {other}"),
    }
}

/// The golden `block_stored_event` as the events decoder would produce it (built by hand so
/// this test depends only on hashing).
fn block_stored_of(ev: &Value) -> BlockStored {
    BlockStored {
        block_hashes: ev["block_hashes"]
            .as_array()
            .expect("block_hashes")
            .iter()
            .map(|h| WireBlockHash::Int(h.as_u64().expect("u64 hash")))
            .collect(),
        parent_block_hash: None,
        token_ids: tokens_of(&ev["token_ids"]),
        block_size: ev["block_size"].as_u64().expect("block_size") as u32,
        lora_name: str_of(ev, "lora_name").map(str::to_owned),
        extra_keys: ev["extra_keys"].as_array().map(|blocks| {
            blocks
                .iter()
                .map(|b| {
                    b.as_array()
                        .map(|keys| keys.iter().map(event_value_from_json).collect())
                })
                .collect()
        }),
        ..Default::default()
    }
}

fn check_case(case: &Value) -> usize {
    let name = case["name"].as_str().expect("name");
    let input = &case["input"];
    let out = &case["output"];
    let algo: HashAlgo = str_of(input, "algo")
        .unwrap_or("sha256")
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let block_size = input["block_size"].as_u64().unwrap_or(16) as usize;
    let tokens = tokens_of(&input["token_ids"]);
    let cfg = HashConfig::new(algo, str_of(input, "seed").map(str::to_owned));
    let hasher = BlockHasher::new(&cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
    let extras = extras_of(input);

    assert_eq!(
        Some(hasher.none_hash().to_hex().as_str()),
        str_of(out, "none_hash_hex"),
        "{name}: NONE_HASH"
    );
    assert_eq!(
        Some(hex::encode(hasher.none_hash_preimage()).as_str()),
        str_of(out, "none_hash_preimage_hex"),
        "{name}: NONE_HASH preimage"
    );

    let blocks = out["blocks"].as_array().expect("blocks");
    let mut parent = *hasher.none_hash();
    for (i, b) in blocks.iter().enumerate() {
        let range = b["token_range"].as_array().expect("token_range");
        let (start, end) = (
            range[0].as_u64().expect("start") as usize,
            range[1].as_u64().expect("end") as usize,
        );
        assert_eq!(
            (start, end),
            (i * block_size, (i + 1) * block_size),
            "{name}"
        );
        let keys = extras.block_extra_keys(i, block_size, ExtraKeyStyle::Tagged);
        let hash_keys = keys
            .hash
            .as_ref()
            .map(|k| Value::Array(k.iter().map(hash_key_json).collect()))
            .unwrap_or(Value::Null);
        assert_eq!(
            hash_keys, b["hash_extra_keys"],
            "{name} block {i}: hashed extra keys"
        );
        let event_keys_json = keys
            .event
            .as_ref()
            .map(|k| Value::Array(k.iter().map(event_value_json).collect()))
            .unwrap_or(Value::Null);
        assert_eq!(
            event_keys_json, b["event_extra_keys"],
            "{name} block {i}: event extra keys"
        );
        let pre = hasher.preimage(&parent, &tokens[start..end], keys.hash.as_deref());
        assert_eq!(
            Some(hex::encode(&pre).as_str()),
            str_of(b, "preimage_hex"),
            "{name} block {i}: preimage"
        );
        let digest = hasher.hash_block(&parent, &tokens[start..end], keys.hash.as_deref());
        assert_eq!(
            Some(digest.to_hex().as_str()),
            str_of(b, "hash_hex"),
            "{name} block {i}: digest"
        );
        assert_eq!(
            Some(wire_u64(&digest)),
            b["wire_u64"].as_u64(),
            "{name} block {i}: wire"
        );
        parent = digest;
    }

    let chain = hasher.block_hashes(&tokens, block_size, &extras);
    let hex_chain: Vec<Value> = chain.iter().map(|d| Value::from(d.to_hex())).collect();
    assert_eq!(
        Value::Array(hex_chain),
        out["block_hashes_hex"],
        "{name}: chain"
    );
    let wire: Vec<Value> = chain.iter().map(|d| Value::from(wire_u64(d))).collect();
    assert_eq!(
        Value::Array(wire),
        out["wire_block_hashes_u64"],
        "{name}: wire chain"
    );
    assert_eq!(chain.len(), blocks.len(), "{name}: block count");
    assert_eq!(
        Some(usable_hit_blocks(tokens.len(), block_size) as u64),
        out["max_prefix_hit_blocks_if_all_cached"].as_u64(),
        "{name}: usable hit blocks"
    );

    let req_keys = request_keys(&tokens, block_size, &extras, ExtraKeyStyle::Tagged);
    assert_eq!(req_keys.len(), chain.len(), "{name}: router key count");
    match out.get("block_stored_event").filter(|e| !e.is_null()) {
        Some(ev) => {
            let ev = block_stored_of(ev);
            let wire_hashes: Vec<u64> = ev.block_hashes.iter().map(WireBlockHash::as_u64).collect();
            let ours: Vec<u64> = chain.iter().map(wire_u64).collect();
            assert_eq!(wire_hashes, ours, "{name}: event hashes");
            let from_event = event_keys(ROOT, &ev).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(from_event, req_keys, "{name}: router keys request vs event");
        }
        None => assert!(chain.is_empty(), "{name}: blocks but no event"),
    }
    blocks.len()
}

#[test]
fn all_golden_cases_match_vllm() {
    let cases = load("golden_hashes.json");
    assert_eq!(cases.len(), 25, "golden_hashes.json should hold 25 cases");
    let blocks: usize = cases.iter().map(check_case).sum();
    assert!(blocks > 100, "only {blocks} blocks checked");
}

#[test]
fn all_extra_cases_match_vllm() {
    let cases = load("extra_hashes.json");
    assert!(
        cases.len() >= 8,
        "extra_hashes.json should hold at least 8 cases"
    );
    for case in &cases {
        check_case(case);
    }
}

#[test]
fn router_keys_do_not_depend_on_engine_hash_settings() {
    // The same request under every algorithm and seed: engine hashes differ, router keys don't.
    let cases = load("golden_hashes.json");
    let case = cases
        .iter()
        .find(|c| c["name"] == "sha256_bs16_lora_and_salt")
        .expect("case");
    let tokens = tokens_of(&case["input"]["token_ids"]);
    let extras = extras_of(&case["input"]);
    let mut first_digests = Vec::new();
    for algo in HashAlgo::ALL {
        for seed in ["0", "1"] {
            let h = BlockHasher::new(&HashConfig::new(algo, Some(seed.into())))
                .unwrap_or_else(|e| panic!("{e}"));
            first_digests.push(h.block_hashes(&tokens, 16, &extras)[0]);
        }
    }
    first_digests.sort();
    first_digests.dedup();
    assert_eq!(first_digests.len(), 8);
    assert_eq!(
        request_keys(&tokens, 16, &extras, ExtraKeyStyle::Tagged),
        request_keys(&tokens, 16, &extras, ExtraKeyStyle::Plain)
    );
}
