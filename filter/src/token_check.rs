//! The online check's wire logic (pure; no host calls): which requests are sampled, asking the
//! engine for the prompt's token ids (vLLM's `return_token_ids`, vLLM >= 0.10.2), reading them
//! back from the response and taking out what was added so the client's response is unchanged.
//!
//! Where vLLM puts the ids (its `protocol.py`):
//!
//! | endpoint           | prompt ids                                  | output ids (also removed) |
//! |--------------------|---------------------------------------------|---------------------------|
//! | chat, whole body   | top-level `prompt_token_ids`                | `choices[].token_ids`     |
//! | chat, stream       | `prompt_token_ids` of the first chunk       | `choices[].token_ids`     |
//! | completions, both  | `choices[].prompt_token_ids` (first chunk)  | `choices[].token_ids`     |
//!
//! vLLM writes a whole body with `model_dump()` (unset fields as `null`) and stream chunks with
//! `exclude_unset` (unset fields absent): the fields the filter added become `null` in a whole
//! body and disappear from a chunk, which is what the engine sends when not asked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde_json::{Map, Value};

use kvroute_core::request::Endpoint;

/// Online check settings (`token_check` in the plugin configuration).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenCheckConfig {
    /// Check one routed request in this many (per model, per plugin: one per VM in the proxy-wasm
    /// build); 0 turns the check off.
    pub sample_one_in: u64,
    /// Also check each of a model's first requests (per plugin, after each tokenizer load).
    pub first_requests: u64,
    /// Longest prompt checked, in tokens: the engine's answer carries the ids (~6 bytes each),
    /// and a whole body is held until its end to take them out.
    pub max_prompt_tokens: usize,
    /// Largest response held or a stream event buffered while taking the ids out (bytes); a
    /// larger one is passed on as it is and the check is dropped.
    pub max_response_bytes: usize,
}

impl Default for TokenCheckConfig {
    fn default() -> Self {
        Self {
            sample_one_in: 1000,
            first_requests: 8,
            max_prompt_tokens: 8192,
            max_response_bytes: 1024 * 1024,
        }
    }
}

/// A model's check state in one plugin (shared by its streams, so atomic).
#[derive(Debug, Default)]
pub struct ModelCheckState {
    /// Routable requests seen (sampling counter).
    seen: AtomicU64,
    /// An online check found the engine's tokens differ: the model fails open.
    mismatch: AtomicBool,
}

impl ModelCheckState {
    /// Whether this request is checked: each of the first `first_requests`, then one in
    /// `sample_one_in`.
    pub fn sample(&self, cfg: &TokenCheckConfig) -> bool {
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        if cfg.sample_one_in == 0 {
            return false;
        }
        n < cfg.first_requests || n.is_multiple_of(cfg.sample_one_in)
    }

    /// Marks the model's tokens as differing from the engine's.
    pub fn set_mismatch(&self) {
        self.mismatch.store(true, Ordering::Relaxed);
    }

    /// The model's tokens differ from the engine's.
    pub fn mismatch(&self) -> bool {
        self.mismatch.load(Ordering::Relaxed)
    }
}

/// The endpoint's name in reports.
pub fn endpoint_name(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::ChatCompletions => "chat",
        Endpoint::Completions => "completions",
    }
}

/// The client already asked for the ids: read them, take nothing out.
pub fn client_asked(body: &Value) -> bool {
    body.get("return_token_ids").and_then(Value::as_bool) == Some(true)
}

/// `body` with `"return_token_ids": true` (`None` when it is not a JSON object).
pub fn add_return_token_ids(body: &[u8]) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("return_token_ids".into(), Value::Bool(true));
    serde_json::to_vec(&v).ok()
}

/// Takes the ids out of one response object (a whole body or a stream chunk). Returns the prompt
/// ids when the object carries them; with `strip`, the added fields are set to `null`
/// (`nulls`) or removed.
fn take_ids(obj: &mut Map<String, Value>, strip: bool, nulls: bool) -> Option<Vec<u32>> {
    fn ids(v: &Value) -> Option<Vec<u32>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    }
    fn clear(o: &mut Map<String, Value>, key: &str, nulls: bool) {
        if nulls {
            if let Some(v) = o.get_mut(key) {
                *v = Value::Null;
            }
        } else {
            o.remove(key);
        }
    }
    let mut prompt = obj.get("prompt_token_ids").and_then(ids);
    if strip {
        clear(obj, "prompt_token_ids", nulls);
    }
    if let Some(Value::Array(choices)) = obj.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            if prompt.is_none() {
                prompt = choice.get("prompt_token_ids").and_then(ids);
            }
            if strip {
                clear(choice, "prompt_token_ids", nulls);
                clear(choice, "token_ids", nulls);
            }
        }
    }
    prompt
}

/// A whole JSON response: the prompt ids it carries, and the body to send on (`None`: unchanged).
pub fn take_from_body(body: &[u8], strip: bool) -> (Option<Vec<u32>>, Option<Vec<u8>>) {
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(body) else {
        return (None, None);
    };
    let prompt = take_ids(&mut obj, strip, true);
    let out = strip
        .then(|| serde_json::to_vec(&Value::Object(obj)).ok())
        .flatten();
    (prompt, out)
}

/// A server-sent-event stream, event by event: takes the prompt ids from the chunk that carries
/// them and (with `strip`) the added fields out of every chunk. Holds at most one incomplete
/// event (bounded by `max_event_bytes`).
#[derive(Debug)]
pub struct StreamIds {
    strip: bool,
    max_event_bytes: usize,
    pending: Vec<u8>,
    prompt: Option<Vec<u32>>,
    /// An event exceeded the bound: everything after it passes unchanged, the check is off.
    gave_up: bool,
}

