//! The per-stream filter and its process-wide configuration.
//!
//! Until the filter's logic sits behind the host trait (issue 12 item 1), this build does the
//! host-independent half itself and fails open on every request: it strips a client's
//! `x-envoy-original-dst-host` on every path (so no client picks the upstream), buffers a routed
//! request's body within `max_body_bytes`, answers 413 above `upstream_max_body_bytes`, reaches
//! the indexer through Envoy's HTTP callout, and resumes without a routing header.

use std::sync::Arc;

use kvroute_filter::config::{ConfigError, FilterConfig};

use crate::abi;
use crate::envoy::{self, CalloutStart, ConfigHandle, CounterId, Level, Stream};

/// The header Envoy's ORIGINAL_DST cluster routes on.
pub const DST_HEADER: &str = "x-envoy-original-dst-host";

/// Why a request went on without a routing decision (the Wasm filter's reasons where they
/// exist, plus the one of this transitional build).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailOpen {
    BodyTooLarge,
    IndexerUnreachable,
    IndexerStatus,
    /// The indexer answered; routing itself lands with the host seam.
    RoutingPending,
}

/// Counters, named `kvroute_native_*` in Envoy's stats.
#[derive(Default)]
pub struct Counters {
    pub requests: Option<CounterId>,
    pub stripped: Option<CounterId>,
    pub indexer_ok: Option<CounterId>,
    pub indexer_failed: Option<CounterId>,
    pub fail_open: Option<CounterId>,
    pub rejected_too_large: Option<CounterId>,
}

/// One `dynamic_module_config` instance: the parsed configuration and its counters.
pub struct NativeConfig {
    pub config: FilterConfig,
    pub counters: Counters,
}

impl NativeConfig {
    /// Parses and validates the filter's JSON configuration (the Wasm build's format; an empty
    /// configuration means the defaults).
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let trimmed = bytes.trim_ascii();
        if trimmed.is_empty() {
            return Ok(FilterConfig::default());
        }
        FilterConfig::parse(trimmed)
    }

    /// Builds the configuration and defines its counters.
    pub fn new(config: FilterConfig, envoy: &ConfigHandle) -> Self {
        let counters = Counters {
            requests: envoy.define_counter("kvroute_native_requests"),
            stripped: envoy.define_counter("kvroute_native_spoofed_dst_header_stripped"),
            indexer_ok: envoy.define_counter("kvroute_native_indexer_ok"),
            indexer_failed: envoy.define_counter("kvroute_native_indexer_failed"),
            fail_open: envoy.define_counter("kvroute_native_fail_open"),
            rejected_too_large: envoy.define_counter("kvroute_native_rejected_too_large"),
        };
        Self { config, counters }
    }
}

/// Where a stream is.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Not routed (other path, no body, or decided): every event continues.
    Passthrough,
    /// Buffering a routed request's body.
    Buffering,
    /// The body is complete; waiting for the indexer's callout.
    AwaitingIndexer(u64),
}

/// One HTTP stream.
pub struct StreamFilter {
    config: Arc<NativeConfig>,
    phase: Phase,
    body_bytes: usize,
}

impl StreamFilter {
    pub fn new(config: Arc<NativeConfig>) -> Self {
        Self {
            config,
            phase: Phase::Passthrough,
            body_bytes: 0,
        }
    }

    fn counters(&self) -> &Counters {
        &self.config.counters
    }

    /// Request headers: strip the client's routing header everywhere, stop routed requests
    /// that carry a body until it is complete.
    pub fn on_request_headers(&mut self, stream: &Stream, end_of_stream: bool) -> abi::CEnum {
        stream.increment(self.counters().requests);
        if stream.request_header(DST_HEADER).is_some() {
            stream.remove_request_header(DST_HEADER);
            stream.clear_route_cache();
            stream.increment(self.counters().stripped);
        }
        let path = stream.request_header(":path").unwrap_or_default();
        let path = String::from_utf8_lossy(&path);
        let path = path.split('?').next().unwrap_or_default();
        if end_of_stream || !self.config.config.routes_path(path) {
            return abi::HEADERS_CONTINUE;
        }
        self.phase = Phase::Buffering;
        abi::HEADERS_STOP_ITERATION
    }

