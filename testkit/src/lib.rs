//! kvroute's test kit (never shipped): what the tests of every crate, `cargo xtask` and the
//! routing benchmark need to run kvroute's processes on loopback, written once.
//!
//! * [`paths`]: the workspace, target directory, download cache, model, binaries.
//! * [`ports`]: free loopback ports.
//! * [`process`]: one test child process, killed on drop ([`process::Proc`]).
//! * [`supervisor`]: the process groups of a local stack, stopped on drop and on Ctrl-C.
//! * [`cmd`]: running build tools with readable failures; [`toolchain`]: the wasm32 target;
//!   [`filter_build`]: the filter's two builds (wasm, native) and building a stack.
//! * [`http`]: the one loopback HTTP/1.1 client; [`fake_server`]: a tiny server for fakes;
//!   [`fake_indexer`]: a programmable indexer API.
//! * [`prom`]: Prometheus metrics of running processes (kvroute-core's parser).
//! * [`redis`]: a throwaway Redis server (the gateways' shared decisions).
//! * [`fleet`]: `kvroute-sim` replicas and `kvroute-indexer` for end-to-end tests;
//!   [`stack`]: the whole stack (replicas, indexer, Envoy) for xtask and the benchmark.
//! * [`peer_install`]: peer routers (LiteLLM, vllm-router, ...) pinned, each in its own venv.
//! * [`text`]: deterministic filler prompts; [`counting_alloc`]: heap bytes and their peak.
//! * [`cases`], [`json`], [`mutate`]: proptest configuration and hostile-input strategies.

pub mod cases;
pub mod cmd;
pub mod counting_alloc;
pub mod fake_indexer;
pub mod fake_server;
pub mod filter_build;
pub mod fleet;
pub mod http;
pub mod json;
pub mod mutate;
pub mod paths;
pub mod peer_install;
pub mod ports;
pub mod process;
pub mod prom;
pub mod redis;
pub mod stack;
pub mod supervisor;
pub mod text;
pub mod toml_merge;
pub mod toolchain;
