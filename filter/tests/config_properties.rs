//! Property tests of the plugin configuration parser (`FilterConfig::parse`, natively: the same
//! code the .wasm runs in `on_configure`). Proves, for arbitrary bytes, arbitrary JSON with the
//! real field names, byte mutations of valid configurations (docs/filter.md's example and a full
//! one) and generated in-range configurations: parsing never panics; a refusal is a `Json` error
//! with a message or an `Invalid` error naming its field, both displayed with the `kvroute
//! configuration` prefix; anything accepted also passes `validate`; generated valid
//! configurations are accepted and keep their key fields; one out-of-range field is refused
//! naming that field.
//!
//! Cases: `PROPTEST_CASES` (default per test below); failures are shrunk, printed and persisted
//! next to this file. See docs/fuzzing.md.

use std::collections::BTreeMap;

use kvroute_filter::config::{ConfigError, FilterConfig};
use kvroute_testkit::mutate::{apply, byte_mutation};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use serde_json::{json, Map, Value};

fn config(default_cases: u32) -> ProptestConfig {
    kvroute_testkit::cases::config(default_cases, None)
}

/// The example of docs/filter.md ("Configuration reference").
const DOC_EXAMPLE: &str = r#"{"route_timeout_ms": 100, "inject_kv_cache_report_mode": true,
 "models": {"qwen3": {"block_size": 16, "lora_paths": {"sql-lora": "/adapters/sql"}}}}"#;

/// Every documented field set.
fn full_example() -> Value {
    json!({
        "indexer_cluster": "kvroute_indexer", "indexer_authority": "kvroute-indexer",
        "route_timeout_ms": 100, "complete_timeout_ms": 1000, "tokenizer_timeout_ms": 30000,
        "routed_paths": ["/v1/completions", "/v1/chat/completions"],
        "max_body_bytes": 4194304, "oversized_body": "fail_open",
        "inject_kv_cache_report_mode": false, "debug_headers": true, "report_completion": true,
        "session_header": "x-session-id", "max_response_scan_bytes": 1048576,
        "discover_models": true, "max_models": 4,
        "tokenizer_retry": {"initial_ms": 500, "max_ms": 30000},
        "unknown_model_retry_ms": 30000, "default_block_size": 16,
        "token_check": {"sample_one_in": 1000, "first_requests": 8, "max_prompt_tokens": 8192,
            "max_response_bytes": 1048576},
        "models": {"qwen3": {"block_size": 16, "extra_key_style": "tagged",
            "tokenizer_source": "indexer", "lora_paths": {"sql-lora": "/adapters/sql"},
            "max_prompt_tokens": 40960,
            "tokenizer_options": {"segment_cache_max_bytes": 1048576,
                "content_format": "string", "trust_request_chat_template": false,
                "default_chat_template_kwargs": {"enable_thinking": false}}}}
    })
}

/// Checks one input: never panics, refusals are clear, acceptances validate.
fn check(bytes: &[u8]) -> Option<FilterConfig> {
    match FilterConfig::parse(bytes) {
        Ok(cfg) => {
            assert_eq!(cfg.validate(), Ok(()), "accepted but invalid: {cfg:?}");
            Some(cfg)
        }
        Err(e) => {
            let shown = e.to_string();
            assert!(shown.starts_with("kvroute configuration"), "{shown}");
            match &e {
                ConfigError::Json(m) => assert!(!m.is_empty(), "an empty JSON error"),
                ConfigError::Invalid { field, problem } => {
                    assert!(!field.is_empty() && !problem.is_empty(), "{e:?}");
                    assert!(shown.contains(field.as_str()), "{shown}");
                }
            }
            None
        }
    }
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec![
            "indexer_cluster", "indexer_authority", "route_timeout_ms", "complete_timeout_ms",
            "tokenizer_timeout_ms", "routed_paths", "max_body_bytes", "oversized_body",
            "inject_kv_cache_report_mode", "debug_headers", "report_completion",
            "session_header", "max_response_scan_bytes", "models", "discover_models",
            "max_models", "tokenizer_retry", "unknown_model_retry_ms",
            "unknown_model_cache_entries", "max_model_name_bytes", "default_block_size",
            "block_size", "extra_key_style", "tokenizer_source", "lora_paths",
            "max_prompt_tokens", "tokenizer_options", "initial_ms", "max_ms", "qwen3",
            "segment_cache_max_bytes", "chat_template", "content_format", "token_check",
            "sample_one_in", "first_requests", "max_response_bytes",
        ])
        .prop_map(str::to_owned),
        1 => any::<String>(),
    ]
}

