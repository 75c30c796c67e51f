//! kvroute-sim: a vLLM-compatible engine simulator. It stands in for GPUs: the same OpenAI HTTP
//! surface, vLLM's block pool and scheduler semantics (prefix hits, LRU eviction, preemption,
//! chunked prefill), KV events byte-compatible with vLLM 0.33.0 on ZeroMQ, vLLM's metric names,
//! and TTFT / latency from a documented cost model, optionally faster than real time.
//!
//! Layout, one job per module:
//! * [`sequence`], [`free_queue`], [`block_pool`], [`kv_manager`], [`scheduler`]: the engine core,
//!   pure and synchronous, unit-testable on plain token vectors;
//! * [`latency`]: the step-time cost model; [`engine`]: the time-scaled step loop on tokio;
//! * [`hashing`]: vLLM's block hash via `kvroute_core::hashing`;
//! * [`events`]: ZeroMQ PUB + ROUTER replay publisher;
//! * [`openai`], [`server`], [`metrics`]: the HTTP surface; [`faults`]: attempt counts and
//!   injected failures; [`cli`], [`app`]: flags and wiring.

pub mod app;
pub mod block_pool;
pub mod cli;
pub mod engine;
pub mod events;
pub mod faults;
pub mod free_queue;
pub mod hashing;
pub mod kv_manager;
pub mod latency;
pub mod metrics;
pub mod openai;
pub mod scheduler;
pub mod sequence;
pub mod server;
