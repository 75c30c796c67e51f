//! The proxy-wasm adapter of one request: forwards the SDK's callbacks to [`Stream`] with a
//! [`WasmHost`], the [`StreamHost`] made of [`crate::host`]'s calls.

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::host::{self, Buffer, Map};
use crate::metrics::{Histogram, Metric, MetricIds};
use crate::plugin::Plugin;
use crate::seam::{
    Body, CallId, CallReply, Callout, Flow, Headers, Host, HostError, HostResult, Level, StreamHost,
};
use crate::stream::Stream;

/// What every context of one VM shares: the plugin (once configured) and the host's metric ids.
#[derive(Debug, Default)]
pub struct VmState {
    /// The plugin, `None` until `on_configure` succeeded.
    pub plugin: Option<std::sync::Arc<Plugin>>,
    /// Metric ids defined at `on_configure`.
    pub metrics: MetricIds<u32>,
    /// The root context id (owner of callouts that must outlive a stream).
    pub root_id: u32,
}

/// The proxy-wasm host of one context.
pub struct WasmHost<'a> {
    vm: &'a VmState,
    context_id: u32,
}

impl<'a> WasmHost<'a> {
    /// The host as seen from context `context_id`.
    pub fn new(vm: &'a VmState, context_id: u32) -> Self {
        Self { vm, context_id }
    }
}

fn map(headers: Headers) -> Map {
    match headers {
        Headers::Request => Map::RequestHeaders,
        Headers::Response => Map::ResponseHeaders,
    }
}

fn buffer(body: Body) -> Buffer {
    match body {
        Body::Request => Buffer::RequestBody,
        Body::Response => Buffer::ResponseBody,
    }
}

fn dispatch(call: &Callout<'_>) -> HostResult<CallId> {
    host::dispatch_http_call(call.cluster, call.headers.to_vec(), call.body, call.timeout)
        .map(|token| CallId(u64::from(token)))
        .map_err(|e| match e {
            // BadArgument: the cluster does not exist (or is not yet known to this worker).
            host::HostError::Status(2) => HostError::UnknownCluster,
            other => other.into(),
        })
}

/// Reads the answer of a callout inside `on_http_call_response` (no headers: reset or timeout).
pub fn call_reply(num_headers: usize, body_size: usize) -> CallReply {
    let header = |name| {
        if num_headers == 0 {
            return None;
        }
        host::get_header(Map::CallResponseHeaders, name)
            .ok()
            .flatten()
    };
    CallReply {
        status: crate::protocol::parse_status(header(":status").as_deref()),
        contract: header(kvroute_core::api::CONTRACT_HEADER),
        body: host::get_buffer(Buffer::CallResponseBody, 0, body_size).unwrap_or_default(),
    }
}

impl Host for WasmHost<'_> {
    fn now_nanos(&self) -> Option<u64> {
        host::now_nanos().ok()
    }

    fn increment(&self, metric: Metric) {
        if let Some(id) = self.vm.metrics.get(metric) {
            let _ = host::increment_metric(id, 1);
        }
    }

    fn record(&self, histogram: Histogram, value: u64) {
        if let Some(id) = self.vm.metrics.get(histogram.into()) {
            let _ = host::record_metric(id, value);
        }
    }

    fn log(&self, level: Level, message: &str) {
        host::log(level, message);
    }

    fn dispatch(&mut self, call: &Callout<'_>) -> HostResult<CallId> {
        dispatch(call)
    }
}

impl StreamHost for WasmHost<'_> {
    fn header(&self, headers: Headers, name: &str) -> HostResult<Option<Vec<u8>>> {
        Ok(host::get_header_bytes(map(headers), name)?)
    }

    fn set_header(&mut self, headers: Headers, name: &str, value: &str) -> HostResult<()> {
        Ok(host::set_header(map(headers), name, value)?)
    }

    fn remove_header(&mut self, headers: Headers, name: &str) -> HostResult<()> {
        Ok(host::remove_header(map(headers), name)?)
    }

    fn read_body(&self, body: Body, max: usize) -> HostResult<Vec<u8>> {
        Ok(host::get_buffer(buffer(body), 0, max)?)
    }

    fn replace_body(&mut self, body: Body, current_len: usize, new: &[u8]) -> HostResult<()> {
        Ok(host::set_buffer(buffer(body), 0, current_len, new)?)
    }

    fn dispatch_detached(&mut self, call: &Callout<'_>) -> HostResult<()> {
        // Envoy cancels a dying stream context's callouts: issue it on the root context's behalf.
        let switched = host::set_effective_context(self.vm.root_id).is_ok();
        let sent = dispatch(call);
        if switched {
            let _ = host::set_effective_context(self.context_id);
        }
        sent.map(|_| ())
    }

    fn send_local_reply(
        &mut self,
        status: u32,
        details: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> HostResult<()> {
        Ok(host::send_local_response(status, details, body, headers)?)
    }

    fn resume_request(&mut self) -> HostResult<()> {
        Ok(host::resume_request()?)
    }

    fn upstream_address(&self) -> Option<String> {
        let raw = host::get_property(&["upstream", "address"]).ok()??;
        crate::seam::socket_address(&raw)
    }
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

/// One request's proxy-wasm context.
pub struct KvRouteHttp {
    id: u32,
    vm: Rc<VmState>,
    stream: Stream,
}

impl KvRouteHttp {
    /// A context for one request.
    pub fn new(id: u32, vm: Rc<VmState>) -> Self {
        let stream = Stream::new(u64::from(id), vm.plugin.clone());
        Self { id, vm, stream }
    }
}

impl Context for KvRouteHttp {
    fn on_done(&mut self) -> bool {
        // The stream is going away (also on a reset while the route call is pending): report now,
        // in case no access-log callback follows.
        self.stream
            .on_stream_end(&mut WasmHost::new(&self.vm, self.id));
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let reply = call_reply(num_headers, body_size);
        self.stream.on_call_reply(
            &mut WasmHost::new(&self.vm, self.id),
            CallId(u64::from(token_id)),
            &reply,
        );
    }
}

impl HttpContext for KvRouteHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(
            self.stream
                .on_request_headers(&mut WasmHost::new(&self.vm, self.id), end_of_stream),
        )
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_request_body(
            &mut WasmHost::new(&self.vm, self.id),
            body_size,
            end_of_stream,
        ))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(
            self.stream
                .on_request_trailers(&mut WasmHost::new(&self.vm, self.id)),
        )
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(
            self.stream
                .on_response_headers(&mut WasmHost::new(&self.vm, self.id), end_of_stream),
        )
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_response_body(
            &mut WasmHost::new(&self.vm, self.id),
            body_size,
            end_of_stream,
        ))
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        action(
            self.stream
                .on_response_trailers(&mut WasmHost::new(&self.vm, self.id)),
        )
    }

    fn on_log(&mut self) {
        self.stream
            .on_stream_end(&mut WasmHost::new(&self.vm, self.id));
    }
}
