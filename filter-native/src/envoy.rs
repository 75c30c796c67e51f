//! Safe wrappers over Envoy's callbacks. Each takes the Envoy pointer it was handed by a hook, so
//! a wrapper is only usable during that hook (the lifetime Envoy guarantees for its pointers).

use std::sync::OnceLock;

use crate::abi::{self, Callbacks, ConfigEnvoyPtr, EnvoyBuffer, FilterEnvoyPtr, ModuleBuffer};

static CALLBACKS: OnceLock<Callbacks> = OnceLock::new();

/// Binds Envoy's callbacks (program init). Later calls keep the first binding.
pub fn bind() -> Result<(), abi::MissingCallback> {
    if CALLBACKS.get().is_none() {
        let resolved = Callbacks::resolve()?;
        let _ = CALLBACKS.set(resolved);
    }
    Ok(())
}

/// The bound callbacks; `None` before a successful [`bind`] (then every wrapper is a no-op that
/// reports failure, never a crash).
fn callbacks() -> Option<&'static Callbacks> {
    CALLBACKS.get()
}

/// Log levels passed to Envoy's `dynamic_modules` logger.
#[derive(Clone, Copy, Debug)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// Logs through Envoy's logger (component `dynamic_modules`), or stderr before binding.
pub fn log(level: Level, message: &str) {
    let level = match level {
        Level::Debug => abi::LOG_DEBUG,
        Level::Info => abi::LOG_INFO,
        Level::Warn => abi::LOG_WARN,
        Level::Error => abi::LOG_ERROR,
    };
    match callbacks() {
        // SAFETY: module buffer valid for the call; Envoy copies it.
        Some(cb) => unsafe {
            if (cb.log_enabled)(level) {
                (cb.log)(level, ModuleBuffer::of(message.as_bytes()));
            }
        },
        None => eprintln!("{message}"),
    }
}

/// Copies an Envoy-owned buffer.
fn envoy_bytes(buffer: EnvoyBuffer) -> Vec<u8> {
    if buffer.ptr.is_null() || buffer.length == 0 {
        return Vec::new();
    }
    // SAFETY: Envoy guarantees `length` readable bytes at `ptr` until the hook returns.
    unsafe { std::slice::from_raw_parts(buffer.ptr.cast::<u8>(), buffer.length) }.to_vec()
}

/// The filter configuration's Envoy side (valid during `on_http_filter_config_new`).
pub struct ConfigHandle(ConfigEnvoyPtr);

impl ConfigHandle {
    /// Wraps the pointer Envoy passed to `on_http_filter_config_new`.
    pub fn new(ptr: ConfigEnvoyPtr) -> Self {
        Self(ptr)
    }

