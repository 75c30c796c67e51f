//! The seam between the filter's logic and the proxy it runs in.
//!
//! [`crate::plugin`] (configuration, tokenizers) and [`crate::stream`] (one request) hold
//! everything the filter decides; they reach the proxy only through the traits here. A host
//! build is a thin adapter that implements them and forwards its callbacks: the proxy-wasm build
//! ([`crate::root_context`], [`crate::http_context`] over [`crate::host`]), a dynamic-module
//! build, and the fake host of the unit tests (`filter/tests/stream_logic.rs`).

use std::fmt;
use std::time::Duration;

use crate::metrics::{Histogram, Metric};

/// A host call that did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// A callout named a cluster the host does not know (yet, on this worker).
    #[error("unknown cluster")]
    UnknownCluster,
    /// Anything else, as the host describes it.
    #[error("{0}")]
    Failed(String),
}

/// Result of a host call.
pub type HostResult<T> = Result<T, HostError>;

/// Log levels (the values are proxy-wasm's, which [`crate::host`] passes through).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u32)]
pub enum Level {
    /// Trace.
    Trace = 0,
    /// Debug.
    Debug = 1,
    /// Info.
    Info = 2,
    /// Warn.
    Warn = 3,
    /// Error.
    Error = 4,
}

/// The header maps a stream can touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headers {
    /// Downstream request headers.
    Request,
    /// Upstream response headers.
    Response,
}

/// The bodies a stream can read and replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// The request body buffered so far.
    Request,
    /// The response body chunk of the current callback (everything buffered after a
    /// [`Flow::Pause`]).
    Response,
}

/// What a stream callback tells the host to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Let the stream go on.
    Continue,
    /// Stop here: on request headers, hold them (the body is handled by the body callbacks); on
    /// the request body, keep buffering it. The stream goes on at [`StreamHost::resume_request`]
    /// or after a local reply. On the response body, keep buffering it until its end (the host
    /// then hands the whole body to the last body callback).
    Pause,
}

/// An HTTP callout to a cluster of the proxy.
#[derive(Debug, Clone, Copy)]
pub struct Callout<'a> {
    /// The proxy's cluster name.
    pub cluster: &'a str,
    /// Request headers, pseudo-headers (`:method`, `:path`, `:authority`) included.
    pub headers: &'a [(&'a str, &'a str)],
    /// Request body.
    pub body: Option<&'a [u8]>,
    /// Deadline.
    pub timeout: Duration,
}

/// A host's handle of one callout in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallId(pub u64);

/// What came back from a callout: enough to classify it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallReply {
    /// `:status`; `None` when the host delivered no headers (reset, timeout, overflow).
    pub status: Option<u16>,
    /// The answer's [`kvroute_core::api::CONTRACT_HEADER`].
    pub contract: Option<String>,
    /// The answer's body (empty when none).
    pub body: Vec<u8>,
}

/// What every part of the filter needs from its host.
pub trait Host {
    /// Host time in nanoseconds since the Unix epoch, `None` if the host cannot tell.
    fn now_nanos(&self) -> Option<u64>;
    /// Adds one to a counter.
    fn increment(&self, metric: Metric);
    /// Records a histogram value.
    fn record(&self, histogram: Histogram, value: u64);
    /// Whether a message at `level` would be logged (so callers skip formatting it otherwise).
    fn log_enabled(&self, level: Level) -> bool {
        let _ = level;
        true
    }
    /// Logs a message (never prompt text). Failures are ignored.
    fn log(&self, level: Level, message: &str);
    /// Starts a callout whose answer comes back to the caller with the returned id.
    fn dispatch(&mut self, call: &Callout<'_>) -> HostResult<CallId>;

    /// Host time in milliseconds, 0 if the host cannot tell.
    fn now_millis(&self) -> u64 {
        self.now_nanos().map_or(0, |n| n / 1_000_000)
    }
}

/// What one request's logic needs from its host, besides [`Host`].
pub trait StreamHost: Host {
    /// A header's raw value, `None` when absent.
    fn header(&self, map: Headers, name: &str) -> HostResult<Option<Vec<u8>>>;
    /// Sets (replaces) a header.
    fn set_header(&mut self, map: Headers, name: &str, value: &str) -> HostResult<()>;
    /// Removes every value of a header; absent is fine.
    fn remove_header(&mut self, map: Headers, name: &str) -> HostResult<()>;
    /// Reads up to `max` bytes of a body from its start.
    fn read_body(&self, body: Body, max: usize) -> HostResult<Vec<u8>>;
    /// Hands up to `max` bytes of a body from its start to `visit`, in one or more pieces (a
    /// host that can lend its buffers does so without copying them).
    fn visit_body(&self, body: Body, max: usize, visit: &mut dyn FnMut(&[u8])) -> HostResult<()> {
        visit(&self.read_body(body, max)?);
        Ok(())
    }
    /// Replaces the first `current_len` bytes of `body` (all of the buffered request body, or the
    /// current response chunk, which after a [`Flow::Pause`] holds everything buffered) with
    /// `new`.
    fn replace_body(&mut self, body: Body, current_len: usize, new: &[u8]) -> HostResult<()>;
    /// Starts a callout nobody waits for, which must outlive this stream (a report sent as the
    /// stream ends).
    fn dispatch_detached(&mut self, call: &Callout<'_>) -> HostResult<()>;
    /// Answers the client locally instead of forwarding the request.
    fn send_local_reply(
        &mut self,
        status: u32,
        details: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> HostResult<()>;
    /// Resumes a request paused by [`Flow::Pause`].
    fn resume_request(&mut self) -> HostResult<()>;
    /// The `IP:port` the proxy sent the request to (Envoy's `upstream.address` attribute), once
    /// the upstream was chosen; `None` when unknown.
    fn upstream_address(&self) -> Option<String>;

    /// A header as text (a value that is not UTF-8 is decoded lossily); `None` when absent or
    /// unreadable.
    fn header_text(&self, map: Headers, name: &str) -> Option<String> {
        self.header(map, name)
            .ok()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }
}

/// An `IP:port` as a host reports it (e.g. Envoy's `upstream.address`), checked: `None` unless
/// the bytes parse as a socket address.
pub fn socket_address(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    text.parse::<std::net::SocketAddr>()
        .ok()
        .map(|_| text.to_string())
}

/// Logs through a [`Host`] (given as a reference) with `format!` arguments, formatting only when
/// the level is enabled.
#[macro_export]
macro_rules! hlog {
    ($host:expr, $level:ident, $($arg:tt)*) => {{
        let host = &*$host;
        if $crate::seam::Host::log_enabled(host, $crate::seam::Level::$level) {
            $crate::seam::Host::log(host, $crate::seam::Level::$level, &format!($($arg)*));
        }
    }};
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Level::Trace => "trace",
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        };
        f.write_str(name)
    }
}
