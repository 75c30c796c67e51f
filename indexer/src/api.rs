//! The HTTP API (axum), loopback by default. See `docs/indexer.md` for every endpoint.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use kvroute_core::api::{
    check_contract, parse_complete_reports, AgreementReport, CompleteReport, ContractCheck,
    TokenizerBundle, CONTRACT_HEADER, CONTRACT_VERSION, MAX_REPORTS_PER_CALL,
};

use crate::agreement::AgreementEvent;

use crate::config::ReplicaConfig;
use crate::membership::lock;
use crate::route::{exact_matches, request_router_keys, route, RouteRequest};
use crate::state::AppState;
use crate::subscriber;
use crate::tokenizer_serving::ServeError;

/// Builds the router.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/route", post(route_handler))
        .route("/v1/complete", post(complete_handler))
        .route("/v1/models", get(models_handler))
        .route("/v1/models/{model}/tokenizer", get(tokenizer_handler))
        .route("/v1/models/{model}/agreement", post(agreement_handler))
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz_handler))
        .route("/debug/replicas", get(debug_replicas))
        .route(
            "/debug/lookup",
            get(debug_lookup_get).post(debug_lookup_post),
        )
        .route("/admin/replicas", post(admin_add))
        .route("/admin/replicas/{name}", delete(admin_remove))
        .route("/admin/replicas/{name}/drain", post(admin_drain))
        .route("/admin/replicas/{name}/undrain", post(admin_undrain))
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(contract_version))
        .with_state(state)
}

/// Every answer carries this indexer's [`CONTRACT_VERSION`]; a request that announces another
/// version is refused with 409 before any handler runs, naming both versions.
async fn contract_version(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let announced = request
        .headers()
        .get(CONTRACT_HEADER)
        .map(|v| v.to_str().unwrap_or("?").to_string());
    let mut response = match check_contract(announced.as_deref()) {
        ContractCheck::Same | ContractCheck::Unversioned => next.run(request).await,
        ContractCheck::Other(_) => {
            let shown: String = announced.unwrap_or_default().chars().take(16).collect();
            error(
                StatusCode::CONFLICT,
                format!(
                    "the caller speaks kvroute contract {shown:?}, this indexer speaks \
                     {CONTRACT_VERSION}: run a filter and an indexer of the same release"
                ),
            )
        }
    };
    response.headers_mut().insert(
        CONTRACT_HEADER,
        axum::http::HeaderValue::from(CONTRACT_VERSION),
    );
    response
}

/// A JSON error response `{"error": message}`.
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": message.into()}))).into_response()
}

/// An error answer: status and message (rendered as `{"error": message}`).
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))
}

/// `Server-Timing` (W3C): the answer's time inside the indexer, so that a caller can tell the
/// decision's share of a slow call from the network's and the scheduler's.
const SERVER_TIMING: header::HeaderName = header::HeaderName::from_static("server-timing");

/// `route;dur=<ms>, index;dur=<ms>` with microsecond precision: `route` is what
/// `route_duration_seconds` observed for this call (body parsing and the decision; not reading
/// the body off the socket or writing the answer), `index` its part in the index lookup, waiting
/// for the index behind event intake included.
fn server_timing_route(
    took: std::time::Duration,
    index: std::time::Duration,
) -> header::HeaderValue {
    let value = format!(
        "route;dur={:.3}, index;dur={:.3}",
        took.as_secs_f64() * 1000.0,
        index.as_secs_f64() * 1000.0
    );
    header::HeaderValue::from_str(&value).unwrap_or(header::HeaderValue::from_static("route"))
}

