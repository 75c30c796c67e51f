//! [`TokenizerDigest`] of a loaded tokenizer: the same function on every side, so equal digests
//! mean equal inputs to rendering and tokenisation.

use std::collections::BTreeMap;

use serde_json::Value;
use sha2::{Digest as _, Sha256};

use super::chat_template::ChatTemplates;
use super::TokenizerOptions;
use crate::api::TokenizerDigest;

/// The first 16 hex digits of SHA-256 over `parts`, each prefixed with its length.
fn fingerprint(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(&h.finalize()[..8])
}

/// Digest of a tokenizer built from `tokenizer_json` (parsed, so a bundle sent as a string or
/// inline as an object digests alike), `templates`, the special tokens templates see, and the
/// options that change rendering (cache sizes and bounds change no token and are left out).
pub(crate) fn digest(
    tokenizer_json: &Value,
    templates: Option<&ChatTemplates>,
    special_tokens: &BTreeMap<String, String>,
    opts: &TokenizerOptions,
) -> TokenizerDigest {
    let tokenizer = serde_json::to_vec(tokenizer_json).unwrap_or_default();
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
        tokenizer: fingerprint(&[&tokenizer]),
        template: fingerprint(&template_parts),
        options: fingerprint(&[options.as_bytes()]),
    }
}
