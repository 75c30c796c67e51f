//! The event data model, independent of how it was encoded on the wire.

use serde::{Deserialize, Serialize};

/// A block hash as it travels in events: an integer (default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`,
/// the last 8 bytes of the digest big-endian; signed encodings are reinterpreted as u64) or the raw
/// digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WireBlockHash {
    /// Integer form.
    Int(u64),
    /// Raw digest bytes.
    Bytes(Vec<u8>),
}

impl WireBlockHash {
    /// The 64-bit key the index uses for this hash: the integer itself, or for raw bytes the last
    /// 8 bytes big-endian (so both forms of the same digest give the same key).
    pub fn as_u64(&self) -> u64 {
        match self {
            WireBlockHash::Int(v) => *v,
            WireBlockHash::Bytes(b) => {
                let mut buf = [0u8; 8];
                let tail = &b[b.len().saturating_sub(8)..];
                buf[8 - tail.len()..].copy_from_slice(tail);
                u64::from_be_bytes(buf)
            }
        }
    }
}

/// One element of an event's `extra_keys` entry (untagged, as events publish them): a LoRA name or
/// cache salt string, an integer, or a nested list such as a multimodal `[identifier, offset]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExtraKeyValue {
    /// A text value (LoRA name, cache salt, multimodal identifier).
    Str(String),
    /// An integer (multimodal offset, legacy LoRA int id).
    Int(i64),
    /// Raw bytes (prompt-embeds digests).
    Bytes(Vec<u8>),
    /// A nested list.
    List(Vec<ExtraKeyValue>),
}

/// The storage tier that holds a block.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
pub enum Medium {
    /// GPU memory (the engine's own prefix cache). vLLM sends "GPU" or omits the field.
    #[default]
    Gpu,
    /// Host memory (CPU offloading).
    Cpu,
    /// Disk or remote storage (e.g. LMCache).
    Storage,
}

impl Medium {
    /// Parses vLLM's medium string (case-insensitive); unknown tiers return `None`.
    pub fn parse(s: &str) -> Option<Medium> {
        match s.to_ascii_uppercase().as_str() {
            "GPU" => Some(Medium::Gpu),
            "CPU" => Some(Medium::Cpu),
            "STORAGE" | "DISK" | "LMCACHE" => Some(Medium::Storage),
            _ => None,
        }
    }

    /// The wire string vLLM uses.
    pub fn as_str(&self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
}

/// `BlockStored`: the engine cached these full blocks.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<WireBlockHash>,
    /// Hash of the block before the first one, `None` when the chain starts at the request's block 0.
    pub parent_block_hash: Option<WireBlockHash>,
    /// All token ids of these blocks (`block_hashes.len() * block_size` of them).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated integer LoRA id (still sent by 0.33.0).
    pub lora_id: Option<i64>,
    /// Storage tier; `None` when omitted on the wire (means GPU).
    pub medium: Option<Medium>,
    /// LoRA adapter name (>= 0.15).
    pub lora_name: Option<String>,
    /// One entry per block: the block's extra keys as events publish them, or `None`.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKeyValue>>>>,
    /// KV cache group index (hybrid models).
    pub group_idx: Option<i64>,
    /// KV cache spec kind ("full_attention", "sliding_window", ...).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window size for sliding-window groups.
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// `LOCAL` or `REMOTE` relative to the publisher (vLLM 0.33); `None` = unspecified.
    pub locality: Option<String>,
    /// Secondary offloading tier identifier, if one generated the event (vLLM 0.33).
    pub ownership: Option<String>,
    /// `vllm_xargs.session_id` of the request that stored the blocks.
    pub session_id: Option<String>,
    /// Tokens beyond each block that its hash also covered, one list per block (lookahead
    /// hashing); `None` when disabled.
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

impl BlockStored {
    /// Whether this event keys one hash block inside a block of `block_size` tokens: with vLLM's
    /// `--prefix-match-unit` (`hash_block_size`) below the block size, a full-attention group also
    /// caches a block under the hash of the prompt's last hash boundary inside it
    /// (`cache_partial_block`), published as a `BlockStored` of that one hash block (its
    /// `block_size` is the hash block size). Such a key never lengthens an attention model's hit
    /// (hits stay block-aligned), so a router skips it.
    pub fn is_hash_block_of(&self, block_size: u32) -> bool {
        self.block_hashes.len() == 1
            && self.block_size > 0
            && self.block_size < block_size
            && block_size.is_multiple_of(self.block_size)
    }
}

/// The block size to keep after seeing an event of `event` tokens per block when `learned` was
/// known: the first size seen, raised when a larger multiple arrives (a hash block's event can
/// come first), never lowered by one (see [`BlockStored::is_hash_block_of`]).
pub fn learned_block_size(learned: Option<u32>, event: u32) -> Option<u32> {
    match learned {
        _ if event == 0 => learned,
        None => Some(event),
        Some(l) if event > l && event.is_multiple_of(l) => Some(event),
        Some(l) => Some(l),
    }
}

/// `BlockRemoved`: the engine evicted these blocks.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct BlockRemoved {
    /// Hashes of evicted blocks.
    pub block_hashes: Vec<WireBlockHash>,
    /// Storage tier; `None` when omitted (GPU).
    pub medium: Option<Medium>,
    /// KV cache group index.
    pub group_idx: Option<i64>,
    /// `LOCAL` or `REMOTE` relative to the publisher (vLLM 0.33); `None` = unspecified.
    pub locality: Option<String>,
    /// Secondary offloading tier identifier, if one generated the event (vLLM 0.33).
    pub ownership: Option<String>,
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum KvEvent {
    /// Blocks were cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
    /// An event type this version does not know (its name); ignored by consumers.
    Unknown(String),
}

/// One published batch: `[ts, events, data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Engine wall-clock timestamp (seconds since the epoch).
    pub ts: f64,
    /// Events in the order the engine produced them.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank; `None` when the batch had only two elements (very old engines).
    pub data_parallel_rank: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(blocks: usize, block_size: u32) -> BlockStored {
        BlockStored {
            block_hashes: (0..blocks as u64).map(WireBlockHash::Int).collect(),
            block_size,
            ..BlockStored::default()
        }
    }

    #[test]
    fn a_hash_block_event_is_one_hash_of_a_divisor_of_the_block_size() {
        assert!(stored(1, 8).is_hash_block_of(16));
        assert!(stored(1, 4).is_hash_block_of(16));
        assert!(
            !stored(2, 8).is_hash_block_of(16),
            "two hashes: full blocks"
        );
        assert!(!stored(1, 16).is_hash_block_of(16));
        assert!(!stored(1, 6).is_hash_block_of(16));
        assert!(!stored(1, 0).is_hash_block_of(16));
    }

    #[test]
    fn the_learned_block_size_rises_to_a_multiple_and_never_falls() {
        assert_eq!(learned_block_size(None, 16), Some(16));
        assert_eq!(learned_block_size(None, 0), None);
        assert_eq!(learned_block_size(Some(16), 8), Some(16));
        assert_eq!(learned_block_size(Some(8), 16), Some(16));
        assert_eq!(learned_block_size(Some(16), 24), Some(16));
        assert_eq!(learned_block_size(Some(16), 0), Some(16));
    }
}
