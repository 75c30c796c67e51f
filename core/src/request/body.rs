//! A request body parsed for routing, with a fast path for the one shape that is mostly
//! numbers: a `/v1/completions` prompt given as a single list of token ids (RL rollouts, agent
//! frameworks that tokenise themselves, the benchmark's replay).
//!
//! Parsed into a `serde_json::Value`, a 48k-token id list is 48k `Value`s built, copied into ids
//! and dropped: 1.4-1.6 ms for its 300 KB natively (serde_json reads such a list at ~250 MB/s;
//! docs/performance.md, "Token-id prompts"). Here a scan of the body's top level finds the
//! `prompt` member's list ([`member_list_span`]), [`token_id_list`] reads it eight bytes at a
//! time, and the rest of the body (with the list cut out) is parsed into a `Value` as before:
//! ~0.4 ms. Whatever is not that shape exactly (text, a batch, a float, a negative number, an id
//! above `u32`, an escaped or repeated `prompt` key, JSON the rest parse refuses) takes the
//! `Value` path, so the results and errors are always those of [`super::parse_body`].

use memchr::{memchr, memchr2};
use serde_json::Value;

use super::error::RequestError;
use super::prompt::{parse_body, Endpoint};

/// A request body: every member as a `Value`, except a completion's token-id prompt, kept as ids.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestBody {
    /// The body's members; without `prompt` when [`Self::prompt_ids`] holds it.
    fields: Value,
    /// A `/v1/completions` prompt that was one list of token ids.
    prompt_ids: Option<Vec<u32>>,
}

impl RequestBody {
    /// Parses a body sent to `endpoint`: malformed JSON is [`RequestError::NotJson`], JSON that is
    /// not an object [`RequestError::NotAnObject`].
    pub fn parse(bytes: &[u8], endpoint: Endpoint) -> Result<Self, RequestError> {
        if endpoint == Endpoint::Completions {
            if let Some(body) = Self::with_token_id_prompt(bytes) {
                return Ok(body);
            }
        }
        let fields = parse_body(bytes)?;
        if !fields.is_object() {
            return Err(RequestError::NotAnObject);
        }
        Ok(Self::from_value(fields))
    }

    /// A body whose members are all in `fields` (tests, callers that built a `Value`).
    pub fn from_value(fields: Value) -> Self {
        Self {
            fields,
            prompt_ids: None,
        }
    }

    /// The members, without `prompt` when [`Self::prompt_ids`] is `Some`: read the prompt
    /// through [`super::ModelTokenizer::tokenize_body_capped`], and rebuild the whole body
    /// with [`Self::to_value`].
    pub fn fields(&self) -> &Value {
        &self.fields
    }

    /// The completion prompt's token ids, when the body gave it as one list of ids.
    pub fn prompt_ids(&self) -> Option<&[u32]> {
        self.prompt_ids.as_deref()
    }

    /// The whole body as one `Value` (the prompt's ids put back, as its last member): for
    /// re-serialising it.
    pub fn to_value(&self) -> Value {
        let mut whole = self.fields.clone();
        if let (Some(ids), Some(obj)) = (&self.prompt_ids, whole.as_object_mut()) {
            obj.insert("prompt".into(), Value::from(ids.clone()));
        }
        whole
    }

    /// The fast path: `None` unless the body is an object whose one `prompt` is a plain id list.
    fn with_token_id_prompt(bytes: &[u8]) -> Option<Self> {
        let (start, end) = member_list_span(bytes, b"prompt")?;
        let ids = token_id_list(&bytes[start..end])?;
        let mut rest = Vec::with_capacity(bytes.len() - (end - start) + 4);
        rest.extend_from_slice(&bytes[..start]);
        rest.extend_from_slice(b"null");
        rest.extend_from_slice(&bytes[end..]);
        let mut fields: Value = serde_json::from_slice(&rest).ok()?;
        // The placeholder must be the only `prompt` the parse saw (no escaped twin).
        if fields.as_object_mut()?.shift_remove("prompt") != Some(Value::Null) {
            return None;
        }
        Some(Self {
            fields,
            prompt_ids: Some(ids),
        })
    }
}

/// Whether `c` is JSON whitespace.
fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\n' | b'\r' | b'\t')
}

/// Index of the first byte at or after `i` that is not JSON whitespace.
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).copied().is_some_and(is_ws) {
        i += 1;
    }
    i
}

