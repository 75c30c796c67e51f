//! One request's logic, host-independent: strip the destination header, buffer the body,
//! tokenise, ask the indexer, set `x-envoy-original-dst-host`, optionally rewrite the body,
//! resume; on any failure, fail open (no header, so the route goes to the fallback cluster). At
//! the end of the stream, report completion (with the engine's `cached_tokens` and the indexer's
//! `decision_id`) to the indexer; a stream that ended while its route call was pending (or after a
//! failed call the indexer may have counted) is reported as abandoned by its `callout_id`, so the
//! indexer releases the replica's in-flight slot at once.
//!
//! A host adapter creates one [`Stream`] per request and forwards its callbacks, each with the
//! host's [`StreamHost`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::api::CompleteReport;
use kvroute_core::request::RequestBody;
use serde_json::Value;

use crate::completions::send_reports;
use crate::config::{Mode, OversizedBody};
use crate::hlog;
use crate::loaded_model::{endpoint_for_path, PrepareError};
use crate::metrics::{Counter, Histogram};
use crate::models::Lookup;
use crate::online_check::OnlineCheck;
use crate::plugin::Plugin;
use crate::protocol::{
    abandon_report, callout_id, complete_report, indexer_post_headers, inject_kv_cache_report_mode,
    max_tokens_of, parse_route_answer, request_id, route_may_be_counted, Completion, FailOpen,
    RouteRequest,
};
use crate::seam::{Body, CallId, CallReply, Callout, Flow, Headers, HostError, StreamHost};
use crate::usage::UsageScanner;

/// The header Envoy's ORIGINAL_DST cluster (`use_http_header: true`) routes by.
pub const DST_HEADER: &str = "x-envoy-original-dst-host";

/// The chosen replica and its alternates, best first, comma-separated: what Envoy's
/// `override_host` load balancing reads (it tries them in order on retries, then its fallback
/// policy; docs/filter.md "Retrying onto the runner-up").
pub const DESTINATIONS_HEADER: &str = "x-kvroute-destinations";

/// The headers that pick an upstream: set only by kvroute, removed from every client request.
const DESTINATION_HEADERS: [&str; 2] = [DST_HEADER, DESTINATIONS_HEADER];

/// Longest session id forwarded to the indexer; longer values are not forwarded.
const MAX_SESSION_BYTES: usize = 256;

/// Debug headers.
const DBG_REPLICA: &str = "x-kvroute-replica";
const DBG_REASON: &str = "x-kvroute-reason";
const DBG_MATCHED: &str = "x-kvroute-matched-tokens";
const DBG_FAIL_OPEN: &str = "x-kvroute-fail-open";
/// In shadow mode, where kvroute would have sent the request (Envoy's balancer chose where it
/// went): named apart so nothing reading `x-kvroute-replica` takes it for the real upstream.
const DBG_SHADOW_REPLICA: &str = "x-kvroute-shadow-replica";
/// In shadow mode, the tokens kvroute expected cached on the replica it would have chosen.
const DBG_SHADOW_MATCHED: &str = "x-kvroute-shadow-matched-tokens";

#[derive(Debug)]
enum Phase {
    /// Not ours (or finished deciding): let everything through.
    Passthrough,
    /// Collecting the body.
    Buffering,
    /// Over `max_body_bytes` with no declared length (failing open), or declared over
    /// `upstream_max_body_bytes`: the host holds the body, unread, until its end, so that one over
    /// `upstream_max_body_bytes` gets 413 here rather than being streamed into an engine that
    /// resets it mid-upload (Envoy then answers 503).
    Oversized,
    /// Waiting for `/v1/route`.
    AwaitingRoute { call: CallId, started_ns: u64 },
    /// A local reply was sent.
    Rejected,
}

/// The indexer's answer as the debug response headers show it.
#[derive(Debug)]
struct DecisionShown {
    /// The chosen replica's name.
    replica: Option<String>,
    /// Why it was chosen.
    reason: Option<String>,
}

