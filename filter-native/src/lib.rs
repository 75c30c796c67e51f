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
//! * [`envoy`]: safe wrappers over the callbacks (headers, bodies, callouts, local replies,
//!   metrics, the configuration scheduler, logging); every `unsafe` block of the crate outside
//!   [`hooks`] lives there.
//! * [`host`], [`config_host`]: the filter's host seam ([`kvroute_filter::seam`]) over those wrappers,
//!   for a request and for the shared plugin.
//! * [`config`]: one filter configuration: the shared [`kvroute_filter::plugin::Plugin`] (one
//!   tokenizer and one segment cache per process), stat ids, queued detached callouts.
//! * [`main_thread`]: the configuration scheduler and the ticker that drives tokenizer fetches and
//!   held completion reports when they fall due.
//! * [`filter`]: one stream, forwarding every hook to [`kvroute_filter::stream::Stream`].
//! * [`hooks`]: the exported event hooks Envoy calls; they only translate pointers and dispatch.
//!
//! The logic (strip, buffer, tokenise, route, fail open, report) is the Wasm build's, written once
//! in `kvroute-filter`; the configuration is its JSON ([`kvroute_filter::config::FilterConfig`]).

#![cfg(not(target_arch = "wasm32"))]

pub mod abi;
pub mod abi_check;
pub mod config;
pub mod config_host;
pub mod envoy;
pub mod filter;
pub mod hooks;
pub mod host;
pub mod main_thread;
