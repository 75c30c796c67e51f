//! The OpenAI-compatible HTTP server (axum), with vLLM's paths and shapes:
//! `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE), their `/render` variants,
//! `GET /v1/models`, `/health`, `/version`, `/metrics`, `/kv_event_sources`,
//! `POST /reset_prefix_cache`; and the simulator's own `POST /admin/speed`, `POST /admin/fail`,
//! `GET /admin/latency-model` (loopback peers only).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream, StreamExt};
use kvroute_core::hashing::BlockHasher;
use kvroute_core::request::{
    request_extras, Endpoint, ModelTokenizer, PromptTokens, RequestBody, RequestError,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::cli::LoraModule;
use crate::engine::{EngineHandle, FinishInfo, NewRequest, SeqOutput};
use crate::hashing::RequestChainHasher;
use crate::latency::{LatencyModel, Speed};
use crate::metrics;
use crate::openai::{self, ApiError, GenParams};

/// Shared server state.
pub struct AppState {
    /// Served model names (first = canonical).
    pub served_names: Vec<String>,
    /// Tokenizer + chat template.
    pub tokenizer: Arc<ModelTokenizer>,
    /// The engines' block hasher.
    pub hasher: Arc<BlockHasher>,
    /// Engines (data-parallel ranks).
    pub engines: Vec<EngineHandle>,
    /// LoRA adapters by name.
    pub loras: HashMap<String, LoraModule>,
    /// Tokens per block.
    pub block_size: usize,
    /// Tokens per request block hash (`--prefix-match-unit`).
    pub hash_block_size: usize,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// Chat default for max tokens.
    pub default_max_tokens: usize,
    /// Seed for outputs.
    pub seed: u64,
    /// `/kv_event_sources` body.
    pub kv_event_sources: Value,
    /// `/version` value.
    pub version: String,
    /// The HTTP port it listens on (`--port`), reported with each finished request.
    pub port: u16,
    /// Unix time the process started.
    pub start_unix_s: f64,
    /// Request counter (ids).
    pub counter: AtomicU64,
    /// The cost model at speed 1 (the flags).
    pub latency: LatencyModel,
    /// The replica's speed factor, shared with the engines.
    pub speed: Arc<Speed>,
    /// `--max-num-batched-tokens`.
    pub max_num_batched_tokens: usize,
    /// `--time-scale`.
    pub time_scale: f64,
    /// Generation attempts received and failures armed by `POST /admin/fail`.
    pub faults: crate::faults::Faults,
}

/// Builds the router.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_text))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/admin/speed", post(admin_speed))
        .route("/admin/fail", post(admin_fail))
        .route("/admin/latency-model", get(admin_latency_model))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_error(e: RequestError) -> ApiError {
    match e {
        RequestError::NotJson(m) => ApiError::validation(format!("JSON decode error: {m}"), None),
        RequestError::NotAnObject => {
            ApiError::validation("Input should be a valid dictionary", None)
        }
        RequestError::MissingField(f) => ApiError::validation(format!("{f}: Field required"), None),
        other => ApiError::bad_request(other.to_string()),
    }
}

/// A validated request, tokenised.
struct Prepared {
    model: String,
    prompts: Vec<Vec<u32>>,
    params: GenParams,
    lora: Option<LoraModule>,
    body: RequestBody,
}

impl AppState {
    fn model_name_ok(&self, model: &str) -> bool {
        self.served_names.iter().any(|n| n == model) || self.loras.contains_key(model)
    }

    fn prepare(
        &self,
        endpoint: Endpoint,
        headers: &HeaderMap,
        raw: &[u8],
        generate: bool,
    ) -> Result<Prepared, ApiError> {
        if let Some(ct) = headers.get(header::CONTENT_TYPE) {
            let media = ct
                .to_str()
                .unwrap_or("")
                .split(';')
                .next()
                .unwrap_or("")
                .trim();
            if !media.eq_ignore_ascii_case("application/json") {
                return Err(ApiError::validation(
                    "Unsupported Media Type: Only 'application/json' is allowed",
                    None,
                ));
            }
        }
        let body = RequestBody::parse(raw, endpoint).map_err(request_error)?;
        let model = match body.fields().get("model") {
            None | Some(Value::Null) => self.served_names[0].clone(),
            Some(Value::String(m)) => m.clone(),
            Some(_) => {
                return Err(ApiError::validation(
                    "model: Input should be a valid string",
                    Some("model"),
                ))
            }
        };
        if !self.model_name_ok(&model) {
            return Err(ApiError::unknown_model(&model, &self.served_names));
        }
        let session_header = headers.get("x-session-id").and_then(|v| v.to_str().ok());
        let chat = endpoint == Endpoint::ChatCompletions;
        let params =
            openai::gen_params(body.fields(), chat, self.default_max_tokens, session_header)?;
        // vLLM tokenises the whole prompt before it refuses one over max_model_len; the
        // simulator stops counting at the limit (same answer, bounded memory: a 3.9 M-digit
        // prompt would otherwise take ~1.3 GB here).
        let tokens = self
            .tokenizer
            .tokenize_body_capped(endpoint, &body, self.max_model_len)
            .map_err(|e| match e {
                RequestError::PromptTooLong { limit } => ApiError::bad_request(format!(
                    "This model's maximum context length is {limit} tokens. However, your \
                     request has more input tokens. Please reduce the length of the input."
                )),
                other => request_error(other),
            })?;
        if matches!(tokens, PromptTokens::Partial(_)) {
            // A text-only model, as vLLM answers for one.
            return Err(ApiError::bad_request(format!(
                "{model} is not a multimodal model: images, audio and video are not supported"
            )));
        }
        let prompts: Vec<Vec<u32>> = tokens.prompts().into_iter().map(<[u32]>::to_vec).collect();
        for p in &prompts {
            if p.is_empty() {
                return Err(ApiError::bad_request("The prompt cannot be empty."));
            }
            let max_out = if generate { params.max_tokens } else { 0 };
            if p.len() + max_out > self.max_model_len {
                return Err(ApiError::bad_request(format!(
                    "This model's maximum context length is {} tokens. However, you requested \
                     {} tokens ({} in the messages, {} in the completion). Please reduce the \
                     length of the messages or completion.",
                    self.max_model_len,
                    p.len() + max_out,
                    p.len(),
                    max_out
                )));
            }
        }
        let lora = self.loras.get(&model).cloned();
        Ok(Prepared {
            model,
            prompts,
            params,
            lora,
            body,
        })
    }

    fn pick_engine(&self) -> &EngineHandle {
        self.engines
            .iter()
            .min_by_key(|e| (e.load_score(), e.rank))
            .unwrap_or(&self.engines[0])
    }

    /// Hands one prompt to the least-loaded engine. Arrival is stamped here, after tokenisation,
    /// as vLLM stamps `arrival_time` when the engine request is made.
    fn submit(
        &self,
        prep: &Prepared,
        prompt: &[u32],
    ) -> Result<mpsc::UnboundedReceiver<SeqOutput>, ApiError> {
        let loras = &self.loras;
        let extras = request_extras(prep.body.fields(), &|name: &str| {
            loras.get(name).map(|l| l.path.clone())
        });
        let chain = RequestChainHasher::new(self.hasher.clone(), extras, self.hash_block_size);
        let meta = chain.event_meta(
            prep.lora.as_ref().map(|l| l.id),
            prep.params.session_id.clone(),
        );
        let seed = prep
            .params
            .seed
            .unwrap_or_else(|| mix_seed(self.seed, prompt));
        let req = NewRequest {
            prompt: prompt.to_vec(),
            max_tokens: prep.params.max_tokens,
            hasher: Arc::new(chain),
            meta,
            report_full: prep.params.report_full,
            seed,
            arrived: Instant::now(),
        };
        self.pick_engine()
            .submit(req)
            .map_err(|e| ApiError::unavailable(e.to_string()))
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids).unwrap_or_default()
    }
}

