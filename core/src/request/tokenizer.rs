//! [`ModelTokenizer`]: a model's tokenizer and chat template(s), plus the segment cache.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value};
use tokenizers::{Encoding, Token, Tokenizer};

use super::bpe_tables::{build_tokenizer, is_compact, BpeTables};
use super::chat_template::ChatTemplates;
use super::openai::{self, CompletionPrompt};
use super::options::TokenizerOptions;
use super::piece_encoder::PieceEncoder;
use super::segment_cache::{SegmentCache, SegmentCacheStats, SegmentKey};
use super::segmenter::{Piece, Segmenter};
use super::{
    ChatContentFormat, Endpoint, ModelFiles, PromptTokens, RequestBody, RequestError,
    MAX_PROMPT_BYTES_PER_TOKEN, MAX_SANE_MODEL_MAX_LENGTH,
};

/// With a token cap, a text piece longer than this (and than the tokens left under the cap) is
/// first counted in chunks of this size, so the tokenizer never sees more of it at once than
/// this (the tokenizer holds ~330 bytes per token natively, ~21 MB for a chunk of digits).
const LONG_PIECE_BYTES: usize = 64 * 1024;

/// transformers appends this to the final message for `continue_final_message`, renders, then
/// cuts the rendered text at it.
const CONTINUE_FINAL_MESSAGE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
/// The special-token attributes transformers passes to every chat template.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model's tokenizer and chat template, with a bounded cache of tokenised segments.
/// `Send + Sync`: share one per model behind an `Arc`.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    templates: Option<ChatTemplates>,
    special_tokens: BTreeMap<String, String>,
    segmenter: Segmenter,
    /// The fast exact encoder for pieces, when the pipeline allows one.
    piece_encoder: Option<PieceEncoder>,
    cache: Mutex<SegmentCache>,
    opts: TokenizerOptions,
    model_max_length: Option<usize>,
    digest: super::digest::TokenizerDigest,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("templates", &self.templates)
            .field("segmenter", &self.segmenter)
            .field("opts", &self.opts)
            .finish()
    }
}

fn tokenizer_error(e: impl std::fmt::Display) -> RequestError {
    RequestError::Tokenizer(e.to_string())
}

