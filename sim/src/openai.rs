//! The OpenAI-compatible request parameters the simulator honours and the response bodies it
//! writes, in vLLM 0.33.0's shapes (vllm/entrypoints/openai/*/protocol.py).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::engine::FinishInfo;

/// A vLLM-shaped error response: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// vLLM's error type ("BadRequestError", "NotFoundError", "Bad Request", ...).
    pub kind: &'static str,
    /// Message (never contains prompt text).
    pub message: String,
    /// The offending parameter, if known.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    /// 400 "Bad Request" (vLLM's request-validation shape: malformed JSON, wrong types).
    pub fn validation(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "Bad Request",
            message: message.into(),
            param,
        }
    }

    /// 404 for a model that is not served.
    pub fn unknown_model(model: &str, served: &[String]) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!(
                "The model `{model}` does not exist. Valid aliases: {}.",
                served.join(", ")
            ),
            param: Some("model"),
        }
    }

    /// 500/503 when the engine is gone.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: message.into(),
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Sampling-side parameters the simulator uses.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// Output tokens to generate.
    pub max_tokens: usize,
    /// Stream as SSE.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `seed`, if given.
    pub seed: Option<u64>,
    /// `vllm_xargs.kv_cache_report_mode == "full"`.
    pub report_full: bool,
    /// `session_id` (body, `X-Session-ID` header, or `vllm_xargs.session_id`).
    pub session_id: Option<String>,
    /// `return_token_ids` (vLLM >= 0.10.2): the prompt's and the output's token ids in the answer.
    pub return_token_ids: bool,
}

fn opt_u64(body: &Value, field: &'static str) -> Result<Option<u64>, ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::validation(
                format!("{field}: Input should be a non-negative integer"),
                Some(field),
            )
        }),
    }
}

fn opt_bool(body: &Value, field: &'static str) -> Result<bool, ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::validation(
            format!("{field}: Input should be a valid boolean"),
            Some(field),
        )),
    }
}

/// Reads the parameters; `chat` selects the chat defaults (`max_completion_tokens` first,
/// `default_max_tokens` when absent) versus completions (default 16).
pub fn gen_params(
    body: &Value,
    chat: bool,
    default_max_tokens: usize,
    session_header: Option<&str>,
) -> Result<GenParams, ApiError> {
    let max = if chat {
        match opt_u64(body, "max_completion_tokens")? {
            Some(v) => Some(v),
            None => opt_u64(body, "max_tokens")?,
        }
    } else {
        opt_u64(body, "max_tokens")?
    };
    let max_tokens = match max {
        Some(0) => {
            return Err(ApiError::bad_request(
                "max_tokens must be at least 1, got 0.",
            ))
        }
        Some(v) => usize::try_from(v).unwrap_or(usize::MAX),
        None if chat => default_max_tokens.max(1),
        None => 16,
    };
    if let Some(n) = opt_u64(body, "n")? {
        if n != 1 {
            return Err(ApiError::bad_request("kvroute-sim supports only n = 1"));
        }
    }
    let stream = opt_bool(body, "stream")?;
    let return_token_ids = opt_bool(body, "return_token_ids")?;
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let seed = match body.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .map(|x| x as u64)
                .or_else(|| v.as_u64())
                .ok_or_else(|| {
                    ApiError::validation("seed: Input should be a valid integer", Some("seed"))
                })?,
        ),
    };
    let xargs = body.get("vllm_xargs");
    if let Some(x) = xargs {
        if !x.is_object() && !x.is_null() {
            return Err(ApiError::validation(
                "vllm_xargs: Input should be a valid dictionary",
                Some("vllm_xargs"),
            ));
        }
    }
    let report_full = xargs
        .and_then(|x| x.get("kv_cache_report_mode"))
        .and_then(Value::as_str)
        == Some("full");
    let session_id = body
        .get("session_id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .or_else(|| session_header.filter(|s| !s.is_empty()).map(str::to_owned))
        .or_else(|| {
            xargs
                .and_then(|x| x.get("session_id"))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        });
    Ok(GenParams {
        max_tokens,
        stream,
        include_usage,
        seed,
        report_full,
        session_id,
        return_token_ids,
    })
}

/// `usage` with `prompt_tokens_details.cached_tokens`.
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Simulator-only timings (unscaled seconds) and the serving replica's HTTP port, added as
/// `kvroute_sim` to final responses; OpenAI clients ignore unknown fields.
pub fn sim_info(f: &FinishInfo, port: u16) -> Value {
    json!({
        "ttft_s": f.ttft_s,
        "queue_s": f.queue_s,
        "prefill_s": f.prefill_s,
        "port": port,
        "e2e_s": f.e2e_s,
        "engine": f.engine,
        "preemptions": f.preemptions,
        "cached_tokens": f.cached_tokens,
    })
}