/// A request's default output seed: the server seed mixed with the prompt (FNV-1a).
fn mix_seed(seed: u64, prompt: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for t in prompt {
        h ^= u64::from(*t);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, Endpoint::Completions, headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, Endpoint::ChatCompletions, headers, body).await
}

async fn generate(s: Arc<AppState>, ep: Endpoint, headers: HeaderMap, raw: Bytes) -> Response {
    if let Some(status) = s.faults.attempt() {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return ApiError {
            status,
            kind: "InternalServerError",
            message: "failure injected by POST /admin/fail".into(),
            param: None,
        }
        .into_response();
    }
    let prep = match s.prepare(ep, &headers, &raw, true) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let chat = ep == Endpoint::ChatCompletions;
    if chat && prep.prompts.len() != 1 {
        return ApiError::bad_request("chat requests have exactly one prompt").into_response();
    }
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let id = if chat {
        format!("chatcmpl-{n:016x}")
    } else {
        format!("cmpl-{n:016x}")
    };
    let mut receivers = Vec::with_capacity(prep.prompts.len());
    for p in &prep.prompts {
        match s.submit(&prep, p) {
            Ok(rx) => receivers.push(rx),
            Err(e) => return e.into_response(),
        }
    }
    if prep.params.stream {
        stream_response(s, prep, id, chat, receivers).into_response()
    } else {
        collect_response(s, prep, id, chat, receivers).await
    }
}

