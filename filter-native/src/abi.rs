//! The raw C ABI of Envoy 1.40.0's dynamic modules: the subset kvroute uses.
//!
//! Written from the facts of `source/extensions/dynamic_modules/abi/abi.h` at Envoy commit
//! [`crate::abi_check::PINNED_ENVOY_BUILD`] (types, enum values, argument order), and checked
//! against the hook signatures that binary itself records. Nothing here is called directly:
//!
//! * Event hooks (`envoy_dynamic_module_on_*`) are exported by [`crate::hooks`].
//! * Callbacks (`envoy_dynamic_module_callback_*`) are Envoy's exported functions. They are
//!   resolved once, at program init, with `dlsym(RTLD_DEFAULT, ..)` into [`Callbacks`] instead of
//!   being linked: a missing one is a clear refusal naming it (not a crash on first use), and the
//!   crate's unit tests link without an Envoy.

use std::ffi::{c_char, c_void, CStr};

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl ModuleBuffer {
    /// A view of `bytes`; valid while `bytes` is.
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr().cast(),
            length: bytes.len(),
        }
    }

    /// The null buffer (`set_header` with it removes the header).
    pub const NULL: Self = Self {
        ptr: std::ptr::null(),
        length: 0,
    };
}

/// `envoy_dynamic_module_type_module_http_header`: a header owned by the module.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_envoy_http_header`: a header owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// C enums are `int`-sized; every enum crosses the ABI as this.
pub type CEnum = u32;

/// `envoy_dynamic_module_type_http_header_type`.
pub const HEADER_TYPE_REQUEST_HEADER: CEnum = 0;
pub const HEADER_TYPE_RESPONSE_HEADER: CEnum = 2;
/// `envoy_dynamic_module_type_http_body_type`.
pub const BODY_TYPE_RECEIVED_REQUEST: CEnum = 0;
pub const BODY_TYPE_BUFFERED_REQUEST: CEnum = 1;
pub const BODY_TYPE_RECEIVED_RESPONSE: CEnum = 2;
pub const BODY_TYPE_BUFFERED_RESPONSE: CEnum = 3;
/// `envoy_dynamic_module_type_log_level` (Trace 0 .. Error 4, as [`kvroute_filter::seam::Level`]).
pub const LOG_TRACE: CEnum = 0;
pub const LOG_DEBUG: CEnum = 1;
pub const LOG_INFO: CEnum = 2;
pub const LOG_WARN: CEnum = 3;
pub const LOG_ERROR: CEnum = 4;
/// `envoy_dynamic_module_type_on_http_filter_{request,response}_headers_status`.
pub const HEADERS_CONTINUE: CEnum = 0;
pub const HEADERS_STOP_ITERATION: CEnum = 1;
/// `envoy_dynamic_module_type_on_http_filter_{request,response}_body_status`.
pub const BODY_CONTINUE: CEnum = 0;
pub const BODY_STOP_AND_BUFFER: CEnum = 1;
/// `envoy_dynamic_module_type_on_http_filter_{request,response}_trailers_status`.
pub const TRAILERS_CONTINUE: CEnum = 0;
pub const TRAILERS_STOP_ITERATION: CEnum = 1;
/// `envoy_dynamic_module_type_on_http_filter_local_reply_status`.
pub const LOCAL_REPLY_CONTINUE: CEnum = 0;
/// `envoy_dynamic_module_type_http_callout_init_result`.
pub const CALLOUT_INIT_SUCCESS: CEnum = 0;
pub const CALLOUT_INIT_CLUSTER_NOT_FOUND: CEnum = 2;
/// `envoy_dynamic_module_type_http_callout_result`.
pub const CALLOUT_SUCCESS: CEnum = 0;
/// `envoy_dynamic_module_type_metrics_result`.
pub const METRICS_SUCCESS: CEnum = 0;

/// `envoy_dynamic_module_type_attribute_id_UpstreamAddress` (`upstream.address`). The value is
/// checked to parse as `IP:port` before use, so a numbering that differs is a missing value,
/// never a wrong one.
pub const ATTRIBUTE_ID_UPSTREAM_ADDRESS: CEnum = 41;

/// `envoy_dynamic_module_callback_http_filter_get_attribute_string`: bound on its own and
/// optional (only shadow mode reads an attribute), so an Envoy without it still loads the module.
pub type GetAttributeString = unsafe extern "C" fn(FilterEnvoyPtr, CEnum, *mut EnvoyBuffer) -> bool;