async fn route_handler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = std::time::Instant::now();
    let mut req: RouteRequest = match parse_json(&body) {
        Ok(r) => r,
        Err(resp) => {
            state.metrics.count_route_error(400);
            return resp.into_response();
        }
    };
    if req.completed.len() > MAX_REPORTS_PER_CALL {
        state.metrics.count_route_error(400);
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "{} completion reports carried, at most {MAX_REPORTS_PER_CALL} are accepted",
                req.completed.len()
            ),
        );
    }
    // The caller's earlier requests ended before this one is decided, whatever the answer.
    let carried = std::mem::take(&mut req.completed);
    if let Some((n, why)) = apply_completions(&state, &carried) {
        tracing::debug!(
            refused = n,
            first = why,
            "carried completion reports refused"
        );
    }
    if !req.shadow && state.shadow_only.load(Ordering::Relaxed) {
        state.metrics.count_route_error(400);
        return error(
            StatusCode::BAD_REQUEST,
            "this is kvroute-indexer assess: it answers only shadow route requests (filter \
             mode = \"shadow\"); nothing is routed",
        );
    }
    let header_session = headers
        .get(state.policy_state.session_header.as_str())
        .and_then(|v| v.to_str().ok());
    crate::index::take_lookup_time();
    let decided = route(&state, &req, header_session);
    let took = started.elapsed();
    let in_index = crate::index::take_lookup_time();
    state.metrics.route_duration.observe(took);
    match decided {
        Ok(r) => {
            let mut resp = Json(r).into_response();
            resp.headers_mut()
                .insert(SERVER_TIMING, server_timing_route(took, in_index));
            resp
        }
        Err(e) => {
            let status = e.status();
            state.metrics.count_route_error(status);
            error(
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                e.to_string(),
            )
        }
    }
}

