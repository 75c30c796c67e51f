//! [`TokenizerDigest`] of a loaded tokenizer: the same function on every side, so equal digests
//! mean equal inputs to rendering and tokenisation.

use std::collections::BTreeMap;

use sha2::{Digest as _, Sha256};
use tokenizers::Tokenizer;

use super::chat_template::ChatTemplates;
use super::TokenizerOptions;
use serde::{Deserialize, Serialize};

/// The first 16 hex digits of SHA-256 over `parts`, each prefixed with its length.
fn fingerprint(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(&h.finalize()[..8])
}

/// SHA-256 of what is written to it.
struct HashWriter(Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Fingerprint of the built tokenizer: its serialisation (vocabulary by id, merges by rank,
/// added tokens by id, every component), hashed as it is written, so no copy of the document
/// is held. A tokenizer built from the compact form and one built from the whole
/// `tokenizer.json` digest alike exactly when they are the same tokenizer.
fn tokenizer_fingerprint(tokenizer: &Tokenizer) -> String {
    let mut w = HashWriter(Sha256::new());
    if serde_json::to_writer(&mut w, tokenizer).is_err() {
        return String::new();
    }
    hex::encode(&w.0.finalize()[..8])
}

/// Digest of a built tokenizer, `templates`, the special tokens templates see, and the options
/// that change rendering (cache sizes and bounds change no token and are left out).
pub(crate) fn digest(
    tokenizer: &Tokenizer,
    templates: Option<&ChatTemplates>,
    special_tokens: &BTreeMap<String, String>,
    opts: &TokenizerOptions,
) -> TokenizerDigest {
    let mut template_parts: Vec<&[u8]> = Vec::new();
    if let Some(t) = templates {
        for (name, source) in t.sources() {
            template_parts.push(name.as_bytes());
            template_parts.push(source.as_bytes());
        }
    }
    template_parts.push(b"--special tokens--");
    for (name, content) in special_tokens {
        template_parts.push(name.as_bytes());
        template_parts.push(content.as_bytes());
    }
    let options = serde_json::json!({
        "trust_request_chat_template": opts.trust_request_chat_template,
        "content_format": opts.content_format,
        "default_chat_template_kwargs": opts.default_chat_template_kwargs,
        "exclude_tools_when_tool_choice_none": opts.exclude_tools_when_tool_choice_none,
    })
    .to_string();
    TokenizerDigest {
        tokenizer: tokenizer_fingerprint(tokenizer),
        template: fingerprint(&template_parts),
        options: fingerprint(&[options.as_bytes()]),
    }
}

/// What one side loaded for a model, as short fingerprints (the first 16 hex digits of SHA-256):
/// the filter and the indexer each compute it from the tokenizer they built
/// (`ModelTokenizer::digest`), so equal digests mean both render and tokenise alike.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerDigest {
    /// `tokenizer.json` (vocabulary, normaliser, pre-tokeniser, added tokens).
    pub tokenizer: String,
    /// The chat template(s) in use and the special tokens templates see.
    pub template: String,
    /// The rendering options (trusted request templates, content format, default template
    /// arguments, tools with `tool_choice: none`).
    pub options: String,
}

impl TokenizerDigest {
    /// The parts that differ between two digests (`tokenizer`, `template`, `options`).
    pub fn differences(&self, other: &Self) -> Vec<&'static str> {
        let mut parts = Vec::new();
        if self.tokenizer != other.tokenizer {
            parts.push("tokenizer");
        }
        if self.template != other.template {
            parts.push("template");
        }
        if self.options != other.options {
            parts.push("options");
        }
        parts
    }
}
