//! kvroute's Envoy HTTP filter.
//!
//! Per request on a routed path: strip any client `x-envoy-original-dst-host`, buffer the body,
//! render and tokenise the prompt with the model's real tokenizer ([`kvroute_core::request`]),
//! compute router keys ([`kvroute_core::router_key`]), ask the indexer sidecar which replica holds
//! the longest prefix (`POST /v1/route`), set `x-envoy-original-dst-host` for Envoy's
//! ORIGINAL_DST cluster and resume. Anything wrong on the filter's side fails open: the header
//! stays absent and Envoy's route sends the request to the load-balanced fallback cluster.
//!
//! The logic is host-independent and reaches the proxy only through [`seam`]'s traits:
//! [`plugin`] (configuration, per-model tokenizers), [`stream`] (one request), with [`config`],
//! [`protocol`] (pure wire logic), [`completions`] (reports held for the next route call), [`usage`] (the response's `cached_tokens`), [`tick_plan`] (how often a host ticks), [`models`]
//! (tokenizer registry), [`loaded_model`] (a model turning a request into router keys) and [`metrics`] (names). The
//! proxy-wasm build is the thin adapter in [`root_context`] and [`http_context`] over [`host`]
//! (panic-free host calls); a native build implements the same traits.

pub mod agreement;
pub mod completions;
pub mod config;
pub mod host;
#[cfg(feature = "wasm-host")]
pub mod http_context;
pub mod loaded_model;
pub mod metrics;
pub mod models;
pub mod online_check;
pub mod plugin;
pub mod protocol;
#[cfg(feature = "wasm-host")]
pub mod root_context;
pub mod seam;
pub mod stream;
pub mod tick_plan;
pub mod token_check;
pub mod usage;

#[cfg(all(target_arch = "wasm32", feature = "wasm-host"))]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root_context::KvRouteRoot::new(context_id))
    });
}}
