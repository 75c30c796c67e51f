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

mod body;
mod bpe_tables;
mod chat_template;
mod digest;
mod error;
mod model_files;
mod openai;
mod options;
mod piece_encoder;
mod prompt;
mod segment_cache;
mod segmenter;
mod tokenizer;

pub use body::{token_id_list, RequestBody};
pub use bpe_tables::{compact_tokenizer_json, BpeTables, CompactTokenizerJson};
pub use digest::TokenizerDigest;
pub use error::RequestError;
pub use model_files::{ModelFileSet, ModelFiles, MODEL_FILE_NAMES};
pub use options::TokenizerOptions;
pub use prompt::{
    parse_body, request_extras, ChatContentFormat, Endpoint, PromptTokens,
    DEFAULT_MAX_PROMPT_TOKENS, MAX_PROMPT_BYTES_PER_TOKEN, MAX_SANE_MODEL_MAX_LENGTH,
};
pub use segment_cache::SegmentCacheStats;
pub use tokenizer::ModelTokenizer;

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
