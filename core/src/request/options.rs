//! How a model's requests are rendered and tokenised ([`TokenizerOptions`]).

use serde_json::{Map, Value};

use super::prompt::ChatContentFormat;

/// Settings of a [`super::ModelTokenizer`]; the defaults follow vLLM's defaults.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenizerOptions {
    /// Upper bound on the segment cache's memory (token ids plus per-entry overhead), in bytes.
    /// 0 disables the cache.
    pub segment_cache_max_bytes: usize,
    /// Upper bound on the number of cached segments. 0 disables the cache.
    pub segment_cache_max_entries: usize,
    /// Minimum size of a line chunk for tokenizers where cutting at line starts is exact
    /// (Qwen2/3, Llama 3 style byte-level BPE). 0 keeps whole spans between added tokens.
    pub line_chunk_bytes: usize,
    /// A chat template that replaces the model's (vLLM's `--chat-template`, as template text).
    pub chat_template: Option<String>,
    /// Accept a `chat_template` sent in the request (vLLM's `--trust-request-chat-template`).
    pub trust_request_chat_template: bool,
    /// vLLM's `--chat-template-content-format`.
    pub content_format: ChatContentFormat,
    /// vLLM's `--default-chat-template-kwargs`.
    pub default_chat_template_kwargs: Map<String, Value>,
    /// vLLM's `--exclude-tools-when-tool-choice-none`.
    pub exclude_tools_when_tool_choice_none: bool,
    /// Most prompts accepted in one batched completion.
    pub max_batch_prompts: usize,
    /// Most messages accepted in one chat request.
    pub max_messages: usize,
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        Self {
            segment_cache_max_bytes: 32 << 20,
            segment_cache_max_entries: 65_536,
            line_chunk_bytes: 2048,
            chat_template: None,
            trust_request_chat_template: false,
            content_format: ChatContentFormat::Auto,
            default_chat_template_kwargs: Map::new(),
            exclude_tools_when_tool_choice_none: false,
            max_batch_prompts: 1024,
            max_messages: 100_000,
        }
    }
}