/// The string of a special-token entry in `tokenizer_config.json`: a string or `{"content"}`.
fn token_content(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Python's `str.isspace` for one character.
fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Where the first media placeholder mark is in a rendered chat (a SIMD search: the text is
/// the whole prompt, searched once per request).
fn media_mark_at(text: &str) -> Option<usize> {
    static FINDER: std::sync::OnceLock<memchr::memmem::Finder<'static>> =
        std::sync::OnceLock::new();
    FINDER
        .get_or_init(|| memchr::memmem::Finder::new(openai::MEDIA_MARK.as_bytes()))
        .find(text.as_bytes())
}

impl ModelTokenizer {
    /// Loads a model's tokenizer and chat template.
    pub fn from_files(files: &ModelFiles, opts: TokenizerOptions) -> Result<Self, RequestError> {
        Self::build(files, None, opts)
    }

    /// Loads a model's tokenizer from the compact form: `files.tokenizer_json` is the document
    /// [`super::compact_tokenizer_json`] made, `tables` the vocabulary and merges it took out.
    /// The same tokenizer as [`Self::from_files`] on the whole document, without its parse
    /// peak.
    pub fn from_compact(
        files: &ModelFiles,
        tables: BpeTables,
        opts: TokenizerOptions,
    ) -> Result<Self, RequestError> {
        Self::build(files, Some(tables), opts)
    }

    /// [`Self::from_files`] through the compact form when the form covers the tokenizer: the
    /// same tokenizer (equal digests), without `tokenizers`' parse peak of the whole document
    /// (docs/filter.md, "Memory per VM"). What a process that builds a tokenizer only to
    /// digest or check it should use.
    pub fn from_files_compacted(
        files: &ModelFiles,
        opts: TokenizerOptions,
    ) -> Result<Self, RequestError> {
        match super::compact_tokenizer_json(&files.tokenizer_json)? {
            Some(compact) => {
                let compact_files = ModelFiles {
                    tokenizer_json: compact.tokenizer_json,
                    tokenizer_config_json: files.tokenizer_config_json.clone(),
                };
                Self::from_compact(&compact_files, compact.tables, opts)
            }
            None => Self::from_files(files, opts),
        }
    }

    /// A tokenizer bundle's files and tables: [`Self::from_compact`] when the bundle carries
    /// BPE tables, else [`Self::from_files`] (the filter's load and the indexer's digest).
    pub fn from_bundle_parts(
        files: &ModelFiles,
        tables: Option<BpeTables>,
        opts: TokenizerOptions,
    ) -> Result<Self, RequestError> {
        Self::build(files, tables, opts)
    }

    fn build(
        files: &ModelFiles,
        tables: Option<BpeTables>,
        opts: TokenizerOptions,
    ) -> Result<Self, RequestError> {
        let tokenizer_json: Value = serde_json::from_slice(&files.tokenizer_json)
            .map_err(|e| RequestError::ModelFiles(format!("tokenizer.json is not JSON: {e}")))?;
        let segmenter = Segmenter::from_tokenizer_json(&tokenizer_json, opts.line_chunk_bytes);
        let piece_encoder = if segmenter.cuts() {
            PieceEncoder::from_tokenizer_json(&tokenizer_json)
        } else {
            None
        };
        let mut tokenizer = match tables {
            Some(tables) => build_tokenizer(&tokenizer_json, tables)?,
            None if is_compact(&tokenizer_json) => {
                return Err(RequestError::ModelFiles(
                    "tokenizer.json is the compact form (its BPE model has no vocab and no \
                     merges) but no BPE tables came with it"
                        .into(),
                ))
            }
            None => {
                // The parsed document is not needed any more: free it before the tokenizer's
                // own parse, whose peak is the larger.
                drop(tokenizer_json);
                Tokenizer::from_bytes(&files.tokenizer_json)
                    .map_err(|e| RequestError::ModelFiles(format!("tokenizer.json: {e}")))?
            }
        };
        // transformers disables the file's truncation and padding unless asked per call.
        tokenizer
            .with_truncation(None)
            .map_err(|e| RequestError::ModelFiles(format!("tokenizer.json: {e}")))?;
        tokenizer.with_padding(None);

        let config: Value = serde_json::from_slice(&files.tokenizer_config_json).map_err(|e| {
            RequestError::ModelFiles(format!("tokenizer_config.json is not JSON: {e}"))
        })?;
        if !config.is_object() {
            return Err(RequestError::ModelFiles(
                "tokenizer_config.json is not an object".into(),
            ));
        }
        let templates = match &opts.chat_template {
            Some(source) => Some(ChatTemplates::single(source.clone())?),
            None => ChatTemplates::from_tokenizer_config(&config)?,
        };
        let special_tokens = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|name| {
                config
                    .get(*name)
                    .and_then(token_content)
                    .map(|c| ((*name).to_owned(), c))
            })
            .collect();
        let cache = Mutex::new(SegmentCache::new(
            opts.segment_cache_max_bytes,
            opts.segment_cache_max_entries,
        ));
        let model_max_length = config
            .get("model_max_length")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| (1..=MAX_SANE_MODEL_MAX_LENGTH).contains(n));
        let digest = super::digest::digest(&tokenizer, templates.as_ref(), &special_tokens, &opts);
        Ok(Self {
            tokenizer,
            templates,
            special_tokens,
            segmenter,
            piece_encoder,
            cache,
            opts,
            model_max_length,
            digest,
        })
    }

    /// Fingerprints of what this tokenizer was built from (see [`super::digest::TokenizerDigest`]).
    pub fn digest(&self) -> &super::digest::TokenizerDigest {
        &self.digest
    }

    /// `model_max_length` from `tokenizer_config.json`, when it is a plausible context length
    /// (an integer in 1..=16 Mi; transformers writes `1e30` for "none").
    pub fn model_max_length(&self) -> Option<usize> {
        self.model_max_length
    }

    /// The options this tokenizer was built with.
    pub fn options(&self) -> &TokenizerOptions {
        &self.opts
    }

    /// The special tokens from `tokenizer_config.json` that templates see, e.g.
    /// `"eos_token" -> "<|im_end|>"`.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// The id of a token (regular or added), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Whether a chat template is available.
    pub fn has_chat_template(&self) -> bool {
        self.templates.is_some()
    }

    /// Whether cached tokenisation cuts text at added tokens and, for known byte-level BPE
    /// pre-tokenisers, at line starts (see the `segmenter` module).
    pub fn segmentation(&self) -> (bool, bool) {
        (self.segmenter.cuts(), self.segmenter.line_cuts())
    }

    /// The engine's token ids for an OpenAI request body.
    pub fn tokenize_request(
        &self,
        endpoint: Endpoint,
        body: &Value,
    ) -> Result<PromptTokens, RequestError> {
        self.tokenize_request_inner(endpoint, body, None)
    }

    /// [`Self::tokenize_request`] for prompts of at most `max_tokens` tokens each; a longer one
    /// is [`RequestError::PromptTooLong`]. Refused before tokenising when the rendered text has
    /// more than `max_tokens x` [`MAX_PROMPT_BYTES_PER_TOKEN`] bytes; otherwise tokenising stops
    /// once the running count passes the cap, and a long piece of text is counted in bounded
    /// chunks before it is tokenised whole, so the work and memory per request follow the cap.
    /// Prompts within the cap get exactly the ids of [`Self::tokenize_request`].
    pub fn tokenize_request_capped(
        &self,
        endpoint: Endpoint,
        body: &Value,
        max_tokens: usize,
    ) -> Result<PromptTokens, RequestError> {
        self.tokenize_request_inner(endpoint, body, Some(max_tokens))
    }

    /// [`Self::tokenize_request_capped`] for a [`RequestBody`]: a completion's token-id prompt
    /// kept as ids is taken as it is (the same ids and errors as through the `Value`).
    pub fn tokenize_body_capped(
        &self,
        endpoint: Endpoint,
        body: &RequestBody,
        max_tokens: usize,
    ) -> Result<PromptTokens, RequestError> {
        match body.prompt_ids() {
            Some(ids) if endpoint == Endpoint::Completions => {
                // The body's other fields are checked as the `Value` path checks them.
                let add_special_tokens = openai::completion_add_special_tokens(body.fields())?;
                let prompt = CompletionPrompt::Ids(ids.to_vec());
                self.completion_ids(prompt, add_special_tokens, Some(max_tokens))
                    .map(PromptTokens::Single)
            }
            _ => self.tokenize_request_inner(endpoint, body.fields(), Some(max_tokens)),
        }
    }

    fn tokenize_request_inner(
        &self,
        endpoint: Endpoint,
        body: &Value,
        cap: Option<usize>,
    ) -> Result<PromptTokens, RequestError> {
        match endpoint {
            Endpoint::ChatCompletions => {
                let (text, add_special_tokens) = self.render_chat_inner(body)?;
                match media_mark_at(&text) {
                    None => Ok(PromptTokens::Single(self.encode_text_inner(
                        &text,
                        add_special_tokens,
                        cap,
                    )?)),
                    Some(cut) => {
                        let mut ids =
                            self.encode_text_inner(&text[..cut], add_special_tokens, cap)?;
                        ids.pop();
                        Ok(PromptTokens::Partial(ids))
                    }
                }
            }
            Endpoint::Completions => {
                let (prompt, add_special_tokens) = openai::completion_prompt(body, &self.opts)?;
                match prompt {
                    CompletionPrompt::Batch(items) => {
                        let mut all = Vec::with_capacity(items.len());
                        for item in items {
                            all.push(self.completion_ids(item, add_special_tokens, cap)?);
                        }
                        Ok(PromptTokens::Batch(all))
                    }
                    single => Ok(PromptTokens::Single(self.completion_ids(
                        single,
                        add_special_tokens,
                        cap,
                    )?)),
                }
            }
        }
    }

    fn completion_ids(
        &self,
        prompt: CompletionPrompt,
        add_special_tokens: bool,
        cap: Option<usize>,
    ) -> Result<Vec<u32>, RequestError> {
        match prompt {
            CompletionPrompt::Text(text) => self.encode_text_inner(&text, add_special_tokens, cap),
            CompletionPrompt::Ids(ids) => match cap {
                Some(limit) if ids.len() > limit => Err(RequestError::PromptTooLong { limit }),
                _ => Ok(ids),
            },
            CompletionPrompt::Batch(_) => Err(RequestError::InvalidField {
                field: "prompt".into(),
                reason: "nested batches are not allowed".into(),
            }),
        }
    }

    /// The text a `/v1/chat/completions` body renders to (before tokenisation).
    pub fn render_chat(&self, body: &Value) -> Result<String, RequestError> {
        self.render_chat_inner(body).map(|(text, _)| text)
    }

    fn render_chat_inner(&self, body: &Value) -> Result<(String, bool), RequestError> {
        let req = openai::chat_request(body, &self.opts)?;
        let request_templates = match &req.chat_template {
            // Only reachable when the options trust request templates.
            Some(source) => Some(self.request_template(source)?),
            None => None,
        };
        let templates = request_templates
            .as_ref()
            .or(self.templates.as_ref())
            .ok_or(RequestError::NoChatTemplate)?;
        let name = templates.select(req.tools.is_some())?;
        let source = templates.source(name);
        let format = match self.opts.content_format {
            ChatContentFormat::Auto => templates.detected_format(name),
            other => other,
        };
        let mut messages = openai::normalise_messages(req.messages, format, source)?;
        if messages.is_empty() {
            return Err(RequestError::InvalidField {
                field: "messages".into(),
                reason: "cannot apply a chat template to an empty conversation".into(),
            });
        }
        let final_message = if req.continue_final_message {
            Some(tag_final_message(&mut messages, source)?)
        } else {
            None
        };

        let mut ctx = Map::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::String(v.clone()));
        }
        for (k, v) in req.kwargs {
            ctx.insert(k, v);
        }
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert("tools".into(), req.tools.unwrap_or(Value::Null));
        ctx.insert("documents".into(), req.documents.unwrap_or(Value::Null));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(req.add_generation_prompt),
        );
        let rendered = templates.render(name, &ctx)?;
        let rendered = match final_message {
            Some(final_message) => cut_at_tag(rendered, &final_message)?,
            None => rendered,
        };
        Ok((rendered, req.add_special_tokens))
    }

    fn request_template(&self, source: &str) -> Result<ChatTemplates, RequestError> {
        // A name of one of the model's templates, else template text (transformers' rule).
        if let Some(own) = &self.templates {
            let named = own.source(source);
            if !named.is_empty() {
                return ChatTemplates::single(named.to_owned());
            }
        }
        ChatTemplates::single(source.to_owned())
    }

    /// Token ids of `text`, with the tokenizer's post-processor adding special tokens when
    /// `add_special_tokens` (as Hugging Face `tokenizer(text, add_special_tokens=...)`).
    /// Segments seen before come from the cache; the result equals
    /// [`Self::encode_text_uncached`].
    pub fn encode_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, RequestError> {
        self.encode_text_inner(text, add_special_tokens, None)
    }

    /// [`Self::encode_text`] with an optional token cap (see [`Self::tokenize_request_capped`]).
    pub fn encode_text_capped(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_tokens: usize,
    ) -> Result<Vec<u32>, RequestError> {
        self.encode_text_inner(text, add_special_tokens, Some(max_tokens))
    }

    fn encode_text_inner(
        &self,
        text: &str,
        add_special_tokens: bool,
        cap: Option<usize>,
    ) -> Result<Vec<u32>, RequestError> {
        if let Some(limit) = cap {
            if text.len() > limit.saturating_mul(MAX_PROMPT_BYTES_PER_TOKEN) {
                return Err(RequestError::PromptTooLong { limit });
            }
        }
        let ids = self.encode_segments(text, cap)?;
        let ids = if add_special_tokens {
            self.post_process(ids)?
        } else {
            ids
        };
        match cap {
            Some(limit) if ids.len() > limit => Err(RequestError::PromptTooLong { limit }),
            _ => Ok(ids),
        }
    }

    /// Token ids of `text` tokenised in one piece, without the cache: the reference that
    /// [`Self::encode_text`] must equal.
    pub fn encode_text_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, RequestError> {
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(tokenizer_error)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of token ids (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String, RequestError> {
        self.tokenizer.decode(ids, false).map_err(tokenizer_error)
    }

    /// Segment cache counters.
    pub fn cache_stats(&self) -> SegmentCacheStats {
        self.lock_cache().stats()
    }

    /// Empties the segment cache.
    pub fn clear_cache(&self) {
        self.lock_cache().clear();
    }

    fn lock_cache(&self) -> MutexGuard<'_, SegmentCache> {
        // A panic while holding the lock cannot leave the LRU inconsistent enough to matter.
        self.cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Ids of a piece the segmenter cut (no added token inside).
    fn encode_piece(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        match &self.piece_encoder {
            Some(encoder) => {
                let mut ids = Vec::with_capacity(text.len() / 3);
                encoder.encode(&self.tokenizer, text, &mut ids)?;
                Ok(ids)
            }
            None => self.encode_text_uncached(text, false),
        }
    }

    /// Refuses a long piece of text that cannot fit in the `remaining` tokens, counting it in
    /// chunks of [`LONG_PIECE_BYTES`] so that a piece of many tokens (a line of digits) never
    /// reaches the tokenizer whole. A token covers at least one byte, so a piece no longer than
    /// `remaining` bytes is not counted. Cutting inside the text can only add a token or two per
    /// cut, so a prompt refused here was at most a few tokens below the cap.
    fn check_piece_fits(
        &self,
        text: &str,
        remaining: usize,
        limit: usize,
    ) -> Result<(), RequestError> {
        if text.len() <= remaining.max(LONG_PIECE_BYTES) {
            return Ok(());
        }
        let mut counted = 0usize;
        let mut rest = text;
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(floor_char_boundary(rest, LONG_PIECE_BYTES));
            counted = counted.saturating_add(self.encode_piece(chunk)?.len());
            if counted > remaining {
                return Err(RequestError::PromptTooLong { limit });
            }
            rest = tail;
        }
        Ok(())
    }

    fn encode_segments(&self, text: &str, cap: Option<usize>) -> Result<Vec<u32>, RequestError> {
        let too_long = |limit| RequestError::PromptTooLong { limit };
        let mut pieces: Vec<Piece<'_>> = Vec::new();
        // Each added token is one token: stop collecting once they alone pass the cap.
        let mut added = 0usize;
        let mut over = false;
        self.segmenter.split(text, |p| {
            if over {
                return;
            }
            if matches!(p, Piece::Added(_)) {
                added += 1;
                over = cap.is_some_and(|c| added > c);
            }
            pieces.push(p);
        });
        if let (true, Some(limit)) = (over, cap) {
            return Err(too_long(limit));
        }
        let keys: Vec<Option<SegmentKey>> = pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => Some(SegmentKey::of(t)),
                Piece::Added(_) => None,
            })
            .collect();
        let mut found: Vec<Option<Arc<[u32]>>> = {
            let mut cache = self.lock_cache();
            keys.iter()
                .map(|k| k.as_ref().and_then(|k| cache.get(k)))
                .collect()
        };
        // Tokens known so far: added tokens and cached pieces; fresh pieces are added below.
        let mut count: usize = pieces
            .iter()
            .zip(&found)
            .map(|(p, f)| match (p, f) {
                (Piece::Added(_), _) => 1,
                (Piece::Text(_), Some(ids)) => ids.len(),
                (Piece::Text(_), None) => 0,
            })
            .sum();
        if let Some(limit) = cap.filter(|&c| count > c) {
            return Err(too_long(limit));
        }
        let mut fresh: HashMap<SegmentKey, Arc<[u32]>> = HashMap::new();
        for ((piece, key), slot) in pieces.iter().zip(&keys).zip(found.iter_mut()) {
            if let (Piece::Text(t), Some(key), None) = (piece, key, &slot) {
                let ids = match fresh.get(key) {
                    Some(ids) => ids.clone(),
                    None => {
                        if let Some(limit) = cap {
                            self.check_piece_fits(t, limit.saturating_sub(count), limit)?;
                        }
                        let ids: Arc<[u32]> = self.encode_piece(t)?.into();
                        fresh.insert(*key, ids.clone());
                        ids
                    }
                };
                count = count.saturating_add(ids.len());
                if let Some(limit) = cap.filter(|&c| count > c) {
                    return Err(too_long(limit));
                }
                *slot = Some(ids);
            }
        }
        if !fresh.is_empty() {
            let mut cache = self.lock_cache();
            for (key, ids) in fresh {
                cache.insert(key, ids);
            }
        }
        let total = found
            .iter()
            .map(|f| f.as_ref().map_or(1, |ids| ids.len()))
            .sum();
        let mut out = Vec::with_capacity(total);
        for (piece, ids) in pieces.iter().zip(found) {
            match (piece, ids) {
                (Piece::Added(id), _) => out.push(*id),
                (Piece::Text(_), Some(ids)) => out.extend_from_slice(&ids),
                (Piece::Text(_), None) => {
                    return Err(RequestError::Tokenizer("segment left untokenised".into()))
                }
            }
        }
        Ok(out)
    }

    fn post_process(&self, ids: Vec<u32>) -> Result<Vec<u32>, RequestError> {
        if self.tokenizer.get_post_processor().is_none() {
            return Ok(ids);
        }
        let tokens = ids
            .into_iter()
            .map(|id| Token::new(id, String::new(), (0, 0)))
            .collect();
        let enc = Encoding::from_tokens(tokens, 0);
        let enc = self
            .tokenizer
            .post_process(enc, None, true)
            .map_err(tokenizer_error)?;
        Ok(enc.get_ids().to_vec())
    }
}

