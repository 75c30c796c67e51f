//! One HTTP stream: forwards Envoy's per-stream hooks to the filter's shared logic
//! ([`kvroute_filter::stream::Stream`]) with a [`NativeStreamHost`], and maps its [`Flow`] to the
//! ABI's statuses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_filter::seam::{Body, CallId, CallReply, Flow};
use kvroute_filter::stream::Stream;

use crate::abi::{self, CEnum};
use crate::config::NativeConfig;
use crate::envoy;
use crate::host::NativeStreamHost;

/// Stream ids for generated request ids, unique in the process.
static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// One stream's filter.
pub struct StreamFilter {
    config: Arc<NativeConfig>,
    stream: Stream,
}

fn headers_status(flow: Flow) -> CEnum {
    match flow {
        Flow::Continue => abi::HEADERS_CONTINUE,
        Flow::Pause => abi::HEADERS_STOP_ITERATION,
    }
}

fn body_status(flow: Flow) -> CEnum {
    match flow {
        Flow::Continue => abi::BODY_CONTINUE,
        Flow::Pause => abi::BODY_STOP_AND_BUFFER,
    }
}

fn trailers_status(flow: Flow) -> CEnum {
    match flow {
        Flow::Continue => abi::TRAILERS_CONTINUE,
        Flow::Pause => abi::TRAILERS_STOP_ITERATION,
    }
}

impl StreamFilter {
    /// A stream under `config`, sharing its plugin.
    pub fn new(config: Arc<NativeConfig>) -> Self {
        let id = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        let stream = Stream::new(id, Some(Arc::clone(&config.plugin)));
        Self { config, stream }
    }

    pub fn on_request_headers(&mut self, envoy: envoy::Stream, end_of_stream: bool) -> CEnum {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        headers_status(self.stream.on_request_headers(&mut host, end_of_stream))
    }

    pub fn on_request_body(&mut self, envoy: envoy::Stream, end_of_stream: bool) -> CEnum {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        let size = host.body_size(Body::Request);
        body_status(self.stream.on_request_body(&mut host, size, end_of_stream))
    }

    pub fn on_request_trailers(&mut self, envoy: envoy::Stream) -> CEnum {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        trailers_status(self.stream.on_request_trailers(&mut host))
    }

    pub fn on_response_headers(&mut self, envoy: envoy::Stream, end_of_stream: bool) -> CEnum {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        headers_status(self.stream.on_response_headers(&mut host, end_of_stream))
    }

    pub fn on_response_body(&mut self, envoy: envoy::Stream, end_of_stream: bool) -> CEnum {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        let size = host.body_size(Body::Response);
        body_status(self.stream.on_response_body(&mut host, size, end_of_stream))
    }

    pub fn on_response_trailers(&mut self, envoy: envoy::Stream) -> CEnum {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        trailers_status(self.stream.on_response_trailers(&mut host))
    }

    /// The stream's callout answered (route call).
    pub fn on_callout_done(&mut self, envoy: envoy::Stream, id: u64, reply: &CallReply) {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        self.stream.on_call_reply(&mut host, CallId(id), reply);
    }

    /// The stream is complete (also after a reset): report its end.
    pub fn on_stream_complete(&mut self, envoy: envoy::Stream) {
        let mut host = NativeStreamHost::new(envoy, &self.config);
        self.stream.on_stream_end(&mut host);
    }
}
