//! The per-request HTTP context: strip the destination header, buffer the body, tokenise, ask the
//! indexer, set `x-envoy-original-dst-host`, optionally rewrite the body, resume; on any failure,
//! fail open (no header, so the route goes to the fallback cluster). At the end of the stream,
//! report completion (with the engine's `cached_tokens` and the indexer's `decision_id`) to the
//! indexer; a stream that ended while its route call was pending (or after a failed call the
//! indexer may have counted) is reported as abandoned by its `callout_id`, so the indexer releases
//! the replica's in-flight slot at once.

use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use serde_json::Value;

use crate::config::OversizedBody;
use crate::engine::{endpoint_for_path, PrepareError};
use crate::hlog;
use crate::host::{self, Buffer, Map};
use crate::metrics::{Counter, Histogram};

/// Longest session id forwarded to the indexer; longer values are not forwarded.
const MAX_SESSION_BYTES: usize = 256;
use crate::models::Lookup;
use crate::online_check::OnlineCheck;
use crate::protocol::{
    abandon_body, callout_id, complete_body, inject_kv_cache_report_mode, max_tokens_of,
    parse_route_answer, parse_status, request_id, route_may_be_counted, Completion, FailOpen,
    ResponseScanner, RouteRequest,
};
use crate::root_context::Shared;
use kvroute_core::api::{CONTRACT_HEADER, CONTRACT_VERSION_STR};

/// The header Envoy's ORIGINAL_DST cluster (`use_http_header: true`) routes by.
pub const DST_HEADER: &str = "x-envoy-original-dst-host";

/// Debug headers.
const DBG_REPLICA: &str = "x-kvroute-replica";
const DBG_REASON: &str = "x-kvroute-reason";
const DBG_MATCHED: &str = "x-kvroute-matched-tokens";
const DBG_FAIL_OPEN: &str = "x-kvroute-fail-open";

#[derive(Debug)]
enum Phase {
    /// Not ours (or finished deciding): let everything through.
    Passthrough,
    /// Collecting the body.
    Buffering,
    /// Over `max_body_bytes` with no declared length (failing open), or declared over
    /// `upstream_max_body_bytes`: Envoy holds the body, unread, until its end, so that one over
    /// `upstream_max_body_bytes` gets 413 here rather than being streamed into an engine that
    /// resets it mid-upload (Envoy then answers 503).
    Oversized,
    /// Waiting for `/v1/route`.
    AwaitingRoute { token: u32, started_ms: u64 },
    /// A local reply was sent.
    Rejected,
}

/// One request.
pub struct KvRouteHttp {
    id: u32,
    shared: Option<Rc<Shared>>,
    phase: Phase,
    path: String,
    request_id: String,
    /// Value of the configured session header, forwarded to the indexer.
    session: Option<String>,
    /// Raw and parsed body, kept while waiting for the indexer when the body may be rewritten.
    body: Option<(Vec<u8>, Value)>,
    /// The replica the indexer chose (also when setting the header then failed).
    routed_to: Option<String>,
    decision: Option<(Option<String>, Option<String>)>,
    /// The indexer's id of the applied decision, echoed in `/v1/complete`.
    decision_id: Option<String>,
    /// This request's route call id while the indexer may count its decision without this
    /// request knowing it (call pending, or failed after the indexer may have decided).
    unanswered_callout: Option<String>,
    /// The response's last byte passed the filter.
    response_done: bool,
    /// The end was reported (`on_done` and `on_log` both report; once).
    reported: bool,
    fail_open: Option<FailOpen>,
    scanner: Option<ResponseScanner>,
    /// Host time (ns) the routed request left for its replica, while its first token is awaited.
    sent_at_ns: Option<u64>,
    /// Time to first token of a streamed response, microseconds (reported with the completion).
    ttft_us: Option<u64>,
    /// This request's online token check, when sampled.
    check: Option<OnlineCheck>,
}

