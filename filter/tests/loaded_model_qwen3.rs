//! The filter's bridge to the shared core with the real Qwen3 tokenizer (natively: the same code
//! the .wasm runs): configuration precedence, LoRA and cache_salt plumbing, batch prompts.

use kvroute_core::api::TokenizerBundle;
use kvroute_core::request::{Endpoint, ModelFiles, ModelTokenizer, RequestBody, TokenizerOptions};
use kvroute_filter::config::FilterConfig;
use kvroute_filter::loaded_model::{LoadedModel, PrepareError, Prepared};
use serde_json::{json, Value};

/// `prepare` on a body sent as JSON text, parsed as the filter parses it.
trait PrepareJson {
    fn prepare_json(&self, endpoint: Endpoint, body: &Value) -> Result<Prepared, PrepareError>;
}

impl PrepareJson for LoadedModel {
    fn prepare_json(&self, endpoint: Endpoint, body: &Value) -> Result<Prepared, PrepareError> {
        let text = serde_json::to_vec(body).expect("serialises");
        let parsed = RequestBody::parse(&text, endpoint).expect("an object");
        self.prepare(endpoint, &parsed)
    }
}

fn bundle(block_size: Option<u32>) -> TokenizerBundle {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/kvroute-cache/models/qwen3")
        });
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| {
            panic!(
                "{} missing ({e}): run `cargo xtask setup`",
                dir.join(f).display()
            )
        })
    };
    TokenizerBundle {
        tokenizer_json: read("tokenizer.json"),
        tokenizer_config_json: read("tokenizer_config.json"),
        block_size,
        ..TokenizerBundle::default()
    }
}

fn cfg(json: serde_json::Value) -> FilterConfig {
    FilterConfig::parse(json.to_string().as_bytes()).expect("valid config")
}

#[test]
fn chat_requests_become_the_core_tokens_and_keys() {
    let c = cfg(json!({"models": {"qwen3": {}}}));
    let m = LoadedModel::from_bundle(&bundle(Some(16)), c.models.get("qwen3"), &c).expect("load");
    assert_eq!(m.block_size, 16);
    let body = json!({"model": "qwen3", "messages": [
        {"role": "system", "content": "You are a helpful assistant. ".repeat(20)},
        {"role": "user", "content": "What is KV cache aware routing?"}]});
    let p = m
        .prepare_json(Endpoint::ChatCompletions, &body)
        .expect("prepare");
    // Same ids as the core tokenizer used directly (what the indexer and the sim compute).
    let files = ModelFiles {
        tokenizer_json: bundle(None).tokenizer_json.into_bytes(),
        tokenizer_config_json: bundle(None).tokenizer_config_json.into_bytes(),
    };
    let tok = ModelTokenizer::from_files(&files, TokenizerOptions::default()).expect("tokenizer");
    let ids = match tok
        .tokenize_request(Endpoint::ChatCompletions, &body)
        .expect("ids")
    {
        kvroute_core::request::PromptTokens::Single(t) => t,
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(p.num_tokens, ids.len());
    assert_eq!(p.router_keys.len(), ids.len() / 16);
    let keys = kvroute_core::router_key::request_keys(
        &ids,
        16,
        &Default::default(),
        kvroute_core::hashing::ExtraKeyStyle::Tagged,
    );
    assert_eq!(p.router_keys, keys.iter().map(|k| k.0).collect::<Vec<_>>());
    assert!(p.lora.is_none());
}

#[test]
fn configuration_overrides_the_indexer_and_extras_change_keys() {
    let c = cfg(
        json!({"models": {"qwen3": {"block_size": 32}, "sql-lora": {"lora_paths": {"sql-lora": "/adapters/sql"}}}}),
    );
    let m = LoadedModel::from_bundle(&bundle(Some(16)), c.models.get("qwen3"), &c).expect("load");
    assert_eq!(
        m.block_size, 32,
        "configured block size wins over the announced one"
    );
    let d = LoadedModel::from_bundle(&bundle(None), None, &c).expect("load");
    assert_eq!(d.block_size, c.default_block_size);

    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(30);
    let base = m
        .prepare_json(
            Endpoint::Completions,
            &json!({"model": "qwen3", "prompt": prompt}),
        )
        .expect("base");
    let salted = m
        .prepare_json(
            Endpoint::Completions,
            &json!({"model": "qwen3", "prompt": prompt, "cache_salt": "tenant-a"}),
        )
        .expect("salted");
    assert_eq!(base.num_tokens, salted.num_tokens);
    assert_ne!(
        base.router_keys, salted.router_keys,
        "cache_salt changes every key"
    );

    let lora =
        LoadedModel::from_bundle(&bundle(Some(32)), c.models.get("sql-lora"), &c).expect("load");
    let l = lora
        .prepare_json(
            Endpoint::Completions,
            &json!({"model": "sql-lora", "prompt": prompt}),
        )
        .expect("lora");
    assert_eq!(l.lora.as_deref(), Some("sql-lora"));
    assert_ne!(
        l.router_keys, base.router_keys,
        "a LoRA adapter changes the keys"
    );

    // A batch routes by its first prompt.
    let batch = m
        .prepare_json(
            Endpoint::Completions,
            &json!({"model": "qwen3", "prompt": [prompt, "other"]}),
        )
        .expect("batch");
    assert_eq!(batch.router_keys, base.router_keys);
    // The same prompt sent as its token ids (read by `RequestBody`'s fast path, whitespace and
    // all) routes like the text, salt included.
    let ids = base.tokens.clone().expect("one whole prompt");
    let spaced = format!(
        r#"{{"model": "qwen3", "cache_salt": "tenant-a", "prompt": [ {} ] }}"#,
        ids.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" , ")
    );
    let parsed = RequestBody::parse(spaced.as_bytes(), Endpoint::Completions).expect("parses");
    assert_eq!(
        parsed.prompt_ids(),
        Some(ids.as_slice()),
        "the fast path took it"
    );
    let by_ids = m.prepare(Endpoint::Completions, &parsed).expect("ids");
    assert_eq!(
        (by_ids.router_keys, by_ids.num_tokens),
        (salted.router_keys.clone(), salted.num_tokens)
    );
    // Garbage is an error, not a panic.
    assert!(m
        .prepare_json(Endpoint::Completions, &json!({"model": "qwen3"}))
        .is_err());
    assert!(m
        .prepare_json(
            Endpoint::ChatCompletions,
            &json!({"model": "qwen3", "messages": 5})
        )
        .is_err());
}

