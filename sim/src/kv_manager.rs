//! vLLM's `KVCacheManager` for one full-attention group (kv_cache_manager.py +
//! single_type_kv_cache_manager.py): per-request block tables, prefix-hit lookup capped at
//! `num_tokens - 1`, slot allocation with the full-prompt admission check, caching of newly
//! full blocks, and freeing in reverse order so a request's tail blocks are evicted first.

use std::collections::HashMap;

use crate::block_pool::{BlockId, BlockPool, CacheRun, PoolError, PoolEvent};
use crate::sequence::{SeqId, Sequence};

#[derive(Debug, Default)]
struct ReqBlocks {
    blocks: Vec<BlockId>,
    num_cached: usize,
}

/// A prefix-cache lookup result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hit {
    /// The hit blocks, in order.
    pub blocks: Vec<BlockId>,
    /// Hit length in tokens.
    pub num_tokens: usize,
}

/// Block tables on top of the pool.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    reqs: HashMap<SeqId, ReqBlocks>,
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl KvCacheManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, emit_events: bool) -> Result<Self, PoolError> {
        Ok(KvCacheManager {
            pool: BlockPool::new(num_blocks, emit_events)?,
            block_size: block_size.max(1),
            reqs: HashMap::new(),
        })
    }

    /// The pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// KV cache usage fraction.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The blocks a request holds.
    pub fn blocks_of(&self, id: SeqId) -> &[BlockId] {
        self.reqs.get(&id).map_or(&[], |r| r.blocks.as_slice())
    }

    /// The longest cached prefix, capped at `(num_tokens - 1) // block_size` blocks. Emits the
    /// `kv_cache_report_mode: full` re-announcement when the sequence asks for it.
    pub fn get_computed_blocks(&mut self, seq: &Sequence) -> Hit {
        let max_blocks = seq.num_tokens().saturating_sub(1) / self.block_size;
        let blocks = self.pool.longest_hit(&seq.block_hashes, max_blocks);
        let num_tokens = blocks.len() * self.block_size;
        if num_tokens > 0 && seq.report_full {
            self.pool.emit_cached_block_events(
                &seq.meta,
                &seq.tokens,
                &seq.block_hashes,
                blocks.len(),
                self.block_size,
            );
        }
        Hit { blocks, num_tokens }
    }

    /// Gives `seq` slots for `num_new_tokens` more tokens, adopting `hit` first when it is being
    /// admitted. With `full_sequence_must_fit`, the whole current sequence must fit (vLLM's
    /// `scheduler_reserve_full_isl`, on by default). Returns false and changes nothing when the
    /// free blocks do not suffice.
    pub fn allocate_slots(
        &mut self,
        seq: &Sequence,
        num_new_tokens: usize,
        hit: Option<&Hit>,
        full_sequence_must_fit: bool,
    ) -> bool {
        let bs = self.block_size;
        let held = self.reqs.get(&seq.id).map_or(0, |r| r.blocks.len());
        let (hit_blocks, hit_tokens): (&[BlockId], usize) =
            hit.map_or((&[], 0), |h| (h.blocks.as_slice(), h.num_tokens));
        let evictable = hit_blocks
            .iter()
            .filter(|b| self.pool.ref_cnt(**b) == 0)
            .count();
        let computed = seq.num_computed_tokens + hit_tokens;
        let free = self.pool.num_free();
        if full_sequence_must_fit {
            let need = cdiv(seq.num_tokens(), bs).saturating_sub(held + hit_blocks.len());
            if need + evictable > free {
                return false;
            }
        }
        let need_slots = computed + num_new_tokens;
        let new_blocks = cdiv(need_slots, bs).saturating_sub(held + hit_blocks.len());
        if new_blocks + evictable > free {
            return false;
        }
        self.pool.touch(hit_blocks);
        let entry = self.reqs.entry(seq.id).or_default();
        if !hit_blocks.is_empty() {
            entry.blocks.extend_from_slice(hit_blocks);
            entry.num_cached = entry.blocks.len();
        }
        match self.pool.get_new_blocks(new_blocks) {
            Ok(blocks) => entry.blocks.extend(blocks),
            Err(e) => {
                // Unreachable after the check above; keep the state consistent anyway.
                tracing::error!(error = %e, "block allocation failed after the free-space check");
                return false;
            }
        }
        let to_cache = (computed + num_new_tokens).min(seq.num_tokens());
        self.cache_blocks(seq, to_cache);
        true
    }

    fn cache_blocks(&mut self, seq: &Sequence, num_tokens: usize) {
        let bs = self.block_size;
        let Some(entry) = self.reqs.get_mut(&seq.id) else {
            return;
        };
        let num_full = (num_tokens.min(seq.block_hashes.len() * bs)) / bs;
        if entry.num_cached >= num_full {
            return;
        }
        self.pool.cache_full_blocks(CacheRun {
            meta: &seq.meta,
            tokens: &seq.tokens,
            hashes: &seq.block_hashes,
            blocks: &entry.blocks,
            num_cached: entry.num_cached,
            num_full,
            block_size: bs,
        });
        entry.num_cached = num_full;
    }

    /// Frees a request's blocks, tail first.
    pub fn free(&mut self, id: SeqId) {
        if let Some(r) = self.reqs.remove(&id) {
            self.pool.free_blocks(r.blocks.into_iter().rev());
        }
    }

    /// Resets the prefix cache (fails while any request holds blocks).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Takes the pool's queued events.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.pool.take_events()
    }
}