impl KvRouteHttp {
    /// A context for one request.
    pub fn new(id: u32, shared: Option<Rc<Shared>>) -> Self {
        Self {
            id,
            shared,
            phase: Phase::Passthrough,
            path: String::new(),
            request_id: String::new(),
            session: None,
            body: None,
            routed_to: None,
            sent_at_ns: None,
            ttft_us: None,
            decision: None,
            decision_id: None,
            unanswered_callout: None,
            response_done: false,
            reported: false,
            fail_open: None,
            scanner: None,
            check: None,
        }
    }

    /// Removes any client-supplied destination header. Returns false when that was impossible
    /// (the caller then refuses the request rather than let a client pick the upstream).
    fn strip_dst_header(&self) -> bool {
        let present = !matches!(
            host::get_header_bytes(Map::RequestHeaders, DST_HEADER),
            Ok(None)
        );
        if !present {
            return true;
        }
        match host::remove_header(Map::RequestHeaders, DST_HEADER) {
            Ok(()) => {
                if let Some(s) = &self.shared {
                    s.metrics.inc(Counter::SpoofedHeaderRemoved);
                }
                true
            }
            Err(e) => {
                hlog!(
                    Error,
                    "kvroute: cannot remove a client {DST_HEADER} ({e}); refusing"
                );
                false
            }
        }
    }

    fn reject(&mut self, status: u32, details: &str, message: &str) -> Action {
        self.phase = Phase::Rejected;
        let body =
            serde_json::json!({"error": {"message": message, "type": details, "code": status}})
                .to_string();
        if let Err(e) = host::send_local_response(
            status,
            details,
            body.as_bytes(),
            &[("content-type", "application/json")],
        ) {
            hlog!(Error, "kvroute: cannot send local reply {status}: {e}");
        }
        Action::Pause
    }

    /// Records a fail-open; the header is already absent (stripped at request headers, and only
    /// ever set as the last step of a successful route).
    fn note_fail_open(&mut self, reason: FailOpen) {
        self.fail_open = Some(reason);
        self.body = None;
        self.phase = Phase::Passthrough;
        if let Some(s) = &self.shared {
            s.metrics.fail_open(reason);
            if s.cfg.debug_headers {
                let _ = host::set_header(Map::RequestHeaders, DBG_FAIL_OPEN, reason.as_str());
            }
        }
        hlog!(
            Debug,
            "kvroute: request {} fails open: {}",
            self.request_id,
            reason.as_str()
        );
    }

    /// 413 for a body the engines would refuse (over `upstream_max_body_bytes`).
    fn too_large_for_engines(&mut self, shared: &Shared) -> Action {
        shared.metrics.inc(Counter::RejectedTooLarge);
        self.reject(
            413,
            "kvroute_body_too_large",
            "request body exceeds the engines' limit",
        )
    }

    fn oversized(&mut self, shared: &Shared) -> Action {
        match shared.cfg.oversized_body {
            OversizedBody::Reject => {
                shared.metrics.inc(Counter::RejectedTooLarge);
                self.reject(
                    413,
                    "kvroute_body_too_large",
                    "request body exceeds the router's limit",
                )
            }
            OversizedBody::FailOpen => {
                self.note_fail_open(FailOpen::TooLarge);
                Action::Continue
            }
        }
    }