async fn complete_handler(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let reports = match parse_complete_reports(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    // Every valid report is applied, even beside invalid ones; the first problem is answered.
    let refused = apply_completions(&state, &reports);
    match refused {
        None => StatusCode::NO_CONTENT.into_response(),
        Some((n, why)) => error(
            StatusCode::BAD_REQUEST,
            format!("{n} of {} reports refused; the first: {why}", reports.len()),
        ),
    }
}

/// Applies reports in order; returns how many were refused and why the first was.
fn apply_completions(
    state: &AppState,
    reports: &[CompleteReport],
) -> Option<(usize, &'static str)> {
    let (mut refused, mut first) = (0, None);
    for report in reports {
        if let Err(why) = apply_completion(state, report) {
            refused += 1;
            first.get_or_insert(why);
        }
    }
    first.map(|why| (refused, why))
}

/// Applies one report: releases its decision (or abandoned route call) and records what the
/// engine reported against what was predicted.
fn apply_completion(state: &AppState, req: &CompleteReport) -> Result<(), &'static str> {
    let m = &state.metrics;
    let Some(decision_id) = req.decision_id.as_deref() else {
        if let (Some(callout), true) = (req.callout_id.as_deref(), req.abandoned) {
            m.completions_abandoned.fetch_add(1, Ordering::Relaxed);
            if let Some(p) = state.load.abandon_callout(callout) {
                share_end(state, &p);
            }
            return Ok(());
        }
        m.completions_missing_id.fetch_add(1, Ordering::Relaxed);
        return Err(
            "missing decision_id (the route answer's; a filter older than this indexer sends \
             only request_id, and its decisions end at their deadline)",
        );
    };
    if crate::shadow::ShadowBook::is_shadow_id(decision_id) {
        let known = |endpoint: &str| state.fleet.all().iter().any(|r| r.endpoint == endpoint);
        let outcome = state.shadow.completed(
            decision_id,
            req.upstream.as_deref(),
            known,
            req.cached_tokens,
            req.abandoned,
        );
        if outcome == crate::shadow::ShadowOutcome::Unknown {
            m.completions_unknown.fetch_add(1, Ordering::Relaxed);
        }
        return Ok(());
    }
    m.completions.fetch_add(1, Ordering::Relaxed);
    if req.abandoned {
        m.completions_abandoned.fetch_add(1, Ordering::Relaxed);
    }
    let done = state
        .load
        .parse_id(decision_id)
        .and_then(|id| state.load.completed(id));
    let Some(p) = done else {
        m.completions_unknown.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    };
    share_end(state, &p);
    if let Some(us) = req.ttft_us.filter(|_| !req.abandoned) {
        m.record_ttft(&p.replica.name, us as f64 / 1e6, p.predicted_ttft_s);
    }
    // Beside the "route decision" line of the same `decision_id`: what the prediction became,
    // to judge a decision (a prefix given away, say) by its outcome.
    tracing::debug!(
        target: "kvroute_indexer::route",
        %decision_id,
        replica = %p.replica.name,
        predicted_ttft_s = p.predicted_ttft_s,
        observed_ttft_s = req.ttft_us.map(|us| us as f64 / 1e6),
        predicted_tokens = p.predicted_tokens,
        cached_tokens = req.cached_tokens,
        abandoned = req.abandoned,
        "decision outcome"
    );
    if p.partial {
        m.hit_prediction_partial.fetch_add(1, Ordering::Relaxed);
    } else if let Some(reported) = req.cached_tokens.filter(|_| !req.abandoned) {
        m.predicted_hit_tokens
            .fetch_add(p.predicted_tokens, Ordering::Relaxed);
        m.reported_hit_tokens.fetch_add(reported, Ordering::Relaxed);
        let c = match reported.cmp(&p.predicted_tokens) {
            std::cmp::Ordering::Equal => &m.hit_exact,
            std::cmp::Ordering::Greater => &m.hit_under_predicted,
            std::cmp::Ordering::Less => &m.hit_over_predicted,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Tells the peer gateways that a decision ended (no-op without `[peers]`).
fn share_end(state: &AppState, p: &crate::load::Pending) {
    if let Some(link) = &state.peers {
        link.publish(kvroute_core::peers::PeerMessage::Ended {
            decision_id: p.id.to_string(),
        });
    }
}

async fn models_handler(State(state): State<Arc<AppState>>) -> Response {
    let mut models: Vec<Value> = state
        .models
        .values()
        .map(|m| {
            json!({
                "name": m.name,
                "block_size": m.block_size(),
                "replicas": state.fleet.of_model(&m.name).len(),
                "tokenizer": m.tokenizers.model_dir().is_some(),
            })
        })
        .collect();
    models.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    Json(json!({"models": models})).into_response()
}

/// `GET /v1/models/{model}/tokenizer[?form=compact]`: the model's tokenizer bundle, in the
/// compact form when asked for and the tokenizer is one it covers (docs/filter.md, "Memory").
/// Built once per model and form (`TokenizerServing`).
async fn tokenizer_handler(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let compact = match q.get("form").map(String::as_str) {
        None | Some("json") => false,
        Some("compact") => true,
        Some(other) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("unknown tokenizer form {other:?} (json or compact)"),
            )
        }
    };
    let Some(m) = state.models.get(&model).cloned() else {
        return error(StatusCode::NOT_FOUND, format!("unknown model {model:?}"));
    };
    let served = match m.tokenizers.bundle(compact).await {
        Ok(s) => s,
        Err(e @ ServeError::NoModelDir(_)) => return error(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ ServeError::Build(_)) => {
            return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
        }
    };
    let max_model_len = state
        .config
        .models
        .iter()
        .find(|c| c.name == model)
        .and_then(|c| c.max_model_len);
    // The kept bundle's tables are shared, not copied, into the answer.
    Json(TokenizerBundle {
        block_size: m.block_size(),
        max_model_len,
        extra_key_style: Some(m.style),
        ..served.bundle.clone()
    })
    .into_response()
}

/// `POST /v1/models/{model}/agreement`: a filter's tokenizer digest, with an online check's
/// outcome when it has one. Answered at once; the report is taken in the background (the first
/// one waits for the indexer's own digest, which must not depend on the caller's deadline).
async fn agreement_handler(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    Json(report): Json<AgreementReport>,
) -> Response {
    let Some(m) = state.models.get(&model).cloned() else {
        return error(StatusCode::NOT_FOUND, format!("unknown model {model:?}"));
    };
    tokio::spawn(take_agreement(m, model, report));
    StatusCode::NO_CONTENT.into_response()
}

/// Compares a filter's report with the indexer's digest, records it and logs what changed.
async fn take_agreement(
    m: Arc<crate::state::ModelRuntime>,
    model: String,
    report: AgreementReport,
) {
    let own = m.tokenizers.own_digest().await;
    let events = lock(&m.agreement).record(own.as_ref(), &report);
    for event in events {
        match event {
            AgreementEvent::DigestMismatch(parts) => tracing::warn!(
                model = %model,
                differs = %parts.join(","),
                "the filter's tokenizer differs from the indexer's in: {}",
                parts.join(", ")
            ),
            AgreementEvent::DigestAgrees => {
                tracing::info!(model = %model, "the filter's tokenizer digest equals the indexer's")
            }
            AgreementEvent::TokensDisagree(c) => tracing::warn!(
                model = %model,
                endpoint = %c.endpoint,
                own_tokens = c.own_tokens,
                engine_tokens = c.engine_tokens,
                first_difference = c.first_difference.unwrap_or_default(),
                "the engine's prompt tokens differ from the filter's: the model fails open until its tokenizer is fixed"
            ),
            AgreementEvent::MismatchCleared => tracing::info!(
                model = %model,
                "a filter with another tokenizer reported: the token mismatch is cleared"
            ),
        }
    }
}

async fn metrics_handler(State(state): State<Arc<AppState>>) -> Response {
    // Decisions past their deadline stop counting before the gauges are read.
    state.load.expire(std::time::Instant::now());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(&state),
    )
        .into_response()
}

