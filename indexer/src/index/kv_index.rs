//! [`KvIndex`]: the index itself (see the `index` module's documentation for its model, event
//! semantics, memory budget and lookup).

use std::collections::HashMap;

use hashbrown::HashTable;
use kvroute_core::events::{BlockRemoved, BlockStored, KvEvent, Medium};
use kvroute_core::hybrid::hit_blocks;
pub use kvroute_core::hybrid::GroupKind;
use kvroute_core::router_key::{event_keys, RouterKey, RouterKeyError, ROOT};
use serde::{Deserialize, Serialize};

use super::hasher::{mix, IdBuildHasher};
use super::predicted::{PredictedChange, PredictedStore};
use super::slab::{
    extra_copies_of, media_of, pack, slot_of, with_extra_copies, Slab, FLAG_ALIASED, MAX_SLOTS,
};

/// A replica id as the caller numbers replicas (stable for the replica's lifetime in the index).
pub type ReplicaId = u32;

/// Medium bit of GPU memory.
pub const MEDIA_GPU: u8 = 1;
/// Medium bit of host (CPU) memory.
pub const MEDIA_CPU: u8 = 2;
/// Medium bit of storage.
pub const MEDIA_STORAGE: u8 = 4;
const MEDIA_ALL: u8 = MEDIA_GPU | MEDIA_CPU | MEDIA_STORAGE;

/// The medium bit of `m`.
pub fn media_bit(m: Medium) -> u8 {
    match m {
        Medium::Gpu => MEDIA_GPU,
        Medium::Cpu => MEDIA_CPU,
        Medium::Storage => MEDIA_STORAGE,
    }
}

/// Index settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Hard memory budget in bytes for the exact index (blocks, holders, hash maps). Default 1 GiB.
    pub max_bytes: usize,
    /// Most predicted (block, replica) entries kept at once. Default 262,144 (~10 MB).
    pub max_predicted: usize,
    /// Only events of this KV cache group are indexed (`None` on the wire counts as group 0),
    /// each as full attention; `None` here indexes every group and looks up with vLLM's hybrid
    /// hit rule ([`kvroute_core::hybrid`]). Default `None`.
    pub group_idx: Option<i64>,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            max_bytes: 1 << 30,
            max_predicted: 1 << 18,
            group_idx: None,
        }
    }
}

/// Errors applying an event. The index is unchanged by an event that returns an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The `BlockStored`'s parent block is unknown, so its router keys cannot be computed.
    #[error("replica {replica}: BlockStored parent {parent:#018x} is not in the index; {blocks} blocks dropped")]
    ParentUnknown {
        /// The replica.
        replica: ReplicaId,
        /// The parent's engine wire hash.
        parent: u64,
        /// Blocks in the dropped event.
        blocks: usize,
    },
    /// The event is malformed (token count, extra keys).
    #[error("replica {replica}: invalid BlockStored: {source}")]
    InvalidEvent {
        /// The replica.
        replica: ReplicaId,
        /// Why.
        #[source]
        source: RouterKeyError,
    },
    /// A LoRA block announced only by its adapter's int id (vLLM <= 0.11: no `lora_name`, no
    /// `extra_keys`). The engine hashed it with the adapter, so it is not a base-model block and
    /// its router keys cannot be computed.
    #[error("replica {replica}: BlockStored of LoRA id {lora_id} without lora_name or extra_keys; {blocks} blocks dropped")]
    LoraIdOnly {
        /// The replica.
        replica: ReplicaId,
        /// The event's `lora_id`.
        lora_id: i64,
        /// Blocks in the dropped event.
        blocks: usize,
    },
    /// A `BlockStored` from a (replica, KV cache group) the index has no slot for, when the
    /// memory budget cannot hold the new slot's bookkeeping even after evicting everything else.
    #[error("replica {replica}: no room in the index budget for KV cache group {group}; {blocks} blocks dropped")]
    NoRoomForGroup {
        /// The replica.
        replica: ReplicaId,
        /// The event's KV cache group.
        group: u8,
        /// Blocks in the dropped event.
        blocks: usize,
    },
    /// More replicas than a holder can name (2^24).
    #[error("too many replicas in one index (limit {limit})")]
    TooManyReplicas {
        /// The limit.
        limit: u32,
    },
    /// A snapshot of an unsupported version.
    #[error("snapshot version {found} is not supported (expected {expected})")]
    SnapshotVersion {
        /// The snapshot's version.
        found: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// A snapshot whose arrays do not agree with each other.
    #[error("snapshot is corrupt: its block, holder and replica arrays do not agree")]
    SnapshotCorrupt,
}

/// What applying one event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct ApplyOutcome {
    /// New (block, replica, medium) holdings.
    pub stored: u32,
    /// Holdings that already existed (re-announced hits): recency refreshed, not counted twice.
    pub refreshed: u32,
    /// New GPU holdings of blocks another replica already held on GPU: prefill computed twice,
    /// what a prefix-aware router would have saved.
    pub duplicated: u32,
    /// Holdings removed.
    pub removed: u32,
    /// `BlockRemoved` hashes this replica did not hold on that medium.
    pub remove_unknown: u32,
    /// Blocks not stored because the budget could not make room.
    pub dropped_for_budget: u32,
    /// Blocks evicted (all holders) to make room.
    pub evicted_for_budget: u32,
    /// Predicted entries replaced by this real event.
    pub predicted_replaced: u32,
    /// Entries cleared (`AllBlocksCleared`).
    pub cleared: u64,
    /// The event was ignored (other KV cache group, unknown event type, no blocks).
    pub ignored: bool,
}

/// Per replica: how many leading blocks of a lookup it holds, per tier (disjoint, consecutive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReplicaMatch {
    /// The replica.
    pub replica: ReplicaId,
    /// Leading blocks in GPU memory.
    pub gpu: u32,
    /// Following blocks only predicted (sibling burst), treated as GPU-to-be; GPU blocks after the
    /// first predicted one count here too (served from GPU only once the predicted ones exist).
    pub predicted: u32,
    /// Following blocks in host memory.
    pub cpu: u32,
    /// Following blocks on storage.
    pub storage: u32,
}

impl ReplicaMatch {
    /// All matched blocks.
    pub fn total(&self) -> u32 {
        self.gpu + self.predicted + self.cpu + self.storage
    }

    /// As the scorer's input.
    pub fn matched(&self) -> kvroute_core::scoring::MatchedBlocks {
        kvroute_core::scoring::MatchedBlocks {
            gpu: self.gpu,
            cpu: self.cpu,
            storage: self.storage,
            predicted: self.predicted,
        }
    }
}

