//! Restart without going blind: the index and every stream's last sequence number, saved
//! periodically (postcard, versioned header, written to a temporary file and renamed into place so a
//! crash never leaves a torn file) and loaded at start. After loading, each stream asks its replica
//! for a replay from `last_seq + 1`; when the replica cannot cover that (buffer rotated, engine
//! restarted, no replay endpoint), that stream's part of the index is dropped.
//!
//! File layout: `b"KVRSNAP\0"`, format version (u32 LE), body length (u64 LE), postcard body.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::index::IndexSnapshot;
use crate::membership::{lock, Replica};
use crate::state::AppState;

const MAGIC: &[u8; 8] = b"KVRSNAP\0";
/// Current snapshot format version.
pub const FORMAT_VERSION: u32 = 1;

/// Snapshot errors.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// File I/O.
    #[error("snapshot {path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Error.
        source: std::io::Error,
    },
    /// Not a snapshot, or truncated.
    #[error("snapshot {0}: not a kvroute snapshot or truncated")]
    Format(PathBuf),
    /// Written by another format version.
    #[error("snapshot {path}: format version {found}, this build reads {FORMAT_VERSION}")]
    Version {
        /// File.
        path: PathBuf,
        /// Version found.
        found: u32,
    },
    /// Body (de)serialisation failed.
    #[error("snapshot {path}: {message}")]
    Codec {
        /// File.
        path: PathBuf,
        /// Message.
        message: String,
    },
}

/// One stream's position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamSnapshot {
    /// Replica name.
    pub replica: String,
    /// Its model.
    pub model: String,
    /// DP rank.
    pub rank: u32,
    /// Index id of the stream's entries.
    pub index_id: u32,
    /// Last applied seq.
    pub last_seq: Option<u64>,
    /// Fingerprint of the last applied payload.
    pub last_fingerprint: Option<u64>,
    /// The engine's `process_start_time_seconds` when saved.
    pub process_start: Option<f64>,
}

/// The snapshot body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Wall clock at save (ms since the epoch).
    pub created_unix_ms: u64,
    /// Stream positions.
    pub streams: Vec<StreamSnapshot>,
    /// Learned block sizes per model.
    pub block_sizes: Vec<(String, u32)>,
    /// The index export (postcard bytes of [`crate::index::KvIndex::export`]).
    pub index: Vec<u8>,
}

/// Encodes a snapshot with its header.
pub fn encode(snap: &Snapshot) -> Result<Vec<u8>, postcard::Error> {
    let body = postcard::to_stdvec(snap)?;
    let mut out = Vec::with_capacity(body.len() + 20);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes a snapshot file's bytes.
pub fn decode(bytes: &[u8], path: &Path) -> Result<Snapshot, SnapshotError> {
    let fmt = || SnapshotError::Format(path.to_path_buf());
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(fmt());
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().map_err(|_| fmt())?);
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version {
            path: path.to_path_buf(),
            found: version,
        });
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().map_err(|_| fmt())?);
    let body = &bytes[20..];
    if body.len() as u64 != len {
        return Err(fmt());
    }
    postcard::from_bytes(body).map_err(|e| SnapshotError::Codec {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Writes atomically: temporary file in the same directory, fsync, rename, fsync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    let io = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("snapshot"),
        std::process::id()
    ));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads a snapshot; `Ok(None)` when the file does not exist.
pub fn read(path: &Path) -> Result<Option<Snapshot>, SnapshotError> {
    match std::fs::read(path) {
        Ok(bytes) => decode(&bytes, path).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SnapshotError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Captures the current state: the index and the stream positions consistently, under the index
/// lock (only the copy is made under it; encoding happens after it is released). Blocking: call
/// it off the async runtime.
pub fn capture(state: &AppState) -> Result<Snapshot, String> {
    let replicas = state.fleet.all();
    let locked = std::time::Instant::now();
    let (export, streams) = state.index.export(|| stream_positions(&replicas));
    state
        .metrics
        .snapshot_lock_us
        .store(locked.elapsed().as_micros() as u64, Ordering::Relaxed);
    let index = postcard::to_stdvec(&export).map_err(|e| e.to_string())?;
    drop(export);
    let block_sizes = state
        .models
        .values()
        .filter_map(|m| m.block_size().map(|b| (m.name.clone(), b)))
        .collect();
    let created_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    Ok(Snapshot {
        created_unix_ms,
        streams,
        block_sizes,
        index,
    })
}

/// Every stream's position (read under the index lock by [`capture`]).
fn stream_positions(replicas: &[Arc<Replica>]) -> Vec<StreamSnapshot> {
    let mut streams = Vec::new();
    for r in replicas {
        let process_start = lock(&r.scraped).process_start;
        for s in &r.streams() {
            let ss = lock(&s.state).clone();
            streams.push(StreamSnapshot {
                replica: r.name.clone(),
                model: r.model.clone(),
                rank: s.rank,
                index_id: s.index_id,
                last_seq: ss.last_seq,
                last_fingerprint: ss.last_fingerprint,
                process_start,
            });
        }
    }
    streams
}

/// Captures and writes a snapshot to the configured path.
pub async fn save(state: &Arc<AppState>) -> Result<(), String> {
    let Some(cfg) = state.config.snapshot.clone() else {
        return Ok(());
    };
    let started = std::time::Instant::now();
    let st = state.clone();
    let bytes = tokio::task::spawn_blocking(move || {
        capture(&st).and_then(|snap| encode(&snap).map_err(|e| e.to_string()))
    })
    .await
    .map_err(|e| e.to_string())??;
    let size = bytes.len();
    let path = cfg.path.clone();
    tokio::task::spawn_blocking(move || write_atomic(&path, &bytes))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    state
        .metrics
        .snapshots_written
        .fetch_add(1, Ordering::Relaxed);
    tracing::debug!(
        bytes = size,
        ms = started.elapsed().as_millis() as u64,
        "snapshot written"
    );
    Ok(())
}

/// Runs forever: writes a snapshot every `interval_ms`.
pub async fn run(state: Arc<AppState>) {
    let Some(cfg) = state.config.snapshot.clone() else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        if let Err(e) = save(&state).await {
            state
                .metrics
                .snapshot_failures
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "snapshot failed");
        }
    }
}

