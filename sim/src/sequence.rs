//! One request as the engine core sees it: prompt + output token ids, the chained block hashes
//! kept up to date as tokens are appended (vLLM's `Request.block_hashes`), and the per-request
//! metadata the KV events carry (LoRA, session, extra keys).

use std::sync::Arc;

use kvroute_core::events::ExtraKeyValue;
use kvroute_core::rng::SplitMix64;

/// A block's full prefix-cache digest (16 or 32 bytes), the key of the block pool's cache map.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockHash {
    bytes: [u8; 32],
    len: u8,
}

impl BlockHash {
    /// Wraps a digest; longer inputs keep their last 32 bytes.
    pub fn from_digest(digest: &[u8]) -> Self {
        let tail = &digest[digest.len().saturating_sub(32)..];
        let mut bytes = [0u8; 32];
        bytes[..tail.len()].copy_from_slice(tail);
        BlockHash {
            bytes,
            len: tail.len() as u8,
        }
    }

    /// A test/bench hash from a 64-bit value (8-byte digest).
    pub fn from_u64(v: u64) -> Self {
        Self::from_digest(&v.to_be_bytes())
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The value vLLM publishes in events: the digest's last 8 bytes, big-endian.
    pub fn wire_u64(&self) -> u64 {
        let b = self.as_bytes();
        let tail = &b[b.len().saturating_sub(8)..];
        let mut buf = [0u8; 8];
        buf[8 - tail.len()..].copy_from_slice(tail);
        u64::from_be_bytes(buf)
    }
}

/// Computes a request's chained block hashes (vLLM's `hash_block_tokens` with the request's extra
/// keys). Implemented over `kvroute_core::hashing` in [`crate::hashing`]; tests use a toy chain.
pub trait ChainHasher: Send + Sync {
    /// Hash of block `block_index` whose tokens are `tokens`, chained on `parent` (`None` = the
    /// engine's NONE_HASH).
    fn hash_block(
        &self,
        parent: Option<&BlockHash>,
        block_index: usize,
        tokens: &[u32],
    ) -> BlockHash;
}

/// What KV events say about the request that stored a block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqMeta {
    /// LoRA adapter name (`lora_name`).
    pub lora_name: Option<String>,
    /// vLLM's integer adapter id (`lora_id`, 1-based in `--lora-modules` order).
    pub lora_id: Option<i64>,
    /// `session_id` of the request.
    pub session_id: Option<String>,
    /// Event extra keys of block 0 (LoRA name, then cache salt), `None` when empty.
    pub extra_block0: Option<Vec<ExtraKeyValue>>,
    /// Event extra keys of every later block (LoRA name only), `None` when empty.
    pub extra_rest: Option<Vec<ExtraKeyValue>>,
}

impl SeqMeta {
    /// The event extra keys of block `index`.
    pub fn extra_for_block(&self, index: usize) -> Option<Vec<ExtraKeyValue>> {
        if index == 0 {
            self.extra_block0.clone()
        } else {
            self.extra_rest.clone()
        }
    }
}

/// Identifies a sequence inside one engine.
pub type SeqId = u64;

/// Deterministic pseudo-random output tokens (splitmix64), seeded per request.
#[derive(Clone, Debug)]
pub struct TokenSource {
    rng: SplitMix64,
    vocab: u32,
}

impl TokenSource {
    /// A source drawing ids in `0..vocab` (vocab must exclude special tokens).
    pub fn new(seed: u64, vocab: u32) -> Self {
        TokenSource {
            rng: SplitMix64::new(seed),
            vocab: vocab.max(1),
        }
    }

    /// The next token id.
    pub fn next_token(&mut self) -> u32 {
        (self.rng.next_u64() % u64::from(self.vocab)) as u32
    }
}

/// A request in the engine core.
pub struct Sequence {
    /// Engine-local id.
    pub id: SeqId,
    /// Prompt tokens followed by output tokens.
    pub tokens: Vec<u32>,
    /// Number of prompt tokens.
    pub num_prompt_tokens: usize,
    /// Output tokens to generate (the sequence finishes after this many).
    pub max_tokens: usize,
    /// Tokens whose KV is computed (or hit in the prefix cache).
    pub num_computed_tokens: usize,
    /// Hashes of every full hash block of `tokens` (`hash_block_size` tokens each).
    pub block_hashes: Vec<BlockHash>,
    /// Metadata for events.
    pub meta: Arc<SeqMeta>,
    /// `vllm_xargs.kv_cache_report_mode == "full"`.
    pub report_full: bool,
    /// Times this sequence was preempted.
    pub num_preemptions: u32,
    /// Prefix-cache hit (tokens) at its first admission; `None` until admitted.
    pub cached_tokens: Option<usize>,
    /// Output token generator.
    pub source: TokenSource,
    /// Arrival time on the simulated clock (seconds).
    pub arrival_s: f64,
    /// When the engine queued it (vLLM's `QUEUED` event), simulated clock; starts as `arrival_s`.
    pub queued_s: f64,
    /// Start of the step that first scheduled it (vLLM's first `SCHEDULED` event; preemptions
    /// do not move it), simulated clock.
    pub scheduled_s: Option<f64>,
    /// First-token time on the simulated clock, once produced.
    pub first_token_s: Option<f64>,
    /// Time of its latest output token, simulated clock.
    pub last_token_s: Option<f64>,
    /// Tokens per block hash (the KV cache's `hash_block_size`).
    block_size: usize,
    hasher: Arc<dyn ChainHasher>,
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("id", &self.id)
            .field("num_tokens", &self.tokens.len())
            .field("num_prompt_tokens", &self.num_prompt_tokens)
            .field("num_computed_tokens", &self.num_computed_tokens)
            .finish_non_exhaustive()
    }
}

