//! A faster exact route from a text piece to token ids for the byte-level BPE family of
//! [`super::segmenter::LINE_SAFE_SPLIT_REGEXES`] (Qwen2/3, Llama 3, GPT-4 style).
//!
//! The tokenizers crate runs such a pipeline as normaliser (NFC or none), a `Split` on the
//! regex (`Isolated`), `ByteLevel` (bytes to the GPT-2 alphabet) and the BPE model, tracking
//! alignments of every byte through each step; its regex engine (fancy-regex, needed for the
//! `\s+(?!\S)` lookahead) took ~1.5 us per token natively, over half the tokenizer's time
//! (`core/examples/latency_stages.rs`). This module computes the same pre-tokens with the
//! `regex` crate and no alignments, then calls the same BPE model on each:
//!
//! * The regex is the model's with its last two alternatives `\s+(?!\S)|\s+` replaced by `\s+`.
//!   The alternatives before are identical, so both regexes start a match at the same places and
//!   agree whenever an earlier alternative matches (leftmost-first, as a backtracking engine).
//!   Otherwise the match is a run of whitespace holding no `\r`/`\n` (every earlier alternative
//!   needs a letter, a number, a non-space char or a line break), and the original regex takes
//!   the run less its last char when the run has two chars or more and a char follows it (the
//!   lookahead fails at the run's end, which is followed by `\S`, and holds one char earlier),
//!   else the whole run. That fix-up is applied here.
//! * Text between matches (none exists for these regexes, which match every char) would be a
//!   pre-token of its own, as `Isolated` keeps it.
//! * NFC runs through the tokenizer's own normaliser, and only on pieces that are not ASCII
//!   (ASCII text is NFC already).
//!
//! A piece must hold no added token: [`super::segmenter`] cuts at every one, and this encoder
//! is only built when no added token is matched after normalisation. The parity tests compare
//! its ids with the tokenizer's own on the whole text.

use regex::Regex;
use serde_json::Value;
use tokenizers::{Model, NormalizedString, Normalizer, Tokenizer};

use super::segmenter::{line_cuts_are_exact, LINE_SAFE_SPLIT_REGEXES};
use super::RequestError;

/// The tail of every regex in [`LINE_SAFE_SPLIT_REGEXES`] that needs a lookahead.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// Encodes text pieces (no added tokens inside) exactly like the tokenizer, faster.
#[derive(Debug)]
pub(crate) struct PieceEncoder {
    /// The pre-tokeniser's regex without its lookahead (see the module docs).
    split: Regex,
    /// Whether the tokenizer has a normaliser (NFC: the only one accepted).
    normalizes: bool,
}

impl PieceEncoder {
    /// The encoder for this `tokenizer.json`, when its pipeline is one this module reproduces
    /// exactly and every added token is matched on raw text (so pieces cut at them are exact).
    pub(crate) fn from_tokenizer_json(tokenizer_json: &Value) -> Option<Self> {
        if !line_cuts_are_exact(tokenizer_json) || has_normalized_added_tokens(tokenizer_json) {
            return None;
        }
        let pattern = tokenizer_json
            .pointer("/pre_tokenizer/pretokenizers/0/pattern/Regex")
            .and_then(Value::as_str)?;
        debug_assert!(LINE_SAFE_SPLIT_REGEXES.contains(&pattern));
        let head = pattern.strip_suffix(LOOKAHEAD_TAIL)?;
        let split = Regex::new(&format!(r"{head}|\s+")).ok()?;
        let normalizes = !tokenizer_json.get("normalizer").is_none_or(Value::is_null);
        Some(Self { split, normalizes })
    }

