//! Safe wrappers over Envoy's callbacks. Each takes the Envoy pointer it was handed by a hook, so
//! a wrapper is only usable while Envoy keeps that pointer valid (a stream's during its hooks, a
//! filter configuration's until its destroy hook).

use std::sync::OnceLock;

use crate::abi::{
    self, Callbacks, ConfigEnvoyPtr, ConfigSchedulerPtr, EnvoyBuffer, FilterEnvoyPtr, ModuleBuffer,
};

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

/// Whether Envoy's `dynamic_modules` logger would print at `level` (an ABI log level).
pub fn log_enabled(level: abi::CEnum) -> bool {
    match callbacks() {
        // SAFETY: a plain query.
        Some(cb) => unsafe { (cb.log_enabled)(level) },
        None => true,
    }
}

/// Logs through Envoy's logger (component `dynamic_modules`), or stderr before binding.
pub fn log(level: abi::CEnum, message: &str) {
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

/// Logs an error line (for the adapter's own failures).
pub fn log_error(message: &str) {
    log(abi::LOG_ERROR, message);
}

/// Logs a debug line (for the adapter's own events).
pub fn log_debug(message: &str) {
    log(abi::LOG_DEBUG, message);
}

/// Copies an Envoy-owned buffer.
fn envoy_bytes(buffer: EnvoyBuffer) -> Vec<u8> {
    if buffer.ptr.is_null() || buffer.length == 0 {
        return Vec::new();
    }
    // SAFETY: Envoy guarantees `length` readable bytes at `ptr` until the hook returns.
    unsafe { std::slice::from_raw_parts(buffer.ptr.cast::<u8>(), buffer.length) }.to_vec()
}

fn module_header(key: &str, value: &str) -> abi::ModuleHttpHeader {
    abi::ModuleHttpHeader {
        key_ptr: key.as_ptr().cast(),
        key_length: key.len(),
        value_ptr: value.as_ptr().cast(),
        value_length: value.len(),
    }
}

fn module_headers(headers: &[(&str, &str)]) -> Vec<abi::ModuleHttpHeader> {
    headers.iter().map(|(k, v)| module_header(k, v)).collect()
}

/// A callout's headers: Envoy's callouts require `host` besides `:method` and `:path`; it is
/// added from `:authority` when the caller gave only that (as proxy-wasm callouts do).
fn callout_headers<'a>(headers: &[(&'a str, &'a str)]) -> Vec<abi::ModuleHttpHeader> {
    let mut out = module_headers(headers);
    let has_host = headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host"));
    if !has_host {
        if let Some((_, authority)) = headers.iter().find(|(k, _)| *k == ":authority") {
            out.push(module_header("host", authority));
        }
    }
    out
}

/// Outcome of starting an HTTP callout.
#[derive(Debug, PartialEq, Eq)]
pub enum CalloutStart {
    /// In flight; its answer arrives with this id.
    Started(u64),
    /// Envoy's `http_callout_init_result` (cluster not found, missing headers, no host, ..).
    Refused(u32),
}

/// An HTTP request to one of Envoy's clusters.
#[derive(Debug, Clone, Copy)]
pub struct CalloutRequest<'a> {
    pub cluster: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
    pub timeout_ms: u64,
}

/// A filter configuration's Envoy side: valid from `on_http_filter_config_new` until its destroy
/// hook. Definitions and callouts belong on the main thread; counters may be incremented from any
/// thread (Envoy's stats are thread-safe).
#[derive(Clone, Copy, Debug)]
pub struct ConfigHandle(ConfigEnvoyPtr);

// SAFETY: the pointer is an opaque handle Envoy keeps alive for the configuration's lifetime; the
// callbacks that use it off the main thread (counters, the scheduler) are thread-safe in Envoy.
unsafe impl Send for ConfigHandle {}
// SAFETY: as above.
unsafe impl Sync for ConfigHandle {}

impl ConfigHandle {
    /// Wraps the pointer Envoy passed to `on_http_filter_config_new`.
    pub fn new(ptr: ConfigEnvoyPtr) -> Self {
        Self(ptr)
    }

