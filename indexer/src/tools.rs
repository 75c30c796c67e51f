//! The operator tools `kvroute-indexer hash` and `kvroute-indexer tokenize`: what kvroute computes
//! for a prompt, to compare with the engine when hashes or tokens do not match.

use std::path::Path;

use kvroute_core::hashing::{
    usable_hit_blocks, wire_u64, BlockHasher, ExtraKeyStyle, HashAlgo, HashConfig, LoraRef,
    MmFeature, RequestExtras,
};
use kvroute_core::request::{Endpoint, ModelFiles, ModelTokenizer, PromptTokens, TokenizerOptions};
use kvroute_core::router_key::request_keys;
use serde::Deserialize;
use serde_json::{json, Value};

/// Errors of the CLI tools.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The input is not what the tool expects.
    #[error("invalid input: {0}")]
    Input(String),
    /// Hashing cannot be reproduced with these settings.
    #[error("{0}")]
    Hash(String),
    /// Tokenizer or template failure.
    #[error("{0}")]
    Request(String),
}

/// Input of `hash` (the keys of the golden file's `input` objects).
#[derive(Debug, Deserialize)]
pub struct HashInput {
    /// `sha256` (vLLM's default), `sha256_cbor`, `xxhash`, `xxhash_cbor`.
    #[serde(default = "default_algo")]
    pub algo: String,
    /// Tokens per block (default 16).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// The prompt's token ids.
    pub token_ids: Vec<u32>,
    /// The engine's `PYTHONHASHSEED`.
    #[serde(default)]
    pub seed: Option<String>,
    /// LoRA adapter name.
    #[serde(default)]
    pub lora_name: Option<String>,
    /// LoRA adapter path.
    #[serde(default)]
    pub lora_path: Option<String>,
    /// Deprecated integer LoRA id (accepted, unused by vLLM >= 0.31 hashing).
    #[serde(default)]
    pub lora_int_id: Option<i64>,
    /// `cache_salt`.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Multimodal items.
    #[serde(default)]
    pub mm_features: Vec<MmFeature>,
    /// vLLM version of the engine (extra-key shape), default 0.33.0.
    #[serde(default)]
    pub engine_version: Option<String>,
}

fn default_algo() -> String {
    "sha256".into()
}
fn default_block_size() -> usize {
    16
}

/// `kvroute-indexer hash`: block hashes, wire values and router keys of a prompt.
pub fn hash(input: &str) -> Result<Value, CliError> {
    let inp: HashInput = serde_json::from_str(input).map_err(|e| CliError::Input(e.to_string()))?;
    if inp.block_size == 0 {
        return Err(CliError::Input("block_size must be > 0".into()));
    }
    let algo: HashAlgo = inp
        .algo
        .parse()
        .map_err(|_| CliError::Input(format!("unknown algo {:?}", inp.algo)))?;
    let style = inp
        .engine_version
        .as_deref()
        .map(ExtraKeyStyle::for_engine_version)
        .unwrap_or(ExtraKeyStyle::Tagged);
    let cfg = HashConfig {
        algo,
        seed: inp.seed.clone(),
        style,
    };
    let hasher = BlockHasher::new(&cfg).map_err(|e| CliError::Hash(e.to_string()))?;
    let lora = match (&inp.lora_name, &inp.lora_path) {
        (Some(name), Some(path)) => Some(LoraRef {
            name: name.clone(),
            path: path.clone(),
        }),
        (Some(_), None) => {
            return Err(CliError::Input(
                "lora_name needs lora_path (vLLM hashes the path too)".into(),
            ))
        }
        _ => None,
    };
    let mut mm = inp.mm_features.clone();
    mm.sort_by_key(|f| f.offset);
    let extras = RequestExtras {
        lora,
        cache_salt: inp.cache_salt.clone().filter(|s| !s.is_empty()),
        mm_features: mm,
    };
    let digests = hasher.block_hashes(&inp.token_ids, inp.block_size, &extras);
    let keys = request_keys(&inp.token_ids, inp.block_size, &extras, style);
    Ok(json!({
        "algo": algo.to_string(),
        "block_size": inp.block_size,
        "num_tokens": inp.token_ids.len(),
        "num_full_blocks": digests.len(),
        "max_prefix_hit_blocks_if_all_cached": usable_hit_blocks(inp.token_ids.len(), inp.block_size),
        "none_hash_hex": hasher.none_hash().to_hex(),
        "block_hashes_hex": digests.iter().map(|d| d.to_hex()).collect::<Vec<_>>(),
        "wire_block_hashes_u64": digests.iter().map(wire_u64).collect::<Vec<_>>(),
        "router_keys_u64": keys.iter().map(|k| k.0).collect::<Vec<_>>(),
    }))
}

/// `kvroute-indexer tokenize`: the engine's token ids for an OpenAI request body.
pub fn tokenize(model_dir: &Path, body: &str) -> Result<Value, CliError> {
    let body: Value = serde_json::from_str(body).map_err(|e| CliError::Input(e.to_string()))?;
    let endpoint = if body.get("messages").is_some() {
        Endpoint::ChatCompletions
    } else if body.get("prompt").is_some() {
        Endpoint::Completions
    } else {
        return Err(CliError::Input(
            "the body has neither \"messages\" (chat) nor \"prompt\" (completion)".into(),
        ));
    };
    let files = ModelFiles::from_dir(model_dir).map_err(|e| CliError::Request(e.to_string()))?;
    let tok = ModelTokenizer::from_files(&files, TokenizerOptions::default())
        .map_err(|e| CliError::Request(e.to_string()))?;
    let tokens = tok
        .tokenize_request(endpoint, &body)
        .map_err(|e| CliError::Request(e.to_string()))?;
    Ok(match tokens {
        PromptTokens::Single(ids) => json!({ "token_ids": ids }),
        PromptTokens::Batch(all) => json!({ "token_ids": all }),
        PromptTokens::Partial(ids) => json!({ "token_ids": ids, "partial": true }),
    })
}
