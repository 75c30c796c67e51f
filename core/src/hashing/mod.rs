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

mod cbor;
mod extra_keys;
mod hasher;
mod pickle;

// pub use extra_keys::{BlockExtraKeys, ExtraKeyStyle, HashExtraKey, MmFeature, RequestExtras};
// pub use hasher::{usable_hit_blocks, wire_u64, BlockHasher, Digest, HashAlgo, HashConfig, HashError};
