//! The event hooks Envoy looks up by name. Each one turns Envoy's pointers back into the module's
//! objects and dispatches to [`crate::filter`]; a panic is caught at this boundary and the
//! stream continues (fail open), never unwinds into Envoy.
//!
//! Ownership: `on_http_filter_config_new` hands Envoy an `Arc<NativeConfig>` (released in
//! `..._config_destroy`); `on_http_filter_new` hands it a `Box<StreamFilter>` holding its own
//! clone of that `Arc` (released in `on_http_filter_destroy`). Envoy calls a stream's hooks on
//! its worker thread, one at a time, so the `&mut StreamFilter` below is never aliased.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::abi::{self, CEnum, ConfigEnvoyPtr, EnvoyBuffer, EnvoyHttpHeader, FilterEnvoyPtr};
use crate::abi_check;
use crate::envoy::{self, CalloutResponse, ConfigHandle, Level, Stream};
use crate::filter::{NativeConfig, StreamFilter};

/// Largest indexer answer read from a callout (bytes).
const MAX_CALLOUT_BODY: usize = 1 << 20;

/// Runs a hook body; a panic is logged and replaced by `fallback`.
fn guard<T>(hook: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(_) => {
            envoy::log(
                Level::Error,
                &format!("kvroute_filter: panic in {hook}; failing open"),
            );
            fallback
        }
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
        || match NativeConfig::parse(&text(config)) {
            Ok(parsed) => {
                let native = NativeConfig::new(parsed, &ConfigHandle::new(config_envoy_ptr));
                Arc::into_raw(Arc::new(native)).cast()
            }
            Err(error) => {
                envoy::log(
                    Level::Error,
                    &format!("kvroute_filter: invalid configuration: {error}"),
                );
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
        drop(unsafe { Arc::from_raw(config_ptr.cast::<NativeConfig>()) });
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    envoy::log(
        Level::Error,
        "kvroute_filter: per-route configuration is not supported",
    );
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

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> CEnum {
    guard("request_headers", abi::HEADERS_CONTINUE, || {
        // SAFETY: Envoy's contract (see `filter`).
        match unsafe { filter(module_ptr) } {
            Some(f) => f.on_request_headers(&Stream::new(envoy_ptr), end_of_stream),
            None => abi::HEADERS_CONTINUE,
        }
    })
}

/// # Safety
/// See [`filter`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy_ptr: FilterEnvoyPtr,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> CEnum {
    guard("request_body", abi::BODY_CONTINUE, || {
        // SAFETY: Envoy's contract (see `filter`).
        match unsafe { filter(module_ptr) } {
            Some(f) => f.on_request_body(&Stream::new(envoy_ptr), end_of_stream),
            None => abi::BODY_CONTINUE,
        }
    })
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
        let response = unsafe {
            CalloutResponse::read(headers, headers_len, chunks, chunks_len, MAX_CALLOUT_BODY)
        };
        let stream = Stream::new(envoy_ptr);
        f.on_callout_done(
            &stream,
            callout_id,
            result == abi::CALLOUT_SUCCESS,
            response.status,
        );
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
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
) -> CEnum {
    abi::TRAILERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _eos: bool,
) -> CEnum {
    abi::HEADERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
    _eos: bool,
) -> CEnum {
    abi::BODY_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
) -> CEnum {
    abi::TRAILERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _e: FilterEnvoyPtr,
    _m: *const c_void,
) {
}

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
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _e: ConfigEnvoyPtr,
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
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _e: ConfigEnvoyPtr,
    _m: *const c_void,
    _id: u64,
    _r: CEnum,
    _h: *const EnvoyHttpHeader,
    _hn: usize,
    _b: *const EnvoyBuffer,
    _bn: usize,
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
