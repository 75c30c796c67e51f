//! The filter's host seam over Envoy's dynamic-module callbacks for one request:
//! [`NativeStreamHost`] (the `StreamHost` of a stream, on its worker). The shared plugin's host is
//! `crate::config_host`.

use kvroute_filter::metrics::{Histogram, Metric};
use kvroute_filter::seam::{
    Body, CallId, Callout, Headers, Host, HostError, HostResult, Level, StreamHost,
};

use crate::abi::{self, CEnum};
use crate::config::NativeConfig;
use crate::config_host::{level, now_nanos, started, timeout_ms};
use crate::envoy::{self, CalloutRequest, Stream};

/// One request's host: the stream's headers, bodies and callouts (its worker thread, during a
/// hook).
pub struct NativeStreamHost<'a> {
    stream: Stream,
    config: &'a NativeConfig,
}

impl<'a> NativeStreamHost<'a> {
    /// The host of `stream` under `config`.
    pub fn new(stream: Stream, config: &'a NativeConfig) -> Self {
        Self { stream, config }
    }

    /// Bytes of `body` this hook sees: what Envoy buffered for the filter plus the chunk of this
    /// event (the filter is the first in the chain, so the two never overlap).
    pub fn body_size(&self, body: Body) -> usize {
        let (buffered, received) = body_kinds(body);
        self.stream.body_size(buffered) + self.stream.body_size(received)
    }
}

fn header_type(headers: Headers) -> CEnum {
    match headers {
        Headers::Request => abi::HEADER_TYPE_REQUEST_HEADER,
        Headers::Response => abi::HEADER_TYPE_RESPONSE_HEADER,
    }
}

/// (buffered, received) body types.
fn body_kinds(body: Body) -> (CEnum, CEnum) {
    match body {
        Body::Request => (
            abi::BODY_TYPE_BUFFERED_REQUEST,
            abi::BODY_TYPE_RECEIVED_REQUEST,
        ),
        Body::Response => (
            abi::BODY_TYPE_BUFFERED_RESPONSE,
            abi::BODY_TYPE_RECEIVED_RESPONSE,
        ),
    }
}

fn refused(what: &str) -> HostError {
    HostError::Failed(format!("Envoy refused {what}"))
}

impl Host for NativeStreamHost<'_> {
    fn now_nanos(&self) -> Option<u64> {
        now_nanos()
    }

    fn increment(&self, metric: Metric) {
        if let Some(id) = self.config.side.metrics.get(metric) {
            self.stream.increment(id);
        }
    }

    fn record(&self, histogram: Histogram, value: u64) {
        if let Some(id) = self.config.side.metrics.get(histogram.into()) {
            self.stream.record(id, value);
        }
    }

    fn log_enabled(&self, at: Level) -> bool {
        envoy::log_enabled(level(at))
    }

    fn log(&self, at: Level, message: &str) {
        envoy::log(level(at), message);
    }

    fn dispatch(&mut self, call: &Callout<'_>) -> HostResult<CallId> {
        started(self.stream.http_callout(&CalloutRequest {
            cluster: call.cluster,
            headers: call.headers,
            body: call.body.unwrap_or_default(),
            timeout_ms: timeout_ms(call),
        }))
    }
}

impl StreamHost for NativeStreamHost<'_> {
    fn header(&self, map: Headers, name: &str) -> HostResult<Option<Vec<u8>>> {
        Ok(self.stream.header(header_type(map), name))
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &str) -> HostResult<()> {
        if !self.stream.set_header(header_type(map), name, Some(value)) {
            return Err(refused("the header"));
        }
        if map == Headers::Request {
            // The route matches on the destination header (envoy/envoy-native.yaml).
            self.stream.clear_route_cache();
        }
        Ok(())
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> HostResult<()> {
        if !self.stream.set_header(header_type(map), name, None) {
            return Err(refused("the header removal"));
        }
        if map == Headers::Request {
            self.stream.clear_route_cache();
        }
        Ok(())
    }

    fn read_body(&self, body: Body, max: usize) -> HostResult<Vec<u8>> {
        let (buffered, received) = body_kinds(body);
        let mut out = Vec::with_capacity(self.body_size(body).min(max));
        self.stream
            .read_bodies(&[buffered, received], max, &mut out);
        Ok(out)
    }

    fn visit_body(&self, body: Body, max: usize, visit: &mut dyn FnMut(&[u8])) -> HostResult<()> {
        let (buffered, received) = body_kinds(body);
        self.stream.visit_bodies(&[buffered, received], max, visit);
        Ok(())
    }

    fn replace_body(&mut self, body: Body, current_len: usize, new: &[u8]) -> HostResult<()> {
        let (buffered, received) = body_kinds(body);
        let (held, arrived) = (
            self.stream.body_size(buffered),
            self.stream.body_size(received),
        );
        if held + arrived != current_len {
            return Err(HostError::Failed(format!(
                "only a whole body is replaced ({current_len} of {} bytes asked)",
                held + arrived
            )));
        }
        let drained = (held == 0 || self.stream.drain_body(buffered, held))
            && (arrived == 0 || self.stream.drain_body(received, arrived));
        // The new body goes where the next filter reads: this event's chunk when there is one
        // (it follows the emptied buffer), else the buffer.
        let into = if arrived > 0 { received } else { buffered };
        if !drained || !self.stream.append_body(into, new) {
            return Err(refused("the body"));
        }
        Ok(())
    }

    fn dispatch_detached(&mut self, call: &Callout<'_>) -> HostResult<()> {
        // Envoy cancels a stream's callouts when the stream goes: the configuration sends it.
        self.config.queue_detached(call).map_err(HostError::Failed)
    }

    fn send_local_reply(
        &mut self,
        status: u32,
        details: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> HostResult<()> {
        self.stream.send_response(status, headers, body, details);
        Ok(())
    }

    fn resume_request(&mut self) -> HostResult<()> {
        self.stream.continue_decoding();
        Ok(())
    }

    fn upstream_address(&self) -> Option<String> {
        let raw = self
            .stream
            .attribute_string(abi::ATTRIBUTE_ID_UPSTREAM_ADDRESS)?;
        kvroute_filter::seam::socket_address(&raw)
    }
}