/// One request.
#[derive(Debug)]
pub struct Stream {
    /// The host's id of the stream (in generated request ids).
    id: u64,
    plugin: Option<Arc<Plugin>>,
    phase: Phase,
    path: String,
    request_id: String,
    /// Value of the configured session header, forwarded to the indexer.
    session: Option<String>,
    /// Raw and parsed body, kept while waiting for the indexer when the body may be rewritten.
    body: Option<(Vec<u8>, RequestBody)>,
    /// The replica the indexer chose (also when setting the header then failed).
    routed_to: Option<String>,
    /// What the indexer said it chose and why, shown in the debug response headers.
    decision: Option<DecisionShown>,
    /// The indexer's id of the applied decision, echoed in `/v1/complete`.
    decision_id: Option<String>,
    /// This request's route call id while the indexer may count its decision without this
    /// request knowing it (call pending, or failed after the indexer may have decided).
    unanswered_callout: Option<String>,
    /// The response's last byte passed the filter.
    response_done: bool,
    /// The end was reported (once, whichever end callback comes first).
    reported: bool,
    fail_open: Option<FailOpen>,
    scanner: Option<UsageScanner>,
    /// Host time (ns) the routed request left for its replica, while its first token is awaited.
    sent_at_ns: Option<u64>,
    /// Time to first token of a streamed response, microseconds (reported with the completion).
    ttft_us: Option<u64>,
    /// This request's online token check, when sampled.
    check: Option<OnlineCheck>,
    /// Shadow mode: the indexer's answer was recorded, not applied.
    shadow: bool,
    /// Where the proxy really sent a shadowed request (`upstream.address`).
    upstream: Option<String>,
    /// Earlier requests' completion reports riding on this stream's route call, until its
    /// answer shows they reached the indexer.
    carried: Vec<CompleteReport>,
}

impl Stream {
    /// A stream with the host's id `id`; without a plugin (not configured) the stream only strips
    /// the destination header.
    pub fn new(id: u64, plugin: Option<Arc<Plugin>>) -> Self {
        Self {
            id,
            plugin,
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
            shadow: false,
            upstream: None,
            carried: Vec::new(),
        }
    }

    /// The fail-open reason of this request, if it failed open.
    pub fn fail_open_reason(&self) -> Option<FailOpen> {
        self.fail_open
    }

    /// The replica endpoint the request was routed to.
    pub fn routed_to(&self) -> Option<&str> {
        self.routed_to.as_deref()
    }

    /// Request headers arrived (`end_of_stream`: there is no body).
    pub fn on_request_headers(&mut self, host: &mut impl StreamHost, end_of_stream: bool) -> Flow {
        if !self.strip_dst_header(host) {
            host.increment(Counter::StripFailedRejected.into());
            return self.reject(
                host,
                503,
                "kvroute_header_strip_failed",
                "request refused by the router",
            );
        }
        let Some(plugin) = self.plugin.clone() else {
            return Flow::Continue;
        };
        let method = host.header_text(Headers::Request, ":method");
        let path = host.header_text(Headers::Request, ":path");
        let (Some(method), Some(path)) = (method, path) else {
            return Flow::Continue;
        };
        if method != "POST" || !plugin.cfg.routes_path(&path) {
            return Flow::Continue;
        }
        self.path = path;
        host.increment(Counter::Requests.into());
        let rid = host.header_text(Headers::Request, "x-request-id");
        self.request_id = request_id(rid.as_deref(), self.id, host.now_nanos().unwrap_or(0));
        if !plugin.cfg.session_header.is_empty() {
            self.session = host
                .header_text(Headers::Request, &plugin.cfg.session_header)
                .filter(|s| !s.is_empty() && s.len() <= MAX_SESSION_BYTES);
        }
        if end_of_stream {
            host.increment(Counter::NoBody.into());
            return Flow::Continue;
        }
        let declared = host
            .header_text(Headers::Request, "content-length")
            .and_then(|v| v.trim().parse::<usize>().ok());
        if declared.is_some_and(|n| n > plugin.cfg.upstream_max_body_bytes) {
            // Answered once that much arrived: a reply before the upload ends is lost in the
            // reset of the connection when most of the body is still unread.
            self.phase = Phase::Oversized;
            return Flow::Pause;
        }
        if declared.is_some_and(|n| n > plugin.cfg.max_body_bytes) {
            return self.oversized(host, &plugin);
        }
        self.phase = Phase::Buffering;
        Flow::Pause
    }

