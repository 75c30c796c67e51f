//! vLLM's prefix-cache block hash, byte for byte (vLLM >= 0.29, reference 0.33.0), and the 64-bit
//! value vLLM publishes in KV events.
//!
//! ```text
//! parent_0 = NONE_HASH = hash_fn(seed as a Python str)
//! h_i = hash_fn((parent_i, tuple(tokens[i*bs..(i+1)*bs]), extra_keys_i or None))
//! ```
//!
//! `hash_fn` serialises the tuple with pickle protocol 5 (`sha256`, `xxhash`) or canonical CBOR
//! (`sha256_cbor`, `xxhash_cbor`) and digests it with sha256 (32 bytes) or xxh3-128 (16 bytes).
//! The parent is the previous block's *full* digest; only full blocks are hashed.
//!
//! The seed is the engine's `PYTHONHASHSEED`, else `"vllm-none-hash"` for sha256*. xxhash*
//! without a seed, and every algorithm on vLLM < 0.29 without a seed, use a random per-process
//! NONE_HASH: [`BlockHasher::new`] and [`HashConfig::for_engine_version`] refuse those set-ups
//! with [`HashError::UnreproducibleSeed`] instead of computing hashes no engine has.
//!
//! Why kvroute computes this hash at all when it keys its index by [`crate::router_key`]: events
//! name blocks by the engine's hash (the `BlockRemoved` of an evicted block carries nothing else),
//! so applying events per replica needs it, and recomputing it from a request lets kvroute check,
//! online, that it and the engines agree on tokens and extra keys.

mod cbor;
mod extra_keys;
mod hasher;
mod pickle;
mod preimage;

pub use extra_keys::{
    BlockExtraKeys, ExtraKeyStyle, HashExtraKey, LoraRef, MmFeature, RequestExtras,
};
pub use hasher::{
    usable_hit_blocks, wire_u64, BlockHasher, Digest, HashAlgo, HashConfig, HashError,
    DEFAULT_NONE_HASH_SEED,
};
