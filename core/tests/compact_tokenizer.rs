//! The compact tokenizer form (`bpe_tables`, what the indexer serves the Wasm filter) builds the
//! same tokenizer as the whole `tokenizer.json`, on the real Qwen3 tokenizer: the same
//! serialisation (digest), and the same ids on a varied corpus (the parity cases, this
//! repository's docs and sources, multilingual text, digits, whitespace and control runs,
//! special tokens in text), without the segment cache and through it.

use std::path::Path;

use kvroute_core::api::TokenizerBundle;
use kvroute_core::request::{
    compact_tokenizer_json, Endpoint, ModelFiles, ModelTokenizer, PromptTokens, TokenizerOptions,
};
use kvroute_testkit::paths::{model_dir, workspace};
use serde_json::{json, Value};

fn no_cache() -> TokenizerOptions {
    TokenizerOptions {
        segment_cache_max_bytes: 0,
        segment_cache_max_entries: 0,
        line_chunk_bytes: 0,
        ..TokenizerOptions::default()
    }
}

/// (whole, compact) tokenizers built with `opts`.
fn both(opts: TokenizerOptions) -> (ModelTokenizer, ModelTokenizer) {
    let files = ModelFiles::from_dir(model_dir()).expect("model files");
    let whole = ModelTokenizer::from_files(&files, opts.clone()).expect("whole loads");
    let split = compact_tokenizer_json(&files.tokenizer_json)
        .expect("tokenizer.json parses")
        .expect("Qwen3 is covered by the compact form");
    assert!(
        split.tokenizer_json.len() * 100 < files.tokenizer_json.len(),
        "the compact document is {} bytes of {}",
        split.tokenizer_json.len(),
        files.tokenizer_json.len()
    );
    let compact_files = ModelFiles {
        tokenizer_json: split.tokenizer_json,
        tokenizer_config_json: files.tokenizer_config_json.clone(),
    };
    let compact =
        ModelTokenizer::from_compact(&compact_files, split.tables, opts).expect("compact loads");
    (whole, compact)
}

/// Texts of many kinds: every file under docs/ and core/src, and hand-made edge cases.
fn corpus() -> Vec<String> {
    let mut texts = Vec::new();
    for dir in ["docs", "core/src/request", "core/src/hashing", "filter/src"] {
        let mut entries: Vec<_> = std::fs::read_dir(workspace().join(dir))
            .expect("read dir")
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        entries.sort();
        for path in entries {
            if let Ok(text) = std::fs::read_to_string(&path) {
                texts.push(text);
            }
        }
    }
    texts.extend(
        [
            "Hello, world! 你好，世界。こんにちは世界。안녕하세요 세계. Привет, мир! مرحبا بالعالم",
            "emoji 👩‍👩‍👧‍👦 🏳️‍🌈 ✨🚀 and combining e\u{301} a\u{308} ﬁ ligature, NFC vs NFD: é é",
            "3.14159265358979323846264338327950288419716939937510 1234567890 0x7fff_ffff",
            "   leading spaces\n\n\n\ttabs\t\tand\r\nCRLF\r\n    \n  trailing   ",
            "\u{0}\u{1}\u{7f}\u{85}\u{a0}\u{2028}\u{feff} controls and odd spaces",
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|endoftext|>",
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call> <|fim_prefix|>a<|fim_suffix|>",
            "don't won't I'm you're we've they'll she'd DON'T It'S",
            "--------------------------------------------------------------------------------",
            "",
        ]
        .map(str::to_owned),
    );
    texts.push("a".repeat(5000));
    texts.push("1".repeat(3000));
    texts.push((0u32..0x3000).filter_map(char::from_u32).collect());
    texts
}

fn single(t: PromptTokens) -> Vec<u32> {
    match t {
        PromptTokens::Single(ids) => ids,
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn the_compact_form_builds_the_same_tokenizer() {
    let (whole, compact) = both(no_cache());
    assert_eq!(
        whole.digest(),
        compact.digest(),
        "the two builds serialise differently"
    );
    let corpus = corpus();
    let mut tokens = 0;
    for (i, text) in corpus.iter().enumerate() {
        for add_special_tokens in [true, false] {
            let body = json!({"prompt": text, "add_special_tokens": add_special_tokens});
            let a = single(
                whole
                    .tokenize_request(Endpoint::Completions, &body)
                    .expect("whole"),
            );
            let b = single(
                compact
                    .tokenize_request(Endpoint::Completions, &body)
                    .expect("compact"),
            );
            assert_eq!(a, b, "text {i} ({} bytes) differs", text.len());
            tokens += a.len();
        }
    }
    assert!(tokens > 100_000, "a varied corpus: {tokens} tokens");
}

#[test]
fn the_parity_cases_render_and_tokenise_alike_through_the_segment_cache() {
    let (whole, compact) = both(TokenizerOptions {
        line_chunk_bytes: 16,
        ..TokenizerOptions::default()
    });
    let cases: Value = serde_json::from_slice(
        &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/cases.json"))
            .expect("cases.json"),
    )
    .expect("cases are JSON");
    let mut compared = 0;
    for (key, endpoint) in [
        ("chats", Endpoint::ChatCompletions),
        ("completions", Endpoint::Completions),
    ] {
        for case in cases[key].as_array().expect("a list of cases") {
            let body = &case["body"];
            // Twice: cold, then warm from the segment cache.
            for _ in 0..2 {
                let a = whole.tokenize_request(endpoint, body);
                let b = compact.tokenize_request(endpoint, body);
                match (a, b) {
                    (Ok(a), Ok(b)) => assert_eq!(a, b, "case {}", case["name"]),
                    (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                    (a, b) => panic!("case {}: {a:?} vs {b:?}", case["name"]),
                }
                compared += 1;
            }
        }
    }
    assert!(compared > 20, "{compared} cases compared");
}

#[test]
fn a_compact_document_without_its_tables_is_refused_by_name() {
    let files = ModelFiles::from_dir(model_dir()).expect("model files");
    let bundle = TokenizerBundle::from_files("qwen3", files.clone(), true).expect("bundle");
    assert!(bundle.bpe_tables.is_some());
    let stripped = ModelFiles {
        tokenizer_json: bundle.tokenizer_json.into_bytes(),
        tokenizer_config_json: files.tokenizer_config_json,
    };
    let e =
        ModelTokenizer::from_files(&stripped, TokenizerOptions::default()).expect_err("no tables");
    assert!(e.to_string().contains("no BPE tables"), "{e}");
}

#[test]
fn building_through_the_compact_form_gives_the_whole_documents_tokenizer_and_template() {
    let files = ModelFiles::from_dir(model_dir()).expect("model files");
    let whole = ModelTokenizer::from_files(&files, no_cache()).expect("whole loads");
    let compacted =
        ModelTokenizer::from_files_compacted(&files, no_cache()).expect("compacted loads");
    assert_eq!(whole.digest(), compacted.digest());
}
