//! The event hooks Envoy looks up by name. Each one turns Envoy's pointers back into the module's
//! objects and dispatches to [`crate::filter`]; a panic is caught at this boundary and the
//! stream continues (fail open), never unwinds into Envoy.
//!
//! Ownership: `on_http_filter_config_new` hands Envoy an `Arc<NativeConfig>` (released in
//! `..._config_destroy`); `on_http_filter_new` hands it a `Box<StreamFilter>` holding its own
//! clone of that `Arc` (released in `on_http_filter_destroy`). Envoy calls a stream's hooks on
//! its worker thread, one at a time, so the `&mut StreamFilter` below is never aliased; the
//! configuration's hooks (scheduled events, configuration callouts) run on the main thread and
//! only take `&NativeConfig` (its shared state is behind locks).

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use kvroute_core::api::CONTRACT_HEADER;
use kvroute_filter::seam::CallReply;

use crate::abi::{self, CEnum, ConfigEnvoyPtr, EnvoyBuffer, EnvoyHttpHeader, FilterEnvoyPtr};
use crate::abi_check;
use crate::config::NativeConfig;
use crate::envoy::log_error;
use crate::envoy::{self, CalloutResponse, ConfigHandle, Stream};
use crate::filter::StreamFilter;

/// Largest route answer read from a stream's callout (bytes).
const MAX_ROUTE_ANSWER: usize = 1 << 20;
/// Largest answer read from a configuration callout: a tokenizer (the Qwen3 one is ~13 MB as
/// the indexer serves it).
const MAX_TOKENIZER_ANSWER: usize = 256 << 20;

/// Runs a hook body; a panic is logged and replaced by `fallback`.
fn guard<T>(hook: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(_) => {
            log_error(&format!("kvroute: panic in {hook}; failing open"));
            fallback
        }
    }
}

/// # Safety
/// `ptr` must be a live pointer returned by [`envoy_dynamic_module_on_http_filter_config_new`].
unsafe fn config<'a>(ptr: *const c_void) -> Option<&'a NativeConfig> {
    // SAFETY: per the function's contract.
    unsafe { ptr.cast::<NativeConfig>().as_ref() }
}

/// Reads a callout's answer into the seam's [`CallReply`] (no status: reset, timeout, overflow).
///
/// # Safety
/// The pointers are those Envoy passed to the callout-done hook, during the hook.
unsafe fn call_reply(
    result: CEnum,
    headers: *const EnvoyHttpHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
    max_body: usize,
) -> CallReply {
    if result != abi::CALLOUT_SUCCESS {
        return CallReply::default();
    }
    // SAFETY: the caller's contract.
    let response = unsafe {
        CalloutResponse::read(
            headers,
            headers_len,
            chunks,
            chunks_len,
            max_body,
            CONTRACT_HEADER,
        )
    };
    CallReply {
        status: response.status,
        contract: response.header,
        body: response.body,
    }
}

/// # Safety
/// `ptr` must be a pointer returned by [`envoy_dynamic_module_on_http_filter_new`], not yet
/// destroyed, used by one thread at a time (Envoy's contract).
unsafe fn filter<'a>(ptr: *const c_void) -> Option<&'a mut StreamFilter> {
    // SAFETY: per the function's contract.
    unsafe { ptr.cast_mut().cast::<StreamFilter>().as_mut() }
}

fn text(buffer: EnvoyBuffer) -> Vec<u8> {
    if buffer.ptr.is_null() {
        return Vec::new();
    }
    // SAFETY: Envoy passes `length` readable bytes, valid during the hook.
    unsafe { std::slice::from_raw_parts(buffer.ptr.cast::<u8>(), buffer.length) }.to_vec()
}

/// Program init: refuse any Envoy but the pinned build, bind the callbacks, report the ABI.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    guard("program_init", std::ptr::null(), || {
        if let Err(mismatch) = abi_check::check(abi_check::host_build_id().as_deref()) {
            // Before binding: Envoy's logger is not reachable yet, stderr is Envoy's log stream.
            eprintln!("{mismatch}");
            return std::ptr::null();
        }
        if let Err(missing) = envoy::bind() {
            eprintln!("kvroute_filter: ABI mismatch: {missing}");
            return std::ptr::null();
        }
        abi_check::ABI_VERSION.as_ptr()
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy_ptr: ConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard(
        "http_filter_config_new",
        std::ptr::null(),
        || match NativeConfig::new(ConfigHandle::new(config_envoy_ptr), &text(config)) {
            Ok(native) => Arc::into_raw(Arc::new(native)).cast(),
            Err(error) => {
                log_error(&format!("kvroute: {error}"));
                std::ptr::null()
            }
        },
    )
}

/// # Safety
/// `config_ptr` is a pointer returned by `..._config_new`, released once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(
    config_ptr: *const c_void,
) {
    if !config_ptr.is_null() {
        // SAFETY: the pointer came from Arc::into_raw in config_new.
        let native = unsafe { Arc::from_raw(config_ptr.cast::<NativeConfig>()) };
        native.shutdown();
    }
}

/// # Safety
/// `module_ptr` is a live pointer returned by `..._config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy_ptr: ConfigEnvoyPtr,
    module_ptr: *const c_void,
    event: u64,
) {
    guard("http_filter_config_scheduled", (), || {
        // SAFETY: Envoy's contract (see `config`).
        if let Some(native) = unsafe { config(module_ptr) } {
            native.on_event(event);
        }
    })
}

