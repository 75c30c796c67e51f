//! vLLM's `BlockPool` (vllm/v1/core/block_pool.py, 0.33.0), reimplemented: a fixed set of KV
//! blocks, a hash -> block map of cached full blocks, reference counts, and a free queue in
//! eviction order that keeps freed blocks' hashes until they are reused.
//!
//! Hybrid models: the pool is shared by every KV cache group (as vLLM's coordinator shares one
//! `BlockPool`); a block is cached under (hash, group), vLLM's `BlockHashWithGroupId`, and its
//! events carry the group.
//!
//! Invariants, as in vLLM:
//! * block 0 is the null block, taken at start and never handed out (usable = N - 1);
//! * a block with `ref_cnt > 0` is pinned: it is never in the free queue, never evicted;
//! * a freed block keeps its hash and stays hittable until it reaches the queue head and is
//!   reused; reuse evicts the hash and emits one `BlockRemoved` per evicted hash;
//! * the same hash may map to several blocks (two requests computed the same block at once);
//!   each caches and later evicts separately, and each emits its own event;
//! * with `hash_block_size` below the block size, a cached block may also be reachable from a
//!   partial key (vLLM's `cache_partial_block`: the prompt's last hash boundary inside it); the
//!   block's keys are evicted together, one `BlockRemoved` each, its primary key first.

use std::collections::HashMap;
use std::sync::Arc;

use crate::free_queue::FreeQueue;
use crate::sequence::{BlockHash, SeqMeta};

/// Index of a block in the pool.
pub type BlockId = u32;

/// A KV cache group id.
pub type GroupId = u8;

/// Errors from the pool.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    /// The pool needs the null block plus at least one usable block.
    #[error("the KV cache needs at least 2 blocks (got {0})")]
    TooSmall(usize),
    /// More blocks were requested than are free.
    #[error("cannot get {wanted} free blocks from the pool ({free} free)")]
    NotEnoughFree {
        /// Blocks asked for.
        wanted: usize,
        /// Blocks free.
        free: usize,
    },
    /// `hash_block_size` (`--prefix-match-unit`) must divide the block size.
    #[error("the hash block size {hash_block_size} does not divide the block size {block_size}")]
    HashBlockSize {
        /// Tokens per block hash.
        hash_block_size: usize,
        /// Tokens per block.
        block_size: usize,
    },
}

/// A KV cache event produced by the pool, before conversion to the wire model.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolEvent {
    /// Full blocks were cached (or, in report-full mode, re-announced).
    Stored {
        /// The storing request's metadata.
        meta: Arc<SeqMeta>,
        /// Hash of the block before the first one; `None` when the run starts at block 0.
        parent: Option<BlockHash>,
        /// Hashes of the stored blocks.
        hashes: Vec<BlockHash>,
        /// Index of the first stored block within its request.
        first_block: usize,
        /// All token ids of the stored blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// The KV cache group.
        group: GroupId,
    },
    /// A cached block of a KV cache group was evicted.
    Removed(BlockHash, GroupId),
    /// The prefix cache was reset.
    Cleared,
}

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    /// The primary key (vLLM's `block_hash`).
    hash: Option<(BlockHash, GroupId)>,
    /// Tokens the primary key covers (vLLM's `block_hash_num_tokens`).
    hash_tokens: usize,
    /// Further keys reaching this block (vLLM's `cached_block_hashes_by_block`): partial keys.
    extra: Vec<(BlockHash, GroupId)>,
}

/// One hash maps to one block, or (rarely) to several, kept in insertion order.
#[derive(Debug, Clone)]
enum Cached {
    One(BlockId),
    Many(Vec<BlockId>),
}

/// The block pool.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: FreeQueue,
    cached: HashMap<(BlockHash, GroupId), Cached>,
    events: Vec<PoolEvent>,
    emit_events: bool,
}

/// The id of the null block.
pub const NULL_BLOCK: BlockId = 0;

impl BlockPool {
    /// A pool of `num_blocks` blocks (block 0 reserved as the null block).
    pub fn new(num_blocks: usize, emit_events: bool) -> Result<Self, PoolError> {
        if num_blocks < 2 || num_blocks > u32::MAX as usize - 1 {
            return Err(PoolError::TooSmall(num_blocks));
        }
        let mut free = FreeQueue::new(num_blocks);
        free.remove(NULL_BLOCK);
        Ok(BlockPool {
            blocks: vec![Block::default(); num_blocks],
            free,
            cached: HashMap::new(),
            events: Vec::new(),
            emit_events,
        })
    }

    /// Total blocks including the null block.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks (including cached blocks no request holds).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// `vllm:kv_cache_usage_perc`: 1 - free / (N - 1).
    pub fn usage(&self) -> f64 {
        let total = self.blocks.len() - 1;
        1.0 - self.free.len() as f64 / total as f64
    }

