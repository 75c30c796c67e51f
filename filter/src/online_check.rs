//! The online check of one sampled request, over the [`StreamHost`] seam: planned after tokenisation, armed when the
//! body asks the engine for the prompt's ids, then fed the response (ids read and taken out, see
//! [`crate::token_check`]) and reported to the indexer with the model's digest
//! (`POST /v1/models/{model}/agreement`). A disagreement marks the model: its next requests fail
//! open as `token_mismatch`.

use std::sync::Arc;

use kvroute_core::api::{AgreementReport, TokenCheck};
use kvroute_core::request::Endpoint;
use serde_json::Value;

use crate::agreement::send_report;
use crate::hlog;
use crate::loaded_model::{LoadedModel, Prepared};
use crate::metrics::Counter;
use crate::models::log_name;
use crate::plugin::Plugin;
use crate::seam::{Body, Flow, Headers, StreamHost};
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
#[derive(Debug)]
pub struct OnlineCheck {
    model: Arc<LoadedModel>,
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
        plugin: &Plugin,
        model: &Arc<LoadedModel>,
        model_name: &str,
        endpoint: Endpoint,
        body: &Value,
        prepared: &mut Prepared,
    ) -> Option<Self> {
        let cfg = &plugin.cfg.token_check;
        let asked = client_asked(body);
        if !model.check.sample(cfg) {
            return None;
        }
        let own = prepared
            .tokens
            .take()
            .filter(|t| t.len() <= cfg.max_prompt_tokens)?;
        Some(Self {
            model: Arc::clone(model),
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
    pub fn on_response_headers(&mut self, host: &mut impl StreamHost) {
        if !self.armed {
            self.reader = Reader::Off;
            return;
        }
        if host.header_text(Headers::Response, ":status").as_deref() != Some("200") {
            self.reader = Reader::Off;
            return;
        }
        let streaming = host
            .header_text(Headers::Response, "content-type")
            .is_some_and(|c| c.contains("text/event-stream"));
        self.reader = if streaming {
            Reader::Stream(StreamIds::new(self.strip, self.max_response_bytes))
        } else {
            if self.strip {
                let _ = host.remove_header(Headers::Response, "content-length");
            }
            Reader::Body
        };
    }

    /// A response body chunk of `chunk_size` bytes. [`Flow::Pause`]: hold it (a whole body is
    /// read at its end); otherwise pass it on, with the size it now has.
    pub fn on_response_body(
        &mut self,
        host: &mut impl StreamHost,
        plugin: &Plugin,
        chunk_size: usize,
        end: bool,
    ) -> (Flow, usize) {
        match &mut self.reader {
            Reader::Pending | Reader::Off => (Flow::Continue, chunk_size),
            Reader::Body => {
                if !end {
                    if chunk_size > self.max_response_bytes {
                        // Too large to hold: pass it on as it is; the check is dropped.
                        self.reader = Reader::Off;
                        host.increment(Counter::TokenCheckIncomplete.into());
                        return (Flow::Continue, chunk_size);
                    }
                    return (Flow::Pause, chunk_size);
                }
                let Ok(whole) = host.read_body(Body::Response, chunk_size) else {
                    self.reader = Reader::Off;
                    host.increment(Counter::TokenCheckIncomplete.into());
                    return (Flow::Continue, chunk_size);
                };
                let (ids, rewritten) = take_from_body(&whole, self.strip);
                let size = match rewritten {
                    Some(b) if host.replace_body(Body::Response, chunk_size, &b).is_ok() => b.len(),
                    _ => chunk_size,
                };
                self.reader = Reader::Off;
                self.conclude(host, plugin, ids.as_deref());
                (Flow::Continue, size)
            }
            Reader::Stream(stream) => {
                let chunk = host
                    .read_body(Body::Response, chunk_size)
                    .unwrap_or_default();
                let out = stream.push(&chunk, end);
                let size = if out == chunk {
                    chunk_size
                } else if host.replace_body(Body::Response, chunk_size, &out).is_ok() {
                    out.len()
                } else {
                    chunk_size
                };
                if end {
                    let ids = stream.prompt_ids().map(<[u32]>::to_vec);
                    self.reader = Reader::Off;
                    self.conclude(host, plugin, ids.as_deref());
                }
                (Flow::Continue, size)
            }
        }
    }

    /// Compares, counts, marks the model on a disagreement, and reports to the indexer.
    fn conclude(&mut self, host: &mut impl StreamHost, plugin: &Plugin, engine: Option<&[u32]>) {
        let Some(engine) = engine else {
            host.increment(Counter::TokenCheckIncomplete.into());
            return;
        };
        let check = TokenCheck::compare(endpoint_name(self.endpoint), &self.own, engine);
        if check.agrees() {
            host.increment(Counter::TokenCheckAgreed.into());
        } else {
            host.increment(Counter::TokenCheckDisagreed.into());
            if !self.model.check.mismatch() {
                hlog!(
                    host,
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
        // The stream ends soon after: the report must outlive it.
        send_report(host, &plugin.cfg, &self.model_name, &report, |h, call| {
            h.dispatch_detached(call)
        });
    }
}
