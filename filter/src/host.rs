//! Panic-free proxy-wasm host calls (the proxy-wasm adapter's only way to the host).
//!
//! The proxy-wasm Rust SDK's `hostcalls` panic on any status they do not expect, and a panic in
//! the VM kills that worker's filter chain (every later request on the worker gets a 503). This
//! module declares the proxy-wasm ABI 0.2.1 imports itself and turns *every* status into a
//! `Result`, so the filter decides what to do with each failure. Only `dispatch_http_call` goes
//! through the SDK, because the SDK's dispatcher must register the callout token to deliver its
//! response; Envoy returns only `Ok`, `BadArgument` or `InternalFailure` from it, all of which the
//! SDK maps to `Result`.
//!
//! Off wasm (native unit tests, clippy) every call returns [`HostError::Unavailable`].

use std::fmt;
use std::time::Duration;

use crate::seam::{self, Level};

/// A host call that did not return `Ok`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostError {
    /// The host returned this raw proxy-wasm status code.
    Status(u32),
    /// Not running inside a proxy-wasm host (native build).
    Unavailable,
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Status(1) => write!(f, "host status NotFound"),
            HostError::Status(2) => write!(f, "host status BadArgument"),
            HostError::Status(10) => write!(f, "host status InternalFailure"),
            HostError::Status(s) => write!(f, "host status {s}"),
            HostError::Unavailable => write!(f, "no proxy-wasm host"),
        }
    }
}

/// Result of a host call.
pub type HostResult<T> = Result<T, HostError>;

impl From<HostError> for seam::HostError {
    fn from(e: HostError) -> Self {
        seam::HostError::Failed(e.to_string())
    }
}

/// Header maps of the proxy-wasm ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Map {
    /// Downstream request headers.
    RequestHeaders = 0,
    /// Upstream response headers.
    ResponseHeaders = 2,
    /// Headers of a `dispatch_http_call` response.
    CallResponseHeaders = 6,
}

/// Buffers of the proxy-wasm ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Buffer {
    /// The (buffered) request body.
    RequestBody = 0,
    /// The current response body chunk.
    ResponseBody = 1,
    /// Body of a `dispatch_http_call` response.
    CallResponseBody = 4,
    /// `vm_config.configuration`.
    VmConfiguration = 6,
    /// The plugin `configuration`.
    PluginConfiguration = 7,
}

/// Metric kinds of the proxy-wasm ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MetricKind {
    /// Monotonic counter.
    Counter = 0,
    /// Gauge.
    Gauge = 1,
    /// Histogram.
    Histogram = 2,
}

#[cfg(target_arch = "wasm32")]
mod abi {
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_log(level: u32, data: *const u8, size: usize) -> u32;
        pub fn proxy_get_current_time_nanoseconds(ret: *mut u64) -> u32;
        pub fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
        pub fn proxy_get_buffer_bytes(
            buffer: u32,
            start: usize,
            max: usize,
            ret_data: *mut *mut u8,
            ret_size: *mut usize,
        ) -> u32;
        pub fn proxy_set_buffer_bytes(
            buffer: u32,
            start: usize,
            size: usize,
            data: *const u8,
            data_size: usize,
        ) -> u32;
        pub fn proxy_get_header_map_value(
            map: u32,
            key: *const u8,
            key_size: usize,
            ret_data: *mut *mut u8,
            ret_size: *mut usize,
        ) -> u32;
        pub fn proxy_replace_header_map_value(
            map: u32,
            key: *const u8,
            key_size: usize,
            value: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_remove_header_map_value(map: u32, key: *const u8, key_size: usize) -> u32;
        pub fn proxy_continue_stream(stream: u32) -> u32;
        pub fn proxy_send_local_response(
            status_code: u32,
            details: *const u8,
            details_size: usize,
            body: *const u8,
            body_size: usize,
            headers: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        pub fn proxy_define_metric(kind: u32, name: *const u8, size: usize, ret: *mut u32) -> u32;
        pub fn proxy_increment_metric(id: u32, offset: i64) -> u32;
        pub fn proxy_record_metric(id: u32, value: u64) -> u32;
        pub fn proxy_set_effective_context(context_id: u32) -> u32;
        pub fn proxy_get_property(
            path: *const u8,
            path_size: usize,
            ret_data: *mut *mut u8,
            ret_size: *mut usize,
        ) -> u32;
    }
}

#[cfg(target_arch = "wasm32")]
fn status(code: u32) -> HostResult<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(HostError::Status(code))
    }
}

