//! A serialisable copy of the exact index, for the service's periodic snapshot (postcard).
//!
//! Predicted entries are not exported: they live for seconds and would be stale after a restart.

use serde::{Deserialize, Serialize};

use super::slab::{media_of, slot_of, FLAG_ALIASED};
use super::{ApplyOutcome, IndexConfig, IndexError, KvIndex, ReplicaId};

/// The snapshot format version this build writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;

/// One block: its router key, engine hashes and holders.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSnapshot {
    /// Router key.
    pub key: u64,
    /// The engine wire hash first reported for it.
    pub engine_hash: u64,
    /// Other engine hashes reported for it (replicas hashing differently).
    pub aliases: Vec<u64>,
    /// `(replica, medium bits)` (`MEDIA_*`).
    pub holders: Vec<(ReplicaId, u8)>,
}

/// The whole exact index of one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    /// [`SNAPSHOT_VERSION`].
    pub version: u32,
    /// Every replica known to the index (including ones holding nothing).
    pub replicas: Vec<ReplicaId>,
    /// Every block.
    pub blocks: Vec<BlockSnapshot>,
}

impl KvIndex {
    /// A copy of the index's blocks and replicas (not its counters or predictions).
    pub fn export(&self) -> IndexSnapshot {
        let mut blocks = Vec::with_capacity(self.stats.blocks as usize);
        for i in 0..self.slab.high() {
            let n = self.slab.get(i);
            if !n.live() {
                continue;
            }
            let aliases = if n.flags & FLAG_ALIASED != 0 {
                self.node_aliases.get(&i).cloned().unwrap_or_default()
            } else {
                Vec::new()
            };
            let holders = n
                .holders()
                .filter_map(|h| self.replica_of_slot(slot_of(h)).map(|r| (r, media_of(h))))
                .collect();
            blocks.push(BlockSnapshot {
                key: n.key,
                engine_hash: n.engine_hash,
                aliases,
                holders,
            });
        }
        IndexSnapshot {
            version: SNAPSHOT_VERSION,
            replicas: self.replicas().into_iter().map(|(r, _)| r).collect(),
            blocks,
        }
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
        let mut ix = KvIndex::new(cfg);
        for &r in &snap.replicas {
            ix.slot(r)?;
        }
        let mut out = ApplyOutcome::default();
        for b in &snap.blocks {
            for &(replica, media) in &b.holders {
                let slot = ix.slot(replica)?;
                for bit in [super::MEDIA_GPU, super::MEDIA_CPU, super::MEDIA_STORAGE] {
                    if media & bit != 0 {
                        ix.store_one(slot, b.key, b.engine_hash, bit, &mut out);
                    }
                }
            }
            if let Some(i) = ix.find_key(b.key) {
                for &a in &b.aliases {
                    ix.note_engine_hash(i, a, &mut out);
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
