//! An OpenAI request body to the token ids the engine will see, exactly as vLLM computes them
//! (the rules are in `docs/vllm-requests.md`):
//!
//! * `/v1/completions`: `prompt` as a string (tokenised with `add_special_tokens`, default
//!   true), a list of token ids, or a batch of either;
//! * `/v1/chat/completions`: messages normalised as vLLM does ([`openai`]), the model's chat
//!   template rendered with minijinja the way transformers renders it with Jinja2
//!   ([`chat_template`]), then tokenised without special tokens (unless `add_special_tokens`).
//!
//! Tokenisation goes through a bounded cache of independently tokenisable segments
//! ([`segmenter`], [`segment_cache`]) so text seen before (a shared system prompt, earlier
//! turns) is not tokenised again; the result is identical to tokenising the whole text. Pieces
//! of the byte-level BPE family (Qwen2/3, Llama 3) go through [`piece_encoder`], an exact and
//! faster route to the same ids than the tokenizers crate's pipeline.
//!
//! Bounded work: [`ModelTokenizer::tokenize_request_capped`] refuses a prompt longer than a
//! token cap (the model's context length) with [`RequestError::PromptTooLong`], first from the
//! rendered text's size ([`MAX_PROMPT_BYTES_PER_TOKEN`]), then while tokenising, so that the
//! tokeniser's working set stays proportional to the cap, not to the body.

mod bpe_tables;
mod chat_template;
mod digest;
mod model_files;
mod openai;
mod piece_encoder;
mod segment_cache;
mod segmenter;
mod tokenizer;

pub use bpe_tables::{compact_tokenizer_json, BpeTables, CompactTokenizerJson};
pub use model_files::{ModelFileSet, ModelFiles, MODEL_FILE_NAMES};
pub use segment_cache::SegmentCacheStats;
pub use tokenizer::{ModelTokenizer, TokenizerOptions};

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

use crate::hashing::{LoraRef, RequestExtras};

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

/// Why a request could not be turned into tokens. Messages never contain prompt text.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is not valid JSON.
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an object.
    #[error("request body must be a JSON object")]
    NotAnObject,
    /// A required field is absent.
    #[error("request body has no \"{0}\"")]
    MissingField(&'static str),
    /// A field has the wrong shape.
    #[error("invalid \"{field}\": {reason}")]
    InvalidField {
        /// The field's name.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A chat message has the wrong shape.
    #[error("invalid message {index}: {reason}")]
    InvalidMessage {
        /// Position in `messages`.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The request exceeds a configured bound.
    #[error("too many {what} (limit {limit})")]
    TooLarge {
        /// What was counted.
        what: &'static str,
        /// The configured limit.
        limit: usize,
    },
    /// The prompt is longer than the token cap (the model's context): the engine refuses it.
    #[error("the prompt is longer than {limit} tokens")]
    PromptTooLong {
        /// The cap.
        limit: usize,
    },
    /// Valid for vLLM, but kvroute cannot reproduce its tokens (e.g. images).
    #[error("unsupported by kvroute: {0}")]
    Unsupported(String),
    /// The request carries its own chat template and the options do not trust request templates
    /// (vLLM's default without `--trust-request-chat-template`).
    #[error("the request carries a chat template but request chat templates are not trusted")]
    UntrustedChatTemplate,
    /// The model has no chat template.
    #[error("the model has no chat template (tokenizer_config.json has no \"chat_template\")")]
    NoChatTemplate,
    /// The chat template failed to compile or render (including `raise_exception`).
    #[error("chat template error: {0}")]
    Template(String),
    /// The tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The model files are missing or malformed.
    #[error("model files: {0}")]
    ModelFiles(String),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_from_paths() {
        assert_eq!(
            Endpoint::from_path("/v1/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions/"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(Endpoint::from_path("/v1/embeddings"), None);
    }

    #[test]
    fn extras_from_body() {
        let body = serde_json::json!({"model": "sql-lora", "cache_salt": "s1"});
        let extras = request_extras(&body, &|name| {
            (name == "sql-lora").then(|| "/adapters/sql".to_owned())
        });
        assert_eq!(extras.cache_salt.as_deref(), Some("s1"));
        let lora = extras.lora.expect("lora");
        assert_eq!(
            (lora.name.as_str(), lora.path.as_str()),
            ("sql-lora", "/adapters/sql")
        );
        let base = request_extras(&serde_json::json!({"model": "qwen3"}), &|_| None);
        assert!(base.lora.is_none() && base.cache_salt.is_none());
    }

    #[test]
    fn bad_json_is_an_error() {
        assert!(matches!(
            parse_body(b"{nope"),
            Err(RequestError::NotJson(_))
        ));
    }
}
