//! The exact KV block index of one model: which replica holds which block, on which medium.
//!
//! # Model
//!
//! * A **block** is identified by its router key ([`RouterKey`], kvroute's chained hash of the
//!   block's tokens and everything before it). One [`KvIndex`] node per block lists its
//!   **holders**: `(replica slot, medium bits)` packed in 32 bits. A block on GPU and CPU of the
//!   same replica is one holder with two medium bits; removing the GPU copy leaves the CPU one.
//! * An **engine hash** (the 64-bit wire hash vLLM publishes) maps to the node it names, so a
//!   `BlockStored` chains from its parent's router key and a `BlockRemoved` finds its block. The map
//!   is shared by all replicas: an engine hash is a hash of the whole prefix, so it names one block
//!   whatever replica reports it. Replicas whose engines hash differently (another algorithm or
//!   seed, a LoRA adapter at another path) report other engine hashes for the same router key:
//!   those are kept as aliases of the node.
//! * Replica ids (`u32`, the caller's) map to dense slots so holders stay 4 bytes.
//!
//! # Event semantics
//!
//! * `BlockStored` with `parent_block_hash: None` chains from [`ROOT`]; with a parent, from the
//!   parent's router key. **A parent this index does not know** (never stored, already removed,
//!   evicted for budget) makes the keys uncomputable: the event is dropped, counted in
//!   [`IndexStats::parent_unknown`], and [`IndexError::ParentUnknown`] is returned so the caller
//!   can log it or ask for a replay. The index is unchanged.
//! * Storing a block a replica already holds on that medium is idempotent: it refreshes recency
//!   and counts as a refresh, never as a second copy. This is what `kv_cache_report_mode: "full"`
//!   needs (vLLM re-announces every prefix hit as a `BlockStored` with no parent). The price: when
//!   an engine briefly holds two physical copies of one block (two requests computed it in the
//!   same step) and evicts one, the index forgets the block early. A false "not cached" costs one
//!   missed hit and heals on the next store; a false "cached" would route misses forever.
//! * `BlockRemoved` clears the medium bit of each named block for that replica; a block with no
//!   holders left is freed. Unknown hashes are counted (`remove_unknown`), not errors.
//! * `AllBlocksCleared` clears the replica on every medium (conservative: forgetting is cheap).
//! * Events of another KV cache group than [`IndexConfig::group_idx`] are ignored and counted.
//!
//! # Memory budget
//!
//! [`IndexStats::bytes_estimate`] counts the allocated capacity of every structure (slab chunks,
//! both hash tables including their control bytes, spilled holder lists, alias maps). Before any
//! insertion that would grow an allocation, the index checks that the *new* allocation fits under
//! [`IndexConfig::max_bytes`] next to the current ones (a table resize briefly holds both), and
//! otherwise evicts blocks until the insertion needs no growth. Eviction is **CLOCK** (second
//! chance), an approximation of least-recently-touched over the whole index: every event that
//! stores, refreshes or chains from a block, and every lookup that matches it, sets its reference
//! bit; the eviction hand clears set bits and evicts the first block whose bit is clear, with all
//! its holders. Evictions are counted in [`IndexStats::evicted_for_budget`]. If nothing can be
//! evicted (the budget is smaller than one allocation), the block is dropped and counted in
//! `dropped_for_budget`. Tables grow by doubling, so the index may stop growing well before the
//! budget when the next doubling would not fit.
//!
//! # Lookup
//!
//! [`KvIndex::lookup`] walks the request's keys in order and keeps, per replica, how far its
//! contiguous prefix reaches and on which tier: first GPU blocks, then (sibling) predicted blocks,
//! then CPU, then storage. Tiers only go down, as the engine serves them: vLLM takes its GPU hit
//! first, then an offload connector loads the continuation from host memory or storage. A GPU
//! block after a predicted one counts as predicted: it is a hit only once the sibling computed
//! the predicted blocks before it. The walk
//! stops at the first block no replica continues, so it costs time proportional to the matched
//! length (and the holders of those blocks), never to the request's length.
//!
//! # Predicted entries
//!
//! See [`KvIndex::insert_predicted`]: short-lived, bounded, replaced by real events, reported
//! separately in [`ReplicaMatch::predicted`].

mod export;
mod hasher;
mod kv_index;
mod predicted;
mod shared;
mod slab;

pub use export::{IndexSnapshot, SNAPSHOT_VERSION};
pub use hasher::{IdBuildHasher, IdHasher};
pub use kv_index::*;
pub use shared::{take_lookup_time, BatchOutcome, SharedIndex};
