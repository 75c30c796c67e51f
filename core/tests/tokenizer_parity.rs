//! Parity of kvroute's request -> tokens path with Hugging Face transformers on the real Qwen3
//! tokenizer and chat template.
//!
//! `tests/parity/reference.py` renders and tokenises every case of `tests/parity/cases.json`
//! with transformers (the python at `KVROUTE_PYTHON`, model at `KVROUTE_MODEL_DIR`); this test
//! checks, for every case, that kvroute renders the same text byte for byte and produces the
//! same token ids through every path: uncached whole-text tokenisation, the segment cache cold
//! and warm, and fine line chunks. Both sides must reject the same cases.

use std::path::Path;
use std::process::Command;

use kvroute_core::request::{
    Endpoint, ModelFiles, ModelTokenizer, PromptTokens, RequestError, TokenizerOptions,
};
use kvroute_testkit::paths::{model_dir, python, workspace};
use serde_json::Value;

/// Runs the reference script, caching its output in target/ keyed by the inputs' hash.
fn reference(cases_path: &Path, model: &Path) -> Value {
    let parity_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity");
    let script = parity_dir.join("reference.py");
    let mut key_bytes = std::fs::read(cases_path).expect("cases.json readable");
    key_bytes.extend(std::fs::read(&script).expect("reference.py readable"));
    key_bytes.extend(std::fs::read(model.join("tokenizer.json")).expect("tokenizer.json"));
    key_bytes.extend(std::fs::read(model.join("tokenizer_config.json")).unwrap_or_default());
    let key = xxhash_rust::xxh3::xxh3_64(&key_bytes);
    let cache_dir = workspace().join("target/kvroute-cache/parity");
    let cache_file = cache_dir.join(format!("reference-{key:016x}.json"));
    if let Ok(bytes) = std::fs::read(&cache_file) {
        if let Ok(v) = serde_json::from_slice(&bytes) {
            return v;
        }
    }
    let out = Command::new(python())
        .arg(&script)
        .arg(model)
        .arg(cases_path)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run the reference python (run `cargo xtask setup`)");
    assert!(
        out.status.success(),
        "reference.py failed (run `cargo xtask setup`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("reference output is JSON");
    let _ = std::fs::create_dir_all(&cache_dir);
    let _ = std::fs::write(&cache_file, &out.stdout);
    v
}

struct Tokenizers {
    /// Default options.
    default: ModelTokenizer,
    /// Tiny line chunks: many cuts, exercising the exactness argument hard.
    fine: ModelTokenizer,
    /// No segment cache at all.
    nocache: ModelTokenizer,
}

fn tokenizers(model: &Path) -> Tokenizers {
    let files = ModelFiles::from_dir(model).expect("model files");
    let make =
        |opts: TokenizerOptions| ModelTokenizer::from_files(&files, opts).expect("tokenizer");
    Tokenizers {
        default: make(TokenizerOptions::default()),
        fine: make(TokenizerOptions {
            line_chunk_bytes: 1,
            ..TokenizerOptions::default()
        }),
        nocache: make(TokenizerOptions {
            segment_cache_max_bytes: 0,
            segment_cache_max_entries: 0,
            line_chunk_bytes: 0,
            ..TokenizerOptions::default()
        }),
    }
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids list")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id"))
        .collect()
}

fn single(r: Result<PromptTokens, RequestError>, name: &str) -> Vec<u32> {
    match r {
        Ok(PromptTokens::Single(ids)) => ids,
        other => panic!("{name}: expected one prompt, got {other:?}"),
    }
}

