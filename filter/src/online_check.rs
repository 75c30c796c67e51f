//! The online check of one sampled request, host side: planned after tokenisation, armed when the
//! body asks the engine for the prompt's ids, then fed the response (ids read and taken out, see
//! [`crate::token_check`]) and reported to the indexer with the model's digest
//! (`POST /v1/models/{model}/agreement`). A disagreement marks the model: its next requests fail
//! open as `token_mismatch`.

use std::rc::Rc;
use std::time::Duration;

use kvroute_core::api::{AgreementReport, TokenCheck, CONTRACT_HEADER, CONTRACT_VERSION_STR};
use kvroute_core::request::Endpoint;
use serde_json::Value;

use crate::engine::{LoadedModel, Prepared};
use crate::hlog;
use crate::host::{self, Buffer, Map};
use crate::metrics::Counter;
use crate::models::log_name;
use crate::root_context::{percent_encode, Shared};
use crate::token_check::{
    add_return_token_ids, client_asked, endpoint_name, take_from_body, StreamIds,
};

/// How the response is read.
#[derive(Debug)]
enum Reader {
    /// Not yet known (before the response headers).
    Pending,
    /// A whole JSON body, held to its end.
    Body,
    /// A server-sent-event stream.
    Stream(StreamIds),
    /// The check was dropped (the response is not one to read).
    Off,
}

/// One sampled request's check.
pub struct OnlineCheck {
    /// The stream's context id.
    context_id: u32,
    model: Rc<LoadedModel>,
    model_name: String,
    endpoint: Endpoint,
    own: Vec<u32>,
    /// The filter added `return_token_ids` (and takes the ids out again).
    strip: bool,
    /// The engine will be asked (the client asked, or the body was rewritten).
    armed: bool,
    reader: Reader,
    max_response_bytes: usize,
}

impl OnlineCheck {
    /// The check of this request, if it is sampled: a single prompt no longer than
    /// `token_check.max_prompt_tokens`.
    pub fn plan(
        context_id: u32,
        shared: &Shared,
        model: &Rc<LoadedModel>,
        model_name: &str,
        endpoint: Endpoint,
        body: &Value,
        prepared: &mut Prepared,
    ) -> Option<Self> {
        let cfg = &shared.cfg.token_check;
        let asked = client_asked(body);
        if !model.check.sample(cfg) {
            return None;
        }
        let own = prepared
            .tokens
            .take()
            .filter(|t| t.len() <= cfg.max_prompt_tokens)?;
        Some(Self {
            context_id,
            model: Rc::clone(model),
            model_name: model_name.to_string(),
            endpoint,
            own,
            strip: !asked,
            armed: asked,
            reader: Reader::Pending,
            max_response_bytes: cfg.max_response_bytes,
        })
    }

    /// The body must be rewritten to ask the engine for the ids.
    pub fn needs_rewrite(&self) -> bool {
        self.strip
    }

    /// Adds `return_token_ids` to `body` (the request body about to be sent); `None` leaves the
    /// check unarmed (it then reads nothing).
    pub fn rewrite(&mut self, body: &[u8]) -> Option<Vec<u8>> {
        let out = add_return_token_ids(body)?;
        self.armed = true;
        Some(out)
    }

    /// The response headers: chooses how to read the body; a whole body that will be rewritten
    /// loses its `content-length`.
    pub fn on_response_headers(&mut self) {
        if !self.armed {
            self.reader = Reader::Off;
            return;
        }
        let status = host::get_header(Map::ResponseHeaders, ":status")
            .ok()
            .flatten();
        if status.as_deref() != Some("200") {
            self.reader = Reader::Off;
            return;
        }
        let streaming = host::get_header(Map::ResponseHeaders, "content-type")
            .ok()
            .flatten()
            .is_some_and(|c| c.contains("text/event-stream"));
        self.reader = if streaming {
            Reader::Stream(StreamIds::new(self.strip, self.max_response_bytes))
        } else {
            if self.strip {
                let _ = host::remove_header(Map::ResponseHeaders, "content-length");
            }
            Reader::Body
        };
    }