async fn readyz_handler(State(state): State<Arc<AppState>>) -> Response {
    let mut problems = Vec::new();
    let mut ready = true;
    let stale_after = state.stale_after();
    for m in state.models.values() {
        problems.extend(lock(&m.agreement).problems(&m.name));
        let reps = state.fleet.of_model(&m.name);
        if !reps.iter().any(|r| r.healthy()) {
            ready = false;
            problems.push(format!("model {}: no healthy replica", m.name));
        }
        for r in &reps {
            if let Some(cause) = lock(&r.hash_mismatch).clone() {
                problems.push(format!(
                    "replica {}: hash self-check mismatch, likely cause {cause}",
                    r.name
                ));
            }
            if r.stale(stale_after) {
                problems.push(format!(
                    "replica {}: event stream stale or disconnected",
                    r.name
                ));
            }
        }
    }
    if let Some(problem) = state.peers.as_ref().and_then(|l| l.problem()) {
        problems.push(problem);
    }
    let status = if !ready {
        "not_ready"
    } else if problems.is_empty() {
        "ready"
    } else {
        "degraded"
    };
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(json!({"status": status, "problems": problems}))).into_response()
}

async fn debug_replicas(State(state): State<Arc<AppState>>) -> Response {
    state.load.expire(std::time::Instant::now());
    let stale_after = state.stale_after();
    let list: Vec<Value> = state
        .fleet
        .all()
        .iter()
        .map(|r| {
            let s = lock(&r.scraped).clone();
            let streams: Vec<Value> = r
                .streams()
                .iter()
                .map(|st| {
                    let ss = lock(&st.state).clone();
                    json!({
                        "rank": st.rank,
                        "index_id": st.index_id,
                        "endpoint": ss.endpoint,
                        "replay": ss.replay,
                        "connected": ss.connected,
                        "last_seq": ss.last_seq,
                        "lag_seconds": ss.lag_seconds,
                        "silence_seconds": ss.last_message.map(|t| t.elapsed().as_secs_f64()),
                        "batches": st.stats.batches.load(Ordering::Relaxed),
                        "events": st.stats.events.load(Ordering::Relaxed),
                        "gaps": st.stats.gaps.load(Ordering::Relaxed),
                        "replays": st.stats.replays.load(Ordering::Relaxed),
                        "resets": st.stats.resets.load(Ordering::Relaxed),
                        "decode_errors": st.stats.event_decode_errors.load(Ordering::Relaxed),
                        "duplicates": st.stats.duplicates.load(Ordering::Relaxed),
                        "rejected_events": st.stats.rejected_events.load(Ordering::Relaxed),
                        "connects": st.stats.connects.load(Ordering::Relaxed),
                    })
                })
                .collect();
            json!({
                "name": r.name,
                "model": r.model,
                "endpoint": r.endpoint,
                "healthy": r.healthy(),
                "stale": r.stale(stale_after),
                "draining": r.draining.load(Ordering::Relaxed),
                "in_flight": r.in_flight.load(Ordering::Relaxed),
                "waiting": s.waiting,
                "running": s.running,
                "kv_usage": s.kv_usage,
                "process_start": s.process_start,
                "scrape_failures": s.failures,
                "hash_mismatch": lock(&r.hash_mismatch).clone(),
                "streams": streams,
            })
        })
        .collect();
    Json(json!({"policy": state.policy.as_str(), "replicas": list})).into_response()
}