/// The byte span (`[` to `]` included) of the value of the member `key` of the top-level object
/// when that value is a list with no list inside it and `key` is written once, unescaped;
/// `None` otherwise, or when any top-level key is escaped (it could spell `key`). Only strings and
/// brackets are scanned: what the span holds is for [`token_id_list`] to check, the rest for the
/// JSON parser.
pub fn member_list_span(b: &[u8], key: &[u8]) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    let mut found = None;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let start = i + 1;
                let mut escaped = false;
                i = start;
                loop {
                    let j = i + memchr2(b'"', b'\\', &b[i..])?;
                    if b[j] == b'\\' {
                        escaped = true;
                        i = j + 2;
                        if i > b.len() {
                            return None;
                        }
                    } else {
                        i = j + 1;
                        break;
                    }
                }
                if depth != 1 {
                    continue;
                }
                let colon = skip_ws(b, i);
                if b.get(colon) != Some(&b':') {
                    continue;
                }
                if escaped {
                    return None;
                }
                if &b[start..i - 1] == key {
                    if found.is_some() {
                        return None;
                    }
                    let open = skip_ws(b, colon + 1);
                    if b.get(open) != Some(&b'[') {
                        return None;
                    }
                    let close = open + memchr(b']', &b[open..])?;
                    found = Some((open, close + 1));
                    i = close + 1;
                }
            }
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                i += 1;
            }
            _ => i += 1,
        }
    }
    found
}

/// The ids of a JSON list (`[` to `]`, nothing around it) of integers in `0..2^32` written
/// plainly (digits, no sign, fraction, exponent or leading zero), with JSON whitespace between
/// tokens; `None` for anything else, including an empty list. Reads eight bytes at a time.
pub fn token_id_list(list: &[u8]) -> Option<Vec<u32>> {
    let inner = list.strip_prefix(b"[")?.strip_suffix(b"]")?;
    // One id per comma and one more: the exact size, so memory follows the ids, not the bytes
    // (a Wasm VM's linear memory never shrinks).
    let mut ids = Vec::with_capacity(memchr::memchr_iter(b',', inner).count() + 1);
    let mut rest = &inner[skip_ws(inner, 0)..];
    loop {
        let (id, len) = leading_digits(rest)?;
        if len == 0 || (len > 1 && rest[0] == b'0') {
            return None;
        }
        ids.push(id);
        rest = &rest[len..];
        // The separators clients write (`,` and `, `) before the next digit, then the rest.
        rest = match rest {
            [b',', b'0'..=b'9', ..] => &rest[1..],
            [b',', b' ', b'0'..=b'9', ..] => &rest[2..],
            _ => {
                let at = skip_ws(rest, 0);
                match rest.get(at) {
                    None => return Some(ids),
                    Some(b',') => &rest[skip_ws(rest, at + 1)..],
                    Some(_) => return None,
                }
            }
        };
    }
}

/// The value and length of the digits `s` starts with (`None` above `u32::MAX`).
fn leading_digits(s: &[u8]) -> Option<(u32, usize)> {
    if let Some(word) = s.first_chunk::<8>() {
        let x = u64::from_le_bytes(*word);
        // Per byte, less '0': a digit is 0..=9; the high bit of either sum marks a non-digit
        // (below '0' borrows, above '9' carries into bit 7). Bytes after the first non-digit
        // may be garbled by its borrow; only the digits before it are read.
        let less_zero = x.wrapping_sub(0x3030_3030_3030_3030);
        let above_nine = x.wrapping_add(0x4646_4646_4646_4646);
        let non_digits = (less_zero | above_nine) & 0x8080_8080_8080_8080;
        let len = (non_digits.trailing_zeros() / 8) as usize;
        if len < 8 {
            return Some((eight_digit_value(less_zero, len), len));
        }
    }
    let mut value: u64 = 0;
    let mut len = 0;
    for &c in s.iter().take_while(|c| c.is_ascii_digit()) {
        value = value * 10 + u64::from(c - b'0');
        if value > u64::from(u32::MAX) {
            return None;
        }
        len += 1;
    }
    Some((value as u32, len))
}