/// Any JSON value, with the configuration's own words among its strings and keys.
fn junk() -> impl Strategy<Value = Value> {
    let words = prop_oneof![
        1 => prop::sample::select(vec![
            "", "fail_open", "reject", "indexer", "vm_config", "tagged", "plain", "/v1/x",
            "openai", "auto",
        ])
        .prop_map(str::to_owned),
        1 => any::<String>(),
    ];
    let shape = kvroute_testkit::json::Shape {
        depth: 4,
        size: 40,
        width: 6,
    };
    kvroute_testkit::json::value(words, field_name(), shape)
}

/// Syntax pieces the byte edits insert (besides random bytes).
const CONFIG_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    "\"",
    ",",
    ":",
    "null",
    "0",
    "-1",
    "1e30",
    "99999999999999999999",
    "\"models\":{}",
    "\"x\":1,",
    "\\u0000",
    "\\ud800",
];

/// An in-range model entry: `(block_size, max_prompt_tokens, lora_paths)`.
type ModelFields = (Option<usize>, Option<usize>, BTreeMap<String, String>);

fn model_fields() -> impl Strategy<Value = ModelFields> {
    (
        prop::option::of(1usize..=4096),
        prop::option::of(1usize..=(16 << 20)),
        prop::collection::btree_map("[a-z][a-z0-9-]{0,8}", "/[a-z/]{1,16}", 0..3),
    )
}

/// A generated valid configuration and the values it sets.
#[derive(Debug, Clone)]
struct Valid {
    route_timeout_ms: u64,
    max_body_bytes: usize,
    routed_paths: Vec<String>,
    default_block_size: usize,
    models: BTreeMap<String, ModelFields>,
    retry: (u64, u64),
}

fn valid() -> impl Strategy<Value = Valid> {
    (
        1u64..=600_000,
        // At most 16 MiB: the default `upstream_max_body_bytes` must stay >= it.
        1024usize..=(16 << 20),
        prop::collection::vec("/[a-z0-9/_.-]{0,24}", 1..4),
        1usize..=4096,
        prop::collection::btree_map("[A-Za-z0-9/._-]{1,24}", model_fields(), 1..=4),
        (1u64..=86_400_000).prop_flat_map(|max| (1..=max, Just(max))),
    )
        .prop_map(
            |(
                route_timeout_ms,
                max_body_bytes,
                routed_paths,
                default_block_size,
                models,
                retry,
            )| {
                Valid {
                    route_timeout_ms,
                    max_body_bytes,
                    routed_paths,
                    default_block_size,
                    models,
                    retry,
                }
            },
        )
}

fn valid_json(v: &Valid) -> Value {
    let models: Map<String, Value> = v
        .models
        .iter()
        .map(|(name, (bs, cap, loras))| {
            let mut m = json!({"lora_paths": loras});
            if let Some(bs) = bs {
                m["block_size"] = json!(bs);
            }
            if let Some(cap) = cap {
                m["max_prompt_tokens"] = json!(cap);
            }
            (name.clone(), m)
        })
        .collect();
    json!({
        "route_timeout_ms": v.route_timeout_ms,
        "max_body_bytes": v.max_body_bytes,
        "routed_paths": v.routed_paths,
        "default_block_size": v.default_block_size,
        "models": models,
        "tokenizer_retry": {"initial_ms": v.retry.0, "max_ms": v.retry.1},
    })
}