    /// Defines a label-less counter; `None` if Envoy refused.
    pub fn define_counter(&self, name: &str) -> Option<CounterId> {
        let cb = callbacks()?;
        let mut id = 0usize;
        // SAFETY: the config pointer is live during config_new; name and out-pointer are valid.
        let result = unsafe {
            (cb.http_filter_config_define_counter)(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        (result == abi::METRICS_SUCCESS).then_some(CounterId(id))
    }
}

/// A counter defined by [`ConfigHandle::define_counter`].
#[derive(Clone, Copy, Debug)]
pub struct CounterId(usize);

/// Outcome of starting an HTTP callout.
#[derive(Debug, PartialEq, Eq)]
pub enum CalloutStart {
    Started(u64),
    /// Envoy's `http_callout_init_result` (cluster not found, missing headers, no host, ..).
    Refused(u32),
}

/// One HTTP stream's Envoy side (valid during the hook that passed the pointer).
pub struct Stream(FilterEnvoyPtr);

impl Stream {
    /// Wraps the pointer Envoy passed to a per-stream hook.
    pub fn new(ptr: FilterEnvoyPtr) -> Self {
        Self(ptr)
    }

    /// The first value of a request header.
    pub fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        let cb = callbacks()?;
        let mut value = EnvoyBuffer {
            ptr: std::ptr::null(),
            length: 0,
        };
        let mut count = 0usize;
        // SAFETY: stream pointer live during the hook; out-pointers valid.
        let found = unsafe {
            (cb.http_get_header)(
                self.0,
                abi::HEADER_TYPE_REQUEST_HEADER,
                ModuleBuffer::of(name.as_bytes()),
                &mut value,
                0,
                &mut count,
            )
        };
        (found && count > 0).then(|| envoy_bytes(value))
    }

    /// Sets (replaces) a request header.
    pub fn set_request_header(&self, name: &str, value: &str) -> bool {
        let Some(cb) = callbacks() else { return false };
        // SAFETY: stream pointer live during the hook; Envoy copies both buffers.
        unsafe {
            (cb.http_set_header)(
                self.0,
                abi::HEADER_TYPE_REQUEST_HEADER,
                ModuleBuffer::of(name.as_bytes()),
                ModuleBuffer::of(value.as_bytes()),
            )
        }
    }

    /// Removes every value of a request header (a null value removes, per the ABI).
    pub fn remove_request_header(&self, name: &str) -> bool {
        let Some(cb) = callbacks() else { return false };
        // SAFETY: as in set_request_header.
        unsafe {
            (cb.http_set_header)(
                self.0,
                abi::HEADER_TYPE_REQUEST_HEADER,
                ModuleBuffer::of(name.as_bytes()),
                ModuleBuffer::NULL,
            )
        }
    }

    /// Makes Envoy pick the route again (after a header the route matches on changed).
    pub fn clear_route_cache(&self) {
        if let Some(cb) = callbacks() {
            // SAFETY: stream pointer live during the hook.
            unsafe { (cb.http_clear_route_cache)(self.0) }
        }
    }

    /// Bytes of the request body: what Envoy buffered so far plus the chunk of this event.
    pub fn request_body_size(&self) -> usize {
        let Some(cb) = callbacks() else { return 0 };
        // SAFETY: stream pointer live during the hook.
        unsafe {
            (cb.http_get_body_size)(self.0, abi::BODY_TYPE_BUFFERED_REQUEST)
                + (cb.http_get_body_size)(self.0, abi::BODY_TYPE_RECEIVED_REQUEST)
        }
    }

    /// Copies the request body (buffered, then this event's chunk), at most `max` bytes;
    /// `None` when it is larger.
    pub fn request_body(&self, max: usize) -> Option<Vec<u8>> {
        let cb = callbacks()?;
        let mut body = Vec::new();
        for kind in [
            abi::BODY_TYPE_BUFFERED_REQUEST,
            abi::BODY_TYPE_RECEIVED_REQUEST,
        ] {
            // SAFETY: stream pointer live during the hook.
            let count = unsafe { (cb.http_get_body_chunks_size)(self.0, kind) };
            if count == 0 {
                continue;
            }
            let mut chunks = vec![
                EnvoyBuffer {
                    ptr: std::ptr::null(),
                    length: 0
                };
                count
            ];
            // SAFETY: `chunks` has room for the `count` buffers Envoy reported.
            if !unsafe { (cb.http_get_body_chunks)(self.0, kind, chunks.as_mut_ptr()) } {
                continue;
            }
            for chunk in chunks {
                if body.len() + chunk.length > max {
                    return None;
                }
                body.extend(envoy_bytes(chunk));
            }
        }
        Some(body)
    }

    /// Resumes a request stopped in a header or body hook.
    pub fn continue_decoding(&self) {
        if let Some(cb) = callbacks() {
            // SAFETY: stream pointer live (callout completions run on the stream's worker).
            unsafe { (cb.http_filter_continue_decoding)(self.0) }
        }
    }

    /// Answers the client locally.
    pub fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8], details: &str) {
        let Some(cb) = callbacks() else { return };
        let mut headers: Vec<abi::ModuleHttpHeader> =
            headers.iter().map(|(k, v)| module_header(k, v)).collect();
        // SAFETY: every buffer outlives the call; Envoy copies them.
        unsafe {
            (cb.http_send_response)(
                self.0,
                status,
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details.as_bytes()),
            )
        }
    }

    /// Starts an HTTP request to an Envoy cluster; its end arrives as
    /// `envoy_dynamic_module_on_http_filter_http_callout_done` with the returned id.
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> CalloutStart {
        let Some(cb) = callbacks() else {
            return CalloutStart::Refused(u32::MAX);
        };
        let mut headers: Vec<abi::ModuleHttpHeader> =
            headers.iter().map(|(k, v)| module_header(k, v)).collect();
        let mut id = 0u64;
        // SAFETY: stream pointer live during the hook; buffers outlive the call (Envoy copies).
        let result = unsafe {
            (cb.http_filter_http_callout)(
                self.0,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            )
        };
        if result == abi::CALLOUT_INIT_SUCCESS {
            CalloutStart::Started(id)
        } else {
            CalloutStart::Refused(result)
        }
    }

    /// Adds one to a counter.
    pub fn increment(&self, counter: Option<CounterId>) {
        let (Some(cb), Some(CounterId(id))) = (callbacks(), counter) else {
            return;
        };
        // SAFETY: stream pointer live; no labels.
        unsafe {
            (cb.http_filter_increment_counter)(self.0, id, std::ptr::null_mut(), 0, 1);
        }
    }
}

fn module_header(key: &str, value: &str) -> abi::ModuleHttpHeader {
    abi::ModuleHttpHeader {
        key_ptr: key.as_ptr().cast(),
        key_length: key.len(),
        value_ptr: value.as_ptr().cast(),
        value_length: value.len(),
    }
}

/// A callout's answer, copied out of Envoy's buffers.
#[derive(Debug, Default)]
pub struct CalloutResponse {
    pub status: Option<u16>,
    pub body: Vec<u8>,
}

impl CalloutResponse {
    /// Reads the headers and body chunks passed to `http_callout_done`, at most `max_body`
    /// bytes of body (the rest is dropped and `status` cleared: an oversized answer is a failure).
    ///
    /// # Safety
    /// The pointers must be those Envoy passed to the hook, during the hook.
    pub unsafe fn read(
        headers: *const abi::EnvoyHttpHeader,
        headers_len: usize,
        chunks: *const EnvoyBuffer,
        chunks_len: usize,
        max_body: usize,
    ) -> Self {
        let mut response = Self::default();
        if !headers.is_null() {
            // SAFETY: Envoy passes headers_len headers at `headers` (caller's contract).
            for header in unsafe { std::slice::from_raw_parts(headers, headers_len) } {
                let key = envoy_bytes(EnvoyBuffer {
                    ptr: header.key_ptr,
                    length: header.key_length,
                });
                if key == b":status" {
                    let value = envoy_bytes(EnvoyBuffer {
                        ptr: header.value_ptr,
                        length: header.value_length,
                    });
                    response.status = std::str::from_utf8(&value)
                        .ok()
                        .and_then(|s| s.parse().ok());
                }
            }
        }
        if !chunks.is_null() {
            // SAFETY: as above, for the body chunks.
            for chunk in unsafe { std::slice::from_raw_parts(chunks, chunks_len) } {
                if response.body.len() + chunk.length > max_body {
                    response.status = None;
                    response.body.clear();
                    break;
                }
                response.body.extend(envoy_bytes(*chunk));
            }
        }
        response
    }
}