/// Takes ownership of a host-allocated buffer (allocated through the SDK's exported
/// `proxy_on_memory_allocate`, i.e. a `Vec<u8>` with exactly this capacity).
#[cfg(target_arch = "wasm32")]
unsafe fn take_host_bytes(ptr: *mut u8, size: usize) -> Vec<u8> {
    if ptr.is_null() {
        Vec::new()
    } else {
        // SAFETY: the host wrote `size` bytes into memory it obtained from our allocator with
        // capacity `size`.
        unsafe { Vec::from_raw_parts(ptr, size, size) }
    }
}

/// Logs a message at `level`. Failures are ignored: there is nowhere else to report them.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        let _ = abi::proxy_log(level as u32, message.as_ptr(), message.len());
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (level, message);
    }
}

/// Host time in nanoseconds since the Unix epoch.
pub fn now_nanos() -> HostResult<u64> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        let mut t: u64 = 0;
        status(abi::proxy_get_current_time_nanoseconds(&mut t))?;
        Ok(t)
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        Err(HostError::Unavailable)
    }
}

/// Host time in milliseconds, 0 if the host cannot tell.
pub fn now_millis() -> u64 {
    now_nanos().map(|n| n / 1_000_000).unwrap_or(0)
}

/// Sets the root context's tick period.
pub fn set_tick_period(period: Duration) -> HostResult<()> {
    let ms = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_set_tick_period_milliseconds(ms))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = ms;
        Err(HostError::Unavailable)
    }
}

/// Reads `max` bytes of `buffer` from `start`. A missing buffer reads as empty.
pub fn get_buffer(buffer: Buffer, start: usize, max: usize) -> HostResult<Vec<u8>> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        let mut ptr: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        match abi::proxy_get_buffer_bytes(buffer as u32, start, max, &mut ptr, &mut size) {
            0 => Ok(take_host_bytes(ptr, size)),
            1 => Ok(Vec::new()),
            code => Err(HostError::Status(code)),
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (buffer, start, max);
        Err(HostError::Unavailable)
    }
}

/// Replaces `size` bytes of `buffer` at `start` with `data`.
pub fn set_buffer(buffer: Buffer, start: usize, size: usize, data: &[u8]) -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_set_buffer_bytes(
            buffer as u32,
            start,
            size,
            data.as_ptr(),
            data.len(),
        ))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (buffer, start, size, data);
        Err(HostError::Unavailable)
    }
}

/// Reads a header as raw bytes (`None` if absent).
pub fn get_header_bytes(map: Map, name: &str) -> HostResult<Option<Vec<u8>>> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        let mut ptr: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        match abi::proxy_get_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            &mut ptr,
            &mut size,
        ) {
            0 => Ok(Some(take_host_bytes(ptr, size))),
            1 => Ok(None),
            code => Err(HostError::Status(code)),
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (map, name);
        Err(HostError::Unavailable)
    }
}