/// # Safety
/// `module_ptr` is a live pointer returned by `..._config_new`; the arrays are Envoy's, valid
/// during the hook.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy_ptr: ConfigEnvoyPtr,
    module_ptr: *const c_void,
    callout_id: u64,
    result: CEnum,
    headers: *const EnvoyHttpHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    guard("http_filter_config_http_callout_done", (), || {
        // SAFETY: Envoy's contract (see `config`).
        let Some(native) = (unsafe { config(module_ptr) }) else {
            return;
        };
        // SAFETY: the arrays are the ones Envoy passed to this hook.
        let reply = unsafe {
            call_reply(
                result,
                headers,
                headers_len,
                chunks,
                chunks_len,
                MAX_TOKENIZER_ANSWER,
            )
        };
        native.on_callout_done(callout_id, &reply);
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    log_error("kvroute: per-route configuration is not supported");
    std::ptr::null()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _config: *const c_void,
) {
}

/// # Safety
/// `config_ptr` is a live pointer returned by `..._config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config_ptr: *const c_void,
    _filter_envoy_ptr: FilterEnvoyPtr,
) -> *const c_void {
    if config_ptr.is_null() {
        return std::ptr::null();
    }
    let config = config_ptr.cast::<NativeConfig>();
    // SAFETY: the pointer came from Arc::into_raw and is live; take one more reference.
    let config = unsafe {
        Arc::increment_strong_count(config);
        Arc::from_raw(config)
    };
    Box::into_raw(Box::new(StreamFilter::new(config))).cast()
}

/// Forwards a per-stream hook to `StreamFilter::$method(stream, args..)`.
macro_rules! stream_hook {
    ($hook:literal, $fallback:expr, $envoy_ptr:ident, $module_ptr:ident, $method:ident($($arg:expr),*)) => {
        guard($hook, $fallback, || {
            // SAFETY: Envoy's contract (see `filter`).
            match unsafe { filter($module_ptr) } {
                Some(f) => f.$method(Stream::new($envoy_ptr) $(, $arg)*),
                None => $fallback,
            }
        })
    };
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> CEnum {
    stream_hook!(
        "request_headers",
        abi::HEADERS_CONTINUE,
        envoy_ptr,
        module_ptr,
        on_request_headers(end_of_stream)
    )
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> CEnum {
    stream_hook!(
        "request_body",
        abi::BODY_CONTINUE,
        envoy_ptr,
        module_ptr,
        on_request_body(end_of_stream)
    )
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
) -> CEnum {
    stream_hook!(
        "request_trailers",
        abi::TRAILERS_CONTINUE,
        envoy_ptr,
        module_ptr,
        on_request_trailers()
    )
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> CEnum {
    stream_hook!(
        "response_headers",
        abi::HEADERS_CONTINUE,
        envoy_ptr,
        module_ptr,
        on_response_headers(end_of_stream)
    )
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> CEnum {
    stream_hook!(
        "response_body",
        abi::BODY_CONTINUE,
        envoy_ptr,
        module_ptr,
        on_response_body(end_of_stream)
    )
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
) -> CEnum {
    stream_hook!(
        "response_trailers",
        abi::TRAILERS_CONTINUE,
        envoy_ptr,
        module_ptr,
        on_response_trailers()
    )
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
) {
    stream_hook!(
        "stream_complete",
        (),
        envoy_ptr,
        module_ptr,
        on_stream_complete()
    )
}

/// # Safety
/// See [`filter`]; the header and chunk arrays are Envoy's, valid during the hook.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    callout_id: u64,
    result: CEnum,
    headers: *const EnvoyHttpHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    guard("http_callout_done", (), || {
        // SAFETY: Envoy's contract (see `filter`).
        let Some(f) = (unsafe { filter(module_ptr) }) else {
            return;
        };
        // SAFETY: the arrays are the ones Envoy passed to this hook.
        let reply = unsafe {
            call_reply(
                result,
                headers,
                headers_len,
                chunks,
                chunks_len,
                MAX_ROUTE_ANSWER,
            )
        };
        f.on_callout_done(Stream::new(envoy_ptr), callout_id, &reply);
    })
}

/// # Safety
/// `module_ptr` came from `on_http_filter_new` and is released exactly once here.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module_ptr: *const c_void) {
    if !module_ptr.is_null() {
        // SAFETY: the pointer came from Box::into_raw in on_http_filter_new.
        drop(unsafe { Box::from_raw(module_ptr.cast_mut().cast::<StreamFilter>()) });
    }
}

// Hooks Envoy requires but kvroute does not act on: they only let the stream go on.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _code: u32,
    _details: EnvoyBuffer,
    _reset_imminent: bool,
) -> CEnum {
    abi::LOCAL_REPLY_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _event: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _h: *const EnvoyHttpHeader,
    _n: usize,
    _eos: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _d: *const EnvoyBuffer,
    _n: usize,
    _eos: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _t: *const EnvoyHttpHeader,
    _n: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _reason: CEnum,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _e: ConfigEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _h: *const EnvoyHttpHeader,
    _n: usize,
    _eos: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _e: ConfigEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _d: *const EnvoyBuffer,
    _n: usize,
    _eos: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _e: ConfigEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _t: *const EnvoyHttpHeader,
    _n: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _e: ConfigEnvoyPtr,
    _m: *const c_void,
    _id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _e: ConfigEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _reason: CEnum,
) {
}