#[test]
fn chat_and_completion_parity_with_transformers() {
    let model = model_dir();
    let cases_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/cases.json");
    let cases: Value =
        serde_json::from_slice(&std::fs::read(&cases_path).expect("cases.json")).expect("JSON");
    let reference = reference(&cases_path, &model);
    let tk = tokenizers(&model);
    assert!(
        tk.default.segmentation() == (true, true),
        "Qwen3 must get both cuts"
    );

    let chats = cases["chats"].as_array().expect("chats");
    let completions = cases["completions"].as_array().expect("completions");
    assert!(chats.len() >= 20 && completions.len() >= 10);
    let mut failures = Vec::new();
    let mut checked_errors = 0;

    for case in chats {
        let name = case["name"].as_str().expect("name");
        let body = &case["body"];
        let want = &reference["chats"][name];
        if want.get("error").is_some() {
            checked_errors += 1;
            if tk
                .default
                .tokenize_request(Endpoint::ChatCompletions, body)
                .is_ok()
            {
                failures.push(format!("{name}: python rejected it, kvroute accepted it"));
            }
            continue;
        }
        let want_text = want["text"].as_str().expect("text");
        let want_ids = ids_of(&want["ids"]);
        let text = match tk.default.render_chat(body) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{name}: render failed: {e}"));
                continue;
            }
        };
        if text != want_text {
            let at = text
                .bytes()
                .zip(want_text.bytes())
                .position(|(a, b)| a != b)
                .unwrap_or(text.len().min(want_text.len()));
            failures.push(format!(
                "{name}: rendered text differs at byte {at}: kvroute {:?} vs python {:?}",
                &text.get(at.saturating_sub(20)..(at + 40).min(text.len())),
                &want_text.get(at.saturating_sub(20)..(at + 40).min(want_text.len()))
            ));
            continue;
        }
        let uncached = tk
            .nocache
            .encode_text_uncached(&text, false)
            .expect("encode");
        if uncached != want_ids {
            failures.push(format!("{name}: whole-text ids differ from python"));
        }
        for (label, t) in [
            ("nocache", &tk.nocache),
            ("default", &tk.default),
            ("fine", &tk.fine),
        ] {
            // Twice: the second run is served from the cache.
            for round in ["cold", "warm"] {
                let ids = single(t.tokenize_request(Endpoint::ChatCompletions, body), name);
                if ids != want_ids {
                    failures.push(format!("{name}: {label}/{round} ids differ from python"));
                }
            }
        }
    }

    for case in completions {
        let name = case["name"].as_str().expect("name");
        let body = &case["body"];
        let want = &reference["completions"][name];
        assert!(want.get("error").is_none(), "{name}: python failed: {want}");
        let want_ids = &want["ids"];
        for (label, t) in [
            ("nocache", &tk.nocache),
            ("default", &tk.default),
            ("fine", &tk.fine),
        ] {
            for round in ["cold", "warm"] {
                let got = t.tokenize_request(Endpoint::Completions, body);
                let ok = match (&got, want_ids.as_array().and_then(|a| a.first())) {
                    (Ok(PromptTokens::Batch(all)), Some(Value::Array(_))) => {
                        let want_all: Vec<Vec<u32>> = want_ids
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(ids_of)
                            .collect();
                        *all == want_all
                    }
                    (Ok(PromptTokens::Single(ids)), _) => *ids == ids_of(want_ids),
                    _ => false,
                };
                if !ok {
                    failures.push(format!(
                        "{name}: {label}/{round} completion ids differ: {got:?}"
                    ));
                }
            }
        }
    }
    assert!(
        checked_errors >= 1,
        "the cases include at least one rejected request"
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let stats = tk.default.cache_stats();
    assert!(
        stats.hits > 0 && stats.misses > 0,
        "the cache was exercised: {stats:?}"
    );
}

/// A conversation that grows turn by turn: every request after the first must be served mostly
/// from the cache, and still equal the uncached ids.
#[test]
fn growing_conversation_hits_the_cache_and_stays_exact() {
    let model = model_dir();
    let tk = tokenizers(&model);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a helpful assistant.\n".repeat(50)}),
    ];
    for turn in 0..6 {
        messages.push(serde_json::json!({"role": "user", "content": format!("Question {turn}: {}", "why? ".repeat(200))}));
        let body = serde_json::json!({"messages": messages});
        let before = tk.default.cache_stats();
        let ids = single(
            tk.default
                .tokenize_request(Endpoint::ChatCompletions, &body),
            "grow",
        );
        let after = tk.default.cache_stats();
        let text = tk.default.render_chat(&body).expect("render");
        assert_eq!(
            ids,
            tk.default
                .encode_text_uncached(&text, false)
                .expect("encode")
        );
        if turn > 0 {
            assert!(
                after.hits > before.hits,
                "turn {turn} reused earlier segments"
            );
        }
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn}.\n\nBecause.")}));
    }
}

#[test]
fn bad_requests_get_clear_errors() {
    let model = model_dir();
    let tk = tokenizers(&model).default;
    let chat = |b: Value| tk.tokenize_request(Endpoint::ChatCompletions, &b);
    assert!(matches!(
        chat(serde_json::json!([1])),
        Err(RequestError::NotAnObject)
    ));
    assert!(matches!(
        chat(serde_json::json!({"model": "q"})),
        Err(RequestError::MissingField("messages"))
    ));
    assert!(matches!(
        chat(serde_json::json!({"messages": []})),
        Err(RequestError::InvalidField { .. })
    ));
    assert!(matches!(
        chat(
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"})
        ),
        Err(RequestError::UntrustedChatTemplate)
    ));
    let completion = |b: Value| tk.tokenize_request(Endpoint::Completions, &b);
    assert!(matches!(
        completion(serde_json::json!({})),
        Err(RequestError::MissingField("prompt"))
    ));
    let many: Vec<String> = (0..2000).map(|i| i.to_string()).collect();
    assert!(matches!(
        completion(serde_json::json!({"prompt": many})),
        Err(RequestError::TooLarge { .. })
    ));
}

#[test]
fn trusted_request_template_is_used() {
    let model = model_dir();
    let files = ModelFiles::from_dir(&model).expect("files");
    let tk = ModelTokenizer::from_files(
        &files,
        TokenizerOptions {
            trust_request_chat_template: true,
            ..TokenizerOptions::default()
        },
    )
    .expect("tokenizer");
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ raise_exception('stop') if m is defined }}"
    });
    assert_eq!(tk.render_chat(&body).expect("render"), "[user] hi\n");
    let ids = single(
        tk.tokenize_request(Endpoint::ChatCompletions, &body),
        "trusted",
    );
    assert_eq!(tk.decode(&ids).expect("decode"), "[user] hi\n");
}