    /// Appends the ids of `piece` (which holds no added token) to `out`; `tokenizer` is the
    /// one whose `tokenizer.json` built this encoder.
    pub(crate) fn encode(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), RequestError> {
        let normalized;
        let text = match tokenizer.get_normalizer() {
            Some(normalizer) if self.normalizes && !piece.is_ascii() => {
                let mut n = NormalizedString::from(piece);
                normalizer
                    .normalize(&mut n)
                    .map_err(|e| RequestError::Tokenizer(e.to_string()))?;
                normalized = n.get().to_owned();
                normalized.as_str()
            }
            _ => piece,
        };
        let model = tokenizer.get_model();
        let mut word = String::new();
        let mut bpe = |pre_token: &str| -> Result<(), RequestError> {
            word.clear();
            word.extend(pre_token.bytes().map(byte_char));
            let tokens = model
                .tokenize(&word)
                .map_err(|e| RequestError::Tokenizer(e.to_string()))?;
            out.extend(tokens.iter().map(|t| t.id));
            Ok(())
        };
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.split.find_at(text, pos) else {
                bpe(&text[pos..])?;
                break;
            };
            if m.start() > pos {
                bpe(&text[pos..m.start()])?;
            }
            let end = lookahead_end(text, m.start(), m.end());
            bpe(&text[m.start()..end])?;
            pos = end;
        }
        Ok(())
    }
}

/// Where the original regex's match ends, given the lookahead-free regex's match `start..end`
/// (see the module docs).
fn lookahead_end(text: &str, start: usize, end: usize) -> usize {
    let run = &text[start..end];
    if end == text.len()
        || !run
            .chars()
            .all(|c| c.is_whitespace() && c != '\r' && c != '\n')
    {
        return end;
    }
    match run.chars().next_back() {
        Some(last) if run.len() > last.len_utf8() => end - last.len_utf8(),
        _ => end,
    }
}

/// Whether an added token is matched after normalisation (`normalized`, which defaults to true
/// for non-special tokens): such a token could hide inside a piece.
fn has_normalized_added_tokens(tokenizer_json: &Value) -> bool {
    let Some(tokens) = tokenizer_json.get("added_tokens").and_then(Value::as_array) else {
        return false;
    };
    tokens.iter().any(|t| {
        let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
        t.get("normalized")
            .and_then(Value::as_bool)
            .unwrap_or(!special)
    })
}

/// GPT-2's byte-to-char map (the `ByteLevel` alphabet): printable Latin-1 bytes map to
/// themselves, the other 68 to U+0100.. in byte order.
const fn byte_char(b: u8) -> char {
    const TABLE: [char; 256] = {
        let mut table = ['\0'; 256];
        let mut next = 0x100u32;
        let mut b = 0usize;
        while b < 256 {
            let printable = matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
            let code = if printable {
                b as u32
            } else {
                next += 1;
                next - 1
            };
            table[b] = match char::from_u32(code) {
                Some(c) => c,
                None => '\0',
            };
            b += 1;
        }
        table
    };
    TABLE[b as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    #[test]
    fn byte_chars_are_the_byte_level_alphabet() {
        let ours: std::collections::BTreeSet<char> = (0..=255u8).map(byte_char).collect();
        let theirs: std::collections::BTreeSet<char> = ByteLevel::alphabet().into_iter().collect();
        assert_eq!(ours.len(), 256);
        assert_eq!(ours, theirs);
        assert_eq!(byte_char(b' '), '\u{120}');
        assert_eq!(byte_char(b'\n'), '\u{10a}');
        assert_eq!(byte_char(b'a'), 'a');
    }

    #[test]
    fn lookahead_fix_up() {
        // "a   b": the run before "b" gives up its last space.
        assert_eq!(lookahead_end("a   b", 1, 4), 3);
        // One space before a word stays (the `\s+` alternative).
        assert_eq!(lookahead_end("a b", 1, 2), 2);
        // At the end of the text the whole run.
        assert_eq!(lookahead_end("a   ", 1, 4), 4);
        // A line break run is another alternative's.
        assert_eq!(lookahead_end("a \n b", 1, 3), 3);
        // Multi-byte whitespace gives up one char, not one byte.
        assert_eq!(lookahead_end("a \u{3000}b", 1, 5), 2);
    }
}
