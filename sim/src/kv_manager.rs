//! vLLM's `KVCacheManager` with its coordinator (kv_cache_manager.py, kv_cache_coordinator.py,
//! single_type_kv_cache_manager.py): per-request block tables per KV cache group, prefix-hit
//! lookup capped at `num_tokens - 1`, slot allocation with the full-prompt admission check,
//! caching of newly full blocks, and freeing in reverse order so a request's tail blocks are
//! evicted first.
//!
//! KV cache groups (hybrid models) share one block pool, as in vLLM. A full-attention group keeps
//! every block of a request; a sliding-window group frees the blocks that left the window before
//! each allocation (`SlidingWindowManager.remove_skipped_blocks`: tokens before
//! `num_computed_tokens - window + 1`), replacing them with the null block. The hit of several
//! groups follows `HybridKVCacheCoordinator.find_longest_cache_hit`: spec groups (groups of equal
//! spec) full attention first, each lowering the candidate length, repeated until it is stable.
//! All groups share one block size (vLLM's uniform-page layouts of Gemma 3 and gpt-oss).
//!
//! Requests may be hashed finer than the block size (`hash_block_size`, vLLM's
//! `--prefix-match-unit`): a block is then keyed, looked up and published by the hash of its last
//! hash block (vLLM's `resolve_block_hashes`), and hits stay block-aligned (vLLM's partial hash
//! hits need Mamba groups). Full-attention groups then also key the block holding the prompt's
//! last hash boundary by that boundary's hash (`FullAttentionManager._cache_partial_tail_block`),
//! published as a `BlockStored` of one hash block.

use std::borrow::Cow;

use std::collections::HashMap;

use kvroute_core::hybrid::{contiguous_blocks_for_hit, GroupKind};

use crate::block_pool::{
    BlockId, BlockPool, CacheRun, GroupId, PartialRun, PoolError, PoolEvent, NULL_BLOCK,
};
use crate::sequence::{BlockHash, SeqId, Sequence};

#[derive(Debug, Default, Clone)]
struct GroupBlocks {
    blocks: Vec<BlockId>,
    num_cached: usize,
}

/// A prefix-cache lookup result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hit {
    /// The hit blocks of group 0, in order (the null block where a sliding window skipped one).
    pub blocks: Vec<BlockId>,
    /// The hit blocks of every group (`per_group[0] == blocks`).
    pub per_group: Vec<Vec<BlockId>>,
    /// Hit length in tokens.
    pub num_tokens: usize,
}

/// Block tables on top of the pool.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    /// Tokens per request block hash (divides `block_size`).
    hash_block_size: usize,
    groups: Vec<GroupKind>,
    reqs: HashMap<SeqId, Vec<GroupBlocks>>,
    /// vLLM's `max_in_flight_tokens` and `max_model_len`: size a sliding-window group's admission
    /// cap. `None`: uncapped (vLLM's fallback when `max_in_flight_tokens` is unset).
    admission_window: Option<(usize, usize)>,
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// The hit blocks of group `g` (none without a hit).
fn hit_of(hit: Option<&Hit>, g: usize) -> &[BlockId] {
    hit.and_then(|h| h.per_group.get(g))
        .map_or(&[], |b| b.as_slice())
}