async fn collect_one(mut rx: mpsc::UnboundedReceiver<SeqOutput>) -> Option<(Vec<u32>, FinishInfo)> {
    let mut ids = Vec::new();
    while let Some(out) = rx.recv().await {
        match out {
            SeqOutput::Token(t) => ids.push(t),
            SeqOutput::Finished(f) => return Some((ids, f)),
        }
    }
    None
}

async fn collect_response(
    s: Arc<AppState>,
    prep: Prepared,
    id: String,
    chat: bool,
    receivers: Vec<mpsc::UnboundedReceiver<SeqOutput>>,
) -> Response {
    let results = futures::future::join_all(receivers.into_iter().map(collect_one)).await;
    let mut choices = Vec::new();
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    let mut infos = Vec::new();
    for (i, r) in results.into_iter().enumerate() {
        let Some((ids, f)) = r else {
            return ApiError::unavailable("the engine stopped").into_response();
        };
        let text = s.decode(&ids);
        let mut choice = if chat {
            openai::chat_choice(&text)
        } else {
            openai::completion_choice(i, &text)
        };
        let asked = prep.params.return_token_ids;
        let prompt_ids = prep.prompts.get(i).map(Vec::as_slice).filter(|_| asked);
        let output_ids = Some(ids.as_slice()).filter(|_| asked);
        openai::add_choice_token_ids(&mut choice, chat, prompt_ids, output_ids);
        choices.push(choice);
        prompt += f.prompt_tokens;
        completion += f.completion_tokens;
        cached += f.cached_tokens;
        infos.push(openai::sim_info(&f, s.port));
    }
    let mut body = json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": unix_now(),
        "model": prep.model,
        "choices": choices,
        "usage": openai::usage(prompt, completion, cached),
        "kvroute_sim": if infos.len() == 1 { infos[0].clone() } else { Value::from(infos) },
    });
    if chat {
        let prompt_ids = prep
            .prompts
            .first()
            .filter(|_| prep.params.return_token_ids);
        body["prompt_token_ids"] = prompt_ids.map_or(Value::Null, |p| Value::from(p.clone()));
    }
    Json(body).into_response()
}

/// Per-prompt streaming state: output ids so far and the incremental detokenizer's window
/// (vLLM's `prefix_offset` / `read_offset`: each step decodes only the last few ids, so a long
/// output costs linear, not quadratic, time).
struct StreamState {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    first: bool,
}

impl StreamState {
    /// Adds `id` and returns the text it completes ("" while a character is still partial).
    fn push(&mut self, id: u32, decode: impl Fn(&[u32]) -> String) -> String {
        self.ids.push(id);
        let prefix_text = decode(&self.ids[self.prefix_offset..self.read_offset]);
        let new_text = decode(&self.ids[self.prefix_offset..]);
        if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            if let Some(delta) = new_text.get(prefix_text.len()..) {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return delta.to_string();
            }
        }
        String::new()
    }
}