/// Reads a host property (an Envoy attribute) by its path, e.g. `["upstream", "address"]`;
/// `None` when the host has no value for it.
pub fn get_property(path: &[&str]) -> HostResult<Option<Vec<u8>>> {
    // proxy-wasm serialises a property path as its parts, each followed by NUL.
    let mut encoded = Vec::new();
    for part in path {
        encoded.extend_from_slice(part.as_bytes());
        encoded.push(0);
    }
    #[cfg(target_arch = "wasm32")]
    unsafe {
        let mut ptr: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        match abi::proxy_get_property(encoded.as_ptr(), encoded.len(), &mut ptr, &mut size) {
            0 => Ok(Some(take_host_bytes(ptr, size))),
            1 => Ok(None),
            code => Err(HostError::Status(code)),
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = encoded;
        Err(HostError::Unavailable)
    }
}

/// Reads a header as text; a value that is not UTF-8 is decoded lossily.
pub fn get_header(map: Map, name: &str) -> HostResult<Option<String>> {
    Ok(get_header_bytes(map, name)?.map(|b| String::from_utf8_lossy(&b).into_owned()))
}

/// Sets (replaces) a header.
pub fn set_header(map: Map, name: &str, value: &str) -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_replace_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        ))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (map, name, value);
        Err(HostError::Unavailable)
    }
}

/// Removes every value of a header (absent is fine).
pub fn remove_header(map: Map, name: &str) -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        match abi::proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) {
            0 | 1 => Ok(()),
            code => Err(HostError::Status(code)),
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (map, name);
        Err(HostError::Unavailable)
    }
}

/// Resumes a paused request.
pub fn resume_request() -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_continue_stream(0))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        Err(HostError::Unavailable)
    }
}

/// Serialises header pairs in the proxy-wasm map format.
pub fn serialize_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in pairs {
        size += 8 + k.len() + 1 + v.len() + 1;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Sends a local reply instead of forwarding the request.
pub fn send_local_response(
    status_code: u32,
    details: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> HostResult<()> {
    let headers = serialize_pairs(headers);
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_send_local_response(
            status_code,
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        ))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (status_code, details, body, headers);
        Err(HostError::Unavailable)
    }
}

/// Defines a metric, returning its id.
pub fn define_metric(kind: MetricKind, name: &str) -> HostResult<u32> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        let mut id: u32 = 0;
        status(abi::proxy_define_metric(
            kind as u32,
            name.as_ptr(),
            name.len(),
            &mut id,
        ))?;
        Ok(id)
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (kind, name);
        Err(HostError::Unavailable)
    }
}

/// Adds `offset` to a counter or gauge.
pub fn increment_metric(id: u32, offset: i64) -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_increment_metric(id, offset))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (id, offset);
        Err(HostError::Unavailable)
    }
}

/// Records a histogram value (or sets a gauge).
pub fn record_metric(id: u32, value: u64) -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_record_metric(id, value))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (id, value);
        Err(HostError::Unavailable)
    }
}

/// Makes later host calls act on behalf of `context_id` (used to issue a callout owned by the
/// root context from a stream context that is about to be destroyed).
pub fn set_effective_context(context_id: u32) -> HostResult<()> {
    #[cfg(target_arch = "wasm32")]
    unsafe {
        status(abi::proxy_set_effective_context(context_id))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = context_id;
        Err(HostError::Unavailable)
    }
}

/// Issues an HTTP callout to `cluster` (through the SDK, which registers the token with its
/// dispatcher so the answer reaches `on_http_call_response`).
pub fn dispatch_http_call(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> HostResult<u32> {
    #[cfg(target_arch = "wasm32")]
    {
        proxy_wasm::hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout)
            .map_err(|s| HostError::Status(s as u32))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (cluster, headers, body, timeout);
        Err(HostError::Unavailable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialized_pairs_follow_the_abi_layout() {
        let bytes = serialize_pairs(&[("a", "bc"), ("", "")]);
        assert_eq!(&bytes[0..4], &2u32.to_le_bytes());
        assert_eq!(&bytes[4..8], &1u32.to_le_bytes());
        assert_eq!(&bytes[8..12], &2u32.to_le_bytes());
        assert_eq!(&bytes[20..], b"a\0bc\0\0\0");
    }
}
