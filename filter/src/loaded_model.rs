//! The bridge to `kvroute_core`: a loaded model (tokenizer + block size + key style) turning an
//! OpenAI request body into router keys. The only module that calls the shared core, so the
//! filter computes exactly what the indexer and the CLI compute.

use std::collections::BTreeMap;

use kvroute_core::hashing::ExtraKeyStyle;
use kvroute_core::request::{
    request_extras, Endpoint, ModelFiles, ModelTokenizer, PromptTokens, RequestBody, RequestError,
    DEFAULT_MAX_PROMPT_TOKENS,
};
use kvroute_core::router_key::request_keys;

use crate::config::{FilterConfig, ModelConfig};
use kvroute_core::api::TokenizerBundle;

/// The OpenAI endpoint a routed path serves: the standard paths, else by suffix so that
/// prefixed paths (`/openai/v1/chat/completions`) work too.
pub fn endpoint_for_path(path: &str) -> Endpoint {
    if let Some(e) = Endpoint::from_path(path) {
        return e;
    }
    let bare = path.split(['?', '#']).next().unwrap_or(path);
    if bare.trim_end_matches('/').ends_with("/chat/completions") {
        Endpoint::ChatCompletions
    } else {
        Endpoint::Completions
    }
}

/// What the indexer needs to route one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Router keys of the prompt's full blocks.
    pub router_keys: Vec<u64>,
    /// Prompt length in tokens.
    pub num_tokens: usize,
    /// LoRA adapter name, if any.
    pub lora: Option<String>,
    /// The prompt's token ids (`None` for a batch of prompts and for a partial prompt, which the
    /// online check skips).
    pub tokens: Option<Vec<u32>>,
    /// Only the prompt's leading tokens are known (a chat with media, up to its first
    /// placeholder).
    pub partial: bool,
}

/// Why a request was not prepared.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The prompt is longer than the model's `max_prompt_tokens`.
    #[error("prompt longer than {0} tokens")]
    TooLong(usize),
    /// The request could not be rendered or tokenised (the message never holds prompt text).
    #[error("{0}")]
    Invalid(String),
}

/// A model ready to route: its tokenizer and hashing parameters.
pub struct LoadedModel {
    tokenizer: ModelTokenizer,
    /// Block size used for the keys.
    pub block_size: usize,
    /// Longest prompt tokenised (tokens); a longer one fails open as `prompt_too_long`.
    pub max_prompt_tokens: usize,
    style: ExtraKeyStyle,
    lora_paths: BTreeMap<String, String>,
    /// The online check's state for this tokenizer (a reload starts afresh).
    pub check: crate::token_check::ModelCheckState,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("block_size", &self.block_size)
            .field("max_prompt_tokens", &self.max_prompt_tokens)
            .finish_non_exhaustive()
    }
}

impl LoadedModel {
    /// Builds the tokenizer from a bundle; configuration overrides what the bundle announces.
    pub fn from_bundle(
        bundle: &TokenizerBundle,
        model_cfg: Option<&ModelConfig>,
        cfg: &FilterConfig,
    ) -> Result<Self, String> {
        Self::load(bundle.clone(), model_cfg, cfg)
    }

    /// [`Self::from_bundle`], consuming the bundle (its documents and tables are freed as the
    /// tokenizer is built instead of copied).
    pub fn load(
        bundle: TokenizerBundle,
        model_cfg: Option<&ModelConfig>,
        cfg: &FilterConfig,
    ) -> Result<Self, String> {
        let TokenizerBundle {
            model: _,
            tokenizer_json,
            tokenizer_config_json,
            block_size: announced_block_size,
            extra_key_style,
            max_model_len,
            bpe_tables,
        } = bundle;
        let files = ModelFiles {
            tokenizer_json: tokenizer_json.into_bytes(),
            tokenizer_config_json: tokenizer_config_json.into_bytes(),
        };
        let opts = model_cfg
            .and_then(|m| m.tokenizer_options.clone())
            .unwrap_or_default();
        let tokenizer = ModelTokenizer::from_bundle_parts(
            &files,
            bpe_tables.map(std::sync::Arc::unwrap_or_clone),
            opts,
        )
        .map_err(|e| e.to_string())?;
        drop(files);
        let block_size = model_cfg
            .and_then(|m| m.block_size)
            .or(announced_block_size.map(|b| b as usize))
            .unwrap_or(cfg.default_block_size);
        // Configuration first, then what the indexer knows of the engines' vLLM version.
        let style: ExtraKeyStyle = model_cfg
            .and_then(|m| m.extra_key_style)
            .or(extra_key_style)
            .unwrap_or_default();
        let max_prompt_tokens = model_cfg
            .and_then(|m| m.max_prompt_tokens)
            .or(max_model_len.map(|n| n as usize))
            .or(tokenizer.model_max_length())
            .unwrap_or(DEFAULT_MAX_PROMPT_TOKENS);
        Ok(Self {
            tokenizer,
            block_size,
            max_prompt_tokens,
            style,
            lora_paths: model_cfg.map(|m| m.lora_paths.clone()).unwrap_or_default(),
            check: crate::token_check::ModelCheckState::default(),
        })
    }

    /// Fingerprints of the tokenizer, template and options loaded (reported to the indexer).
    pub fn digest(&self) -> &kvroute_core::api::TokenizerDigest {
        self.tokenizer.digest()
    }

    /// Renders/tokenises the request (at most `max_prompt_tokens` per prompt) and computes its
    /// router keys. A batch of prompts routes by its first prompt.
    pub fn prepare(
        &self,
        endpoint: Endpoint,
        body: &RequestBody,
    ) -> Result<Prepared, PrepareError> {
        let (tokens, whole) = match self
            .tokenizer
            .tokenize_body_capped(endpoint, body, self.max_prompt_tokens)
            .map_err(|e| match e {
                RequestError::PromptTooLong { limit } => PrepareError::TooLong(limit),
                other => PrepareError::Invalid(other.to_string()),
            })? {
            PromptTokens::Single(t) => (t, Some(true)),
            PromptTokens::Batch(b) => (b.into_iter().next().unwrap_or_default(), Some(false)),
            PromptTokens::Partial(t) => (t, None),
        };
        let lookup = |name: &str| self.lora_paths.get(name).cloned();
        let extras = request_extras(body.fields(), &lookup);
        let keys = request_keys(&tokens, self.block_size, &extras, self.style);
        Ok(Prepared {
            router_keys: keys.iter().map(|k| k.0).collect(),
            num_tokens: tokens.len(),
            lora: extras.lora.as_ref().map(|l| l.name.clone()),
            partial: whole.is_none(),
            tokens: (whole == Some(true)).then_some(tokens),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_the_path_suffix() {
        assert!(matches!(
            endpoint_for_path("/v1/chat/completions?x"),
            Endpoint::ChatCompletions
        ));
        assert!(matches!(
            endpoint_for_path("/openai/v1/completions"),
            Endpoint::Completions
        ));
    }
}
