//! Property tests of the indexer's configuration parser (`Config::parse(text, origin)`) on
//! arbitrary text, TOML built from the real section and key names with junk values, and line and
//! byte mutations of `indexer/examples/indexer.toml` (read at test time). Proves: parsing never
//! panics; a syntax or type error names the origin it was given; a validation error names a
//! field; a config that parses validates again and survives a TOML round trip (serialise, parse,
//! same text).
//!
//! Cases: `PROPTEST_CASES` (default per test below); failures are shrunk, printed and persisted
//! next to this file. See docs/fuzzing.md.

use std::sync::LazyLock;

use kvroute_indexer::config::{Config, ConfigError};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

fn config(default_cases: u32) -> ProptestConfig {
    kvroute_testkit::cases::config(default_cases, None)
}

/// The example file as shipped.
static EXAMPLE: LazyLock<String> = LazyLock::new(|| {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/indexer.toml");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
});

/// The example without its `model_dir` (a path that exists only in a deployment), so that it
/// validates and mutations reach every later check.
static EXAMPLE_VALID: LazyLock<String> = LazyLock::new(|| {
    EXAMPLE
        .lines()
        .filter(|l| !l.trim_start().starts_with("model_dir"))
        .collect::<Vec<_>>()
        .join("\n")
});

/// A fixed origin string per case, so errors can be checked for it.
const ORIGIN: &str = "fuzz-origin://indexer.toml";

/// Parses `text`; checks every property; returns the config when it parsed.
fn check(text: &str) -> Option<Config> {
    match Config::parse(text, ORIGIN) {
        Ok(cfg) => {
            if let Err(e) = cfg.validate() {
                panic!("parsed but does not validate again: {e}");
            }
            let again = toml::to_string(&cfg).expect("a parsed config serialises");
            let cfg2 = Config::parse(&again, "round-trip")
                .unwrap_or_else(|e| panic!("round trip refused: {e}\n{again}"));
            assert_eq!(toml::to_string(&cfg2).expect("serialises"), again);
            Some(cfg)
        }
        Err(e) => {
            let shown = e.to_string();
            match &e {
                ConfigError::Parse { path, message } => {
                    assert_eq!(path, ORIGIN);
                    assert!(shown.contains(ORIGIN), "{shown}");
                    assert!(!message.is_empty());
                }
                ConfigError::Invalid { field, message } => {
                    assert!(!field.is_empty() && !message.is_empty(), "{e:?}");
                    assert!(shown.contains(field.as_str()), "{shown}");
                }
                ConfigError::Read { .. } => panic!("parse read a file: {e}"),
            }
            None
        }
    }
}

fn junk_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "-1",
            "1",
            "16",
            "4096",
            "1048576",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775808",
            "1e400",
            "nan",
            "inf",
            "-0.0",
            "0.5",
            "true",
            "false",
            "\"\"",
            "\"x\"",
            "\"127.0.0.1:0\"",
            "\"[::1]:8190\"",
            "\"tcp://127.0.0.1:5557\"",
            "\"tcp://\"",
            "\"tcp://:1\"",
            "\"sha256_cbor\"",
            "\"xxhash\"",
            "\"0.33.0\"",
            "\"0\"",
            "[]",
            "[\"a\", 1]",
            "{}",
            "{ a = 1 }",
            "1979-05-27T07:32:00Z",
            "'''multi\nline'''",
            "\"\\u0000\"",
            "\"\\ud800\"",
        ])
        .prop_map(str::to_owned),
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        any::<String>().prop_map(|s| format!("{s:?}")),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec![
            "listen", "admin_token", "admin_token_env", "scrape_interval_ms", "stale_after_ms",
            "max_body_bytes", "max_bytes", "predicted_ttl_ms", "path", "interval_ms",
            "connect_timeout_ms", "max_backoff_ms", "replay_read_timeout_ms",
            "replay_max_batches", "replay_max_bytes", "max_message_bytes", "bind_address",
            "allowed_peers", "session_header", "session_ttl_ms", "approx_ttl_ms",
            "approx_max_entries", "prefill_tokens_per_s", "half_life_s", "ttft_objective_s", "name",
            "model_dir", "block_size", "algo", "seed", "engine_version", "http", "endpoint",
            "events", "replay", "topic", "data_parallel_size", "bind",
        ])
        .prop_map(str::to_owned),
        1 => "[a-z_]{1,12}",
        1 => any::<String>().prop_map(|s| format!("{s:?}")),
    ]
}