/// What a loaded snapshot restores once replicas exist.
#[derive(Debug, Default)]
pub struct Restore {
    /// The snapshot, if one was loaded.
    pub snapshot: Option<Snapshot>,
}

/// Loads the configured snapshot (if any) and reserves the index ids of streams that still exist,
/// so replicas added next get the same ids. A broken or foreign-version file is logged and ignored.
pub fn load_and_reserve(state: &AppState) -> Restore {
    let Some(cfg) = &state.config.snapshot else {
        return Restore::default();
    };
    let snap = match read(&cfg.path) {
        Ok(Some(s)) => s,
        Ok(None) => {
            tracing::info!(path = %cfg.path.display(), "no snapshot yet; starting empty");
            return Restore::default();
        }
        Err(e) => {
            tracing::warn!(error = %e, "ignoring unreadable snapshot; starting empty");
            return Restore::default();
        }
    };
    for s in &snap.streams {
        state.fleet.reserve_id(&s.replica, s.rank, s.index_id);
    }
    Restore {
        snapshot: Some(snap),
    }
}

/// After the configured replicas were added: restores the index, stream positions and engine start
/// times; drops the entries of streams that no longer exist. Call before starting subscribers.
pub fn apply_restore(state: &AppState, restore: Restore) {
    let Some(snap) = restore.snapshot else {
        return;
    };
    let export: IndexSnapshot = match postcard::from_bytes(&snap.index) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "snapshot index part unreadable; starting empty");
            return;
        }
    };
    if let Err(e) = state.index.import(&export, || ()) {
        tracing::warn!(error = %e, "snapshot index import failed; starting empty");
        return;
    }
    for (model, bs) in &snap.block_sizes {
        if let Some(m) = state.models.get(model) {
            if m.block_size().is_none() {
                m.block_size.store(*bs, Ordering::Relaxed);
            }
        }
    }
    let mut restored = 0;
    for s in &snap.streams {
        let live = state.fleet.get(&s.replica).and_then(|r| {
            if r.model != s.model {
                return None;
            }
            r.streams()
                .iter()
                .find(|st| st.rank == s.rank && st.index_id == s.index_id)
                .cloned()
                .map(|st| (r.clone(), st))
        });
        match live {
            Some((r, st)) => {
                {
                    let mut ss = lock(&st.state);
                    ss.last_seq = s.last_seq;
                    ss.last_fingerprint = s.last_fingerprint;
                }
                if s.process_start.is_some() {
                    lock(&r.scraped).process_start = s.process_start;
                }
                restored += 1;
            }
            None => {
                state.index.remove_streams([s.index_id]);
            }
        }
    }
    tracing::info!(
        streams = restored,
        age_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
            .saturating_sub(snap.created_unix_ms),
        "snapshot restored; replaying from each stream's last seq"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejects_garbage() {
        let snap = Snapshot {
            created_unix_ms: 5,
            streams: vec![StreamSnapshot {
                replica: "r0".into(),
                model: "m".into(),
                rank: 0,
                index_id: 3,
                last_seq: Some(42),
                last_fingerprint: Some(7),
                process_start: Some(1.5),
            }],
            block_sizes: vec![("m".into(), 16)],
            index: vec![1, 2, 3],
        };
        let bytes = encode(&snap).unwrap();
        let p = Path::new("x");
        assert_eq!(decode(&bytes, p).unwrap(), snap);
        assert!(decode(&bytes[..bytes.len() - 1], p).is_err());
        let mut wrong = bytes.clone();
        wrong[8] = 9;
        assert!(matches!(
            decode(&wrong, p),
            Err(SnapshotError::Version { found: 9, .. })
        ));
        assert!(decode(b"hello world, not a snapshot", p).is_err());
    }
}
