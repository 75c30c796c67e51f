//! Splits text into pieces that tokenise independently, so each piece can be cached.
//!
//! Two cuts keep tokenisation exact:
//!
//! 1. **Added tokens.** Hugging Face tokenizers first extract added tokens whose `normalized` flag
//!    is false (leftmost-longest match over the raw text), then run normaliser, pre-tokeniser and
//!    model on each remaining span separately. Cutting at the same matches (same automaton kind
//!    as the tokenizers crate: leftmost-longest; here the `aho-corasick` crate, whose prefilter
//!    skips to the bytes a token can start with) gives the same spans. This is only
//!    done when none of those tokens has `lstrip`, `rstrip` or `single_word`, which make a match
//!    reach into its neighbours.
//! 2. **Line starts, for known pre-tokenisers.** For the byte-level BPE pre-tokeniser of the
//!    GPT-4 / Qwen2 / Qwen3 / Llama 3 family (a `Split` on one of the regexes in
//!    [`LINE_SAFE_SPLIT_REGEXES`], then `ByteLevel` without prefix space or its own regex; NFC or
//!    no normaliser), no pre-token contains a `\n` followed by a non-whitespace character: every
//!    alternative of the regex either cannot contain `\n`, or ends at the last `\n` of a run. NFC
//!    never composes across `\n`. So a span can be cut just after such a `\n`. Cuts are made once
//!    a chunk holds at least `min_chunk_bytes`, deciding only from text before the cut, so two
//!    texts that share a prefix are chunked identically over that prefix.

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

/// Pre-tokeniser regexes under which a cut after `"\n"` before a non-whitespace char is exact.
pub(crate) const LINE_SAFE_SPLIT_REGEXES: [&str; 2] = [
    // Qwen2, Qwen2.5, Qwen3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Llama 3, GPT-4 (cl100k)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// The added tokens cut at: a matcher over their contents and their ids, by pattern index.
struct AddedTokens {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

/// One piece of text: a span to tokenise, or an added token already identified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Text that tokenises independently of its neighbours.
    Text(&'a str),
    /// An added token's id.
    Added(u32),
}

/// How a model's text may be cut.
pub(crate) struct Segmenter {
    /// Non-normalised added tokens, when cutting at them is exact.
    added: Option<AddedTokens>,
    /// Minimum chunk size for line cuts, when they are exact for this tokenizer.
    line_chunk_bytes: Option<usize>,
}

impl std::fmt::Debug for Segmenter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segmenter")
            .field("added_token_cuts", &self.added.is_some())
            .field("line_chunk_bytes", &self.line_chunk_bytes)
            .finish()
    }
}

impl Segmenter {
    /// Decides from the parsed `tokenizer.json` which cuts are exact. `min_chunk_bytes == 0`
    /// turns line cuts off.
    pub(crate) fn from_tokenizer_json(tokenizer_json: &Value, min_chunk_bytes: usize) -> Self {
        let added = added_token_matcher(tokenizer_json);
        let line_chunk_bytes =
            (min_chunk_bytes > 0 && added.is_some() && line_cuts_are_exact(tokenizer_json))
                .then_some(min_chunk_bytes);
        Self {
            added,
            line_chunk_bytes,
        }
    }

    /// Whether this segmenter cuts at anything at all.
    pub(crate) fn cuts(&self) -> bool {
        self.added.is_some()
    }

    /// Whether line cuts are on.
    pub(crate) fn line_cuts(&self) -> bool {
        self.line_chunk_bytes.is_some()
    }

    /// Cuts `text` into pieces, calling `f` on each in order.
    pub(crate) fn split<'a>(&self, text: &'a str, mut f: impl FnMut(Piece<'a>)) {
        let Some(added) = &self.added else {
            if !text.is_empty() {
                f(Piece::Text(text));
            }
            return;
        };
        let mut start = 0;
        for m in added.matcher.find_iter(text) {
            if m.start() > start {
                self.chunk(&text[start..m.start()], &mut f);
            }
            f(Piece::Added(added.ids[m.pattern().as_usize()]));
            start = m.end();
        }
        if start < text.len() {
            self.chunk(&text[start..], &mut f);
        }
    }

    fn chunk<'a>(&self, span: &'a str, f: &mut impl FnMut(Piece<'a>)) {
        let Some(min) = self.line_chunk_bytes else {
            f(Piece::Text(span));
            return;
        };
        let mut chunk_start = 0;
        // A cut at `p` needs `p - chunk_start >= min`, so look for the "\n" at `p - 1` from there.
        while chunk_start + min < span.len() {
            let Some(cut) = find_line_start(span, chunk_start + min - 1) else {
                break;
            };
            f(Piece::Text(&span[chunk_start..cut]));
            chunk_start = cut;
        }
        if chunk_start < span.len() {
            f(Piece::Text(&span[chunk_start..]));
        }
    }
}

/// The first position at or after `from` that follows a `"\n"` and holds a non-whitespace char.
fn find_line_start(span: &str, from: usize) -> Option<usize> {
    let bytes = span.as_bytes();
    let mut i = from;
    while i < bytes.len() {
        let rel = memchr::memchr(b'\n', &bytes[i..])?;
        let cut = i + rel + 1;
        if cut >= bytes.len() {
            return None;
        }
        if span[cut..]
            .chars()
            .next()
            .is_some_and(|c| !c.is_whitespace())
        {
            return Some(cut);
        }
        i = cut;
    }
    None
}