fn header() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "",
        "[index]",
        "[snapshot]",
        "[events]",
        "[policies]",
        "[scoring]",
        "[inflight]",
        "[[models]]",
        "[models.hash]",
        "[models.loras]",
        "[[models.replicas]]",
        "[nope]",
        "[[index]]",
        "[models]",
    ])
    .prop_map(str::to_owned)
}

/// A TOML-ish document from real headers and keys with junk values.
fn document() -> impl Strategy<Value = String> {
    prop::collection::vec(
        (header(), prop::collection::vec((key(), junk_value()), 0..5)),
        0..6,
    )
    .prop_map(|sections| {
        let mut s = String::new();
        for (h, kvs) in sections {
            s.push_str(&h);
            s.push('\n');
            for (k, v) in kvs {
                s.push_str(&format!("{k} = {v}\n"));
            }
        }
        s
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the value of line `i` (if it has `=`) with another value.
    Value(usize, String),
    DeleteLine(usize),
    DuplicateLine(usize),
    SwapLines(usize, usize),
    Flip(usize, u8),
    Insert(usize, String),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), junk_value()).prop_map(|(i, v)| Mutation::Value(i, v)),
        1 => any::<usize>().prop_map(Mutation::DeleteLine),
        1 => any::<usize>().prop_map(Mutation::DuplicateLine),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => (any::<usize>(), prop::sample::select(vec!["[", "]", "\"", "=", "\n", "#", "'''", "[[models]]\n"]))
            .prop_map(|(i, t)| Mutation::Insert(i, t.to_owned())),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(text: String, m: &Mutation) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let n = lines.len().max(1);
    match m {
        Mutation::Value(i, v) => {
            if let Some(line) = lines.get_mut(i % n) {
                if let Some((k, _)) = line.split_once('=') {
                    *line = format!("{k}= {v}");
                }
            }
        }
        Mutation::DeleteLine(i) if !lines.is_empty() => {
            lines.remove(i % n);
        }
        Mutation::DuplicateLine(i) if !lines.is_empty() => {
            let l = lines[i % n].clone();
            lines.insert(i % n, l);
        }
        Mutation::SwapLines(a, b) if !lines.is_empty() => lines.swap(a % n, b % n),
        Mutation::Flip(i, b) => {
            let mut bytes = text.into_bytes();
            if !bytes.is_empty() {
                let at = i % bytes.len();
                bytes[at] ^= b | 1;
            }
            return String::from_utf8_lossy(&bytes).into_owned();
        }
        Mutation::Insert(i, t) => {
            let mut s = text;
            let mut at = i % (s.len() + 1);
            while !s.is_char_boundary(at) {
                at -= 1;
            }
            s.insert_str(at, t);
            return s;
        }
        Mutation::Truncate(i) => {
            let mut s = text;
            let mut at = i % (s.len() + 1);
            while !s.is_char_boundary(at) {
                at -= 1;
            }
            s.truncate(at);
            return s;
        }
        _ => {}
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(config(4096))]

    #[test]
    fn arbitrary_text(text in any::<String>()) {
        check(&text);
    }

    #[test]
    fn generated_documents(doc in document()) {
        check(&doc);
    }

    #[test]
    fn mutated_example(valid in any::<bool>(), edits in prop::collection::vec(mutation(), 1..5)) {
        let mut text = if valid { EXAMPLE_VALID.clone() } else { EXAMPLE.clone() };
        for m in &edits {
            text = apply(text, m);
        }
        check(&text);
    }
}

/// The example validates once its deployment-only `model_dir` is gone, and as shipped it is
/// refused for exactly that field (so the mutations above start from both outcomes).
#[test]
fn the_example_file() {
    let cfg = check(&EXAMPLE_VALID).expect("the example validates without model_dir");
    assert_eq!(cfg.models[0].replicas.len(), 2);
    match Config::parse(&EXAMPLE, ORIGIN) {
        Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "models[0].model_dir"),
        other => panic!("expected the missing model_dir to be refused, got {other:?}"),
    }
    assert!(check("").is_none(), "no models");
    assert!(check("listen = ").is_none());
}

/// The mutations are not vacuous: single edits of the valid example are sometimes still
/// accepted (so the round-trip property runs) and often refused.
#[test]
fn mutations_reach_both_outcomes() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut ok, mut err) = (0, 0);
    for _ in 0..200 {
        let m = mutation().new_tree(&mut runner).expect("tree").current();
        match check(&apply(EXAMPLE_VALID.clone(), &m)) {
            Some(_) => ok += 1,
            None => err += 1,
        }
    }
    assert!(ok >= 20 && err >= 20, "{ok} accepted, {err} refused of 200");
}
