//! kvroute's filter as an Envoy dynamic module (`envoy.filters.http.dynamic_modules`).
//!
//! Envoy `dlopen`s the shared library once per process and calls its hooks on the worker threads,
//! so state kept in statics is shared by every worker (one tokenizer per Envoy instead of one per
//! Wasm VM). Modules, one job each:
//!
//! * [`abi`]: the raw `extern "C"` surface of Envoy 1.40.0's dynamic-module ABI (the subset used),
//!   written from the facts of `source/extensions/dynamic_modules/abi/abi.h` at the pinned commit.
//! * [`abi_check`]: which Envoy build the bindings were written for, and the load-time check that
//!   refuses any other one.
//! * [`envoy`]: safe wrappers over the callbacks (headers, body, callouts, local replies, metrics,
//!   logging); every `unsafe` block of the crate outside [`hooks`] lives there.
//! * [`filter`]: the per-stream filter (strip, buffer, ask the indexer, fail open).
//! * [`hooks`]: the exported event hooks Envoy calls; they only translate pointers and dispatch.
//!
//! The configuration is the Wasm filter's JSON ([`kvroute_filter::config::FilterConfig`]).

#![cfg(not(target_arch = "wasm32"))]

pub mod abi;
pub mod abi_check;
pub mod envoy;
pub mod filter;
pub mod hooks;