fn stream_response(
    s: Arc<AppState>,
    prep: Prepared,
    id: String,
    chat: bool,
    receivers: Vec<mpsc::UnboundedReceiver<SeqOutput>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let created = unix_now();
    let model = prep.model.clone();
    let include_usage = prep.params.include_usage;
    let return_token_ids = prep.params.return_token_ids;
    let prompts = prep.prompts.clone();
    let total = receivers.len();
    let merged = stream::select_all(receivers.into_iter().enumerate().map(|(i, rx)| {
        stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|o| (o, rx)) })
            .map(move |o| (i, o))
            .boxed()
    }));
    let mut states: Vec<StreamState> = (0..total)
        .map(|_| StreamState {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            first: true,
        })
        .collect();
    let mut finished: Vec<FinishInfo> = Vec::new();
    let events = merged
        .map(move |(i, out)| {
            let mut evs: Vec<Value> = Vec::new();
            let st = &mut states[i];
            match out {
                SeqOutput::Token(t) => {
                    let delta = st.push(t, |ids| s.decode(ids));
                    let prompt_ids = prompts.get(i).map(Vec::as_slice).filter(|_| return_token_ids);
                    let new_ids = [t];
                    let output = Some(&new_ids[..]).filter(|_| return_token_ids);
                    if chat {
                        if st.first {
                            let mut role =
                                openai::chat_chunk(&id, created, &model, Some(""), true, false);
                            openai::add_token_ids(&mut role, true, prompt_ids, None);
                            evs.push(role);
                        }
                        let mut c = openai::chat_chunk(&id, created, &model, Some(&delta), false, false);
                        openai::add_token_ids(&mut c, true, None, output);
                        evs.push(c);
                    } else {
                        let mut c = openai::completion_chunk(&id, created, &model, i, &delta, false);
                        let first_prompt = prompt_ids.filter(|_| st.first);
                        openai::add_token_ids(&mut c, false, first_prompt, output);
                        evs.push(c);
                    }
                    st.first = false;
                }
                SeqOutput::Finished(f) => {
                    let mut last = if chat {
                        openai::chat_chunk(&id, created, &model, Some(""), false, true)
                    } else {
                        openai::completion_chunk(&id, created, &model, i, "", true)
                    };
                    last["kvroute_sim"] = openai::sim_info(&f, s.port);
                    evs.push(last);
                    finished.push(f);
                    if finished.len() == total && include_usage {
                        let (p, c, k) = finished.iter().fold((0, 0, 0), |a, f| {
                            (a.0 + f.prompt_tokens, a.1 + f.completion_tokens, a.2 + f.cached_tokens)
                        });
                        evs.push(json!({
                            "id": id, "object": if chat { "chat.completion.chunk" } else { "text_completion" },
                            "created": created, "model": model, "choices": [],
                            "usage": openai::usage(p, c, k),
                        }));
                    }
                }
            }
            stream::iter(
                evs.into_iter()
                    .map(|v| Ok(Event::default().data(v.to_string())))
                    .collect::<Vec<_>>(),
            )
        })
        .flatten()
        .chain(stream::once(async { Ok(Event::default().data("[DONE]")) }));
    Sse::new(events)
}

async fn render(s: Arc<AppState>, ep: Endpoint, headers: HeaderMap, raw: Bytes) -> Response {
    let prep = match s.prepare(ep, &headers, &raw, false) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let one = |i: usize, ids: &Vec<u32>| json!({"request_id": format!("render-{n:016x}-{i}"), "model": prep.model, "token_ids": ids});
    if ep == Endpoint::ChatCompletions {
        match prep.prompts.first() {
            Some(ids) => Json(one(0, ids)).into_response(),
            None => ApiError::bad_request("no prompt").into_response(),
        }
    } else {
        let all: Vec<Value> = prep
            .prompts
            .iter()
            .enumerate()
            .map(|(i, p)| one(i, p))
            .collect();
        Json(Value::from(all)).into_response()
    }
}

async fn render_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    render(s, Endpoint::Completions, headers, body).await
}

async fn render_chat(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    render(s, Endpoint::ChatCompletions, headers, body).await
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    let created = unix_now();
    let mut data: Vec<Value> = s
        .served_names
        .iter()
        .map(|n| {
            json!({"id": n, "object": "model", "created": created, "owned_by": "vllm",
                   "root": s.served_names[0], "parent": null, "max_model_len": s.max_model_len})
        })
        .collect();
    let mut loras: Vec<&LoraModule> = s.loras.values().collect();
    loras.sort_by_key(|l| l.id);
    for l in loras {
        data.push(json!({"id": l.name, "object": "model", "created": created, "owned_by": "vllm",
                         "root": l.path, "parent": s.served_names[0], "max_model_len": s.max_model_len}));
    }
    Json(json!({"object": "list", "data": data}))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn version(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"version": s.version}))
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    let snapshot: Vec<metrics::EngineMetrics> = s
        .engines
        .iter()
        .map(|e| match e.metrics.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        })
        .collect();
    let mut text = metrics::render(&s.served_names[0], &snapshot, s.start_unix_s);
    let (received, injected) = s.faults.counts();
    metrics::render_attempts(&mut text, &s.served_names[0], received, injected);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn kv_event_sources(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(s.kv_event_sources.clone())
}

async fn reset_prefix_cache(State(s): State<Arc<AppState>>) -> Response {
    let mut ok = true;
    for e in &s.engines {
        match e.reset_prefix_cache().await {
            Ok(r) => ok &= r,
            Err(err) => return ApiError::unavailable(err.to_string()).into_response(),
        }
    }
    Json(json!({"success": ok})).into_response()
}