    /// Everything between the complete body and the callout. `Ok` = callout in flight.
    fn start_route(&mut self, shared: &Shared, raw: Vec<u8>) -> Result<(), FailOpen> {
        let body: Value = serde_json::from_slice(&raw).map_err(|_| FailOpen::NotJson)?;
        if !body.is_object() {
            return Err(FailOpen::NotJson);
        }
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .ok_or(FailOpen::NoModel)?
            .to_string();
        let lookup = shared
            .models
            .borrow_mut()
            .lookup(&model, host::now_millis());
        let loaded = match lookup {
            Lookup::Ready(m) => m,
            Lookup::NotReady => return Err(FailOpen::TokenizerNotReady),
            Lookup::Unknown => return Err(FailOpen::UnknownModel),
        };
        if loaded.check.mismatch() {
            return Err(FailOpen::TokenMismatch);
        }
        let t0 = host::now_nanos().unwrap_or(0);
        let endpoint = endpoint_for_path(&self.path);
        let mut prepared = loaded.prepare(endpoint, &body).map_err(|e| {
            hlog!(
                Debug,
                "kvroute: request {} not tokenised: {e}",
                self.request_id
            );
            match e {
                PrepareError::TooLong(_) => FailOpen::PromptTooLong,
                PrepareError::Invalid(_) => FailOpen::TokenizeError,
            }
        })?;
        if let Ok(t1) = host::now_nanos() {
            shared
                .metrics
                .record(Histogram::PrepareUs, t1.saturating_sub(t0) / 1000);
        }
        self.check = OnlineCheck::plan(
            self.id,
            shared,
            &loaded,
            &model,
            endpoint,
            &body,
            &mut prepared,
        );
        let callout = next_callout_id();
        let route = RouteRequest {
            model: model.clone(),
            router_keys: Some(prepared.router_keys),
            num_tokens: Some(prepared.num_tokens),
            block_size: u32::try_from(loaded.block_size).ok(),
            request_id: Some(self.request_id.clone()),
            callout_id: Some(callout.clone()),
            max_tokens: max_tokens_of(&body),
            lora: prepared.lora,
            session: self.session.clone(),
            ..RouteRequest::default()
        };
        let payload = serde_json::to_vec(&route).map_err(|_| FailOpen::HostcallError)?;
        let headers = vec![
            (":method", "POST"),
            (":path", "/v1/route"),
            (":authority", shared.cfg.indexer_authority.as_str()),
            ("content-type", "application/json"),
            (CONTRACT_HEADER, CONTRACT_VERSION_STR),
        ];
        let token = host::dispatch_http_call(
            &shared.cfg.indexer_cluster,
            headers,
            Some(&payload),
            Duration::from_millis(shared.cfg.route_timeout_ms),
        )
        .map_err(|e| {
            hlog!(Warn, "kvroute: route callout not dispatched: {e}");
            // BadArgument: the cluster does not exist (or is not yet known to this worker).
            if e == host::HostError::Status(2) {
                FailOpen::IndexerUnavailable
            } else {
                FailOpen::HostcallError
            }
        })?;
        self.phase = Phase::AwaitingRoute {
            token,
            started_ms: host::now_millis(),
        };
        self.unanswered_callout = Some(callout);
        let check_rewrites = self.check.as_ref().is_some_and(OnlineCheck::needs_rewrite);
        if shared.cfg.inject_kv_cache_report_mode || check_rewrites {
            self.body = Some((raw, body));
        }
        Ok(())
    }

    /// Applies a route answer. `Err` = fail open (header not set).
    fn apply_route(
        &mut self,
        shared: &Shared,
        num_headers: usize,
        body_size: usize,
        started_ms: u64,
    ) -> Result<(), FailOpen> {
        let elapsed = host::now_millis().saturating_sub(started_ms);
        shared
            .metrics
            .record(Histogram::RouteCallUs, elapsed.saturating_mul(1000));
        let status = if num_headers == 0 {
            None
        } else {
            parse_status(
                host::get_header(Map::CallResponseHeaders, ":status")
                    .ok()
                    .flatten()
                    .as_deref(),
            )
        };
        let contract = if num_headers == 0 {
            None
        } else {
            host::get_header(Map::CallResponseHeaders, CONTRACT_HEADER)
                .ok()
                .flatten()
        };
        let answer_body =
            host::get_buffer(Buffer::CallResponseBody, 0, body_size).unwrap_or_default();
        let answer = parse_route_answer(
            status,
            contract.as_deref(),
            &answer_body,
            elapsed,
            shared.cfg.route_timeout_ms,
        )
        .inspect_err(|reason| {
            if *reason == FailOpen::ContractMismatch {
                hlog!(
                    Error,
                    "kvroute: the indexer speaks kvroute contract {:?}, this filter {}: \
                     run a filter and an indexer of the same release; failing open",
                    contract.as_deref().unwrap_or("(refused ours)"),
                    kvroute_core::api::CONTRACT_VERSION
                );
            }
        })
        .inspect_err(|_| {
            if !route_may_be_counted(status) {
                self.unanswered_callout = None;
            }
        })?;
        // The indexer counted this request in flight: report its end whatever happens next.
        self.unanswered_callout = None;
        self.decision_id = answer.decision_id.clone();
        self.routed_to = Some(answer.endpoint.clone());
        self.sent_at_ns = host::now_nanos().ok();
        host::set_header(Map::RequestHeaders, DST_HEADER, &answer.endpoint).map_err(|e| {
            hlog!(Warn, "kvroute: cannot set {DST_HEADER}: {e}");
            FailOpen::HostcallError
        })?;
        if shared.cfg.debug_headers {
            if let Some(r) = &answer.replica {
                let _ = host::set_header(Map::RequestHeaders, DBG_REPLICA, r);
            }
            if let Some(r) = &answer.reason {
                let _ = host::set_header(Map::RequestHeaders, DBG_REASON, r);
            }
            if let Some(m) = answer.matched_gpu_tokens {
                let _ = host::set_header(Map::RequestHeaders, DBG_MATCHED, &m.to_string());
            }
        }
        self.decision = Some((answer.replica, answer.reason));
        if let Some((raw, parsed)) = self.body.take() {
            self.rewrite_body(shared, &raw, &parsed);
        }
        Ok(())
    }