    /// Request body data arrived; `body_size` is the size of what the host buffered so far.
    pub fn on_request_body(
        &mut self,
        host: &mut impl StreamHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Flow {
        match self.phase {
            Phase::Buffering | Phase::Oversized => {}
            Phase::Rejected | Phase::AwaitingRoute { .. } => return Flow::Pause,
            Phase::Passthrough => return Flow::Continue,
        }
        let Some(plugin) = self.plugin.clone() else {
            return Flow::Continue;
        };
        if body_size > plugin.cfg.upstream_max_body_bytes {
            return self.too_large_for_engines(host);
        }
        if matches!(self.phase, Phase::Oversized) {
            return if end_of_stream {
                self.oversized(host, &plugin)
            } else {
                Flow::Pause
            };
        }
        if body_size > plugin.cfg.max_body_bytes {
            if plugin.cfg.oversized_body == OversizedBody::Reject || end_of_stream {
                return self.oversized(host, &plugin);
            }
            self.phase = Phase::Oversized;
            return Flow::Pause;
        }
        if !end_of_stream {
            return Flow::Pause;
        }
        let raw = match host.read_body(Body::Request, body_size) {
            Ok(b) => b,
            Err(e) => {
                hlog!(host, Warn, "kvroute: cannot read the request body: {e}");
                self.note_fail_open(host, &plugin, FailOpen::HostcallError);
                return Flow::Continue;
            }
        };
        match self.start_route(host, &plugin, raw) {
            Ok(()) => Flow::Pause,
            Err(reason) => {
                self.note_fail_open(host, &plugin, reason);
                Flow::Continue
            }
        }
    }

    /// Request trailers arrived: a body that ends with trailers is routed with what was buffered.
    pub fn on_request_trailers(&mut self, host: &mut impl StreamHost) -> Flow {
        let Some(plugin) = self.plugin.clone() else {
            return Flow::Continue;
        };
        match self.phase {
            Phase::Buffering => {}
            Phase::Oversized => return self.oversized(host, &plugin),
            _ => return Flow::Continue,
        }
        let raw = match host.read_body(Body::Request, plugin.cfg.max_body_bytes) {
            Ok(b) => b,
            Err(_) => {
                self.note_fail_open(host, &plugin, FailOpen::HostcallError);
                return Flow::Continue;
            }
        };
        // The body cannot be rewritten once trailers arrived; route without injection.
        match self.start_route(host, &plugin, raw) {
            Ok(()) => {
                self.body = None;
                Flow::Pause
            }
            Err(reason) => {
                self.note_fail_open(host, &plugin, reason);
                Flow::Continue
            }
        }
    }

    /// A callout of this stream answered. Applies a route answer (or fails open) and resumes.
    pub fn on_call_reply(&mut self, host: &mut impl StreamHost, call: CallId, reply: &CallReply) {
        let Phase::AwaitingRoute {
            call: awaited,
            started_ns,
        } = self.phase
        else {
            return;
        };
        if awaited != call {
            return;
        }
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        self.phase = Phase::Passthrough;
        self.settle_carried(host, &plugin, reply);
        match self.apply_route(host, &plugin, reply, started_ns) {
            Ok(()) if self.shadow => host.increment(Counter::Shadowed.into()),
            Ok(()) => host.increment(Counter::Routed.into()),
            Err(reason) => self.note_fail_open(host, &plugin, reason),
        }
        if let Err(e) = host.resume_request() {
            hlog!(
                host,
                Error,
                "kvroute: cannot resume request {}: {e}",
                self.request_id
            );
        }
    }

    /// Response headers arrived (`end_of_stream`: there is no body).
    pub fn on_response_headers(&mut self, host: &mut impl StreamHost, end_of_stream: bool) -> Flow {
        if end_of_stream {
            self.response_done = true;
        }
        let Some(plugin) = self.plugin.clone() else {
            return Flow::Continue;
        };
        if plugin.cfg.debug_headers {
            if let Some(DecisionShown { replica, reason }) = &self.decision {
                if let Some(r) = replica {
                    let _ = host.set_header(Headers::Response, self.replica_header(), r);
                }
                if let Some(r) = reason {
                    let _ = host.set_header(Headers::Response, DBG_REASON, r);
                }
            }
            if let Some(f) = self.fail_open {
                let _ = host.set_header(Headers::Response, DBG_FAIL_OPEN, f.as_str());
            }
        }
        if let Some(check) = &mut self.check {
            check.on_response_headers(host);
        }
        if self.shadow && self.upstream.is_none() {
            self.upstream = host.upstream_address();
        }
        if self.routed_to.is_some() && plugin.cfg.report_completion {
            let streaming = host
                .header_text(Headers::Response, "content-type")
                .is_some_and(|c| c.contains("text/event-stream"));
            self.scanner = Some(UsageScanner::new(
                plugin.cfg.max_response_scan_bytes,
                streaming,
            ));
        }
        Flow::Continue
    }

    /// A response body chunk of `chunk_size` bytes passed.
    pub fn on_response_body(
        &mut self,
        host: &mut impl StreamHost,
        chunk_size: usize,
        end_of_stream: bool,
    ) -> Flow {
        let chunk_size = match (&mut self.check, &self.plugin) {
            (Some(check), Some(plugin)) => {
                match check.on_response_body(host, plugin, chunk_size, end_of_stream) {
                    (Flow::Continue, size) => size,
                    (Flow::Pause, _) => return Flow::Pause,
                }
            }
            _ => chunk_size,
        };
        if end_of_stream {
            self.response_done = true;
        }
        // The first bytes of a stream carry the first token; a whole JSON body says nothing of it.
        if chunk_size > 0 && self.scanner.as_ref().is_some_and(UsageScanner::streaming) {
            if let Some(sent) = self.sent_at_ns.take() {
                if let Some(now) = host.now_nanos() {
                    self.ttft_us = Some(now.saturating_sub(sent) / 1_000);
                }
            }
        }
        if let Some(scanner) = &mut self.scanner {
            if host
                .visit_body(Body::Response, chunk_size, &mut |part| scanner.push(part))
                .is_err()
            {
                self.scanner = None;
            }
        }
        Flow::Continue
    }

    /// Response trailers arrived: the response is complete.
    pub fn on_response_trailers(&mut self, _host: &mut impl StreamHost) -> Flow {
        self.response_done = true;
        Flow::Continue
    }

    /// The stream is going away (completed, reset, or logged): reports its end once, whichever
    /// of the host's end callbacks calls first.
    pub fn on_stream_end(&mut self, host: &mut impl StreamHost) {
        if let Some(plugin) = self.plugin.clone() {
            self.report_end(host, &plugin);
        }
    }

    /// Removes any client-supplied destination header. Returns false when that was impossible
    /// (the caller then refuses the request rather than let a client pick the upstream).
    fn strip_dst_header(&self, host: &mut impl StreamHost) -> bool {
        for name in DESTINATION_HEADERS {
            let present = !matches!(host.header(Headers::Request, name), Ok(None));
            if !present {
                continue;
            }
            match host.remove_header(Headers::Request, name) {
                Ok(()) => {
                    if self.plugin.is_some() {
                        host.increment(Counter::SpoofedHeaderRemoved.into());
                    }
                }
                Err(e) => {
                    hlog!(
                        host,
                        Error,
                        "kvroute: cannot remove a client {name} ({e}); refusing"
                    );
                    return false;
                }
            }
        }
        true
    }

    fn reject(
        &mut self,
        host: &mut impl StreamHost,
        status: u32,
        details: &str,
        message: &str,
    ) -> Flow {
        self.phase = Phase::Rejected;
        let body =
            serde_json::json!({"error": {"message": message, "type": details, "code": status}})
                .to_string();
        if let Err(e) = host.send_local_reply(
            status,
            details,
            body.as_bytes(),
            &[("content-type", "application/json")],
        ) {
            hlog!(
                host,
                Error,
                "kvroute: cannot send local reply {status}: {e}"
            );
        }
        Flow::Pause
    }

    /// Records a fail-open; the header is already absent (stripped at request headers, and only
    /// ever set as the last step of a successful route).
    fn note_fail_open(&mut self, host: &mut impl StreamHost, plugin: &Plugin, reason: FailOpen) {
        self.fail_open = Some(reason);
        self.body = None;
        self.phase = Phase::Passthrough;
        host.increment(reason.into());
        if plugin.cfg.debug_headers {
            let _ = host.set_header(Headers::Request, DBG_FAIL_OPEN, reason.as_str());
        }
        hlog!(
            host,
            Debug,
            "kvroute: request {} fails open: {}",
            self.request_id,
            reason.as_str()
        );
    }

    /// 413 for a body the engines would refuse (over `upstream_max_body_bytes`).
    fn too_large_for_engines(&mut self, host: &mut impl StreamHost) -> Flow {
        host.increment(Counter::RejectedTooLarge.into());
        self.reject(
            host,
            413,
            "kvroute_body_too_large",
            "request body exceeds the engines' limit",
        )
    }

    fn oversized(&mut self, host: &mut impl StreamHost, plugin: &Plugin) -> Flow {
        match plugin.cfg.oversized_body {
            OversizedBody::Reject => {
                host.increment(Counter::RejectedTooLarge.into());
                self.reject(
                    host,
                    413,
                    "kvroute_body_too_large",
                    "request body exceeds the router's limit",
                )
            }
            OversizedBody::FailOpen => {
                self.note_fail_open(host, plugin, FailOpen::TooLarge);
                Flow::Continue
            }
        }
    }

    /// Everything between the complete body and the callout. `Ok` = callout in flight.
    fn start_route(
        &mut self,
        host: &mut impl StreamHost,
        plugin: &Plugin,
        raw: Vec<u8>,
    ) -> Result<(), FailOpen> {
        let endpoint = endpoint_for_path(&self.path);
        let body = RequestBody::parse(&raw, endpoint).map_err(|_| FailOpen::NotJson)?;
        let model = body
            .fields()
            .get("model")
            .and_then(Value::as_str)
            .ok_or(FailOpen::NoModel)?
            .to_string();
        let loaded = match plugin.lookup(&model, host.now_millis()) {
            Lookup::Ready(m) => m,
            Lookup::NotReady => return Err(FailOpen::TokenizerNotReady),
            Lookup::Unknown => return Err(FailOpen::UnknownModel),
        };
        if loaded.check.mismatch() {
            return Err(FailOpen::TokenMismatch);
        }
        let t0 = host.now_nanos().unwrap_or(0);
        let mut prepared = loaded.prepare(endpoint, &body).map_err(|e| {
            hlog!(
                host,
                Debug,
                "kvroute: request {} not tokenised: {e}",
                self.request_id
            );
            match e {
                PrepareError::TooLong(_) => FailOpen::PromptTooLong,
                PrepareError::Invalid(_) => FailOpen::TokenizeError,
            }
        })?;
        if let Some(t1) = host.now_nanos() {
            host.record(Histogram::PrepareUs, t1.saturating_sub(t0) / 1000);
        }
        self.check = OnlineCheck::plan(
            plugin,
            &loaded,
            &model,
            endpoint,
            body.fields(),
            &mut prepared,
        );
        let callout = next_callout_id(host.now_nanos());
        let route = RouteRequest {
            model,
            router_keys: Some(prepared.router_keys),
            num_tokens: Some(prepared.num_tokens),
            block_size: u32::try_from(loaded.block_size).ok(),
            request_id: Some(self.request_id.clone()),
            callout_id: Some(callout.clone()),
            max_tokens: max_tokens_of(body.fields()),
            lora: prepared.lora,
            session: self.session.clone(),
            shadow: plugin.cfg.mode == Mode::Shadow,
            partial: prepared.partial,
            completed: plugin.take_held(),
            ..RouteRequest::default()
        };
        self.shadow = route.shadow;
        let payload = serde_json::to_vec(&route);
        self.carried = route.completed;
        let Ok(payload) = payload else {
            self.give_back_carried(host, plugin);
            return Err(FailOpen::HostcallError);
        };
        let headers = indexer_post_headers(&plugin.cfg, "/v1/route");
        let dispatched = host.dispatch(&Callout {
            cluster: &plugin.cfg.indexer_cluster,
            headers: &headers,
            body: Some(&payload),
            timeout: Duration::from_millis(plugin.cfg.route_timeout_ms),
        });
        let call = dispatched.map_err(|e| {
            hlog!(host, Warn, "kvroute: route callout not dispatched: {e}");
            self.give_back_carried(host, plugin);
            if e == HostError::UnknownCluster {
                FailOpen::IndexerUnavailable
            } else {
                FailOpen::HostcallError
            }
        })?;
        self.phase = Phase::AwaitingRoute {
            call,
            started_ns: host.now_nanos().unwrap_or(0),
        };
        self.unanswered_callout = Some(callout);
        let check_rewrites = self.check.as_ref().is_some_and(OnlineCheck::needs_rewrite);
        if plugin.cfg.inject_kv_cache_report_mode || check_rewrites {
            self.body = Some((raw, body));
        }
        Ok(())
    }

    /// Applies a route answer. `Err` = fail open (header not set).
    fn apply_route(
        &mut self,
        host: &mut impl StreamHost,
        plugin: &Plugin,
        reply: &CallReply,
        started_ns: u64,
    ) -> Result<(), FailOpen> {
        let elapsed_us = host.now_nanos().unwrap_or(0).saturating_sub(started_ns) / 1000;
        host.record(Histogram::RouteCallUs, elapsed_us);
        let elapsed = elapsed_us / 1000;
        let answer = parse_route_answer(
            reply.status,
            reply.contract.as_deref(),
            &reply.body,
            elapsed,
            plugin.cfg.route_timeout_ms,
        )
        .inspect_err(|reason| {
            if *reason == FailOpen::ContractMismatch {
                hlog!(
                    host,
                    Error,
                    "kvroute: the indexer speaks kvroute contract {:?}, this filter {}: \
                     run a filter and an indexer of the same release; failing open",
                    reply.contract.as_deref().unwrap_or("(refused ours)"),
                    kvroute_core::api::CONTRACT_VERSION
                );
            }
            if !route_may_be_counted(reply.status) {
                self.unanswered_callout = None;
            }
        })?;
        // The indexer counted this request in flight: report its end whatever happens next.
        self.unanswered_callout = None;
        plugin.note_indexer_hold(answer.report_hold_ms);
        self.decision_id = answer.decision_id.clone();
        self.routed_to = Some(answer.endpoint.clone());
        self.sent_at_ns = host.now_nanos();
        // Shadow mode never sets the destination: Envoy's own load balancer decides.
        if !self.shadow {
            let destinations = std::iter::once(&answer.endpoint)
                .chain(&answer.alternates)
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(",");
            for (name, value) in [
                (DST_HEADER, answer.endpoint.as_str()),
                (DESTINATIONS_HEADER, destinations.as_str()),
            ] {
                host.set_header(Headers::Request, name, value)
                    .map_err(|e| {
                        hlog!(host, Warn, "kvroute: cannot set {name}: {e}");
                        FailOpen::HostcallError
                    })?;
            }
        }
        if plugin.cfg.debug_headers {
            if let Some(r) = &answer.replica {
                let _ = host.set_header(Headers::Request, self.replica_header(), r);
            }
            if let Some(r) = &answer.reason {
                let _ = host.set_header(Headers::Request, DBG_REASON, r);
            }
            if let Some(m) = answer.matched_gpu_tokens {
                let matched = if self.shadow {
                    DBG_SHADOW_MATCHED
                } else {
                    DBG_MATCHED
                };
                let _ = host.set_header(Headers::Request, matched, &m.to_string());
            }
        }
        self.decision = Some(DecisionShown {
            replica: answer.replica,
            reason: answer.reason,
        });
        if let Some((raw, parsed)) = self.body.take() {
            rewrite_body(host, plugin, self.check.as_mut(), &raw, &parsed);
        }
        Ok(())
    }

    /// The debug header naming kvroute's choice: where the request went when routing, where it
    /// would have gone in shadow mode.
    fn replica_header(&self) -> &'static str {
        if self.shadow {
            DBG_SHADOW_REPLICA
        } else {
            DBG_REPLICA
        }
    }