fn lookup_response(state: &AppState, req: &RouteRequest) -> Response {
    let keys = match request_router_keys(state, req) {
        Ok(k) => k,
        Err(e) => {
            return error(
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST),
                e.to_string(),
            )
        }
    };
    let replicas = state.fleet.of_model(&keys.model.name);
    let usable = keys.usable();
    let matched = exact_matches(state, &replicas, usable);
    let bs = u64::from(keys.block_size);
    let out: Vec<Value> = replicas
        .iter()
        .zip(&matched)
        .map(|(r, m)| {
            json!({
                "replica": r.name,
                "endpoint": r.endpoint,
                "blocks": {"gpu": m.gpu, "cpu": m.cpu, "storage": m.storage, "predicted": m.predicted},
                "tokens": {"gpu": u64::from(m.gpu) * bs, "cpu": u64::from(m.cpu) * bs, "storage": u64::from(m.storage) * bs, "predicted": u64::from(m.predicted) * bs},
            })
        })
        .collect();
    Json(json!({
        "model": keys.model.name,
        "block_size": keys.block_size,
        "num_tokens": keys.num_tokens,
        "usable_blocks": usable.len(),
        "router_keys": keys.keys.iter().map(|k| k.0).collect::<Vec<u64>>(),
        "replicas": out,
    }))
    .into_response()
}

async fn debug_lookup_post(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match parse_json::<RouteRequest>(&body) {
        Ok(req) => lookup_response(&state, &req),
        Err(resp) => resp.into_response(),
    }
}

async fn debug_lookup_get(
    State(state): State<Arc<AppState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(model) = q.get("model") else {
        return error(StatusCode::BAD_REQUEST, "missing ?model=");
    };
    let Some(keys) = q.get("keys") else {
        return error(
            StatusCode::BAD_REQUEST,
            "missing ?keys=k1,k2,... (decimal u64 router keys)",
        );
    };
    let parsed: Result<Vec<u64>, _> = keys
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().parse::<u64>())
        .collect();
    let Ok(router_keys) = parsed else {
        return error(
            StatusCode::BAD_REQUEST,
            "keys must be decimal u64 values separated by commas",
        );
    };
    // Every given key counts as usable: num_tokens = keys * block_size + 1.
    let bs = state
        .models
        .get(model)
        .and_then(|m| m.block_size())
        .unwrap_or(crate::route::FALLBACK_BLOCK_SIZE) as usize;
    let req = RouteRequest {
        model: model.clone(),
        num_tokens: Some(router_keys.len() * bs + 1),
        router_keys: Some(router_keys),
        ..Default::default()
    };
    lookup_response(&state, &req)
}

/// Checks `Authorization: Bearer <admin token>`.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &state.admin_token else {
        return Err(ApiError(
            StatusCode::FORBIDDEN,
            "admin API disabled: set admin_token or admin_token_env".into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token".into(),
        ))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn admin_add(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r.into_response();
    }
    let mut v: Value = match parse_json(&body) {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let Some(model) = v
        .as_object_mut()
        .and_then(|o| o.remove("model"))
        .and_then(|m| m.as_str().map(str::to_string))
    else {
        return error(StatusCode::BAD_REQUEST, "field `model`: required string");
    };
    if !state.models.contains_key(&model) {
        return error(StatusCode::NOT_FOUND, format!("unknown model {model:?}"));
    }
    let cfg: ReplicaConfig = match serde_json::from_value(v) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid replica: {e}")),
    };
    if let Err(e) = cfg.validate("replica") {
        return error(StatusCode::BAD_REQUEST, e.to_string());
    }
    match state.fleet.add(&model, cfg) {
        Ok(replica) => {
            subscriber::spawn_replica(&state, &replica);
            tracing::info!(replica = %replica.name, %model, "replica added via admin API");
            (
                StatusCode::CREATED,
                Json(json!({"replica": replica.name, "model": model})),
            )
                .into_response()
        }
        Err(e) => error(StatusCode::CONFLICT, e.to_string()),
    }
}

async fn admin_remove(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r.into_response();
    }
    match state.fleet.remove(&name) {
        Ok(r) => {
            state.index.remove_streams(r.index_ids());
            tracing::info!(replica = %name, "replica removed via admin API");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => error(StatusCode::NOT_FOUND, e.to_string()),
    }
}

async fn admin_drain(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    set_draining(&state, &headers, &name, true)
}

async fn admin_undrain(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    set_draining(&state, &headers, &name, false)
}

fn set_draining(state: &AppState, headers: &HeaderMap, name: &str, draining: bool) -> Response {
    if let Err(r) = authorize(state, headers) {
        return r.into_response();
    }
    match state.fleet.get(name) {
        Some(r) => {
            r.draining.store(draining, Ordering::Relaxed);
            tracing::info!(replica = %name, draining, "replica drain state changed via admin API");
            StatusCode::NO_CONTENT.into_response()
        }
        None => error(StatusCode::NOT_FOUND, format!("no replica named {name:?}")),
    }
}
