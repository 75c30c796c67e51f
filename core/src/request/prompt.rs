//! What a request is made of for tokenising: its endpoint, its prompt's token ids, the chat
//! content format, the prompt limits, and the body parse and extras of a request.

use super::error::RequestError;
use crate::hashing::{LoraRef, RequestExtras};

/// Bytes of prompt text per token above which a prompt cannot fit its token cap. Measured with
/// the Qwen3 tokenizer on real text (docs/filter.md, "Bounded work per request"): English prose
/// 3.3-4.0 bytes per token (6.6 at most for one whitespace-heavy page), Rust and Python code
/// 3.8-4.5 (5.4 at most), Chinese 4.5, Japanese 4.6, Korean 4.0, JSON 1.5-3.6, code indented by
/// 32 spaces 6.3. 16 is 2.4x the densest real file: a prompt with more than `cap x 16` bytes is
/// refused without tokenising it. Only synthetic runs of one character (64 dashes: 17.7, spaces:
/// 128 bytes per token) exceed it, and those fail open, i.e. go unrouted.
pub const MAX_PROMPT_BYTES_PER_TOKEN: usize = 16;

/// The token cap of a model that announces no context length (neither the configuration, nor
/// the indexer, nor `model_max_length` in `tokenizer_config.json`): 128 Ki tokens, the context
/// of most current models (Qwen3, Llama 3.1).
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 131_072;

/// Largest `model_max_length` taken from `tokenizer_config.json`; transformers writes `1e30`
/// when a model sets none.
pub const MAX_SANE_MODEL_MAX_LENGTH: usize = 16 << 20;

/// The OpenAI endpoints kvroute understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint of a request path (query string ignored), `None` for anything else.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split(['?', '#']).next().unwrap_or("");
        let path = path.strip_suffix('/').unwrap_or(path);
        match path {
            "/v1/completions" => Some(Self::Completions),
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            _ => None,
        }
    }

    /// The request path of this endpoint.
    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// The engine's token ids for a request: one prompt, or one per prompt of a batched completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTokens {
    /// A single prompt (every chat request, and completions with one prompt).
    Single(Vec<u32>),
    /// A completion whose `prompt` is a list of prompts: vLLM runs one request per entry.
    Batch(Vec<Vec<u32>>),
    /// The leading tokens of a chat with images, audio or video: the prompt up to its first
    /// media placeholder (less its last token, which the placeholder's text could merge with).
    /// What follows depends on the media and is not predicted.
    Partial(Vec<u32>),
}

impl PromptTokens {
    /// Every prompt's ids, in order.
    pub fn prompts(&self) -> Vec<&[u32]> {
        match self {
            Self::Single(ids) | Self::Partial(ids) => vec![ids.as_slice()],
            Self::Batch(all) => all.iter().map(Vec::as_slice).collect(),
        }
    }
}

/// How the chat template expects `content`: vLLM's `--chat-template-content-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatContentFormat {
    /// Detect from the template (a loop over `message.content` means `openai`).
    #[default]
    Auto,
    /// Content is one string (text parts joined with `"\n"`).
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts.
    #[serde(rename = "openai")]
    OpenAi,
}

/// Parses a request body, mapping malformed JSON to [`RequestError::NotJson`].
pub fn parse_body(bytes: &[u8]) -> Result<serde_json::Value, RequestError> {
    serde_json::from_slice(bytes).map_err(|e| {
        // serde_json's message holds only a position, never the input.
        RequestError::NotJson(e.to_string())
    })
}

/// The parts of a request that change vLLM's block hashes besides the tokens: `cache_salt`, and
/// the LoRA adapter when `model` names one (`lora_paths` maps a served adapter name to the path
/// vLLM loaded it from, `None` for the base model).
pub fn request_extras(
    body: &serde_json::Value,
    lora_paths: &dyn Fn(&str) -> Option<String>,
) -> RequestExtras {
    let cache_salt = body
        .get("cache_salt")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned);
    let lora = body
        .get("model")
        .and_then(serde_json::Value::as_str)
        .and_then(|name| {
            lora_paths(name).map(|path| LoraRef {
                name: name.to_owned(),
                path,
            })
        });
    RequestExtras {
        lora,
        cache_salt,
        ..RequestExtras::default()
    }
}