/// The largest char boundary of `s` at or below `max` (at least one char, so progress is made).
fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut i = max;
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    if i == 0 {
        s.chars().next().map_or(s.len(), char::len_utf8)
    } else {
        i
    }
}

/// Appends transformers' continuation tag to the final message's content and returns the
/// content as it was (for the check after rendering).
fn tag_final_message(
    messages: &mut [Value],
    template_source: &str,
) -> Result<String, RequestError> {
    let invalid = |reason: &str| RequestError::InvalidField {
        field: "continue_final_message".into(),
        reason: reason.into(),
    };
    if !template_source.contains("content") {
        return Err(invalid("the chat template does not use message content"));
    }
    let last = messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .ok_or_else(|| invalid("the conversation is empty"))?;
    match last.get_mut("content") {
        Some(Value::String(s)) => {
            let original = s.clone();
            s.push_str(CONTINUE_FINAL_MESSAGE_TAG);
            Ok(original)
        }
        Some(Value::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Value::String(text)) = part.get_mut("text") {
                    let original = text.clone();
                    text.push_str(CONTINUE_FINAL_MESSAGE_TAG);
                    return Ok(original);
                }
            }
            Err(invalid("the final message has no text to continue"))
        }
        _ => Err(invalid("the final message has no content to continue")),
    }
}