    /// A response body chunk of `body_size` bytes. `None`: hold it (a whole body is read at its
    /// end); `Some(n)`: pass on, the chunk now has `n` bytes.
    pub fn on_response_body(
        &mut self,
        shared: &Shared,
        body_size: usize,
        end: bool,
    ) -> Option<usize> {
        match &mut self.reader {
            Reader::Pending | Reader::Off => Some(body_size),
            Reader::Body => {
                if !end {
                    if body_size > self.max_response_bytes {
                        // Too large to hold: pass it on as it is; the check is dropped.
                        self.reader = Reader::Off;
                        shared.metrics.inc(Counter::TokenCheckIncomplete);
                        return Some(body_size);
                    }
                    return None;
                }
                let whole = host::get_buffer(Buffer::ResponseBody, 0, body_size).ok()?;
                let (ids, rewritten) = take_from_body(&whole, self.strip);
                let size = match rewritten {
                    Some(b) if host::set_buffer(Buffer::ResponseBody, 0, body_size, &b).is_ok() => {
                        b.len()
                    }
                    _ => body_size,
                };
                self.reader = Reader::Off;
                self.conclude(shared, ids.as_deref());
                Some(size)
            }
            Reader::Stream(stream) => {
                let chunk =
                    host::get_buffer(Buffer::ResponseBody, 0, body_size).unwrap_or_default();
                let out = stream.push(&chunk, end);
                let size = if out == chunk {
                    body_size
                } else if host::set_buffer(Buffer::ResponseBody, 0, body_size, &out).is_ok() {
                    out.len()
                } else {
                    body_size
                };
                if end {
                    let ids = stream.prompt_ids().map(<[u32]>::to_vec);
                    self.reader = Reader::Off;
                    self.conclude(shared, ids.as_deref());
                }
                Some(size)
            }
        }
    }

    /// Compares, counts, marks the model on a disagreement, and reports to the indexer.
    fn conclude(&mut self, shared: &Shared, engine: Option<&[u32]>) {
        let Some(engine) = engine else {
            shared.metrics.inc(Counter::TokenCheckIncomplete);
            return;
        };
        let check = TokenCheck::compare(endpoint_name(self.endpoint), &self.own, engine);
        if check.agrees() {
            shared.metrics.inc(Counter::TokenCheckAgreed);
        } else {
            shared.metrics.inc(Counter::TokenCheckDisagreed);
            if !self.model.check.mismatch() {
                hlog!(
                    Error,
                    "kvroute: model {}: the engine's prompt tokens differ from the filter's ({} \
                     request: {} here, {} at the engine, first difference at {}); the model \
                     fails open as token_mismatch until its tokenizer is fixed",
                    log_name(&self.model_name),
                    check.endpoint,
                    check.own_tokens,
                    check.engine_tokens,
                    check.first_difference.unwrap_or_default()
                );
            }
            self.model.check.set_mismatch();
        }
        let report = AgreementReport {
            digest: self.model.digest().clone(),
            check: Some(check),
        };
        send_report(shared, &self.model_name, &report, Some(self.context_id));
    }
}

/// Issues `POST /v1/models/{model}/agreement`; from a stream context (`stream: Some(its id)`), on
/// the root context's behalf, so the report outlives the stream.
pub fn send_report(shared: &Shared, model: &str, report: &AgreementReport, stream: Option<u32>) {
    let Ok(body) = serde_json::to_vec(report) else {
        return;
    };
    let path = format!("/v1/models/{}/agreement", percent_encode(model));
    let headers = vec![
        (":method", "POST"),
        (":path", path.as_str()),
        (":authority", shared.cfg.indexer_authority.as_str()),
        ("content-type", "application/json"),
        (CONTRACT_HEADER, CONTRACT_VERSION_STR),
    ];
    let switched = stream.is_some() && host::set_effective_context(shared.root_id).is_ok();
    let sent = host::dispatch_http_call(
        &shared.cfg.indexer_cluster,
        headers,
        Some(&body),
        Duration::from_millis(shared.cfg.complete_timeout_ms),
    );
    if let (true, Some(id)) = (switched, stream) {
        let _ = host::set_effective_context(id);
    }
    if let Err(e) = sent {
        shared.metrics.inc(Counter::AgreementReportFailed);
        hlog!(
            Debug,
            "kvroute: agreement report of model {} not sent: {e}",
            log_name(model)
        );
    }
}