    /// Reports the request's end once: a completion (abandoned when the response did not end) of
    /// the decision applied, or the abandonment of a route call whose answer was never used. The
    /// report is held to ride on a later route call (see [`crate::completions`]).
    fn report_end(&mut self, host: &mut impl StreamHost, plugin: &Plugin) {
        // A route call still pending when the stream goes may not deliver what it carries.
        self.give_back_carried(host, plugin);
        if self.reported || !plugin.cfg.report_completion {
            return;
        }
        let report = if let Some(endpoint) = &self.routed_to {
            let cached = self
                .scanner
                .as_ref()
                .filter(|_| self.response_done)
                .and_then(UsageScanner::cached_tokens);
            if !self.response_done {
                host.increment(Counter::Abandoned.into());
            }
            if self.shadow && self.upstream.is_none() {
                self.upstream = host.upstream_address();
            }
            complete_report(&Completion {
                decision_id: self.decision_id.as_deref(),
                request_id: &self.request_id,
                endpoint,
                cached_tokens: cached,
                ttft_us: self.ttft_us,
                abandoned: !self.response_done,
                upstream: self.upstream.as_deref(),
            })
        } else if let Some(callout) = &self.unanswered_callout {
            host.increment(Counter::Abandoned.into());
            abandon_report(callout, &self.request_id)
        } else {
            return;
        };
        self.reported = true;
        if let Some(due) = plugin.report_end(report, host.now_millis()) {
            // The stream dies right after this call: the reports must outlive it.
            send_reports(host, &plugin.cfg, &due, |h, call| h.dispatch_detached(call));
        }
    }