    /// Distinct cached hashes.
    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// Reference count of a block.
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.ref_cnt)
    }

    /// The hash (and group) a block is cached under, if any.
    pub fn block_hash(&self, id: BlockId) -> Option<(BlockHash, GroupId)> {
        self.blocks.get(id as usize).and_then(|b| b.hash)
    }

    /// The free queue from head (evicted first) to tail.
    pub fn free_queue(&self) -> Vec<BlockId> {
        self.free.to_vec()
    }

    /// Any block of `group` cached under `hash` (the earliest inserted).
    pub fn get_cached_block(&self, hash: &BlockHash, group: GroupId) -> Option<BlockId> {
        match self.cached.get(&(*hash, group))? {
            Cached::One(id) => Some(*id),
            Cached::Many(ids) => ids.first().copied(),
        }
    }

    /// vLLM's `get_cached_block(hash, group_ids)`: one cached block per group, or `None` when
    /// any group misses.
    pub fn get_cached_blocks(&self, hash: &BlockHash, groups: &[GroupId]) -> Option<Vec<BlockId>> {
        groups
            .iter()
            .map(|&g| self.get_cached_block(hash, g))
            .collect()
    }

    /// Takes `n` blocks from the head of the free queue, evicting their hashes (one
    /// `BlockRemoved` each), with `ref_cnt` 1.
    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::NotEnoughFree {
                wanted: n,
                free: self.free.len(),
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(id) = self.free.pop_front() else {
                break;
            };
            self.evict_hash(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Ok(out)
    }

    /// Drops every key of block `id` (primary first), one `BlockRemoved` per key it held
    /// (vLLM's `_remove_cached_block_hashes` + `_emit_block_removed_events`).
    fn evict_hash(&mut self, id: BlockId) {
        let blk = &mut self.blocks[id as usize];
        let Some(primary) = blk.hash.take() else {
            return;
        };
        blk.hash_tokens = 0;
        let extra = std::mem::take(&mut blk.extra);
        for key in std::iter::once(primary).chain(extra) {
            self.unmap_key(key, id);
        }
    }

    /// Removes the mapping `key -> id`; emits `BlockRemoved` when it existed.
    fn unmap_key(&mut self, key: (BlockHash, GroupId), id: BlockId) {
        let removed = match self.cached.get_mut(&key) {
            Some(Cached::One(b)) if *b == id => {
                self.cached.remove(&key);
                true
            }
            Some(Cached::Many(ids)) => {
                let before = ids.len();
                ids.retain(|b| *b != id);
                let removed = ids.len() != before;
                if ids.len() == 1 {
                    let only = ids[0];
                    self.cached.insert(key, Cached::One(only));
                }
                removed
            }
            _ => false,
        };
        if removed && self.emit_events {
            self.events.push(PoolEvent::Removed(key.0, key.1));
        }
    }

    /// Whether `key` maps to block `id`.
    fn maps_to(&self, key: &(BlockHash, GroupId), id: BlockId) -> bool {
        match self.cached.get(key) {
            Some(Cached::One(b)) => *b == id,
            Some(Cached::Many(ids)) => ids.contains(&id),
            None => false,
        }
    }

    /// Adds the mapping `key -> id` (after any block already cached under `key`).
    fn map_key(&mut self, key: (BlockHash, GroupId), id: BlockId) {
        match self.cached.get_mut(&key) {
            None => {
                self.cached.insert(key, Cached::One(id));
            }
            Some(Cached::One(other)) => {
                let other = *other;
                self.cached.insert(key, Cached::Many(vec![other, id]));
            }
            Some(Cached::Many(ids)) => ids.push(id),
        }
    }

    /// vLLM's `_insert_block_hash`: `key` becomes the block's primary key, or a further key when
    /// it has one.
    fn insert_key(&mut self, key: (BlockHash, GroupId), id: BlockId, num_tokens: usize) {
        if self.blocks[id as usize].hash == Some(key) || self.maps_to(&key, id) {
            return;
        }
        let blk = &mut self.blocks[id as usize];
        if blk.hash.is_none() {
            blk.hash = Some(key);
            blk.hash_tokens = num_tokens;
        } else {
            blk.extra.push(key);
        }
        self.map_key(key, id);
    }

    /// Pins hit blocks: `ref_cnt += 1`, leaving the free queue if they were free.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            if self.blocks[id as usize].ref_cnt == 0 {
                self.free.remove(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Releases blocks given in eviction priority order (the first is evicted first). Blocks
    /// reaching `ref_cnt == 0` with a hash go to the tail (LRU); unhashed ones to the head.
    pub fn free_blocks(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        let mut evict_first = Vec::new();
        for id in ordered {
            if id == NULL_BLOCK {
                continue;
            }
            let b = &mut self.blocks[id as usize];
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                if b.hash.is_none() {
                    evict_first.push(id);
                } else {
                    self.free.push_back(id);
                }
            }
        }
        self.free.prepend(&evict_first);
    }

    /// Caches `blocks[num_cached..num_full]` of a request under `hashes[num_cached..num_full]`
    /// and emits one `BlockStored` for the run (parent = hash of block `num_cached - 1`).
    pub fn cache_full_blocks(&mut self, run: CacheRun<'_>) {
        let CacheRun {
            meta,
            tokens,
            hashes,
            blocks,
            num_cached,
            num_full,
            block_size,
            group,
        } = run;
        if num_cached >= num_full || num_full > blocks.len() || num_full > hashes.len() {
            return;
        }
        for i in num_cached..num_full {
            let id = blocks[i];
            if id == NULL_BLOCK {
                continue;
            }
            let h = (hashes[i], group);
            if self.blocks[id as usize].hash == Some(h) {
                continue;
            }
            // A block keyed by a partial prefix becomes a full block: its keys go first (vLLM's
            // partial -> full promotion).
            self.evict_hash(id);
            self.insert_key(h, id, (i + 1) * block_size);
        }
        if self.emit_events {
            let parent = if num_cached == 0 {
                None
            } else {
                Some(hashes[num_cached - 1])
            };
            self.events.push(PoolEvent::Stored {
                meta: meta.clone(),
                parent,
                hashes: hashes[num_cached..num_full].to_vec(),
                first_block: num_cached,
                token_ids: tokens[num_cached * block_size..num_full * block_size].to_vec(),
                block_size,
                group,
            });
        }
    }

    /// vLLM's `cache_partial_block`: makes block `id` reachable from the prefix of `num_tokens`
    /// tokens (a multiple of `hash_block_size` inside the block) under the request's hash at that
    /// boundary, `hashes[num_tokens / hash_block_size - 1]` (`hashes` are per hash block). Emits a
    /// `BlockStored` of that one hash block (block size `hash_block_size`) unless the block
    /// already had the key.
    pub fn cache_partial_block(&mut self, run: PartialRun<'_>) {
        let PartialRun {
            meta,
            tokens,
            hashes,
            block: id,
            num_tokens,
            hash_block_size,
            group,
        } = run;
        let n = num_tokens / hash_block_size.max(1);
        if id == NULL_BLOCK || n == 0 || n > hashes.len() {
            return;
        }
        let key = (hashes[n - 1], group);
        let already = self.blocks[id as usize].hash == Some(key) || self.maps_to(&key, id);
        let blk = &self.blocks[id as usize];
        if !already && blk.hash.is_some() && blk.hash_tokens < n * hash_block_size {
            self.evict_hash(id);
        }
        self.insert_key(key, id, n * hash_block_size);
        if self.emit_events && !already {
            let start = (n - 1) * hash_block_size;
            self.events.push(PoolEvent::Stored {
                meta: meta.clone(),
                parent: n.checked_sub(2).map(|p| hashes[p]),
                hashes: vec![hashes[n - 1]],
                first_block: n - 1,
                token_ids: tokens[start..start + hash_block_size].to_vec(),
                block_size: hash_block_size,
                group,
            });
        }
    }

    /// `kv_cache_report_mode: full`: re-announces a request's hit blocks `0..num_hit` as one
    /// `BlockStored` with no parent, without touching pool state.
    pub fn emit_cached_block_events(
        &mut self,
        meta: &Arc<SeqMeta>,
        tokens: &[u32],
        hashes: &[BlockHash],
        num_hit: usize,
        block_size: usize,
        group: GroupId,
    ) {
        if !self.emit_events || num_hit == 0 || num_hit > hashes.len() {
            return;
        }
        self.events.push(PoolEvent::Stored {
            meta: meta.clone(),
            parent: None,
            hashes: hashes[..num_hit].to_vec(),
            first_block: 0,
            token_ids: tokens[..num_hit * block_size].to_vec(),
            block_size,
            group,
        });
    }

    /// Drops every hash when no block is held; emits `AllBlocksCleared`. Returns false (and
    /// changes nothing) while any request holds blocks, as vLLM does.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.free.len() != self.blocks.len() - 1 {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
            b.hash_tokens = 0;
            b.extra.clear();
        }
        if self.emit_events {
            self.events.push(PoolEvent::Cleared);
        }
        true
    }

    /// Takes the queued events.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }
}

/// Arguments of [`BlockPool::cache_full_blocks`].
#[derive(Debug)]
pub struct CacheRun<'a> {
    /// The request's metadata.
    pub meta: &'a Arc<SeqMeta>,
    /// All of the request's token ids.
    pub tokens: &'a [u32],
    /// All of the request's block hashes.
    pub hashes: &'a [BlockHash],
    /// The request's block table.
    pub blocks: &'a [BlockId],
    /// Blocks already cached.
    pub num_cached: usize,
    /// Full blocks to be cached after this call.
    pub num_full: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The KV cache group of `blocks`.
    pub group: GroupId,
}

/// Arguments of [`BlockPool::cache_partial_block`].
#[derive(Debug)]
pub struct PartialRun<'a> {
    /// The request's metadata.
    pub meta: &'a Arc<SeqMeta>,
    /// All of the request's token ids.
    pub tokens: &'a [u32],
    /// The request's hashes, one per hash block.
    pub hashes: &'a [BlockHash],
    /// The block that holds the boundary.
    pub block: BlockId,
    /// The prefix length (tokens) the key stands for.
    pub num_tokens: usize,
    /// Tokens per hash block.
    pub hash_block_size: usize,
    /// The KV cache group of `block`.
    pub group: GroupId,
}