impl StreamIds {
    /// A stream reader.
    pub fn new(strip: bool, max_event_bytes: usize) -> Self {
        Self {
            strip,
            max_event_bytes,
            pending: Vec::new(),
            prompt: None,
            gave_up: false,
        }
    }

    /// The prompt ids seen (`None` also when the reader gave up).
    pub fn prompt_ids(&self) -> Option<&[u32]> {
        self.prompt.as_deref().filter(|_| !self.gave_up)
    }

    /// Takes a chunk; returns the bytes to send on now (complete events, rewritten). At the end
    /// of the stream everything held is returned.
    pub fn push(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        if self.gave_up {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        let pending = std::mem::take(&mut self.pending);
        let mut out = Vec::with_capacity(pending.len());
        let mut start = 0;
        while let Some(len) = event_end(&pending[start..]) {
            out.extend_from_slice(&self.rewrite_event(&pending[start..start + len]));
            start += len;
        }
        self.pending = pending[start..].to_vec();
        if end || self.pending.len() > self.max_event_bytes {
            if !end {
                self.gave_up = true;
            }
            out.append(&mut self.pending);
        }
        out
    }

    /// One event (with its terminating blank line): `data:` lines holding a JSON object are
    /// read and, with `strip`, rewritten.
    fn rewrite_event(&mut self, event: &[u8]) -> Vec<u8> {
        let Ok(text) = std::str::from_utf8(event) else {
            return event.to_vec();
        };
        let mut out = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            let body = line.trim_end_matches(['\n', '\r']);
            let ending = &line[body.len()..];
            let Some(data) = body.strip_prefix("data:") else {
                out.push_str(line);
                continue;
            };
            let json = data.strip_prefix(' ').unwrap_or(data);
            match serde_json::from_str::<Value>(json) {
                Ok(Value::Object(mut obj)) => {
                    let prompt = take_ids(&mut obj, self.strip, false);
                    if self.prompt.is_none() {
                        self.prompt = prompt;
                    }
                    if self.strip {
                        out.push_str("data: ");
                        out.push_str(&Value::Object(obj).to_string());
                        out.push_str(ending);
                    } else {
                        out.push_str(line);
                    }
                }
                _ => out.push_str(line),
            }
        }
        out.into_bytes()
    }
}

/// Length of the first complete event in `buf` (through its blank line), if any.
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sampling_takes_the_first_requests_then_one_in_n() {
        let cfg = TokenCheckConfig {
            sample_one_in: 10,
            first_requests: 3,
            ..TokenCheckConfig::default()
        };
        let s = ModelCheckState::default();
        let picked: Vec<u64> = (0..25).filter(|_| s.sample(&cfg)).collect();
        assert_eq!(picked.len(), 5, "0, 1, 2, 10, 20");
        let off = TokenCheckConfig {
            sample_one_in: 0,
            ..cfg
        };
        assert!(!ModelCheckState::default().sample(&off));
    }

    #[test]
    fn chat_bodies_give_their_ids_and_are_restored() {
        let body = json!({"id": "c", "choices": [{"index": 0, "message": {"content": "hi"},
            "token_ids": [7, 8]}], "usage": {"prompt_tokens": 3}, "prompt_token_ids": [1, 2, 3]});
        let (ids, out) = take_from_body(body.to_string().as_bytes(), true);
        assert_eq!(ids, Some(vec![1, 2, 3]));
        let out: Value = serde_json::from_slice(&out.expect("rewritten")).expect("json");
        assert_eq!(out["prompt_token_ids"], Value::Null);
        assert_eq!(out["choices"][0]["token_ids"], Value::Null);
        assert_eq!(out["usage"]["prompt_tokens"], 3);
        let (ids, out) = take_from_body(body.to_string().as_bytes(), false);
        assert_eq!((ids.map(|i| i.len()), out), (Some(3), None), "client asked");
    }

    #[test]
    fn completion_streams_lose_the_fields_event_by_event() {
        let first = json!({"choices": [{"index": 0, "text": "a", "prompt_token_ids": [5, 6],
            "token_ids": [9]}]});
        let second = json!({"choices": [{"index": 0, "text": "b", "token_ids": [10]}]});
        let stream = format!("data: {first}\n\ndata: {second}\n\ndata: [DONE]\n\n");
        let mut s = StreamIds::new(true, 1 << 20);
        let (a, b) = stream.as_bytes().split_at(17);
        let mut out = s.push(a, false);
        assert!(out.is_empty(), "an incomplete event is held");
        out.extend(s.push(b, true));
        assert_eq!(s.prompt_ids(), Some(&[5u32, 6][..]));
        let text = String::from_utf8(out).expect("utf8");
        assert!(!text.contains("token_ids"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert_eq!(text.matches("\n\n").count(), 3);
    }

    #[test]
    fn an_oversized_event_passes_unchanged_and_ends_the_check() {
        let mut s = StreamIds::new(true, 8);
        let out = s.push(b"data: {\"prompt_token_ids\": [1]", false);
        assert_eq!(out, b"data: {\"prompt_token_ids\": [1]");
        assert_eq!(s.push(b"}\n\n", true), b"}\n\n");
        assert_eq!(s.prompt_ids(), None);
    }

    #[test]
    fn injection_adds_the_flag() {
        let out = add_return_token_ids(br#"{"model":"m","prompt":"x"}"#).expect("object");
        let v: Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["return_token_ids"], true);
        assert!(client_asked(&v));
        assert!(add_return_token_ids(b"[1]").is_none());
    }
}