/// Admin routes answer loopback peers only (403 otherwise, e.g. with `--host 0.0.0.0`). Without
/// connection info (the router driven in-process) the caller is trusted.
fn admin_forbidden(peer: Option<&ConnectInfo<SocketAddr>>) -> Option<Response> {
    match peer {
        Some(ConnectInfo(addr)) if !addr.ip().is_loopback() => Some(
            ApiError {
                status: StatusCode::FORBIDDEN,
                kind: "Forbidden",
                message: "admin endpoints answer loopback clients only".into(),
                param: None,
            }
            .into_response(),
        ),
        _ => None,
    }
}

fn latency_model_body(s: &AppState) -> Value {
    let speed = s.speed.get();
    let eff = s.latency.scaled(speed);
    json!({
        "speed": speed,
        "prefill_tokens_per_s": eff.prefill_tokens_per_s,
        "decode_step_ms": eff.decode_step_ms,
        "decode_ms_per_seq": eff.decode_ms_per_seq,
        "decode_ms_per_1k_context": eff.decode_ms_per_1k_context,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "time_scale": s.time_scale,
        "base": s.latency,
    })
}

/// `GET /admin/latency-model`: the effective cost model (speed applied; model milliseconds).
async fn admin_latency_model(
    State(s): State<Arc<AppState>>,
    req: axum::extract::Request,
) -> Response {
    if let Some(r) = admin_forbidden(req.extensions().get()) {
        return r;
    }
    Json(latency_model_body(&s)).into_response()
}

/// `POST /admin/speed` with `{"speed": F}`: sets the replica's speed factor for every step
/// scheduled from now on; answers `{"speed": F}` (400 on anything but a finite number > 0).
async fn admin_speed(State(s): State<Arc<AppState>>, req: axum::extract::Request) -> Response {
    if let Some(r) = admin_forbidden(req.extensions().get()) {
        return r;
    }
    let raw = match axum::body::to_bytes(req.into_body(), 64 * 1024).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request(format!("unreadable body: {e}")).into_response(),
    };
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            return ApiError::bad_request(format!(
                "expected a JSON object {{\"speed\": <number > 0>}}: {e}"
            ))
            .into_response()
        }
    };
    let Some(v) = body.get("speed") else {
        return ApiError::bad_request(
            "missing field \"speed\": expected {\"speed\": <number > 0>}",
        )
        .into_response();
    };
    let Some(f) = v.as_f64() else {
        return ApiError::bad_request(format!("\"speed\" must be a number > 0, got {v}"))
            .into_response();
    };
    match s.speed.set(f) {
        Ok(new) => {
            tracing::info!(speed = new, "speed factor changed");
            Json(json!({"speed": new})).into_response()
        }
        Err(e) => ApiError::bad_request(e.to_string()).into_response(),
    }
}

/// `POST /admin/fail` with `{"requests": N, "status": S}`: the next N generation requests answer
/// status S (default 500) without running; N = 0 disarms. Answers the plan.
async fn admin_fail(State(s): State<Arc<AppState>>, req: axum::extract::Request) -> Response {
    if let Some(r) = admin_forbidden(req.extensions().get()) {
        return r;
    }
    let raw = match axum::body::to_bytes(req.into_body(), 64 * 1024).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request(format!("unreadable body: {e}")).into_response(),
    };
    let plan: crate::faults::FailPlan = match serde_json::from_slice(&raw) {
        Ok(p) => p,
        Err(e) => {
            return ApiError::bad_request(format!(
                "expected {{\"requests\": <count>, \"status\": <500-599>}}: {e}"
            ))
            .into_response()
        }
    };
    if let Err(e) = plan.check() {
        return ApiError::bad_request(e).into_response();
    }
    s.faults.arm(plan);
    tracing::info!(
        requests = plan.requests,
        status = plan.status,
        "failures armed"
    );
    Json(json!(plan)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_routes_refuse_non_loopback_peers() {
        let peer = |a: &str| ConnectInfo(a.parse::<SocketAddr>().expect("addr"));
        let refused = admin_forbidden(Some(&peer("10.1.2.3:4000"))).map(|r| r.status());
        assert_eq!(refused, Some(StatusCode::FORBIDDEN));
        assert!(admin_forbidden(Some(&peer("127.0.0.1:4000"))).is_none());
        assert!(admin_forbidden(Some(&peer("[::1]:4000"))).is_none());
        assert!(admin_forbidden(None).is_none());
    }
}