#[test]
fn the_prompt_cap_comes_from_config_then_indexer_then_tokenizer_config() {
    use kvroute_filter::loaded_model::PrepareError;
    let c = cfg(json!({"models": {"capped": {"max_prompt_tokens": 64}}}));
    // Qwen3's tokenizer_config.json says model_max_length 131072.
    let plain = LoadedModel::from_bundle(&bundle(Some(16)), None, &c).expect("load");
    assert_eq!(plain.max_prompt_tokens, 131_072);
    let mut announced = bundle(Some(16));
    announced.max_model_len = Some(40_960);
    let m = LoadedModel::from_bundle(&announced, None, &c).expect("load");
    assert_eq!(
        m.max_prompt_tokens, 40_960,
        "the indexer's max_model_len wins"
    );
    let m = LoadedModel::from_bundle(&announced, c.models.get("capped"), &c).expect("load");
    assert_eq!(m.max_prompt_tokens, 64, "the configuration wins");

    let fits = json!({"model": "capped", "prompt": "word ".repeat(50)});
    assert!(m.prepare_json(Endpoint::Completions, &fits).is_ok());
    let long = json!({"model": "capped", "prompt": "word ".repeat(80)});
    assert!(matches!(
        m.prepare_json(Endpoint::Completions, &long),
        Err(PrepareError::TooLong(64))
    ));
    let long_ids = json!({"model": "capped", "prompt": vec![7u32; 65]});
    assert!(matches!(
        m.prepare_json(Endpoint::Completions, &long_ids),
        Err(PrepareError::TooLong(64))
    ));
    let digits =
        json!({"model": "capped", "messages": [{"role": "user", "content": "7".repeat(900)}]});
    assert!(matches!(
        m.prepare_json(Endpoint::ChatCompletions, &digits),
        Err(PrepareError::TooLong(64))
    ));
}