/// transformers' cut of the rendered chat at the continuation tag.
fn cut_at_tag(rendered: String, final_message: &str) -> Result<String, RequestError> {
    let tag = CONTINUE_FINAL_MESSAGE_TAG.trim_matches(py_is_space);
    let final_stripped = final_message.trim_matches(py_is_space);
    if !rendered.contains(final_stripped) || !rendered.contains(tag) {
        return Err(RequestError::InvalidField {
            field: "continue_final_message".into(),
            reason: "the final message does not appear in the rendered chat".into(),
        });
    }
    let loc = rendered.rfind(tag).unwrap_or(0);
    let mut out = rendered;
    if out[loc..].starts_with(CONTINUE_FINAL_MESSAGE_TAG) {
        out.truncate(loc);
    } else {
        out.truncate(loc);
        let kept = out.trim_end_matches(py_is_space).len();
        out.truncate(kept);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_at_tag_like_transformers() {
        let r = format!("<s>user: hi{CONTINUE_FINAL_MESSAGE_TAG}</s>");
        assert_eq!(cut_at_tag(r, "hi").expect("ok"), "<s>user: hi");
        // A template that strips the message drops the tag's trailing space: cut and rstrip.
        let r = "<s>user: hi  CONTINUE_FINAL_MESSAGE_TAG</s>".to_owned();
        assert_eq!(cut_at_tag(r, "hi  ").expect("ok"), "<s>user: hi");
        assert!(cut_at_tag("nothing".into(), "hi").is_err());
    }

    #[test]
    fn model_tokenizer_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<ModelTokenizer>();
    }
}
