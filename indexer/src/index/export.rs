//! A serialisable copy of the exact index, for the service's periodic snapshot (postcard).
//!
//! Predicted entries are not exported: they live for seconds and would be stale after a restart.

use serde::{Deserialize, Serialize};

use super::kv_index::{
    ApplyOutcome, IndexConfig, IndexError, KvIndex, LearnedGroup, ReplicaId, MEDIA_CPU, MEDIA_GPU,
    MEDIA_STORAGE,
};
use super::slab::{media_of, slot_of, FLAG_ALIASED};

/// The snapshot format version this build writes and reads (3: KV cache groups in holders and
/// the replicas' group layouts; 2: flat arrays; 1 had one record with two lists per block, which
/// made the copy under the index lock slow).
pub const SNAPSHOT_VERSION: u32 = 3;

/// The whole exact index of one model, as flat arrays (one allocation each, whatever the size):
/// block `i` is `keys[i]` / `engine_hashes[i]` with the next `holder_counts[i]` entries of
/// `holders`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    /// [`SNAPSHOT_VERSION`].
    pub version: u32,
    /// Every replica known to the index (including ones holding nothing), sorted.
    pub replicas: Vec<ReplicaId>,
    /// Router key of each block.
    pub keys: Vec<u64>,
    /// The engine wire hash first reported for each block.
    pub engine_hashes: Vec<u64>,
    /// Number of holders of each block.
    pub holder_counts: Vec<u16>,
    /// Holders, block after block: position in `replicas` << 8 | KV cache group << 3 | medium
    /// bits (`MEDIA_*`).
    pub holders: Vec<u32>,
    /// Each replica's KV cache group layout as its events described it (replicas without one are
    /// left out).
    pub layouts: Vec<(ReplicaId, Vec<Option<LearnedGroup>>)>,
    /// Other engine hashes reported for a block (replicas hashing differently): (block, hash).
    pub aliases: Vec<(u32, u64)>,
}

impl IndexSnapshot {
    /// Blocks in the snapshot.
    pub fn blocks(&self) -> usize {
        self.keys.len()
    }

    /// Every block as (key, engine hash, [(replica, medium bits)]) (one entry per replica and
    /// group), for tests and tools.
    pub fn iter_blocks(&self) -> impl Iterator<Item = (u64, u64, Vec<(ReplicaId, u8)>)> + '_ {
        let mut at = 0usize;
        (0..self.keys.len()).map(move |i| {
            let n = usize::from(self.holder_counts.get(i).copied().unwrap_or(0));
            let holders = self
                .holders
                .get(at..at + n)
                .unwrap_or(&[])
                .iter()
                .filter_map(|&h| {
                    self.replicas
                        .get((h >> 8) as usize)
                        .map(|&r| (r, (h & 0x7) as u8))
                })
                .collect();
            at += n;
            (self.keys[i], self.engine_hashes[i], holders)
        })
    }
}