/// A non-streaming completion choice.
pub fn completion_choice(index: usize, text: &str) -> Value {
    json!({
        "index": index,
        "text": text,
        "logprobs": null,
        "finish_reason": "length",
        "stop_reason": null,
        "prompt_logprobs": null,
    })
}

/// A non-streaming chat choice.
pub fn chat_choice(text: &str) -> Value {
    json!({
        "index": 0,
        "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                    "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null},
        "logprobs": null,
        "finish_reason": "length",
        "stop_reason": null,
    })
}

/// A streaming completion chunk.
pub fn completion_chunk(
    id: &str,
    created: u64,
    model: &str,
    index: usize,
    text: &str,
    finish: bool,
) -> Value {
    json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": null,
                     "finish_reason": if finish { Value::from("length") } else { Value::Null },
                     "stop_reason": null}],
    })
}

/// Adds the token ids of `return_token_ids` to a stream chunk as vLLM does (only when asked:
/// chunks are written with `exclude_unset`): chat's `prompt_token_ids` at the top of the first
/// chunk, completions' in the first chunk's choice; `token_ids` (the new output ids) in the choice.
pub fn add_token_ids(
    chunk: &mut Value,
    chat: bool,
    prompt: Option<&[u32]>,
    output: Option<&[u32]>,
) {
    if let (true, Some(p)) = (chat, prompt) {
        chunk["prompt_token_ids"] = Value::from(p.to_vec());
    }
    if let Some(choice) = chunk
        .get_mut("choices")
        .and_then(|c| c.get_mut(0))
        .and_then(Value::as_object_mut)
    {
        if let (false, Some(p)) = (chat, prompt) {
            choice.insert("prompt_token_ids".into(), Value::from(p.to_vec()));
        }
        if let Some(o) = output {
            choice.insert("token_ids".into(), Value::from(o.to_vec()));
        }
    }
}

/// The token-id fields of a whole answer's choice (`null` when not asked): completions carry
/// `prompt_token_ids` there (chat carries it at the top of the answer), both `token_ids`.
pub fn add_choice_token_ids(
    choice: &mut Value,
    chat: bool,
    prompt: Option<&[u32]>,
    output: Option<&[u32]>,
) {
    let ids = |v: Option<&[u32]>| v.map_or(Value::Null, |ids| Value::from(ids.to_vec()));
    if let Some(c) = choice.as_object_mut() {
        if !chat {
            c.insert("prompt_token_ids".into(), ids(prompt));
        }
        c.insert("token_ids".into(), ids(output));
    }
}

/// A streaming chat chunk; `role` only on the first.
pub fn chat_chunk(
    id: &str,
    created: u64,
    model: &str,
    text: Option<&str>,
    role: bool,
    finish: bool,
) -> Value {
    let mut delta = serde_json::Map::new();
    if role {
        delta.insert("role".into(), Value::from("assistant"));
    }
    if let Some(t) = text {
        delta.insert("content".into(), Value::from(t));
    }
    json!({
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": null,
                     "finish_reason": if finish { Value::from("length") } else { Value::Null },
                     "stop_reason": null}],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_defaults_and_errors() {
        let p = gen_params(&json!({"prompt": "x"}), false, 99, None).unwrap();
        assert_eq!(p.max_tokens, 16);
        let p = gen_params(&json!({"messages": []}), true, 99, None).unwrap();
        assert_eq!(p.max_tokens, 99);
        let p = gen_params(
            &json!({"max_tokens": 5, "vllm_xargs": {"kv_cache_report_mode": "full", "session_id": "s"}}),
            true,
            99,
            None,
        )
        .unwrap();
        assert!(p.report_full);
        assert_eq!(p.session_id.as_deref(), Some("s"));
        assert_eq!(p.max_tokens, 5);
        assert!(gen_params(&json!({"max_tokens": "a"}), false, 1, None).is_err());
        assert!(gen_params(&json!({"max_tokens": 0}), false, 1, None).is_err());
        let p = gen_params(&json!({"session_id": "b"}), false, 1, Some("h")).unwrap();
        assert_eq!(p.session_id.as_deref(), Some("b"));
    }

    #[test]
    fn error_shape() {
        let e = ApiError::unknown_model("x", &["qwen3".into()]);
        let b = e.body();
        assert_eq!(b["error"]["code"], 404);
        assert_eq!(b["error"]["type"], "NotFoundError");
        assert_eq!(b["error"]["param"], "model");
    }
}