    /// Adds `kv_cache_report_mode` to the body and fixes content-length; on any failure the
    /// original body and length are kept (the request is still routed).
    fn rewrite_body(&mut self, shared: &Shared, raw: &[u8], parsed: &Value) {
        let report_mode = shared
            .cfg
            .inject_kv_cache_report_mode
            .then(|| inject_kv_cache_report_mode(raw, parsed))
            .flatten();
        let new_body = match self.check.as_mut().filter(|c| c.needs_rewrite()) {
            Some(check) => check
                .rewrite(report_mode.as_deref().unwrap_or(raw))
                .or(report_mode),
            None => report_mode,
        };
        let Some(new_body) = new_body else {
            return;
        };
        let had_length = matches!(
            host::get_header_bytes(Map::RequestHeaders, "content-length"),
            Ok(Some(_))
        );
        if had_length {
            if let Err(e) = host::set_header(
                Map::RequestHeaders,
                "content-length",
                &new_body.len().to_string(),
            ) {
                hlog!(
                    Warn,
                    "kvroute: body not rewritten, content-length not settable: {e}"
                );
                return;
            }
        }
        if let Err(e) = host::set_buffer(Buffer::RequestBody, 0, raw.len(), &new_body) {
            hlog!(Warn, "kvroute: body not rewritten: {e}");
            if had_length {
                let _ = host::set_header(
                    Map::RequestHeaders,
                    "content-length",
                    &raw.len().to_string(),
                );
            }
            return;
        }
        shared.metrics.inc(Counter::BodyRewritten);
    }

    /// Reports the request's end once: a completion (abandoned when the response did not end) of
    /// the decision applied, or the abandonment of a route call whose answer was never used.
    fn report_end(&mut self, shared: &Shared) {
        if self.reported || !shared.cfg.report_completion {
            return;
        }
        let body = if let Some(endpoint) = &self.routed_to {
            let cached = self
                .scanner
                .as_ref()
                .filter(|_| self.response_done)
                .and_then(ResponseScanner::cached_tokens);
            if !self.response_done {
                shared.metrics.inc(Counter::Abandoned);
            }
            complete_body(&Completion {
                decision_id: self.decision_id.as_deref(),
                request_id: &self.request_id,
                endpoint,
                cached_tokens: cached,
                ttft_us: self.ttft_us,
                abandoned: !self.response_done,
            })
        } else if let Some(callout) = &self.unanswered_callout {
            shared.metrics.inc(Counter::Abandoned);
            abandon_body(callout, &self.request_id)
        } else {
            return;
        };
        self.reported = true;
        let headers = vec![
            (":method", "POST"),
            (":path", "/v1/complete"),
            (":authority", shared.cfg.indexer_authority.as_str()),
            ("content-type", "application/json"),
            (CONTRACT_HEADER, CONTRACT_VERSION_STR),
        ];
        // The stream context dies right after this call, and Envoy cancels a dying context's
        // callouts: issue the report on the root context's behalf.
        let switched = host::set_effective_context(shared.root_id).is_ok();
        let sent = host::dispatch_http_call(
            &shared.cfg.indexer_cluster,
            headers,
            Some(&body),
            Duration::from_millis(shared.cfg.complete_timeout_ms),
        );
        if switched {
            let _ = host::set_effective_context(self.id);
        }
        match sent {
            Ok(_) => shared.metrics.inc(Counter::CompleteSent),
            Err(e) => {
                shared.metrics.inc(Counter::CompleteFailed);
                hlog!(Debug, "kvroute: completion report not sent: {e}");
            }
        }
    }
}