    /// Request body: buffer to the end (bounded), then ask the indexer.
    pub fn on_request_body(&mut self, stream: &Stream, end_of_stream: bool) -> abi::CEnum {
        if self.phase != Phase::Buffering {
            return abi::BODY_CONTINUE;
        }
        let size = stream.request_body_size();
        let config = &self.config.config;
        if size > config.upstream_max_body_bytes {
            stream.increment(self.counters().rejected_too_large);
            self.phase = Phase::Passthrough;
            stream.send_response(
                413,
                &[("content-type", "application/json")],
                br#"{"error":{"message":"request body too large","type":"BadRequestError","code":413}}"#,
                "kvroute_body_too_large",
            );
            return abi::BODY_STOP_AND_BUFFER;
        }
        if size > config.max_body_bytes {
            return self.fail_open(stream, FailOpen::BodyTooLarge, false);
        }
        if !end_of_stream {
            return abi::BODY_STOP_AND_BUFFER;
        }
        self.body_bytes = stream
            .request_body(config.max_body_bytes)
            .map_or(0, |body| body.len());
        let headers = [
            (":method", "GET"),
            (":path", "/healthz"),
            (":authority", config.indexer_authority.as_str()),
            ("host", config.indexer_authority.as_str()),
        ];
        match stream.http_callout(
            &config.indexer_cluster,
            &headers,
            b"",
            config.route_timeout_ms,
        ) {
            CalloutStart::Started(id) => {
                self.phase = Phase::AwaitingIndexer(id);
                abi::BODY_STOP_AND_BUFFER
            }
            CalloutStart::Refused(code) => {
                envoy::log(
                    Level::Debug,
                    &format!("kvroute_filter: indexer callout refused ({code})"),
                );
                self.fail_open(stream, FailOpen::IndexerUnreachable, false)
            }
        }
    }

    /// The indexer answered (or the callout failed).
    pub fn on_callout_done(
        &mut self,
        stream: &Stream,
        id: u64,
        succeeded: bool,
        status: Option<u16>,
    ) {
        if self.phase != Phase::AwaitingIndexer(id) {
            return;
        }
        let reason = match (succeeded, status) {
            (true, Some(200)) => {
                stream.increment(self.counters().indexer_ok);
                FailOpen::RoutingPending
            }
            (true, _) => FailOpen::IndexerStatus,
            (false, _) => FailOpen::IndexerUnreachable,
        };
        if reason != FailOpen::RoutingPending {
            stream.increment(self.counters().indexer_failed);
        }
        self.fail_open(stream, reason, true);
    }

    /// Goes on without a routing header; resumes the stream when it was stopped.
    fn fail_open(&mut self, stream: &Stream, reason: FailOpen, resume: bool) -> abi::CEnum {
        stream.increment(self.counters().fail_open);
        envoy::log(
            Level::Debug,
            &format!(
                "kvroute_filter: fail open ({reason:?}, body {} bytes)",
                self.body_bytes
            ),
        );
        self.phase = Phase::Passthrough;
        if resume {
            stream.continue_decoding();
        }
        abi::BODY_CONTINUE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_configuration_is_the_default_and_a_bad_one_is_refused() {
        let config = NativeConfig::parse(b"  ").expect("empty");
        assert_eq!(
            config.indexer_cluster,
            FilterConfig::default().indexer_cluster
        );
        let config = NativeConfig::parse(br#"{"route_timeout_ms": 250}"#).expect("valid");
        assert_eq!(config.route_timeout_ms, 250);
        assert!(NativeConfig::parse(br#"{"route_timeout_ms": "soon"}"#).is_err());
        assert!(NativeConfig::parse(b"{not json").is_err());
    }
}
