//! The engine's block hash: [`ChainHasher`] over `kvroute_core::hashing`, so the simulator hashes
//! exactly as vLLM 0.33.0 does (and as the router recomputes), including LoRA and cache_salt.

use std::sync::Arc;

use kvroute_core::hashing::{BlockHasher, Digest, ExtraKeyStyle, RequestExtras};

use crate::sequence::{BlockHash, ChainHasher, SeqMeta};

/// One request's hash chain: the engine's hasher plus the request's extra keys.
pub struct RequestChainHasher {
    hasher: Arc<BlockHasher>,
    extras: RequestExtras,
    block_size: usize,
    style: ExtraKeyStyle,
}

impl RequestChainHasher {
    /// A chain for a request with `extras`.
    pub fn new(hasher: Arc<BlockHasher>, extras: RequestExtras, block_size: usize) -> Self {
        let style = hasher.style();
        RequestChainHasher {
            hasher,
            extras,
            block_size,
            style,
        }
    }

    /// The event metadata of this request (per-block extra keys as events publish them).
    pub fn event_meta(&self, lora_id: Option<i64>, session_id: Option<String>) -> SeqMeta {
        let k0 = self.extras.block_extra_keys(0, self.block_size, self.style);
        let k1 = self.extras.block_extra_keys(1, self.block_size, self.style);
        SeqMeta {
            lora_name: self.extras.lora.as_ref().map(|l| l.name.clone()),
            lora_id,
            session_id,
            extra_block0: k0.event,
            extra_rest: k1.event,
        }
    }
}

impl ChainHasher for RequestChainHasher {
    fn hash_block(&self, parent: Option<&BlockHash>, idx: usize, tokens: &[u32]) -> BlockHash {
        let keys = self
            .extras
            .block_extra_keys(idx, self.block_size, self.style);
        let parent_digest = parent.and_then(|p| Digest::from_slice(p.as_bytes()));
        let parent_ref = parent_digest.as_ref().unwrap_or(self.hasher.none_hash());
        let d = self
            .hasher
            .hash_block(parent_ref, tokens, keys.hash.as_deref());
        BlockHash::from_digest(d.as_bytes())
    }
}