/// The number written by the first `len` (< 8) bytes of `digits` (ASCII digits less '0', first
/// digit in the lowest byte): shifted so that they end the word (zeros before them), then
/// combined pairwise (Lemire's eight-digit SWAR conversion).
fn eight_digit_value(digits: u64, len: usize) -> u32 {
    if len == 0 {
        return 0;
    }
    let v = digits << (8 * (8 - len));
    let v = (v & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    let v = (v & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32;
    // At most seven digits: below 10^7, so it fits.
    v as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_id_lists_are_read_and_anything_else_is_not() {
        let ok = |t: &str| token_id_list(t.as_bytes());
        assert_eq!(ok("[1,2,3]"), Some(vec![1, 2, 3]));
        assert_eq!(ok("[ 0 ,\n4294967295\t]"), Some(vec![0, u32::MAX]));
        assert_eq!(
            ok("[1234567,12345678,123456789,7]"),
            Some(vec![1_234_567, 12_345_678, 123_456_789, 7])
        );
        for other in [
            "[]",
            "[ ]",
            "[4294967296]",
            "[-1]",
            "[1.0]",
            "[1e3]",
            "[01]",
            "[00]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[\"1\"]",
            "[[1]]",
            "[1]x",
            " [1]",
            "1",
            "",
            "[1",
            "[1,,2]",
            "[99999999999999999999999]",
            "[12345678901]",
            "[1,\u{e9}]",
        ] {
            assert_eq!(ok(other), None, "{other}");
        }
    }

    #[test]
    fn ids_read_eight_bytes_at_a_time_equal_a_plain_parse() {
        let mut n: u64 = 1;
        let ids: Vec<u32> = (0..5000)
            .map(|i| {
                n = n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                // Every length from 1 to 10 digits.
                ((n >> 20) % 10u64.pow(1 + i % 10)).min(u64::from(u32::MAX)) as u32
            })
            .collect();
        let text = serde_json::to_string(&ids).expect("json");
        assert_eq!(token_id_list(text.as_bytes()), Some(ids.clone()));
        // Python's `json.dumps` separators, and separators no client writes.
        for sep in [", ", " ,", " , ", ",\n  "] {
            let spaced = text.replace(',', sep);
            assert_eq!(
                token_id_list(spaced.as_bytes()),
                Some(ids.clone()),
                "{sep:?}"
            );
        }
    }

    #[test]
    fn the_prompt_list_is_found_only_where_it_is_unambiguous() {
        let span = |t: &str| member_list_span(t.as_bytes(), b"prompt");
        let body = r#"{"a":"\"prompt\":[9]","x":{"prompt":[8]},"prompt" : [1,2],"b":[3]}"#;
        let (s, e) = span(body).expect("found");
        assert_eq!(&body[s..e], "[1,2]");
        for other in [
            r#"{"prompt":"text"}"#,
            r#"{"prompt":[1],"prompt":[2]}"#,
            r#"{"pr\u006fmpt":[1],"prompt":[2]}"#,
            r#"["prompt",[1]]"#,
            r#"{"a":[1]}"#,
            r#"{"prompt":[1"#,
            "{\"prompt\":[1],\"a\":\"\\",
        ] {
            assert_eq!(span(other), None, "{other}");
        }
    }

    #[test]
    fn a_completion_id_prompt_is_kept_as_ids_and_the_rest_as_values() {
        let raw = br#"{"model":"m","prompt":[5, 6,7],"max_tokens":3,"x":{"y":[1.5]}}"#;
        let body = RequestBody::parse(raw, Endpoint::Completions).expect("parses");
        assert_eq!(body.prompt_ids(), Some(&[5, 6, 7][..]));
        assert_eq!(body.fields().get("prompt"), None);
        assert_eq!(body.fields()["x"], json!({"y": [1.5]}));
        let whole: Value = serde_json::from_slice(raw).expect("json");
        assert_eq!(body.to_value(), whole);
        // A chat body, and a completion's text prompt, stay whole.
        let chat = RequestBody::parse(raw, Endpoint::ChatCompletions).expect("parses");
        assert_eq!((chat.prompt_ids(), chat.fields()), (None, &whole));
        let text = RequestBody::parse(br#"{"prompt":"hi"}"#, Endpoint::Completions).expect("ok");
        assert_eq!(text.fields(), &json!({"prompt": "hi"}));
    }

    #[test]
    fn repeated_keys_and_bad_bodies_behave_as_the_value_parse() {
        for (raw, prompt) in [
            (&br#"{"prompt":[1],"prompt":[2,3]}"#[..], json!([2, 3])),
            (br#"{"prompt":[1],"prompt":"text"}"#, json!("text")),
            (br#"{"prompt":[1],"pr\u006fmpt":null}"#, Value::Null),
        ] {
            let body = RequestBody::parse(raw, Endpoint::Completions).expect("parses");
            assert_eq!(body.prompt_ids(), None);
            assert_eq!(body.fields()["prompt"], prompt);
        }
        for bad in [
            &b"{\"prompt\":[1,2]"[..],
            b"{\"prompt\":[1,2],}",
            b"{\"prompt\":[1] x}",
        ] {
            assert!(matches!(
                RequestBody::parse(bad, Endpoint::Completions),
                Err(RequestError::NotJson(_))
            ));
        }
        assert!(matches!(
            RequestBody::parse(b"[1,2]", Endpoint::Completions),
            Err(RequestError::NotAnObject)
        ));
    }
}