/// Looks up [`GetAttributeString`] in the process.
pub fn resolve_get_attribute_string() -> Option<GetAttributeString> {
    let name = c"envoy_dynamic_module_callback_http_filter_get_attribute_string";
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: Envoy's function of this name has this signature in the pinned ABI (the build
    // check, crate::abi_check, refuses any other Envoy before it is called).
    Some(unsafe { std::mem::transmute::<*mut c_void, GetAttributeString>(symbol) })
}

/// `envoy_dynamic_module_type_http_filter_envoy_ptr` (per stream, owned by Envoy).
pub type FilterEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr` (per filter config, owned by Envoy).
pub type ConfigEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_scheduler_module_ptr` (created and deleted by the
/// module through Envoy's callbacks).
pub type ConfigSchedulerPtr = *mut c_void;

/// Why the callbacks could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("Envoy does not export `{0}`: it is not the Envoy these bindings were written for")]
pub struct MissingCallback(pub &'static str);

/// Declares [`Callbacks`]: one typed function pointer per Envoy callback used, each resolved by
/// its full C name (`envoy_dynamic_module_callback_` + field name).
macro_rules! callbacks {
    ($($name:ident: fn($($arg:ty),* $(,)?) $(-> $ret:ty)?;)*) => {
        /// Envoy's callbacks, resolved once at program init.
        pub struct Callbacks {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Callbacks {
            /// The C names of every callback bound, for the setup check against a binary.
            pub const NAMES: &'static [&'static str] = &[
                $(concat!("envoy_dynamic_module_callback_", stringify!($name)),)*
            ];

            /// Looks every callback up in the process (Envoy exports them as dynamic symbols).
            pub fn resolve() -> Result<Self, MissingCallback> {
                Ok(Self {
                    $($name: {
                        const NAME: &str =
                            concat!("envoy_dynamic_module_callback_", stringify!($name), "\0");
                        let c_name = CStr::from_bytes_with_nul(NAME.as_bytes())
                            .map_err(|_| MissingCallback(stringify!($name)))?;
                        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
                        let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c_name.as_ptr()) };
                        if symbol.is_null() {
                            return Err(MissingCallback(&NAME[..NAME.len() - 1]));
                        }
                        // SAFETY: the symbol is Envoy's C function of this name, whose
                        // signature at the pinned ABI is the one declared here; the build check
                        // (crate::abi_check) refuses any other Envoy before this is used.
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(symbol)
                        }
                    },)*
                })
            }
        }
    };
}

callbacks! {
    log: fn(CEnum, ModuleBuffer);
    log_enabled: fn(CEnum) -> bool;
    http_get_header: fn(FilterEnvoyPtr, CEnum, ModuleBuffer, *mut EnvoyBuffer, usize, *mut usize) -> bool;
    http_set_header: fn(FilterEnvoyPtr, CEnum, ModuleBuffer, ModuleBuffer) -> bool;
    http_clear_route_cache: fn(FilterEnvoyPtr);
    http_get_body_size: fn(FilterEnvoyPtr, CEnum) -> usize;
    http_get_body_chunks_size: fn(FilterEnvoyPtr, CEnum) -> usize;
    http_get_body_chunks: fn(FilterEnvoyPtr, CEnum, *mut EnvoyBuffer) -> bool;
    http_send_response: fn(FilterEnvoyPtr, u32, *mut ModuleHttpHeader, usize, ModuleBuffer, ModuleBuffer);
    http_filter_continue_decoding: fn(FilterEnvoyPtr);
    http_filter_http_callout: fn(FilterEnvoyPtr, *mut u64, ModuleBuffer, *mut ModuleHttpHeader, usize, ModuleBuffer, u64) -> CEnum;
    http_filter_config_define_counter: fn(ConfigEnvoyPtr, ModuleBuffer, *mut ModuleBuffer, usize, *mut usize) -> CEnum;
    http_filter_increment_counter: fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> CEnum;
    http_filter_config_define_histogram: fn(ConfigEnvoyPtr, ModuleBuffer, *mut ModuleBuffer, usize, *mut usize) -> CEnum;
    http_filter_record_histogram_value: fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> CEnum;
    http_filter_config_increment_counter: fn(ConfigEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> CEnum;
    http_append_body: fn(FilterEnvoyPtr, CEnum, ModuleBuffer) -> bool;
    http_drain_body: fn(FilterEnvoyPtr, CEnum, usize) -> bool;
    http_filter_config_http_callout: fn(ConfigEnvoyPtr, *mut u64, ModuleBuffer, *mut ModuleHttpHeader, usize, ModuleBuffer, u64) -> CEnum;
    http_filter_config_scheduler_new: fn(ConfigEnvoyPtr) -> ConfigSchedulerPtr;
    http_filter_config_scheduler_commit: fn(ConfigSchedulerPtr, u64);
    http_filter_config_scheduler_delete: fn(ConfigSchedulerPtr);
}