/// A leftmost-longest matcher over the added tokens matched on raw text, or `None` when cutting
/// at them would not be exact (or the model has none).
fn added_token_matcher(tokenizer_json: &Value) -> Option<AddedTokens> {
    let tokens = tokenizer_json.get("added_tokens")?.as_array()?;
    let mut patterns: Vec<(String, u32)> = Vec::new();
    for t in tokens {
        let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
        let content = t.get("content").and_then(Value::as_str)?;
        let id = u32::try_from(t.get("id").and_then(Value::as_u64)?).ok()?;
        // `normalized` defaults to true for non-special tokens in tokenizers; absent means unknown.
        let normalized = t
            .get("normalized")
            .and_then(Value::as_bool)
            .unwrap_or(!flag("special"));
        if normalized {
            continue;
        }
        if flag("lstrip") || flag("rstrip") || flag("single_word") || content.is_empty() {
            return None;
        }
        patterns.push((content.to_owned(), id));
    }
    if patterns.is_empty() {
        return None;
    }
    // Two tokens with one content: which one the tokenizer picks is not this module's to guess.
    let mut contents: Vec<&str> = patterns.iter().map(|(c, _)| c.as_str()).collect();
    contents.sort_unstable();
    if contents.windows(2).any(|w| w[0] == w[1]) {
        return None;
    }
    let matcher = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(patterns.iter().map(|(c, _)| c))
        .ok()?;
    Some(AddedTokens {
        matcher,
        ids: patterns.into_iter().map(|(_, id)| id).collect(),
    })
}

/// Whether the pipeline is one for which line cuts are proven exact (see the module docs).
pub(crate) fn line_cuts_are_exact(tokenizer_json: &Value) -> bool {
    let normalizer_ok = match tokenizer_json.get("normalizer") {
        None | Some(Value::Null) => true,
        Some(n) => n.get("type").and_then(Value::as_str) == Some("NFC"),
    };
    let model_ok = tokenizer_json.get("model").is_some_and(|m| {
        m.get("type").and_then(Value::as_str) == Some("BPE")
            && m.get("dropout").is_none_or(Value::is_null)
    });
    let pre_ok = tokenizer_json.get("pre_tokenizer").is_some_and(|p| {
        if p.get("type").and_then(Value::as_str) != Some("Sequence") {
            return false;
        }
        let Some(list) = p.get("pretokenizers").and_then(Value::as_array) else {
            return false;
        };
        let [split, byte_level] = list.as_slice() else {
            return false;
        };
        let split_ok = split.get("type").and_then(Value::as_str) == Some("Split")
            && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
            && split.get("invert").and_then(Value::as_bool) == Some(false)
            && split
                .get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(Value::as_str)
                .is_some_and(|r| LINE_SAFE_SPLIT_REGEXES.contains(&r));
        let bl_ok = byte_level.get("type").and_then(Value::as_str) == Some("ByteLevel")
            && byte_level.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
            && byte_level.get("use_regex").and_then(Value::as_bool) == Some(false);
        split_ok && bl_ok
    });
    normalizer_ok && model_ok && pre_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen_like() -> Value {
        json!({
            "added_tokens": [
                {"id": 1, "content": "<|im_start|>", "special": true, "lstrip": false, "rstrip": false, "single_word": false, "normalized": false},
                {"id": 2, "content": "<|im_end|>", "special": true, "lstrip": false, "rstrip": false, "single_word": false, "normalized": false},
                {"id": 3, "content": "<think>", "special": false, "lstrip": false, "rstrip": false, "single_word": false, "normalized": false}
            ],
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LINE_SAFE_SPLIT_REGEXES[0]}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]},
            "model": {"type": "BPE", "dropout": null}
        })
    }

    fn pieces(seg: &Segmenter, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        seg.split(text, |p| {
            out.push(match p {
                Piece::Text(t) => t.to_owned(),
                Piece::Added(id) => format!("#{id}"),
            })
        });
        out
    }

    #[test]
    fn cuts_at_added_tokens() {
        let seg = Segmenter::from_tokenizer_json(&qwen_like(), 0);
        assert!(!seg.line_cuts());
        assert_eq!(
            pieces(&seg, "<|im_start|>user\nhi<think><|im_end|>\n"),
            vec!["#1", "user\nhi", "#3", "#2", "\n"]
        );
    }

    #[test]
    fn line_cuts_only_before_text_and_after_min() {
        let seg = Segmenter::from_tokenizer_json(&qwen_like(), 4);
        assert!(seg.line_cuts());
        assert_eq!(
            pieces(&seg, "ab\ncdef\n\n  gh\nij\n"),
            vec!["ab\ncdef\n\n  gh\n", "ij\n"]
        );
        assert_eq!(pieces(&seg, "abcdef\nx"), vec!["abcdef\n", "x"]);
        // The text is the concatenation of the pieces, whatever the input.
        let text = "x\n\ny\n z\nw\n\n\nq\n";
        for min in 1..8 {
            let seg = Segmenter::from_tokenizer_json(&qwen_like(), min);
            assert_eq!(pieces(&seg, text).concat(), text);
        }
    }

    #[test]
    fn flags_disable_cuts() {
        let mut j = qwen_like();
        j["added_tokens"][0]["lstrip"] = json!(true);
        let seg = Segmenter::from_tokenizer_json(&j, 4);
        assert!(!seg.cuts() && !seg.line_cuts());
        let mut j = qwen_like();
        j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true);
        assert!(!Segmenter::from_tokenizer_json(&j, 4).line_cuts());
    }
}