    /// The route call's answer came: reports it carried reached the indexer when the answer is
    /// the indexer's (it applies them before deciding, whatever it answers); otherwise (a reset,
    /// Envoy's timeout or its own error) they are held again, to go with a later call.
    fn settle_carried(&mut self, host: &mut impl StreamHost, plugin: &Plugin, reply: &CallReply) {
        if reply.contract.is_none() {
            self.give_back_carried(host, plugin);
            return;
        }
        for _ in std::mem::take(&mut self.carried) {
            host.increment(Counter::CompleteSent.into());
            host.increment(Counter::CompleteCarried.into());
        }
    }

    /// Holds the carried reports again (sending everything held when that fills the queue).
    fn give_back_carried(&mut self, host: &mut impl StreamHost, plugin: &Plugin) {
        if self.carried.is_empty() {
            return;
        }
        let carried = std::mem::take(&mut self.carried);
        if let Some(due) = plugin.give_back(carried, host.now_millis()) {
            send_reports(host, &plugin.cfg, &due, |h, call| h.dispatch_detached(call));
        }
    }
}

/// Adds `kv_cache_report_mode` (when configured) and the online check's `return_token_ids` (when
/// sampled) to the body and fixes content-length; on any failure the original body and length
/// are kept (the request is still routed).
fn rewrite_body(
    host: &mut impl StreamHost,
    plugin: &Plugin,
    check: Option<&mut OnlineCheck>,
    raw: &[u8],
    parsed: &RequestBody,
) {
    let report_mode = plugin
        .cfg
        .inject_kv_cache_report_mode
        .then(|| inject_kv_cache_report_mode(raw, parsed))
        .flatten();
    let new_body = match check.filter(|c| c.needs_rewrite()) {
        Some(check) => check
            .rewrite(report_mode.as_deref().unwrap_or(raw))
            .or(report_mode),
        None => report_mode,
    };
    let Some(new_body) = new_body else {
        return;
    };
    let had_length = matches!(host.header(Headers::Request, "content-length"), Ok(Some(_)));
    if had_length {
        if let Err(e) = host.set_header(
            Headers::Request,
            "content-length",
            &new_body.len().to_string(),
        ) {
            hlog!(
                host,
                Warn,
                "kvroute: body not rewritten, content-length not settable: {e}"
            );
            return;
        }
    }
    if let Err(e) = host.replace_body(Body::Request, raw.len(), &new_body) {
        hlog!(host, Warn, "kvroute: body not rewritten: {e}");
        if had_length {
            let _ = host.set_header(Headers::Request, "content-length", &raw.len().to_string());
        }
        return;
    }
    host.increment(Counter::BodyRewritten.into());
}

/// A route call id unique to this process (seeded with the time of its first call).
fn next_callout_id(now_nanos: Option<u64>) -> String {
    static SEED: AtomicU64 = AtomicU64::new(0);
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let candidate = now_nanos.unwrap_or(1).max(1);
    let seed = match SEED.compare_exchange(0, candidate, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => candidate,
        Err(current) => current,
    };
    callout_id(seed, SEQ.fetch_add(1, Ordering::Relaxed))
}