/// Counters and sizes, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct IndexStats {
    /// Distinct blocks (router keys) held by at least one replica.
    pub blocks: u64,
    /// (block, replica) entries.
    pub entries: u64,
    /// Replicas known to the index.
    pub replicas: u64,
    /// Bytes allocated by the exact index (see the module docs).
    pub bytes_estimate: u64,
    /// The configured budget.
    pub max_bytes: u64,
    /// Blocks evicted to stay under the budget.
    pub evicted_for_budget: u64,
    /// (block, replica) entries those evictions removed.
    pub evicted_entries_for_budget: u64,
    /// Blocks not stored because no room could be made.
    pub dropped_for_budget: u64,
    /// `BlockStored` events dropped because their parent was unknown.
    pub parent_unknown: u64,
    /// Blocks in those events.
    pub parent_unknown_blocks: u64,
    /// Invalid events rejected.
    pub invalid_events: u64,
    /// Events ignored (other KV cache group, unknown type).
    pub ignored_events: u64,
    /// GPU stores of a block the (replica, group) already held, in a chain with a parent: a
    /// second physical copy, each evicted with its own `BlockRemoved`.
    pub extra_copies: u64,
    /// `BlockStored` events of one hash block inside a larger block (`--prefix-match-unit` below
    /// the block size), skipped: they never lengthen an attention model's hit.
    pub hash_block_events: u64,
    /// New holdings stored.
    pub stored: u64,
    /// Holdings re-announced (refreshed, not double counted).
    pub refreshed: u64,
    /// Holdings removed by `BlockRemoved`.
    pub removed: u64,
    /// `BlockRemoved` hashes that named nothing this replica held.
    pub remove_unknown: u64,
    /// Entries cleared by `AllBlocksCleared` / `clear_replica`.
    pub cleared: u64,
    /// Engine hashes reported for a router key other than the one they were first seen with.
    pub engine_hash_conflicts: u64,
    /// Engine hashes kept as aliases (replicas hashing differently).
    pub engine_hash_aliases: u64,
    /// Live predicted entries.
    pub predicted_entries: u64,
    /// Approximate bytes of the predicted store (bounded by `max_predicted`, outside `max_bytes`).
    pub predicted_bytes: u64,
    /// Predicted entries inserted.
    pub predicted_inserted: u64,
    /// Predicted entries replaced by real events (the prediction came true).
    pub predicted_replaced: u64,
    /// Predicted entries that expired unconfirmed.
    pub predicted_expired: u64,
    /// Predicted entries dropped to stay under `max_predicted`.
    pub predicted_evicted: u64,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct SlotInfo {
    pub(super) replica: ReplicaId,
    /// The KV cache group this slot holds blocks of (one slot per (replica, group)).
    pub(super) group: u8,
    entries: u64,
}

/// KV cache groups a holder can name (group ids `0..MAX_GROUPS`).
pub const MAX_GROUPS: i64 = 32;

/// A KV cache group as a replica's events describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LearnedGroup {
    /// Its attention kind (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`).
    pub kind: GroupKind,
    /// Tokens per block of its events.
    pub block_size: u32,
}

impl LearnedGroup {
    /// Blocks before a hit point it needs (`None`: all).
    fn rule(&self) -> Option<usize> {
        self.kind.contiguous_blocks(self.block_size)
    }
}

/// A slot's key: replica and KV cache group.
fn slot_key(replica: ReplicaId, group: u8) -> u64 {
    u64::from(replica) << 8 | u64::from(group)
}

/// Per-replica progress while walking a lookup.
#[derive(Debug, Clone, Copy, Default)]
struct Walk {
    /// Blocks matched so far; the replica continues at block `i` only if `reach == i`.
    reach: u32,
    /// 0 GPU, 1 predicted, 2 CPU, 3 storage.
    tier: u8,
    gpu: u32,
    predicted: u32,
    cpu: u32,
    storage: u32,
}

/// The exact block index of one model. See the module docs.
#[derive(Debug)]
pub struct KvIndex {
    cfg: IndexConfig,
    pub(super) slab: Slab,
    /// Router key -> node (the table stores node ids; keys are read from the nodes).
    by_key: HashTable<u32>,
    /// Engine hash -> node (canonical engine hash of the node).
    by_engine: HashTable<u32>,
    /// Other engine hashes of a node (replicas that hash differently).
    alias_node: HashMap<u64, u32, IdBuildHasher>,
    pub(super) node_aliases: HashMap<u32, Vec<u64>, IdBuildHasher>,
    /// Largest `capacity()` each alias map has had: its allocation (maps never shrink here), which
    /// `capacity()` itself understates while deleted slots are pending.
    alias_node_cap: usize,
    node_aliases_cap: usize,
    /// (replica, group) ([`slot_key`]) -> dense slot.
    slot_of: HashMap<u64, u32, IdBuildHasher>,
    pub(super) slots: Vec<Option<SlotInfo>>,
    /// Per replica: the kind of each KV cache group it reported (index = group id), learned from
    /// `BlockStored` events. A replica whose only group is full-attention group 0 is looked up by
    /// the plain walk; any other layout by the hybrid rule.
    pub(super) layouts: HashMap<ReplicaId, Vec<Option<LearnedGroup>>, IdBuildHasher>,
    free_slots: Vec<u32>,
    predicted: PredictedStore,
    /// CLOCK hand.
    hand: u32,
    spill_bytes: usize,
    pub(super) stats: IndexStats,
}

impl Default for KvIndex {
    fn default() -> Self {
        KvIndex::new(IndexConfig::default())
    }
}

/// Bytes a hashbrown table of `u32` with `buckets` buckets allocates (data + control bytes).
fn table_bytes_for_buckets(buckets: usize) -> usize {
    if buckets == 0 {
        0
    } else {
        (buckets * 4).next_multiple_of(16) + buckets + 16
    }
}

/// Bucket count of `t`, from its allocation size.
fn table_buckets(t: &HashTable<u32>) -> usize {
    let alloc = t.allocation_size();
    let mut b = 0usize;
    if alloc == 0 {
        return 0;
    }
    while table_bytes_for_buckets(b.max(1)) < alloc {
        b = (b * 2).max(1);
    }
    b.max(1)
}

/// Items a table of `buckets` holds before it must grow (hashbrown keeps 7/8 load).
fn full_capacity(buckets: usize) -> usize {
    if buckets < 8 {
        buckets.saturating_sub(1)
    } else {
        buckets / 8 * 7
    }
}

fn table_bytes(t: &HashTable<u32>) -> usize {
    t.allocation_size()
}