impl KvCacheManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens, one full-attention group.
    pub fn new(num_blocks: usize, block_size: usize, emit_events: bool) -> Result<Self, PoolError> {
        Self::with_groups(
            num_blocks,
            block_size,
            vec![GroupKind::FullAttention],
            emit_events,
        )
    }

    /// A manager whose KV cache groups are `groups` (group id = position), sharing one pool.
    pub fn with_groups(
        num_blocks: usize,
        block_size: usize,
        groups: Vec<GroupKind>,
        emit_events: bool,
    ) -> Result<Self, PoolError> {
        let groups = if groups.is_empty() {
            vec![GroupKind::FullAttention]
        } else {
            groups
        };
        Ok(KvCacheManager {
            pool: BlockPool::new(num_blocks, emit_events)?,
            block_size: block_size.max(1),
            hash_block_size: block_size.max(1),
            groups,
            reqs: HashMap::new(),
            admission_window: None,
        })
    }

    /// Requests are hashed every `hash_block_size` tokens (vLLM's `hash_block_size`); it must
    /// divide the block size.
    pub fn with_hash_block_size(mut self, hash_block_size: usize) -> Result<Self, PoolError> {
        if hash_block_size == 0 || !self.block_size.is_multiple_of(hash_block_size) {
            return Err(PoolError::HashBlockSize {
                hash_block_size,
                block_size: self.block_size,
            });
        }
        self.hash_block_size = hash_block_size;
        Ok(self)
    }

    /// Tokens per request block hash.
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// vLLM's `resolve_block_hashes`: one hash per full block, the hash of its last hash block.
    fn block_hashes<'a>(&self, seq: &'a Sequence) -> Cow<'a, [BlockHash]> {
        let k = self.block_size / self.hash_block_size;
        if k <= 1 {
            return Cow::Borrowed(&seq.block_hashes);
        }
        Cow::Owned(seq.block_hashes.chunks_exact(k).map(|c| c[k - 1]).collect())
    }

    /// Caps a sliding-window group's share of the full-sequence admission check as vLLM does
    /// (`SlidingWindowSpec.max_admission_blocks_per_request`): blocks for `window - 1 +
    /// max_in_flight_tokens` tokens (at most `max_model_len`), plus one. vLLM's
    /// `max_in_flight_tokens` is `max_num_batched_tokens` x concurrent batches (2 with its
    /// default async scheduling).
    pub fn with_admission_cap(mut self, max_in_flight_tokens: usize, max_model_len: usize) -> Self {
        self.admission_window = Some((max_in_flight_tokens, max_model_len));
        self
    }

    /// The most blocks group `g` reserves for one request at admission (`None`: uncapped).
    fn admission_cap(&self, g: usize) -> Option<usize> {
        let (in_flight, max_model_len) = self.admission_window?;
        match self.groups.get(g)? {
            GroupKind::FullAttention => None,
            GroupKind::SlidingWindow { window } => {
                let tokens = ((*window as usize).saturating_sub(1) + in_flight).min(max_model_len);
                Some(cdiv(tokens, self.block_size) + 1)
            }
        }
    }

    /// The pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The KV cache groups.
    pub fn groups(&self) -> &[GroupKind] {
        &self.groups
    }

    /// KV cache usage fraction.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The blocks a request holds in group 0.
    pub fn blocks_of(&self, id: SeqId) -> &[BlockId] {
        self.group_blocks_of(id, 0)
    }

    /// The blocks a request holds in `group` (the null block where a window freed one).
    pub fn group_blocks_of(&self, id: SeqId, group: usize) -> &[BlockId] {
        self.reqs
            .get(&id)
            .and_then(|g| g.get(group))
            .map_or(&[], |r| r.blocks.as_slice())
    }

    /// The longest cached prefix, capped at `(num_tokens - 1) // block_size` blocks. Emits the
    /// `kv_cache_report_mode: full` re-announcement (per group) when the sequence asks for it.
    pub fn get_computed_blocks(&mut self, seq: &Sequence) -> Hit {
        let max_tokens = seq.num_tokens().saturating_sub(1);
        let hashes = self.block_hashes(seq);
        let (per_group, num_tokens) = self.find_longest_cache_hit(&hashes, max_tokens);
        if num_tokens > 0 && seq.report_full {
            for (g, blocks) in per_group.iter().enumerate() {
                if !blocks.is_empty() {
                    self.pool.emit_cached_block_events(
                        &seq.meta,
                        &seq.tokens,
                        &hashes,
                        blocks.len(),
                        self.block_size,
                        g as GroupId,
                    );
                }
            }
        }
        Hit {
            blocks: per_group.first().cloned().unwrap_or_default(),
            per_group,
            num_tokens,
        }
    }

    /// `KVCacheCoordinator.find_longest_cache_hit`: the hit blocks of every group and the hit
    /// length in tokens, at most `max_tokens`.
    fn find_longest_cache_hit(
        &self,
        hashes: &[BlockHash],
        max_tokens: usize,
    ) -> (Vec<Vec<BlockId>>, usize) {
        let bs = self.block_size;
        let n = self.groups.len();
        // Spec groups: groups of equal spec, full attention first (a stable sort, as vLLM's).
        let mut spec_groups: Vec<(GroupKind, Vec<GroupId>)> = Vec::new();
        for (g, kind) in self.groups.iter().enumerate() {
            match spec_groups.iter_mut().find(|(k, _)| k == kind) {
                Some((_, ids)) => ids.push(g as GroupId),
                None => spec_groups.push((*kind, vec![g as GroupId])),
            }
        }
        spec_groups.sort_by_key(|(k, _)| *k != GroupKind::FullAttention);
        if n == 1 {
            let ids = &spec_groups[0].1;
            let (blocks, len) = self.find_for_spec(spec_groups[0].0, ids, hashes, max_tokens);
            return (blocks, len * bs);
        }
        let simple = spec_groups.len() == 2 && spec_groups[0].0 == GroupKind::FullAttention;
        let mut hit_blocks: Vec<Option<Vec<BlockId>>> = vec![None; n];
        let mut full_len: Option<usize> = None;
        let mut hit_length = max_tokens;
        loop {
            let mut curr = hit_length;
            for (kind, ids) in &spec_groups {
                if *kind == GroupKind::FullAttention {
                    if let Some(len) = full_len {
                        curr = curr.min(len * bs);
                        continue;
                    }
                }
                let (blocks, len) = self.find_for_spec(*kind, ids, hashes, curr);
                curr = len * bs;
                if *kind == GroupKind::FullAttention {
                    full_len = Some(len);
                }
                for (g, b) in ids.iter().zip(blocks) {
                    hit_blocks[usize::from(*g)] = Some(b);
                }
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        // Truncate the full-attention groups to the final length.
        let num_blocks = cdiv(hit_length, bs);
        let per_group = hit_blocks
            .into_iter()
            .enumerate()
            .map(|(g, b)| {
                let mut b = b.unwrap_or_default();
                if self.groups[g] == GroupKind::FullAttention {
                    b.truncate(num_blocks);
                }
                b
            })
            .collect();
        (per_group, hit_length)
    }

    /// One spec group's `find_longest_cache_hit`: per group id its hit blocks, and the hit length
    /// in blocks.
    fn find_for_spec(
        &self,
        kind: GroupKind,
        ids: &[GroupId],
        hashes: &[BlockHash],
        max_tokens: usize,
    ) -> (Vec<Vec<BlockId>>, usize) {
        let bs = self.block_size;
        let max_blocks = (max_tokens / bs).min(hashes.len());
        let mut out: Vec<Vec<BlockId>> = vec![Vec::new(); ids.len()];
        match kind {
            GroupKind::FullAttention => {
                for h in &hashes[..max_blocks] {
                    let Some(found) = self.pool.get_cached_blocks(h, ids) else {
                        break;
                    };
                    for (o, b) in out.iter_mut().zip(found) {
                        o.push(b);
                    }
                }
            }
            GroupKind::SlidingWindow { window } => {
                // SlidingWindowManager: scan right to left for `contiguous` cached blocks.
                let contiguous = contiguous_blocks_for_hit(window, bs as u32);
                for o in out.iter_mut() {
                    *o = vec![NULL_BLOCK; max_blocks];
                }
                let mut run = 0usize;
                let mut found_at = None;
                for i in (0..max_blocks).rev() {
                    match self.pool.get_cached_blocks(&hashes[i], ids) {
                        Some(found) => {
                            for (o, b) in out.iter_mut().zip(found) {
                                o[i] = b;
                            }
                            run += 1;
                            if run >= contiguous {
                                found_at = Some(i + run);
                                break;
                            }
                        }
                        None => run = 0,
                    }
                }
                let keep = found_at.unwrap_or(run);
                for o in out.iter_mut() {
                    o.truncate(keep);
                }
            }
        }
        let len = out.first().map_or(0, Vec::len);
        (out, len)
    }

    /// Gives `seq` slots for `num_new_tokens` more tokens, adopting `hit` first when it is being
    /// admitted. With `full_sequence_must_fit`, the whole current sequence must fit (vLLM's
    /// `scheduler_reserve_full_isl`, on by default). Returns false and changes nothing but the
    /// release of out-of-window blocks (as vLLM) when the free blocks do not suffice.
    pub fn allocate_slots(
        &mut self,
        seq: &Sequence,
        num_new_tokens: usize,
        hit: Option<&Hit>,
        full_sequence_must_fit: bool,
    ) -> bool {
        let bs = self.block_size;
        let n = self.groups.len();
        let hit_tokens = hit.map_or(0, |h| h.num_tokens);
        let held = |s: &Self, g: usize| s.group_blocks_of(seq.id, g).len();
        let evictable: usize = (0..n)
            .map(|g| {
                hit_of(hit, g)
                    .iter()
                    .filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0)
                    .count()
            })
            .sum();
        let computed = seq.num_computed_tokens + hit_tokens;
        if full_sequence_must_fit {
            let need: usize = (0..n)
                .map(|g| {
                    let required = cdiv(seq.num_tokens(), bs);
                    let required = self.admission_cap(g).map_or(required, |c| required.min(c));
                    required.saturating_sub(held(self, g) + hit_of(hit, g).len())
                })
                .sum();
            if need + evictable > self.pool.num_free() {
                return false;
            }
        }
        // Free what left the sliding windows before allocating (fewer evictions).
        self.remove_skipped_blocks(seq.id, computed);
        let need_slots = computed + num_new_tokens;
        let new_blocks: Vec<usize> = (0..n)
            .map(|g| cdiv(need_slots, bs).saturating_sub(held(self, g) + hit_of(hit, g).len()))
            .collect();
        if new_blocks.iter().sum::<usize>() + evictable > self.pool.num_free() {
            return false;
        }
        for g in 0..n {
            self.pool.touch(hit_of(hit, g));
        }
        let mut tables = self
            .reqs
            .remove(&seq.id)
            .unwrap_or_else(|| vec![GroupBlocks::default(); n]);
        for (g, t) in tables.iter_mut().enumerate() {
            let hb = hit_of(hit, g);
            if !hb.is_empty() {
                t.blocks.extend_from_slice(hb);
                t.num_cached = t.blocks.len();
            }
            match self.pool.get_new_blocks(new_blocks[g]) {
                Ok(blocks) => t.blocks.extend(blocks),
                Err(e) => {
                    // Unreachable after the check above; keep the state consistent anyway.
                    tracing::error!(error = %e, "block allocation failed after the free-space check");
                }
            }
        }
        self.reqs.insert(seq.id, tables);
        let to_cache = (computed + num_new_tokens).min(seq.num_tokens());
        self.cache_blocks(seq, to_cache);
        true
    }

    /// `SlidingWindowManager.remove_skipped_blocks`: frees the blocks of each sliding-window
    /// group that lie entirely before `num_computed_tokens - window + 1`, last first, stopping at
    /// one already freed.
    fn remove_skipped_blocks(&mut self, id: SeqId, num_computed_tokens: usize) {
        let bs = self.block_size;
        let Some(tables) = self.reqs.get_mut(&id) else {
            return;
        };
        for (g, kind) in self.groups.iter().enumerate() {
            let GroupKind::SlidingWindow { window } = *kind else {
                continue;
            };
            let skipped = (num_computed_tokens + 1).saturating_sub(window as usize);
            let Some(t) = tables.get_mut(g) else {
                continue;
            };
            let last = (skipped / bs).min(t.blocks.len());
            let mut freed = Vec::new();
            for i in (0..last).rev() {
                if t.blocks[i] == NULL_BLOCK {
                    break;
                }
                freed.push(t.blocks[i]);
                t.blocks[i] = NULL_BLOCK;
            }
            if !freed.is_empty() {
                self.pool.free_blocks(freed);
            }
        }
    }

    fn cache_blocks(&mut self, seq: &Sequence, num_tokens: usize) {
        let bs = self.block_size;
        let hashes = self.block_hashes(seq);
        let Some(tables) = self.reqs.get_mut(&seq.id) else {
            return;
        };
        let num_full = (num_tokens.min(hashes.len() * bs)) / bs;
        for (g, t) in tables.iter_mut().enumerate() {
            if t.num_cached >= num_full {
                continue;
            }
            self.pool.cache_full_blocks(CacheRun {
                meta: &seq.meta,
                tokens: &seq.tokens,
                hashes: &hashes,
                blocks: &t.blocks,
                num_cached: t.num_cached,
                num_full,
                block_size: bs,
                group: g as GroupId,
            });
            t.num_cached = num_full;
        }
        if self.hash_block_size < bs {
            self.cache_partial_tail_blocks(seq, num_full * bs);
        }
    }

    /// `FullAttentionManager._cache_partial_tail_block`, per full-attention group: the prompt's
    /// last hash boundary the hit rule could use (`num_prompt_tokens - 1` rounded down to the hash
    /// block size), when it lies inside a block and within the `num_tokens` cached ones.
    fn cache_partial_tail_blocks(&mut self, seq: &Sequence, num_tokens: usize) {
        let (bs, hbs) = (self.block_size, self.hash_block_size);
        let limit = seq.num_prompt_tokens.saturating_sub(1);
        let boundary = (limit / hbs).min(seq.block_hashes.len()) * hbs;
        if boundary == 0 || boundary > num_tokens || boundary.is_multiple_of(bs) {
            return;
        }
        let Some(tables) = self.reqs.get(&seq.id) else {
            return;
        };
        for (g, kind) in self.groups.iter().enumerate() {
            if *kind != GroupKind::FullAttention {
                continue;
            }
            let Some(&block) = tables.get(g).and_then(|t| t.blocks.get(boundary / bs)) else {
                continue;
            };
            self.pool.cache_partial_block(PartialRun {
                meta: &seq.meta,
                tokens: &seq.tokens,
                hashes: &seq.block_hashes,
                block,
                num_tokens: boundary,
                hash_block_size: hbs,
                group: g as GroupId,
            });
        }
    }

    /// Frees a request's blocks, tail first, group after group.
    pub fn free(&mut self, id: SeqId) {
        if let Some(tables) = self.reqs.remove(&id) {
            for t in tables {
                self.pool.free_blocks(t.blocks.into_iter().rev());
            }
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

#[cfg(test)]
mod tests;