/// A route call id unique to this VM (seeded with the VM's first call time).
fn next_callout_id() -> String {
    static SEED: AtomicU64 = AtomicU64::new(0);
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut seed = SEED.load(Ordering::Relaxed);
    if seed == 0 {
        seed = host::now_nanos().unwrap_or(1).max(1);
        SEED.store(seed, Ordering::Relaxed);
    }
    callout_id(seed, SEQ.fetch_add(1, Ordering::Relaxed))
}

impl Context for KvRouteHttp {
    fn on_done(&mut self) -> bool {
        // The stream is going away (also on a reset while the route call is pending): report now,
        // in case no access-log callback follows.
        if let Some(shared) = self.shared.clone() {
            self.report_end(&shared);
        }
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Phase::AwaitingRoute { token, started_ms } = self.phase else {
            return;
        };
        if token != token_id {
            return;
        }
        let Some(shared) = self.shared.clone() else {
            return;
        };
        self.phase = Phase::Passthrough;
        match self.apply_route(&shared, num_headers, body_size, started_ms) {
            Ok(()) => shared.metrics.inc(Counter::Routed),
            Err(reason) => self.note_fail_open(reason),
        }
        if let Err(e) = host::resume_request() {
            hlog!(
                Error,
                "kvroute: cannot resume request {}: {e}",
                self.request_id
            );
        }
    }
}