    /// Defines a label-less counter; `None` if Envoy refused.
    pub fn define_counter(&self, name: &str) -> Option<usize> {
        let cb = callbacks()?;
        let mut id = 0usize;
        // SAFETY: the config pointer is live; name and out-pointer are valid for the call.
        let result = unsafe {
            (cb.http_filter_config_define_counter)(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        (result == abi::METRICS_SUCCESS).then_some(id)
    }

    /// Defines a label-less histogram; `None` if Envoy refused.
    pub fn define_histogram(&self, name: &str) -> Option<usize> {
        let cb = callbacks()?;
        let mut id = 0usize;
        // SAFETY: as in define_counter.
        let result = unsafe {
            (cb.http_filter_config_define_histogram)(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        (result == abi::METRICS_SUCCESS).then_some(id)
    }

    /// Adds one to a counter outside any stream.
    pub fn increment(&self, counter: usize) {
        if let Some(cb) = callbacks() {
            // SAFETY: the config pointer is live; no labels.
            unsafe {
                (cb.http_filter_config_increment_counter)(
                    self.0,
                    counter,
                    std::ptr::null_mut(),
                    0,
                    1,
                );
            }
        }
    }

    /// Starts a callout owned by the configuration (main thread); its answer arrives as
    /// `envoy_dynamic_module_on_http_filter_config_http_callout_done`.
    pub fn http_callout(&self, request: &CalloutRequest<'_>) -> CalloutStart {
        let Some(cb) = callbacks() else {
            return CalloutStart::Refused(u32::MAX);
        };
        let mut headers = callout_headers(request.headers);
        let mut id = 0u64;
        // SAFETY: the config pointer is live (main thread); buffers outlive the call (Envoy
        // copies them).
        let result = unsafe {
            (cb.http_filter_config_http_callout)(
                self.0,
                &mut id,
                ModuleBuffer::of(request.cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(request.body),
                request.timeout_ms,
            )
        };
        if result == abi::CALLOUT_INIT_SUCCESS {
            CalloutStart::Started(id)
        } else {
            CalloutStart::Refused(result)
        }
    }

    /// Creates the configuration's scheduler (events run on the main thread).
    pub fn new_scheduler(&self) -> Option<Scheduler> {
        let cb = callbacks()?;
        // SAFETY: the config pointer is live.
        let ptr = unsafe { (cb.http_filter_config_scheduler_new)(self.0) };
        (!ptr.is_null()).then_some(Scheduler(ptr))
    }
}

/// A configuration scheduler: [`Scheduler::commit`] from any thread makes Envoy call
/// `envoy_dynamic_module_on_http_filter_config_scheduled` on the main thread. Deleted on drop.
#[derive(Debug)]
pub struct Scheduler(ConfigSchedulerPtr);

// SAFETY: Envoy's configuration scheduler is made to be committed to from any thread.
unsafe impl Send for Scheduler {}
// SAFETY: as above.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Posts `event` to the main thread.
    pub fn commit(&self, event: u64) {
        if let Some(cb) = callbacks() {
            // SAFETY: the scheduler is live until drop.
            unsafe { (cb.http_filter_config_scheduler_commit)(self.0, event) }
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        if let Some(cb) = callbacks() {
            // SAFETY: created by scheduler_new, deleted once.
            unsafe { (cb.http_filter_config_scheduler_delete)(self.0) }
        }
    }
}

/// One HTTP stream's Envoy side (valid during the hook that passed the pointer).
#[derive(Clone, Copy, Debug)]
pub struct Stream(FilterEnvoyPtr);

impl Stream {
    /// Wraps the pointer Envoy passed to a per-stream hook.
    pub fn new(ptr: FilterEnvoyPtr) -> Self {
        Self(ptr)
    }

    /// The first value of a header of `map` (an ABI header type); `None` when absent.
    pub fn header(&self, map: abi::CEnum, name: &str) -> Option<Vec<u8>> {
        let cb = callbacks()?;
        let mut value = EnvoyBuffer {
            ptr: std::ptr::null(),
            length: 0,
        };
        let mut count = 0usize;
        // SAFETY: stream pointer live during the hook; out-pointers valid.
        unsafe {
            (cb.http_get_header)(
                self.0,
                map,
                ModuleBuffer::of(name.as_bytes()),
                &mut value,
                0,
                &mut count,
            )
        };
        (count > 0).then(|| envoy_bytes(value))
    }

    /// Sets (replaces) a header of `map`; `None` as the value removes it.
    pub fn set_header(&self, map: abi::CEnum, name: &str, value: Option<&str>) -> bool {
        let Some(cb) = callbacks() else { return false };
        let value = value.map_or(ModuleBuffer::NULL, |v| ModuleBuffer::of(v.as_bytes()));
        // SAFETY: stream pointer live during the hook; Envoy copies both buffers.
        unsafe { (cb.http_set_header)(self.0, map, ModuleBuffer::of(name.as_bytes()), value) }
    }

    /// A string attribute of the stream (an ABI attribute id); `None` when Envoy has no value or
    /// does not offer attributes.
    pub fn attribute_string(&self, id: abi::CEnum) -> Option<Vec<u8>> {
        static GET: OnceLock<Option<abi::GetAttributeString>> = OnceLock::new();
        let get = (*GET.get_or_init(abi::resolve_get_attribute_string))?;
        let mut value = EnvoyBuffer {
            ptr: std::ptr::null(),
            length: 0,
        };
        // SAFETY: stream pointer live during the hook; the out-pointer is valid.
        let ok = unsafe { get(self.0, id, &mut value) };
        ok.then(|| envoy_bytes(value))
    }

    /// Makes Envoy pick the route again (after a header the route matches on changed).
    pub fn clear_route_cache(&self) {
        if let Some(cb) = callbacks() {
            // SAFETY: stream pointer live during the hook.
            unsafe { (cb.http_clear_route_cache)(self.0) }
        }
    }

    /// Bytes of a body of `kind` (an ABI body type).
    pub fn body_size(&self, kind: abi::CEnum) -> usize {
        let Some(cb) = callbacks() else { return 0 };
        // SAFETY: stream pointer live during the hook.
        unsafe { (cb.http_get_body_size)(self.0, kind) }
    }

    /// Appends the chunks of the bodies `kinds`, in order, to `out`: their first `max` bytes.
    pub fn read_bodies(&self, kinds: &[abi::CEnum], max: usize, out: &mut Vec<u8>) {
        self.visit_bodies(kinds, max, &mut |part| out.extend_from_slice(part));
    }

    /// Hands the chunks of the bodies `kinds`, in order, to `visit` where Envoy holds them (no
    /// copy): their first `max` bytes.
    pub fn visit_bodies(&self, kinds: &[abi::CEnum], max: usize, visit: &mut dyn FnMut(&[u8])) {
        let Some(cb) = callbacks() else { return };
        const NONE: EnvoyBuffer = EnvoyBuffer {
            ptr: std::ptr::null(),
            length: 0,
        };
        let mut room = max;
        for &kind in kinds {
            // SAFETY: stream pointer live during the hook.
            let count = unsafe { (cb.http_get_body_chunks_size)(self.0, kind) };
            if count == 0 {
                continue;
            }
            // A streamed chunk is one or a few slices: those fit on the stack.
            let mut few = [NONE; 8];
            let mut many = Vec::new();
            let chunks: &mut [EnvoyBuffer] = if count <= few.len() {
                &mut few[..count]
            } else {
                many.resize(count, NONE);
                &mut many
            };
            // SAFETY: `chunks` has room for the `count` buffers Envoy reported.
            if !unsafe { (cb.http_get_body_chunks)(self.0, kind, chunks.as_mut_ptr()) } {
                continue;
            }
            for chunk in chunks.iter() {
                if room == 0 {
                    return;
                }
                if chunk.ptr.is_null() || chunk.length == 0 {
                    continue;
                }
                let take = chunk.length.min(room);
                // SAFETY: Envoy guarantees `length` readable bytes at `ptr` until the hook
                // returns; the slice does not outlive this call.
                let part = unsafe { std::slice::from_raw_parts(chunk.ptr.cast::<u8>(), take) };
                visit(part);
                room -= take;
            }
        }
    }

    /// Drains `bytes` from the start of a body of `kind`.
    pub fn drain_body(&self, kind: abi::CEnum, bytes: usize) -> bool {
        let Some(cb) = callbacks() else { return false };
        // SAFETY: stream pointer live during the hook.
        unsafe { (cb.http_drain_body)(self.0, kind, bytes) }
    }

    /// Appends `data` to a body of `kind`.
    pub fn append_body(&self, kind: abi::CEnum, data: &[u8]) -> bool {
        let Some(cb) = callbacks() else { return false };
        // SAFETY: stream pointer live during the hook; Envoy copies the data.
        unsafe { (cb.http_append_body)(self.0, kind, ModuleBuffer::of(data)) }
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
        let mut headers = module_headers(headers);
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

    /// Starts an HTTP request owned by this stream; its answer arrives as
    /// `envoy_dynamic_module_on_http_filter_http_callout_done` with the returned id.
    pub fn http_callout(&self, request: &CalloutRequest<'_>) -> CalloutStart {
        let Some(cb) = callbacks() else {
            return CalloutStart::Refused(u32::MAX);
        };
        let mut headers = callout_headers(request.headers);
        let mut id = 0u64;
        // SAFETY: stream pointer live during the hook; buffers outlive the call (Envoy copies).
        let result = unsafe {
            (cb.http_filter_http_callout)(
                self.0,
                &mut id,
                ModuleBuffer::of(request.cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(request.body),
                request.timeout_ms,
            )
        };
        if result == abi::CALLOUT_INIT_SUCCESS {
            CalloutStart::Started(id)
        } else {
            CalloutStart::Refused(result)
        }
    }

    /// Adds one to a counter.
    pub fn increment(&self, counter: usize) {
        if let Some(cb) = callbacks() {
            // SAFETY: stream pointer live; no labels.
            unsafe {
                (cb.http_filter_increment_counter)(self.0, counter, std::ptr::null_mut(), 0, 1);
            }
        }
    }

    /// Records a histogram value.
    pub fn record(&self, histogram: usize, value: u64) {
        if let Some(cb) = callbacks() {
            // SAFETY: stream pointer live; no labels.
            unsafe {
                (cb.http_filter_record_histogram_value)(
                    self.0,
                    histogram,
                    std::ptr::null_mut(),
                    0,
                    value,
                );
            }
        }
    }
}

/// A callout's answer, copied out of Envoy's buffers.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CalloutResponse {
    /// `:status`; `None` when the answer is missing or over the size limit.
    pub status: Option<u16>,
    /// The value of the header asked for (the kvroute contract header).
    pub header: Option<String>,
    pub body: Vec<u8>,
}

impl CalloutResponse {
    /// Reads the headers and body chunks passed to a callout-done hook, at most `max_body` bytes
    /// of body (an answer over it is a failure: no status, no body), and the value of
    /// `header_name`.
    ///
    /// # Safety
    /// The pointers must be those Envoy passed to the hook, during the hook.
    pub unsafe fn read(
        headers: *const abi::EnvoyHttpHeader,
        headers_len: usize,
        chunks: *const EnvoyBuffer,
        chunks_len: usize,
        max_body: usize,
        header_name: &str,
    ) -> Self {
        let mut response = Self::default();
        if !headers.is_null() {
            // SAFETY: Envoy passes headers_len headers at `headers` (caller's contract).
            for header in unsafe { std::slice::from_raw_parts(headers, headers_len) } {
                let key = envoy_bytes(EnvoyBuffer {
                    ptr: header.key_ptr,
                    length: header.key_length,
                });
                let value = || {
                    envoy_bytes(EnvoyBuffer {
                        ptr: header.value_ptr,
                        length: header.value_length,
                    })
                };
                if key == b":status" {
                    response.status = std::str::from_utf8(&value())
                        .ok()
                        .and_then(|s| s.trim().parse().ok());
                } else if key.eq_ignore_ascii_case(header_name.as_bytes()) {
                    response.header = Some(String::from_utf8_lossy(&value()).into_owned());
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