impl KvIndex {
    /// A copy of the index's blocks and replicas (not its counters or predictions). Walks the
    /// slab once and fills a few flat arrays; the service calls it under the index lock.
    pub fn export(&self) -> IndexSnapshot {
        let replicas: Vec<ReplicaId> = self.replicas().into_iter().map(|(r, _)| r).collect();
        // Dense slot -> position in `replicas` << 5 | group.
        let mut position = vec![u32::MAX; self.slots.len()];
        for (slot, info) in self.slots.iter().enumerate() {
            if let Some(info) = info {
                if let Ok(p) = replicas.binary_search(&info.replica) {
                    position[slot] = (p as u32) << 5 | u32::from(info.group);
                }
            }
        }
        let mut layouts: Vec<(ReplicaId, Vec<Option<LearnedGroup>>)> =
            self.layouts.iter().map(|(&r, l)| (r, l.clone())).collect();
        layouts.sort_unstable_by_key(|(r, _)| *r);
        let blocks = self.stats.blocks as usize;
        let mut snap = IndexSnapshot {
            version: SNAPSHOT_VERSION,
            replicas,
            keys: Vec::with_capacity(blocks),
            engine_hashes: Vec::with_capacity(blocks),
            holder_counts: Vec::with_capacity(blocks),
            holders: Vec::with_capacity(self.stats.entries as usize),
            layouts,
            aliases: Vec::new(),
        };
        for i in 0..self.slab.high() {
            let n = self.slab.get(i);
            if !n.live() {
                continue;
            }
            let block = snap.keys.len() as u32;
            let before = snap.holders.len();
            for h in n.holders() {
                if let Some(&p) = position.get(slot_of(h) as usize) {
                    if p != u32::MAX {
                        snap.holders.push(p << 3 | u32::from(media_of(h)));
                    }
                }
            }
            snap.keys.push(n.key);
            snap.engine_hashes.push(n.engine_hash);
            snap.holder_counts
                .push(u16::try_from(snap.holders.len() - before).unwrap_or(u16::MAX));
            if n.flags & FLAG_ALIASED != 0 {
                if let Some(aliases) = self.node_aliases.get(&i) {
                    snap.aliases.extend(aliases.iter().map(|&a| (block, a)));
                }
            }
        }
        snap
    }

    /// Rebuilds an index from a snapshot under `cfg`'s budget (blocks that do not fit are
    /// dropped and counted, exactly as live events would be).
    pub fn import(cfg: IndexConfig, snap: &IndexSnapshot) -> Result<KvIndex, IndexError> {
        if snap.version != SNAPSHOT_VERSION {
            return Err(IndexError::SnapshotVersion {
                found: snap.version,
                expected: SNAPSHOT_VERSION,
            });
        }
        let blocks = snap.keys.len();
        if snap.engine_hashes.len() != blocks
            || snap.holder_counts.len() != blocks
            || snap
                .holder_counts
                .iter()
                .map(|&c| usize::from(c))
                .sum::<usize>()
                != snap.holders.len()
        {
            return Err(IndexError::SnapshotCorrupt);
        }
        let mut ix = KvIndex::new(cfg);
        for &r in &snap.replicas {
            ix.slot(r, 0)?;
        }
        for (r, layout) in &snap.layouts {
            for (g, learned) in layout.iter().enumerate() {
                if let (Some(learned), Ok(g)) = (learned, u8::try_from(g)) {
                    ix.learn_group(*r, g, *learned);
                }
            }
        }
        let mut out = ApplyOutcome::default();
        let mut at = 0usize;
        let mut aliases = snap.aliases.iter().peekable();
        for b in 0..blocks {
            let (key, engine_hash) = (snap.keys[b], snap.engine_hashes[b]);
            let n = usize::from(snap.holder_counts[b]);
            for &h in &snap.holders[at..at + n] {
                let Some(&replica) = snap.replicas.get((h >> 8) as usize) else {
                    return Err(IndexError::SnapshotCorrupt);
                };
                let slot = ix.slot(replica, ((h >> 3) & 0x1f) as u8)?;
                let media = (h & 0x7) as u8;
                for bit in [MEDIA_GPU, MEDIA_CPU, MEDIA_STORAGE] {
                    if media & bit != 0 {
                        ix.store_one(slot, key, engine_hash, bit, false, &mut out);
                    }
                }
            }
            at += n;
            let found = ix.find_key(key);
            while let Some(&&(block, alias)) = aliases.peek() {
                if block as usize > b {
                    break;
                }
                aliases.next();
                if let (true, Some(i)) = (block as usize == b, found) {
                    ix.note_engine_hash(i, alias, &mut out);
                }
            }
        }
        // Importing is not new traffic.
        ix.stats.stored = 0;
        ix.stats.refreshed = 0;
        ix.refresh_bytes();
        Ok(ix)
    }
}