/// Bytes the next insert into `t` would newly allocate: 0 while it has room or can rehash in
/// place (hashbrown reclaims tombstones in place when at most half full), else the doubled table.
/// Bytes per slot of the alias map (engine hash -> node): key, value, control byte, padding.
const ALIAS_NODE_ENTRY_BYTES: usize = 8 + 4 + 1 + 3;
/// Bytes per slot of the node -> aliases map: key, `Vec` header, control byte, padding.
const NODE_ALIASES_ENTRY_BYTES: usize = 4 + 24 + 1 + 3;
/// Heap bytes of one alias in its node's `Vec`.
const ALIAS_HEAP_BYTES: usize = 8;
/// Bytes per item of `slot_of` (key, slot), of `layouts` (replica, vector) and of one layout.
const SLOT_OF_ENTRY_BYTES: usize = 16;
const LAYOUTS_ENTRY_BYTES: usize = 32;
const LAYOUT_ENTRY_BYTES: usize = std::mem::size_of::<Option<LearnedGroup>>();

/// Bytes a map of `len` items may allocate on its next insert: nothing while it has room, else a
/// table twice its allocated capacity `cap_hwm` (a resize holds the old and the new table at once,
/// so the whole new one must fit; an in-place rehash makes this an overestimate).
fn map_growth(len: usize, capacity: usize, cap_hwm: usize, entry_bytes: usize) -> usize {
    if len < capacity {
        return 0;
    }
    (cap_hwm.max(capacity) * 2).max(4) * entry_bytes
}

/// Bytes a vector of `len` items with room for `capacity` may allocate to hold `want` items: the
/// standard library's amortised growth (twice the capacity, at least `want`, at least 4) as a
/// whole new buffer, since the old one is held while the items move.
fn vec_growth(len: usize, capacity: usize, want: usize, item_bytes: usize) -> usize {
    if want <= capacity || want <= len {
        return 0;
    }
    (capacity * 2).max(want).max(4) * item_bytes
}

fn table_growth(t: &HashTable<u32>) -> usize {
    if t.len() < t.capacity() {
        return 0;
    }
    let buckets = table_buckets(t);
    if t.len() < full_capacity(buckets) / 2 {
        return 0;
    }
    table_bytes_for_buckets((buckets * 2).max(4))
}

impl KvIndex {
    /// An empty index.
    pub fn new(cfg: IndexConfig) -> Self {
        let mut ix = KvIndex {
            stats: IndexStats {
                max_bytes: cfg.max_bytes as u64,
                ..IndexStats::default()
            },
            cfg,
            slab: Slab::default(),
            by_key: HashTable::new(),
            by_engine: HashTable::new(),
            alias_node: HashMap::default(),
            node_aliases: HashMap::default(),
            alias_node_cap: 0,
            node_aliases_cap: 0,
            slot_of: HashMap::default(),
            slots: Vec::new(),
            layouts: HashMap::default(),
            free_slots: Vec::new(),
            predicted: PredictedStore::default(),
            hand: 0,
            spill_bytes: 0,
        };
        ix.refresh_bytes();
        ix
    }

    /// The settings.
    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    /// Counters and sizes.
    pub fn stats(&self) -> IndexStats {
        let mut s = self.stats;
        s.bytes_estimate = self.bytes() as u64;
        s.predicted_entries = self.predicted.len() as u64;
        s.predicted_bytes = self.predicted.bytes() as u64;
        s.replicas = self.replica_count() as u64;
        s
    }

    /// Replicas known to the index with their (block) entry counts, sorted by id.
    pub fn replicas(&self) -> Vec<(ReplicaId, u64)> {
        let mut per: HashMap<ReplicaId, u64, IdBuildHasher> = HashMap::default();
        for s in self.slots.iter().flatten() {
            *per.entry(s.replica).or_default() += s.entries;
        }
        let mut v: Vec<(ReplicaId, u64)> = per.into_iter().collect();
        v.sort_unstable();
        v
    }

    /// Per replica, the blocks it holds in its largest KV cache group (any medium): how full its
    /// prefix cache is, for [`kvroute_core::scoring::Load::cache_fill`].
    pub fn held_blocks(&self) -> HashMap<ReplicaId, u64, IdBuildHasher> {
        let mut per: HashMap<ReplicaId, u64, IdBuildHasher> = HashMap::default();
        for s in self.slots.iter().flatten() {
            let held = per.entry(s.replica).or_default();
            *held = (*held).max(s.entries);
        }
        per
    }