impl HttpContext for KvRouteHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if !self.strip_dst_header() {
            if let Some(s) = &self.shared {
                s.metrics.inc(Counter::StripFailedRejected);
            }
            return self.reject(
                503,
                "kvroute_header_strip_failed",
                "request refused by the router",
            );
        }
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let method = host::get_header(Map::RequestHeaders, ":method")
            .ok()
            .flatten();
        let path = host::get_header(Map::RequestHeaders, ":path")
            .ok()
            .flatten();
        let (Some(method), Some(path)) = (method, path) else {
            return Action::Continue;
        };
        if method != "POST" || !shared.cfg.routes_path(&path) {
            return Action::Continue;
        }
        self.path = path;
        shared.metrics.inc(Counter::Requests);
        let rid = host::get_header(Map::RequestHeaders, "x-request-id")
            .ok()
            .flatten();
        self.request_id = request_id(rid.as_deref(), self.id, host::now_nanos().unwrap_or(0));
        if !shared.cfg.session_header.is_empty() {
            self.session = host::get_header(Map::RequestHeaders, &shared.cfg.session_header)
                .ok()
                .flatten()
                .filter(|s| !s.is_empty() && s.len() <= MAX_SESSION_BYTES);
        }
        if end_of_stream {
            shared.metrics.inc(Counter::NoBody);
            return Action::Continue;
        }
        let declared = host::get_header(Map::RequestHeaders, "content-length")
            .ok()
            .flatten()
            .and_then(|v| v.trim().parse::<usize>().ok());
        if declared.is_some_and(|n| n > shared.cfg.upstream_max_body_bytes) {
            // Answered once that much arrived: a reply before the upload ends is lost in the
            // reset of the connection when most of the body is still unread.
            self.phase = Phase::Oversized;
            return Action::Pause;
        }
        if declared.is_some_and(|n| n > shared.cfg.max_body_bytes) {
            return self.oversized(&shared);
        }
        self.phase = Phase::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.phase {
            Phase::Buffering | Phase::Oversized => {}
            Phase::Rejected | Phase::AwaitingRoute { .. } => return Action::Pause,
            Phase::Passthrough => return Action::Continue,
        }
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        if body_size > shared.cfg.upstream_max_body_bytes {
            return self.too_large_for_engines(&shared);
        }
        if matches!(self.phase, Phase::Oversized) {
            return if end_of_stream {
                self.oversized(&shared)
            } else {
                Action::Pause
            };
        }
        if body_size > shared.cfg.max_body_bytes {
            if shared.cfg.oversized_body == OversizedBody::Reject || end_of_stream {
                return self.oversized(&shared);
            }
            self.phase = Phase::Oversized;
            return Action::Pause;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let raw = match host::get_buffer(Buffer::RequestBody, 0, body_size) {
            Ok(b) => b,
            Err(e) => {
                hlog!(Warn, "kvroute: cannot read the request body: {e}");
                self.note_fail_open(FailOpen::HostcallError);
                return Action::Continue;
            }
        };
        match self.start_route(&shared, raw) {
            Ok(()) => Action::Pause,
            Err(reason) => {
                self.note_fail_open(reason);
                Action::Continue
            }
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body that ends with trailers: route it now with what was buffered.
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        match self.phase {
            Phase::Buffering => {}
            Phase::Oversized => return self.oversized(&shared),
            _ => return Action::Continue,
        }
        let raw = match host::get_buffer(Buffer::RequestBody, 0, shared.cfg.max_body_bytes) {
            Ok(b) => b,
            Err(_) => {
                self.note_fail_open(FailOpen::HostcallError);
                return Action::Continue;
            }
        };
        // The body cannot be rewritten once trailers arrived; route without injection.
        match self.start_route(&shared, raw) {
            Ok(()) => {
                self.body = None;
                Action::Pause
            }
            Err(reason) => {
                self.note_fail_open(reason);
                Action::Continue
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.response_done = true;
        }
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        if shared.cfg.debug_headers {
            if let Some((replica, reason)) = &self.decision {
                if let Some(r) = replica {
                    let _ = host::set_header(Map::ResponseHeaders, DBG_REPLICA, r);
                }
                if let Some(r) = reason {
                    let _ = host::set_header(Map::ResponseHeaders, DBG_REASON, r);
                }
            }
            if let Some(f) = self.fail_open {
                let _ = host::set_header(Map::ResponseHeaders, DBG_FAIL_OPEN, f.as_str());
            }
        }
        if let Some(check) = &mut self.check {
            check.on_response_headers();
        }
        if self.routed_to.is_some() && shared.cfg.report_completion {
            let streaming = host::get_header(Map::ResponseHeaders, "content-type")
                .ok()
                .flatten()
                .is_some_and(|c| c.contains("text/event-stream"));
            self.scanner = Some(ResponseScanner::new(
                shared.cfg.max_response_scan_bytes,
                streaming,
            ));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let body_size = match (&mut self.check, &self.shared) {
            (Some(check), Some(shared)) => {
                match check.on_response_body(shared, body_size, end_of_stream) {
                    Some(size) => size,
                    None => return Action::Pause,
                }
            }
            _ => body_size,
        };
        if end_of_stream {
            self.response_done = true;
        }
        // The first bytes of a stream carry the first token; a whole JSON body says nothing of it.
        if body_size > 0
            && self
                .scanner
                .as_ref()
                .is_some_and(ResponseScanner::streaming)
        {
            if let (Some(sent), Ok(now)) = (self.sent_at_ns.take(), host::now_nanos()) {
                self.ttft_us = Some(now.saturating_sub(sent) / 1_000);
            }
        }
        if let Some(scanner) = &mut self.scanner {
            match host::get_buffer(Buffer::ResponseBody, 0, body_size) {
                Ok(chunk) => scanner.push(&chunk),
                Err(_) => self.scanner = None,
            }
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.response_done = true;
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(shared) = self.shared.clone() {
            self.report_end(&shared);
        }
    }
}