/// One field set out of range: `(json pointer to set, value, field named in the error)`.
fn out_of_range() -> impl Strategy<Value = (Vec<&'static str>, Value, &'static str)> {
    prop_oneof![
        Just((vec!["route_timeout_ms"], json!(0), "route_timeout_ms")),
        (600_001u64..u64::MAX).prop_map(|v| (
            vec!["complete_timeout_ms"],
            json!(v),
            "complete_timeout_ms"
        )),
        (0usize..1024).prop_map(|v| (vec!["max_body_bytes"], json!(v), "max_body_bytes")),
        ((256usize << 20) + 1..usize::MAX).prop_map(|v| (
            vec!["max_body_bytes"],
            json!(v),
            "max_body_bytes"
        )),
        Just((vec!["routed_paths"], json!([]), "routed_paths")),
        "[a-z?]{0,8}".prop_map(|p| (vec!["routed_paths"], json!([p]), "routed_paths")),
        Just((vec!["indexer_cluster"], json!("  "), "indexer_cluster")),
        Just((vec!["max_models"], json!(0), "max_models")),
        Just((vec!["default_block_size"], json!(0), "default_block_size")),
        (4097usize..1 << 40).prop_map(|v| (
            vec!["default_block_size"],
            json!(v),
            "default_block_size"
        )),
        Just((
            vec!["unknown_model_cache_entries"],
            json!(0),
            "unknown_model_cache_entries"
        )),
        Just((
            vec!["tokenizer_retry", "initial_ms"],
            json!(0),
            "tokenizer_retry"
        )),
    ]
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes);
    }

    #[test]
    fn arbitrary_json(v in junk()) {
        check(v.to_string().as_bytes());
    }

    #[test]
    fn mutated_configs(
        which in 0usize..3,
        edits in prop::collection::vec(byte_mutation(CONFIG_TOKENS), 1..5),
    ) {
        let mut bytes = match which {
            0 => DOC_EXAMPLE.as_bytes().to_vec(),
            1 => full_example().to_string().into_bytes(),
            _ => serde_json::to_vec_pretty(&full_example()).expect("json"),
        };
        for m in &edits {
            apply(&mut bytes, m);
        }
        check(&bytes);
    }

    #[test]
    fn valid_configs_keep_their_fields(v in valid(), pretty in any::<bool>()) {
        let j = valid_json(&v);
        let text = if pretty { serde_json::to_string_pretty(&j) } else { serde_json::to_string(&j) };
        let cfg = check(text.expect("json").as_bytes())
            .unwrap_or_else(|| panic!("a valid config was refused: {:?}", FilterConfig::parse(j.to_string().as_bytes())));
        prop_assert_eq!(cfg.route_timeout_ms, v.route_timeout_ms);
        prop_assert_eq!(cfg.max_body_bytes, v.max_body_bytes);
        prop_assert_eq!(&cfg.routed_paths, &v.routed_paths);
        prop_assert_eq!(cfg.default_block_size, v.default_block_size);
        prop_assert_eq!((cfg.tokenizer_retry.initial_ms, cfg.tokenizer_retry.max_ms), v.retry);
        prop_assert_eq!(cfg.models.len(), v.models.len());
        for (name, (bs, cap, loras)) in &v.models {
            let m = &cfg.models[name];
            prop_assert_eq!(m.block_size, *bs);
            prop_assert_eq!(m.max_prompt_tokens, *cap);
            prop_assert_eq!(&m.lora_paths, loras);
        }
        for p in &v.routed_paths {
            prop_assert!(cfg.routes_path(p));
            let with_query = format!("{p}?stream=true");
            prop_assert!(cfg.routes_path(&with_query));
        }
    }

    #[test]
    fn one_bad_field_is_named(v in valid(), (path, value, field) in out_of_range()) {
        let mut j = valid_json(&v);
        let mut at = &mut j;
        for (i, key) in path.iter().enumerate() {
            if i + 1 == path.len() {
                at[*key] = value.clone();
            } else {
                at = &mut at[*key];
            }
        }
        match FilterConfig::parse(j.to_string().as_bytes()) {
            Err(ConfigError::Invalid { field: f, .. }) => prop_assert_eq!(f, field),
            other => prop_assert!(false, "{} = {} gave {:?}", field, value, other),
        }
    }
}

/// Fixed inputs: empty and blank input are the defaults, the docs' example is accepted.
#[test]
fn known_inputs() {
    for blank in [&b""[..], b"  \n\t"] {
        assert_eq!(check(blank), Some(FilterConfig::default()));
    }
    let doc = check(DOC_EXAMPLE.as_bytes()).expect("the docs' example parses");
    assert_eq!(doc.models["qwen3"].block_size, Some(16));
    assert_eq!(doc.models["qwen3"].lora_paths["sql-lora"], "/adapters/sql");
    assert!(doc.inject_kv_cache_report_mode);
    assert!(check(full_example().to_string().as_bytes()).is_some());
    assert!(
        check(br#"{"route_timeout_mss": 1}"#).is_none(),
        "unknown field"
    );
    assert!(check(&[0xff, 0xfe, b'{', b'}']).is_none());
}