    /// Distinct replicas known to the index.
    fn replica_count(&self) -> usize {
        let mut ids: Vec<ReplicaId> = self.slots.iter().flatten().map(|s| s.replica).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// The KV cache group kinds `replica` reported (index = group id; `None`: not seen).
    pub fn layout(&self, replica: ReplicaId) -> &[Option<LearnedGroup>] {
        self.layouts
            .get(&replica)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// Whether `replica` is looked up by the hybrid rule: any layout but a lone full-attention
    /// group 0.
    fn is_hybrid(&self, replica: ReplicaId) -> bool {
        match self.layout(replica) {
            [] => false,
            [Some(g)] => g.kind != GroupKind::FullAttention,
            _ => true,
        }
    }

    /// Records that `replica`'s group `group` is of `kind`.
    pub(super) fn learn_group(&mut self, replica: ReplicaId, group: u8, learned: LearnedGroup) {
        let layout = self.layouts.entry(replica).or_default();
        let g = usize::from(group);
        if layout.len() <= g {
            layout.resize(g + 1, None);
        }
        layout[g] = Some(learned);
    }

    /// The block size `replica`'s events showed for `group`, else for any of its groups (vLLM's
    /// hybrid layouts share one block size).
    fn learned_block_size(&self, replica: ReplicaId, group: u8) -> Option<u32> {
        let layout = self.layout(replica);
        layout
            .get(usize::from(group))
            .copied()
            .flatten()
            .or_else(|| layout.iter().flatten().next().copied())
            .map(|g| g.block_size)
    }

    /// Who holds `key` in which KV cache group, with medium bits (`MEDIA_*`), sorted by
    /// (replica, group). For debug endpoints and tests.
    pub fn group_holders(&self, key: RouterKey) -> Vec<(ReplicaId, u8, u8)> {
        let Some(i) = self.find_key(key.0) else {
            return Vec::new();
        };
        let mut v: Vec<(ReplicaId, u8, u8)> = self
            .slab
            .get(i)
            .holders()
            .filter_map(|h| {
                let info = self.slots.get(slot_of(h) as usize)?.as_ref()?;
                Some((info.replica, info.group, media_of(h)))
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// Who holds `key`, with medium bits (`MEDIA_*`), sorted by replica. For debug endpoints.
    pub fn holders(&self, key: RouterKey) -> Vec<(ReplicaId, u8)> {
        let Some(i) = self.find_key(key.0) else {
            return Vec::new();
        };
        let mut v: Vec<(ReplicaId, u8)> = self
            .slab
            .get(i)
            .holders()
            .filter_map(|h| self.replica_of_slot(slot_of(h)).map(|r| (r, media_of(h))))
            .collect();
        v.sort_unstable();
        // One entry per replica: the media of all its groups.
        v.dedup_by(|b, a| {
            let same = a.0 == b.0;
            if same {
                a.1 |= b.1;
            }
            same
        });
        v
    }

    /// The router key an engine hash currently names, if known.
    pub fn key_of_engine_hash(&self, engine_hash: u64) -> Option<RouterKey> {
        self.find_engine(engine_hash)
            .map(|i| RouterKey(self.slab.get(i).key))
    }

    fn bytes(&self) -> usize {
        self.slab.bytes()
            + table_bytes(&self.by_key)
            + table_bytes(&self.by_engine)
            + self.spill_bytes
            + self.alias_node_cap * ALIAS_NODE_ENTRY_BYTES
            + self.node_aliases_cap * NODE_ALIASES_ENTRY_BYTES
            + self.stats.engine_hash_aliases as usize * ALIAS_HEAP_BYTES
            + self.slots.capacity() * std::mem::size_of::<Option<SlotInfo>>()
            + self.slot_of.capacity() * SLOT_OF_ENTRY_BYTES
            + self.layouts.capacity() * LAYOUTS_ENTRY_BYTES
            + self
                .layouts
                .values()
                .map(|l| l.capacity() * LAYOUT_ENTRY_BYTES)
                .sum::<usize>()
    }

    pub(super) fn refresh_bytes(&mut self) {
        self.stats.bytes_estimate = self.bytes() as u64;
    }

    fn replica_of_slot(&self, slot: u32) -> Option<ReplicaId> {
        self.slots
            .get(slot as usize)
            .and_then(|s| s.as_ref())
            .map(|s| s.replica)
    }

    /// Bytes that registering (`replica`, `group`) may allocate: its slot, its entry in the slot
    /// map, its layout (an upper bound: see [`vec_growth`] and [`map_growth`]). Zero when the slot
    /// exists.
    fn registration_growth(&self, replica: ReplicaId, group: u8) -> usize {
        if self.slot_of.contains_key(&slot_key(replica, group)) {
            return 0;
        }
        let slot_bytes = std::mem::size_of::<Option<SlotInfo>>();
        let slots = if self.free_slots.is_empty() {
            vec_growth(
                self.slots.len(),
                self.slots.capacity(),
                self.slots.len() + 1,
                slot_bytes,
            )
        } else {
            0
        };
        let slot_of = map_growth(
            self.slot_of.len(),
            self.slot_of.capacity(),
            self.slot_of.capacity(),
            SLOT_OF_ENTRY_BYTES,
        );
        let layout = match self.layouts.get(&replica) {
            Some(l) => vec_growth(
                l.len(),
                l.capacity(),
                usize::from(group) + 1,
                LAYOUT_ENTRY_BYTES,
            ),
            None => {
                map_growth(
                    self.layouts.len(),
                    self.layouts.capacity(),
                    self.layouts.capacity(),
                    LAYOUTS_ENTRY_BYTES,
                ) + vec_growth(0, 0, usize::from(group) + 1, LAYOUT_ENTRY_BYTES)
            }
        };
        slots + slot_of + layout
    }

    /// The dense slot of `replica`, registering it if new.
    pub(super) fn slot(&mut self, replica: ReplicaId, group: u8) -> Result<u32, IndexError> {
        if let Some(&s) = self.slot_of.get(&slot_key(replica, group)) {
            return Ok(s);
        }
        let s = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                let s = self.slots.len() as u32;
                if s >= MAX_SLOTS {
                    return Err(IndexError::TooManyReplicas { limit: MAX_SLOTS });
                }
                self.slots.push(None);
                s
            }
        };
        self.slots[s as usize] = Some(SlotInfo {
            replica,
            group,
            entries: 0,
        });
        self.slot_of.insert(slot_key(replica, group), s);
        Ok(s)
    }

    #[inline]
    pub(super) fn find_key(&self, key: u64) -> Option<u32> {
        let slab = &self.slab;
        self.by_key
            .find(mix(key), |&i| slab.get(i).key == key)
            .copied()
    }

    #[inline]
    fn find_engine(&self, h: u64) -> Option<u32> {
        let slab = &self.slab;
        if let Some(&i) = self
            .by_engine
            .find(mix(h), |&i| slab.get(i).engine_hash == h)
        {
            return Some(i);
        }
        if self.alias_node.is_empty() {
            None
        } else {
            self.alias_node.get(&h).copied()
        }
    }

    /// Applies one event from `replica` (registered on first use).
    pub fn apply(&mut self, replica: ReplicaId, ev: &KvEvent) -> Result<ApplyOutcome, IndexError> {
        let out = match ev {
            KvEvent::BlockStored(st) => self.apply_stored(replica, st),
            KvEvent::BlockRemoved(rm) => self.apply_removed(replica, rm),
            KvEvent::AllBlocksCleared => {
                let cleared = self.clear_replica(replica);
                Ok(ApplyOutcome {
                    cleared,
                    ..ApplyOutcome::default()
                })
            }
            KvEvent::Unknown(_) => {
                self.stats.ignored_events += 1;
                Ok(ApplyOutcome {
                    ignored: true,
                    ..ApplyOutcome::default()
                })
            }
        };
        self.refresh_bytes();
        out
    }

    /// The group id an event of `group` is indexed under, `None` when it is not indexed (another
    /// group than the configured one, or a group id out of range).
    fn wanted_group(&self, group: Option<i64>) -> Option<u8> {
        let g = group.unwrap_or(0);
        match self.cfg.group_idx {
            Some(want) if want != g => None,
            // One configured group is indexed as group 0, full attention.
            Some(_) => Some(0),
            None => u8::try_from(g).ok().filter(|&g| i64::from(g) < MAX_GROUPS),
        }
    }

    fn ignored(&mut self) -> Result<ApplyOutcome, IndexError> {
        self.stats.ignored_events += 1;
        Ok(ApplyOutcome {
            ignored: true,
            ..ApplyOutcome::default()
        })
    }

    fn apply_stored(
        &mut self,
        replica: ReplicaId,
        st: &BlockStored,
    ) -> Result<ApplyOutcome, IndexError> {
        let Some(group) = self.wanted_group(st.group_idx) else {
            return self.ignored();
        };
        if st.block_hashes.is_empty() {
            return self.ignored();
        }
        if self
            .learned_block_size(replica, group)
            .is_some_and(|bs| st.is_hash_block_of(bs))
        {
            self.stats.hash_block_events += 1;
            return Ok(ApplyOutcome {
                ignored: true,
                ..ApplyOutcome::default()
            });
        }
        let kind = if self.cfg.group_idx.is_some() {
            GroupKind::FullAttention
        } else {
            match GroupKind::from_event(
                st.kv_cache_spec_kind.as_deref(),
                st.kv_cache_spec_sliding_window,
            ) {
                Ok(k) => k,
                // A group whose hit rule is not modelled (mamba, ...): not indexed.
                Err(_) => return self.ignored(),
            }
        };
        if let (Some(lora_id), None, None) = (st.lora_id, &st.lora_name, &st.extra_keys) {
            self.stats.invalid_events += 1;
            return Err(IndexError::LoraIdOnly {
                replica,
                lora_id,
                blocks: st.block_hashes.len(),
            });
        }
        let parent = match &st.parent_block_hash {
            None => ROOT,
            Some(p) => {
                let ph = p.as_u64();
                match self.find_engine(ph) {
                    Some(i) => {
                        let n = self.slab.get(i);
                        n.touch();
                        RouterKey(n.key)
                    }
                    None => {
                        self.stats.parent_unknown += 1;
                        self.stats.parent_unknown_blocks += st.block_hashes.len() as u64;
                        return Err(IndexError::ParentUnknown {
                            replica,
                            parent: ph,
                            blocks: st.block_hashes.len(),
                        });
                    }
                }
            }
        };
        let keys = match event_keys(parent, st) {
            Ok(k) if k.len() == st.block_hashes.len() => k,
            Ok(k) => {
                self.stats.invalid_events += 1;
                return Err(IndexError::InvalidEvent {
                    replica,
                    source: RouterKeyError::TokenCountMismatch {
                        blocks: st.block_hashes.len(),
                        block_size: st.block_size as usize,
                        expected: st.block_hashes.len() * st.block_size as usize,
                        got: k.len() * st.block_size as usize,
                    },
                });
            }
            Err(source) => {
                self.stats.invalid_events += 1;
                return Err(IndexError::InvalidEvent { replica, source });
            }
        };
        let mut out = ApplyOutcome::default();
        let growth = self.registration_growth(replica, group);
        if growth > 0 && !self.make_room(growth, None, &mut out) {
            let blocks = st.block_hashes.len();
            self.stats.dropped_for_budget += blocks as u64;
            return Err(IndexError::NoRoomForGroup {
                replica,
                group,
                blocks,
            });
        }
        let slot = self.slot(replica, group)?;
        self.learn_group(
            replica,
            group,
            LearnedGroup {
                kind,
                block_size: st.block_size,
            },
        );
        let bit = media_bit(st.medium.unwrap_or_default());
        // A chain continuing from a parent is computed work: a block it names that the slot
        // already holds is a second physical copy. A parentless chain may be a re-announce of
        // hits (`kv_cache_report_mode: full`), which is not.
        let copies = st.parent_block_hash.is_some();
        for (key, h) in keys.iter().zip(&st.block_hashes) {
            self.store_one(slot, key.0, h.as_u64(), bit, copies, &mut out);
        }
        Ok(out)
    }

    /// Records that `slot` holds `key` (engine hash `eh`) on medium `bit`; when it held it on
    /// GPU already and `copies`, counts one more GPU copy.
    pub(super) fn store_one(
        &mut self,
        slot: u32,
        key: u64,
        eh: u64,
        bit: u8,
        copies: bool,
        out: &mut ApplyOutcome,
    ) {
        let idx = match self.find_key(key) {
            Some(i) => {
                self.note_engine_hash(i, eh, out);
                i
            }
            None => match self.new_node(key, eh, out) {
                Some(i) => i,
                None => {
                    out.dropped_for_budget += 1;
                    self.stats.dropped_for_budget += 1;
                    return;
                }
            },
        };
        let node = self.slab.get(idx);
        node.touch();
        let replica = self.replica_of_slot(slot);
        // A replica's first GPU copy (in any of its groups) of a block another replica holds on
        // GPU: its prefill was computed twice.
        let held_elsewhere = bit == MEDIA_GPU && {
            let gpu_holders = node
                .holders()
                .filter(|&h| slot_of(h) != slot && media_of(h) & MEDIA_GPU != 0)
                .map(|h| self.replica_of_slot(slot_of(h)));
            let (mut other, mut own) = (false, false);
            for r in gpu_holders {
                if r == replica {
                    own = true;
                } else {
                    other = true;
                }
            }
            other && !own
        };
        let stored_before = out.stored;
        match node.find_slot(slot) {
            Some(pos) => {
                let h = node.holder(pos);
                if media_of(h) & bit != 0 {
                    out.refreshed += 1;
                    self.stats.refreshed += 1;
                    if copies && bit == MEDIA_GPU {
                        self.slab
                            .get_mut(idx)
                            .set_holder(pos, with_extra_copies(h, extra_copies_of(h) + 1));
                        self.stats.extra_copies += 1;
                    }
                } else {
                    self.slab.get_mut(idx).set_holder(
                        pos,
                        with_extra_copies(pack(slot, media_of(h) | bit), extra_copies_of(h)),
                    );
                    out.stored += 1;
                    self.stats.stored += 1;
                }
            }
            None => {
                let growth = node.push_growth();
                if growth > 0 && !self.make_room(growth, Some(idx), out) {
                    out.dropped_for_budget += 1;
                    self.stats.dropped_for_budget += 1;
                    self.free_if_empty(idx);
                    return;
                }
                self.spill_bytes += self.slab.get_mut(idx).push(pack(slot, bit));
                if let Some(Some(info)) = self.slots.get_mut(slot as usize) {
                    info.entries += 1;
                }
                self.stats.entries += 1;
                out.stored += 1;
                self.stats.stored += 1;
            }
        }
        if held_elsewhere && out.stored > stored_before {
            out.duplicated += 1;
        }
        // The replica's prediction (on its group-0 slot, standing for every group) is replaced
        // by the first store of the block in any of its groups.
        if !self.predicted.is_empty() {
            let pred_slot = replica.and_then(|r| self.slot_of.get(&slot_key(r, 0)).copied());
            if pred_slot.is_some_and(|p| self.predicted.remove(key, p)) {
                out.predicted_replaced += 1;
                self.stats.predicted_replaced += 1;
            }
        }
    }

    /// Links engine hash `eh` to node `idx` if it is not linked yet (an alias of another engine),
    /// within the memory budget: when no room can be made the alias is not recorded (a later
    /// `BlockRemoved` by that hash is then counted as unknown) and the drop is counted.
    pub(super) fn note_engine_hash(&mut self, idx: u32, eh: u64, out: &mut ApplyOutcome) {
        if self.slab.get(idx).engine_hash == eh {
            return;
        }
        match self.find_engine(eh) {
            Some(j) if j == idx => {}
            Some(_) => self.stats.engine_hash_conflicts += 1,
            None => {
                let growth = map_growth(
                    self.alias_node.len(),
                    self.alias_node.capacity(),
                    self.alias_node_cap,
                    ALIAS_NODE_ENTRY_BYTES,
                ) + if self.node_aliases.contains_key(&idx) {
                    0
                } else {
                    map_growth(
                        self.node_aliases.len(),
                        self.node_aliases.capacity(),
                        self.node_aliases_cap,
                        NODE_ALIASES_ENTRY_BYTES,
                    )
                } + ALIAS_HEAP_BYTES;
                if !self.make_room(growth, Some(idx), out) {
                    out.dropped_for_budget += 1;
                    self.stats.dropped_for_budget += 1;
                    return;
                }
                self.alias_node.insert(eh, idx);
                self.node_aliases.entry(idx).or_default().push(eh);
                self.alias_node_cap = self.alias_node_cap.max(self.alias_node.capacity());
                self.node_aliases_cap = self.node_aliases_cap.max(self.node_aliases.capacity());
                self.slab.get_mut(idx).flags |= FLAG_ALIASED;
                self.stats.engine_hash_aliases += 1;
            }
        }
    }

    /// Allocates a node for `key`, making room under the budget first. `None` if impossible.
    fn new_node(&mut self, key: u64, eh: u64, out: &mut ApplyOutcome) -> Option<u32> {
        // Whether `eh` names no block yet; only an eviction can change that below.
        let mut engine_free = self.find_engine(eh).is_none();
        loop {
            let growth = self.slab.alloc_growth()
                + table_growth(&self.by_key)
                + if engine_free {
                    table_growth(&self.by_engine)
                } else {
                    0
                };
            if growth == 0 || self.bytes() + growth <= self.cfg.max_bytes {
                break;
            }
            if !self.evict_one(None, out) {
                return None;
            }
            if !engine_free {
                engine_free = self.find_engine(eh).is_none();
            }
        }
        let idx = self.slab.alloc(key, eh)?;
        let slab = &self.slab;
        self.by_key
            .insert_unique(mix(key), idx, |&i| mix(slab.get(i).key));
        if engine_free {
            let slab = &self.slab;
            self.by_engine
                .insert_unique(mix(eh), idx, |&i| mix(slab.get(i).engine_hash));
        } else {
            // The engine hash already names another block: keep that mapping (this node's copy
            // of the hash is not in the table, so freeing it leaves the other intact).
            self.stats.engine_hash_conflicts += 1;
        }
        self.stats.blocks += 1;
        Some(idx)
    }

    /// Evicts until `growth` more bytes fit under the budget. False if nothing more can go.
    fn make_room(&mut self, growth: usize, protect: Option<u32>, out: &mut ApplyOutcome) -> bool {
        while self.bytes() + growth > self.cfg.max_bytes {
            if !self.evict_one(protect, out) {
                return false;
            }
        }
        true
    }

    /// CLOCK: evicts the first live node (not `protect`) whose reference bit is clear.
    fn evict_one(&mut self, protect: Option<u32>, out: &mut ApplyOutcome) -> bool {
        let high = self.slab.high();
        if high == 0 {
            return false;
        }
        // Two full turns: the first may only clear reference bits.
        for _ in 0..(2 * high as u64 + 2) {
            if self.hand >= high {
                self.hand = 0;
            }
            let i = self.hand;
            self.hand += 1;
            if Some(i) == protect {
                continue;
            }
            let n = self.slab.get(i);
            if !n.live() {
                continue;
            }
            if n.referenced.load(std::sync::atomic::Ordering::Relaxed) != 0 {
                n.referenced.store(0, std::sync::atomic::Ordering::Relaxed);
                continue;
            }
            let holders = n.holders_len() as u64;
            let slots: Vec<u32> = n.holders().map(slot_of).collect();
            for s in slots {
                if let Some(Some(info)) = self.slots.get_mut(s as usize) {
                    info.entries = info.entries.saturating_sub(1);
                }
            }
            self.stats.entries -= holders;
            self.free_node(i);
            self.stats.evicted_for_budget += 1;
            self.stats.evicted_entries_for_budget += holders;
            out.evicted_for_budget += 1;
            return true;
        }
        false
    }

    /// Removes node `i` from every map and frees it (its holders must already be accounted).
    fn free_node(&mut self, i: u32) {
        let (key, eh, aliased) = {
            let n = self.slab.get(i);
            (n.key, n.engine_hash, n.flags & FLAG_ALIASED != 0)
        };
        let slab = &self.slab;
        if let Ok(e) = self
            .by_key
            .find_entry(mix(key), |&j| j == i && slab.get(j).key == key)
        {
            e.remove();
        }
        let slab = &self.slab;
        if let Ok(e) = self
            .by_engine
            .find_entry(mix(eh), |&j| j == i && slab.get(j).engine_hash == eh)
        {
            e.remove();
        }
        if aliased {
            if let Some(aliases) = self.node_aliases.remove(&i) {
                self.stats.engine_hash_aliases -= aliases.len() as u64;
                for a in aliases {
                    self.alias_node.remove(&a);
                }
            }
        }
        self.spill_bytes -= self.slab.get(i).spill_heap_bytes();
        self.slab.release(i);
        self.stats.blocks -= 1;
    }

    fn free_if_empty(&mut self, i: u32) {
        if self.slab.get(i).holders_len() == 0 {
            self.free_node(i);
        }
    }

    fn apply_removed(
        &mut self,
        replica: ReplicaId,
        rm: &BlockRemoved,
    ) -> Result<ApplyOutcome, IndexError> {
        let Some(group) = self.wanted_group(rm.group_idx) else {
            return self.ignored();
        };
        let mut out = ApplyOutcome::default();
        let Some(&slot) = self.slot_of.get(&slot_key(replica, group)) else {
            out.remove_unknown = rm.block_hashes.len() as u32;
            self.stats.remove_unknown += rm.block_hashes.len() as u64;
            return Ok(out);
        };
        let bit = media_bit(rm.medium.unwrap_or_default());
        for h in &rm.block_hashes {
            if self.remove_one(slot, h.as_u64(), bit) {
                out.removed += 1;
                self.stats.removed += 1;
            } else {
                out.remove_unknown += 1;
                self.stats.remove_unknown += 1;
            }
        }
        Ok(out)
    }

    /// Clears medium `bits` of `slot` on the block named by engine hash `eh`.
    fn remove_one(&mut self, slot: u32, eh: u64, bits: u8) -> bool {
        let Some(idx) = self.find_engine(eh) else {
            return false;
        };
        self.remove_holder_bits(idx, slot, bits)
    }

    fn remove_holder_bits(&mut self, idx: u32, slot: u32, bits: u8) -> bool {
        let node = self.slab.get_mut(idx);
        let Some(pos) = node.find_slot(slot) else {
            return false;
        };
        let h = node.holder(pos);
        if media_of(h) & bits == 0 {
            return false;
        }
        if bits == MEDIA_GPU && extra_copies_of(h) > 0 {
            // One of several GPU copies evicted: the block is still held.
            node.set_holder(pos, with_extra_copies(h, extra_copies_of(h) - 1));
            return true;
        }
        let left = media_of(h) & !bits;
        if left != 0 {
            // Extra GPU copies stay while the GPU bit does (a removal of another medium).
            let copies = if left & MEDIA_GPU != 0 {
                extra_copies_of(h)
            } else {
                0
            };
            node.set_holder(pos, with_extra_copies(pack(slot, left), copies));
            return true;
        }
        let freed = node.swap_remove(pos);
        self.spill_bytes -= freed;
        self.stats.entries -= 1;
        if let Some(Some(info)) = self.slots.get_mut(slot as usize) {
            info.entries = info.entries.saturating_sub(1);
        }
        self.free_if_empty(idx);
        true
    }

    /// Forgets everything `replica` holds (engine restart, lost events). Returns the entries
    /// removed. Walks the whole index: O(blocks), a rare operation.
    pub fn clear_replica(&mut self, replica: ReplicaId) -> u64 {
        let cleared: u64 = self
            .slots_of(replica)
            .into_iter()
            .map(|slot| self.clear_slot(slot))
            .sum();
        self.stats.cleared += cleared;
        self.refresh_bytes();
        cleared
    }

    /// The slots of `replica` (one per KV cache group it reported).
    fn slots_of(&self, replica: ReplicaId) -> Vec<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| s.replica == replica))
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// Removes every holding of `slot`; returns how many.
    fn clear_slot(&mut self, slot: u32) -> u64 {
        let mut cleared = 0;
        let has = self
            .slots
            .get(slot as usize)
            .and_then(|s| s.as_ref())
            .map_or(0, |s| s.entries);
        if has > 0 {
            for i in 0..self.slab.high() {
                let n = self.slab.get(i);
                if !n.live() || n.find_slot(slot).is_none() {
                    continue;
                }
                if self.remove_holder_bits(i, slot, MEDIA_ALL) {
                    cleared += 1;
                }
            }
        }
        self.predicted.remove_slot(slot);
        cleared
    }

    /// Clears `replica` and forgets it (its slot is reused). Returns the entries removed.
    pub fn remove_replica(&mut self, replica: ReplicaId) -> u64 {
        let slots = self.slots_of(replica);
        let cleared = self.clear_replica(replica);
        for slot in slots {
            if let Some(Some(info)) = self.slots.get(slot as usize) {
                self.slot_of.remove(&slot_key(info.replica, info.group));
            }
            if let Some(s) = self.slots.get_mut(slot as usize) {
                *s = None;
            }
            self.free_slots.push(slot);
        }
        self.layouts.remove(&replica);
        cleared
    }

    /// Drops every block, replica and prediction (counters are kept).
    pub fn clear(&mut self) {
        self.slab.clear();
        self.by_key = HashTable::new();
        self.by_engine = HashTable::new();
        self.alias_node.clear();
        self.node_aliases.clear();
        self.slot_of.clear();
        self.slots.clear();
        self.layouts.clear();
        self.free_slots.clear();
        self.predicted.clear();
        self.hand = 0;
        self.spill_bytes = 0;
        self.stats.blocks = 0;
        self.stats.entries = 0;
        self.stats.engine_hash_aliases = 0;
        self.refresh_bytes();
    }

    /// For each replica holding at least block 0 of `keys`: how many leading blocks it holds, per
    /// tier (see the module docs). `now_ms` (the caller's monotonic clock) decides which predicted
    /// entries are still valid. Sorted by replica id.
    pub fn lookup(&self, keys: &[RouterKey], now_ms: u64) -> Vec<ReplicaMatch> {
        let mut walk = vec![Walk::default(); self.slots.len()];
        let use_predicted = !self.predicted.is_empty();
        let high = self.slab.high();
        let mut prev: Option<u32> = None;
        for (i, key) in keys.iter().enumerate() {
            let i = i as u32;
            let mut alive = 0u32;
            // A chain stored by one event sits in consecutive slab slots: try the slot after the
            // previous block before probing the table (one cache line instead of three misses).
            let next = prev
                .map(|p| p + 1)
                .filter(|&n| n < high && self.slab.get(n).live() && self.slab.get(n).key == key.0);
            let found = next.or_else(|| self.find_key(key.0));
            prev = found;
            if let Some(idx) = found {
                let node = self.slab.get(idx);
                node.touch();
                for h in node.holders() {
                    let Some(w) = walk.get_mut(slot_of(h) as usize) else {
                        continue;
                    };
                    if w.reach != i {
                        continue;
                    }
                    let m = media_of(h);
                    let cont = match w.tier {
                        0 if m & MEDIA_GPU != 0 => {
                            w.gpu += 1;
                            true
                        }
                        // After a predicted block, a GPU block is GPU-to-be too.
                        0 | 1
                            if (w.tier == 1 && m & MEDIA_GPU != 0)
                                || (use_predicted
                                    && self.predicted.holds(key.0, slot_of(h), now_ms)) =>
                        {
                            w.tier = 1;
                            w.predicted += 1;
                            true
                        }
                        0..=2 if m & MEDIA_CPU != 0 => {
                            w.tier = 2;
                            w.cpu += 1;
                            true
                        }
                        _ if m & MEDIA_STORAGE != 0 => {
                            w.tier = 3;
                            w.storage += 1;
                            true
                        }
                        _ => false,
                    };
                    if cont {
                        w.reach = i + 1;
                        alive += 1;
                    }
                }
            }
            if use_predicted {
                for s in self.predicted.slots(key.0, now_ms) {
                    if let Some(w) = walk.get_mut(s as usize) {
                        if w.reach == i && w.tier <= 1 {
                            w.tier = 1;
                            w.predicted += 1;
                            w.reach = i + 1;
                            alive += 1;
                        }
                    }
                }
            }
            if alive == 0 {
                break;
            }
        }
        let any_hybrid = self.layouts.keys().any(|&r| self.is_hybrid(r));
        let mut out: Vec<ReplicaMatch> = walk
            .iter()
            .enumerate()
            .filter(|(_, w)| w.reach > 0)
            .filter_map(|(s, w)| {
                self.replica_of_slot(s as u32)
                    .filter(|&r| !any_hybrid || !self.is_hybrid(r))
                    .map(|replica| ReplicaMatch {
                        replica,
                        gpu: w.gpu,
                        predicted: w.predicted,
                        cpu: w.cpu,
                        storage: w.storage,
                    })
            })
            .collect();
        if any_hybrid {
            out.extend(self.lookup_hybrid(keys, now_ms));
        }
        out.sort_unstable_by_key(|m| m.replica);
        out
    }

    /// The lookup of replicas with a hybrid layout: per replica, the hit vLLM's
    /// `HybridKVCacheCoordinator` computes from what each of its groups holds on GPU
    /// ([`kvroute_core::hybrid::hit_blocks`]); blocks predicted for the replica count as held by
    /// every group (the `predicted` tier). CPU and storage tiers are not counted for these
    /// replicas (offloading of hybrid models is not modelled).
    fn lookup_hybrid(&self, keys: &[RouterKey], now_ms: u64) -> Vec<ReplicaMatch> {
        /// A hybrid replica: its groups as (slot, rule), and the slot its predictions sit on.
        struct Hybrid {
            replica: ReplicaId,
            groups: Vec<(Option<usize>, Option<usize>)>,
            pred_slot: Option<usize>,
        }
        let slot_index =
            |r: ReplicaId, g: u8| self.slot_of.get(&slot_key(r, g)).map(|&s| s as usize);
        let hybrids: Vec<Hybrid> = self
            .layouts
            .iter()
            .filter(|(&r, _)| self.is_hybrid(r))
            .map(|(&replica, layout)| Hybrid {
                replica,
                groups: layout
                    .iter()
                    .enumerate()
                    .filter_map(|(g, k)| {
                        let g = u8::try_from(g).ok()?;
                        k.map(|k| (slot_index(replica, g), k.rule()))
                    })
                    .collect(),
                pred_slot: slot_index(replica, 0),
            })
            .collect();
        let words = keys.len().div_ceil(64).max(1);
        let bit = |v: &[u64], s: Option<usize>, i: usize| {
            s.and_then(|s| v.get(s * words + i / 64))
                .is_some_and(|w| w & (1 << (i % 64)) != 0)
        };
        let set = |v: &mut [u64], s: usize, i: usize| {
            if let Some(w) = v.get_mut(s * words + i / 64) {
                *w |= 1 << (i % 64);
            }
        };
        // Per slot: GPU-held and predicted blocks of the request (bitsets).
        let mut held = vec![0u64; self.slots.len() * words];
        let use_predicted = !self.predicted.is_empty();
        let mut pred = if use_predicted {
            vec![0u64; self.slots.len() * words]
        } else {
            Vec::new()
        };
        // A full-attention group needs every block before the hit: the walk may stop once no
        // full group's run of held-or-predicted blocks continues, unless some replica has no
        // full group at all (its windows can be served after any gap).
        let bounded = hybrids
            .iter()
            .all(|h| h.groups.iter().any(|&(_, rule)| rule.is_none()));
        let full_groups: Vec<(Option<usize>, Option<usize>)> = hybrids
            .iter()
            .flat_map(|h| {
                h.groups
                    .iter()
                    .filter(|&&(_, rule)| rule.is_none())
                    .map(|&(slot, _)| (slot, h.pred_slot))
            })
            .collect();
        let mut runs = vec![0usize; full_groups.len()];
        let mut walked = keys.len();
        for (i, key) in keys.iter().enumerate() {
            if let Some(idx) = self.find_key(key.0) {
                let node = self.slab.get(idx);
                node.touch();
                for h in node.holders() {
                    if media_of(h) & MEDIA_GPU != 0 {
                        set(&mut held, slot_of(h) as usize, i);
                    }
                }
            }
            if use_predicted {
                for s in self.predicted.slots(key.0, now_ms) {
                    set(&mut pred, s as usize, i);
                }
            }
            if bounded {
                let mut alive = false;
                for (run, &(slot, pred_slot)) in runs.iter_mut().zip(&full_groups) {
                    if *run == i && (bit(&held, slot, i) || bit(&pred, pred_slot, i)) {
                        *run = i + 1;
                        alive = true;
                    }
                }
                if !alive {
                    walked = i;
                    break;
                }
            }
        }
        let mut out = Vec::new();
        for h in &hybrids {
            let rules: Vec<Option<usize>> = h.groups.iter().map(|&(_, r)| r).collect();
            let gpu = hit_blocks(&rules, walked, |g, i| bit(&held, h.groups[g].0, i));
            let with_pred = if use_predicted {
                hit_blocks(&rules, walked, |g, i| {
                    bit(&held, h.groups[g].0, i) || bit(&pred, h.pred_slot, i)
                })
            } else {
                gpu
            };
            if with_pred > 0 {
                out.push(ReplicaMatch {
                    replica: h.replica,
                    gpu: gpu as u32,
                    predicted: with_pred.saturating_sub(gpu) as u32,
                    cpu: 0,
                    storage: 0,
                });
            }
        }
        out
    }

    /// Predicts that `replica` will hold `keys` on GPU until `now_ms + ttl_ms` (written when a
    /// request is routed there, so siblings in the same burst follow it before any event). Blocks
    /// the replica already holds on GPU are skipped. Expired entries are pruned first; the store is
    /// bounded by [`IndexConfig::max_predicted`]. Returns the entries inserted or refreshed.
    pub fn insert_predicted(
        &mut self,
        replica: ReplicaId,
        keys: &[RouterKey],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<usize, IndexError> {
        // Predictions live on the replica's group-0 slot and stand for every group.
        let slot = self.slot(replica, 0)?;
        // The slots of the groups the replica reported: a block is already real when every one
        // of them holds it on GPU (a group without a slot holds nothing).
        let group_slots: Vec<Option<u32>> = self
            .layout(replica)
            .iter()
            .enumerate()
            .filter(|(_, g)| g.is_some())
            .map(|(g, _)| {
                u8::try_from(g)
                    .ok()
                    .and_then(|g| self.slot_of.get(&slot_key(replica, g)).copied())
            })
            .collect();
        let mut change = PredictedChange::default();
        self.predicted
            .expire(now_ms, self.cfg.max_predicted, &mut change);
        let expires = now_ms.saturating_add(ttl_ms);
        for key in keys {
            let real = !group_slots.is_empty()
                && self.find_key(key.0).is_some_and(|i| {
                    let n = self.slab.get(i);
                    group_slots.iter().all(|s| {
                        s.and_then(|s| n.find_slot(s))
                            .is_some_and(|p| media_of(n.holder(p)) & MEDIA_GPU != 0)
                    })
                });
            if !real {
                self.predicted.insert(key.0, slot, expires, &mut change);
            }
        }
        self.predicted
            .expire(now_ms, self.cfg.max_predicted, &mut change);
        self.note_predicted(change);
        Ok((change.inserted + change.refreshed) as usize)
    }

    /// Prunes predicted entries expired at `now_ms` (also done by `insert_predicted`).
    pub fn expire_predicted(&mut self, now_ms: u64) {
        let mut change = PredictedChange::default();
        self.predicted
            .expire(now_ms, self.cfg.max_predicted, &mut change);
        self.note_predicted(change);
    }

    fn note_predicted(&mut self, c: PredictedChange) {
        self.stats.predicted_inserted += c.inserted;
        self.stats.predicted_expired += c.expired;
        self.stats.predicted_evicted += c.evicted;
    }
}

#[cfg(test)]
use super::export::IndexSnapshot;
#[cfg(test)]
use super::shared::SharedIndex;

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
#[cfg(test)]
#[path = "tests_hybrid.rs"]
mod tests_hybrid;
