//! kvroute-core: the pure logic shared by the Envoy filter (wasm32-wasip1), the indexer sidecar,
//! the engine simulator and the CLI, so that none of them can disagree with another or with vLLM.
//!
//! * [`hashing`]: vLLM's own prefix-cache block hash (all four `--prefix-caching-hash-algo`s) and the
//!   64-bit value vLLM puts on the wire.
//! * [`router_key`]: kvroute's own chained 64-bit key, independent of the engine's hash settings.
//! * [`events`]: the KV event stream's msgpack codec, every layout vLLM has shipped.
//! * [`request`]: an OpenAI request body to the engine's token ids (chat template + tokenizer).
//! * [`scoring`]: the replica choice: predicted time to first token and harm, in seconds.
//! * [`calibration`]: each replica's prefill rate and step time, learned from its metrics.
//! * [`api`]: the filter <-> indexer HTTP contract (route, complete, tokenizer bundle), versioned.
//! * [`prometheus`]: reading Prometheus text exposition (engine metrics; tests read ours).
//! * [`rng`]: SplitMix64, the one small deterministic generator of the workspace.
//! * `shutdown` (feature `shutdown`, needs tokio): waiting for Ctrl-C or SIGTERM in a server.
//! * `peers` (feature `peers`): the decision that gateways' indexers share with each other.

pub mod api;
pub mod calibration;
pub mod events;
pub mod hashing;
pub mod hybrid;
pub mod packed_keys;
#[cfg(feature = "peers")]
pub mod peers;
pub mod prometheus;
pub mod request;
pub mod rng;
pub mod router_key;
pub mod scoring;
#[cfg(feature = "shutdown")]
pub mod shutdown;