/// Everything needed to build a [`Sequence`].
pub struct SequenceSpec {
    /// Engine-local id.
    pub id: SeqId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Event metadata.
    pub meta: Arc<SeqMeta>,
    /// Report reused blocks (`kv_cache_report_mode: full`).
    pub report_full: bool,
    /// Output token generator.
    pub source: TokenSource,
    /// Arrival time on the simulated clock.
    pub arrival_s: f64,
}

impl Sequence {
    /// Builds the sequence and hashes its full prompt blocks of `block_size` tokens (the KV
    /// cache's `hash_block_size`, the block size unless `--prefix-match-unit` is finer).
    pub fn new(spec: SequenceSpec, block_size: usize, hasher: Arc<dyn ChainHasher>) -> Self {
        let num_prompt_tokens = spec.prompt.len();
        let mut seq = Sequence {
            id: spec.id,
            tokens: spec.prompt,
            num_prompt_tokens,
            max_tokens: spec.max_tokens.max(1),
            num_computed_tokens: 0,
            block_hashes: Vec::new(),
            meta: spec.meta,
            report_full: spec.report_full,
            num_preemptions: 0,
            cached_tokens: None,
            source: spec.source,
            arrival_s: spec.arrival_s,
            queued_s: spec.arrival_s,
            scheduled_s: None,
            first_token_s: None,
            last_token_s: None,
            block_size: block_size.max(1),
            hasher,
        };
        seq.update_block_hashes();
        seq
    }

    /// Prompt + output tokens so far.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Output tokens so far.
    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// The generated token ids.
    pub fn output_tokens(&self) -> &[u32] {
        &self.tokens[self.num_prompt_tokens..]
    }

    /// Appends a sampled token and hashes any block it completes.
    pub fn append_token(&mut self, token: u32) {
        self.tokens.push(token);
        self.update_block_hashes();
    }

    /// Whether the sequence has produced all its tokens.
    pub fn is_finished(&self) -> bool {
        self.num_output_tokens() >= self.max_tokens
    }

    fn update_block_hashes(&mut self) {
        let bs = self.block_size;
        let full = self.tokens.len() / bs;
        while self.block_hashes.len() < full {
            let i = self.block_hashes.len();
            let h = self.hasher.hash_block(
                self.block_hashes.last(),
                i,
                &self.tokens[i * bs..(i + 1) * bs],
            );
            self.block_hashes.push(h);
        }
    }
}

/// A toy chained hash (FNV-1a over parent and tokens) for unit tests and benchmarks that do not
/// need vLLM's real hash.
#[derive(Debug, Default, Clone, Copy)]
pub struct ToyHasher;

impl ChainHasher for ToyHasher {
    fn hash_block(&self, parent: Option<&BlockHash>, _idx: usize, tokens: &[u32]) -> BlockHash {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: u8| {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01B3);
        };
        if let Some(p) = parent {
            p.as_bytes().iter().for_each(|b| eat(*b));
        }
        for t in tokens {
            t.to_le_bytes().iter().for_each(|b| eat(*b));
        }
        BlockHash::from_u64(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_value_is_last_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(BlockHash::from_digest(&d).wire_u64(), 0x0102_0304_0506_0708);
        assert_eq!(BlockHash::from_u64(42).wire_u64(), 42);
    }

    #[test]
    fn appending_tokens_hashes_completed_blocks() {
        let spec = SequenceSpec {
            id: 1,
            prompt: (0..20).collect(),
            max_tokens: 20,
            meta: Arc::default(),
            report_full: false,
            source: TokenSource::new(7, 1000),
            arrival_s: 0.0,
        };
        let mut s = Sequence::new(spec, 16, Arc::new(ToyHasher));
        assert_eq!(s.block_hashes.len(), 1);
        for _ in 0..12 {
            let t = s.source.next_token();
            s.append_token(t);
        }
        assert_eq!(s.num_tokens(), 32);
        assert_eq!(s.block_hashes.len(), 2);
    }
}
