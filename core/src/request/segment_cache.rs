//! A bounded least-recently-used cache from segment text to its token ids.
//!
//! Keys are the xxh3-128 digest of the segment's bytes plus its length, so the cache never holds
//! prompt text. The bound is both a number of entries and an approximate number of bytes
//! (token ids plus a fixed per-entry overhead); the least recently used entries go first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Bytes charged per entry on top of its ids (map slot, order slot, `Arc` header).
const ENTRY_OVERHEAD_BYTES: usize = 96;

/// The identity of one segment: xxh3-128 of its bytes and its length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SegmentKey {
    digest: u128,
    len: usize,
}

impl SegmentKey {
    /// The key of `text`.
    pub(crate) fn of(text: &str) -> Self {
        Self {
            digest: xxhash_rust::xxh3::xxh3_128(text.as_bytes()),
            len: text.len(),
        }
    }
}

struct Entry {
    ids: Arc<[u32]>,
    last_used: u64,
}

/// Counters describing the cache, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// Entries held now.
    pub entries: usize,
    /// Approximate bytes held now.
    pub bytes: usize,
    /// Lookups that found their segment.
    pub hits: u64,
    /// Lookups that had to tokenise.
    pub misses: u64,
    /// Entries dropped to stay within the bounds.
    pub evictions: u64,
}

/// The LRU itself. Not synchronised: [`super::ModelTokenizer`] wraps it in a mutex.
pub(crate) struct SegmentCache {
    map: HashMap<SegmentKey, Entry>,
    order: BTreeMap<u64, SegmentKey>,
    tick: u64,
    max_bytes: usize,
    max_entries: usize,
    stats: SegmentCacheStats,
}

impl SegmentCache {
    /// An empty cache holding at most `max_entries` entries and about `max_bytes` bytes.
    /// Either bound at zero disables caching.
    pub(crate) fn new(max_bytes: usize, max_entries: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            max_bytes,
            max_entries,
            stats: SegmentCacheStats::default(),
        }
    }

    fn cost(ids_len: usize) -> usize {
        ids_len
            .saturating_mul(std::mem::size_of::<u32>())
            .saturating_add(ENTRY_OVERHEAD_BYTES)
    }

    /// The ids of `key`, marking it most recently used.
    pub(crate) fn get(&mut self, key: &SegmentKey) -> Option<Arc<[u32]>> {
        self.tick += 1;
        let tick = self.tick;
        match self.map.get_mut(key) {
            Some(entry) => {
                self.order.remove(&entry.last_used);
                entry.last_used = tick;
                self.order.insert(tick, *key);
                self.stats.hits += 1;
                Some(entry.ids.clone())
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Stores `ids` under `key`, evicting least recently used entries to stay within the bounds.
    /// An entry larger than a quarter of the byte bound is not stored.
    pub(crate) fn insert(&mut self, key: SegmentKey, ids: Arc<[u32]>) {
        let cost = Self::cost(ids.len());
        if self.max_entries == 0 || cost > self.max_bytes / 4 {
            return;
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some(old) = self.map.insert(
            key,
            Entry {
                ids,
                last_used: tick,
            },
        ) {
            self.order.remove(&old.last_used);
            self.stats.bytes = self.stats.bytes.saturating_sub(Self::cost(old.ids.len()));
        }
        self.order.insert(tick, key);
        self.stats.bytes += cost;
        while self.map.len() > self.max_entries || self.stats.bytes > self.max_bytes {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(old) = self.map.remove(&oldest) {
                self.stats.bytes = self.stats.bytes.saturating_sub(Self::cost(old.ids.len()));
                self.stats.evictions += 1;
            }
        }
        self.stats.entries = self.map.len();
    }

    /// Drops every entry (counters are kept).
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
        self.stats.bytes = 0;
        self.stats.entries = 0;
    }

    /// Current counters.
    pub(crate) fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            entries: self.map.len(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Arc<[u32]> {
        (0..n).collect::<Vec<_>>().into()
    }

    #[test]
    fn evicts_least_recently_used_by_entries() {
        let mut c = SegmentCache::new(1 << 20, 2);
        let (a, b, d) = (
            SegmentKey::of("a"),
            SegmentKey::of("b"),
            SegmentKey::of("d"),
        );
        c.insert(a, ids(1));
        c.insert(b, ids(2));
        assert!(c.get(&a).is_some()); // a is now the most recent
        c.insert(d, ids(3));
        assert!(c.get(&b).is_none(), "b was least recently used");
        assert_eq!(c.get(&a).as_deref(), Some(&[0u32][..]));
        assert_eq!(c.get(&d).map(|v| v.len()), Some(3));
        assert_eq!(c.stats().evictions, 1);
    }

    #[test]
    fn respects_byte_bound() {
        let max_bytes = 4 * (SegmentCache::cost(100));
        let mut c = SegmentCache::new(max_bytes, 1000);
        for i in 0..50 {
            c.insert(SegmentKey::of(&i.to_string()), ids(100));
            assert!(c.stats().bytes <= max_bytes);
        }
        assert_eq!(c.stats().entries, 4);
        // Too large for the cache: refused, nothing evicted.
        c.insert(SegmentKey::of("big"), ids(10_000));
        assert_eq!(c.stats().entries, 4);
    }

    #[test]
    fn same_text_same_key_length_matters() {
        assert_eq!(SegmentKey::of("hello"), SegmentKey::of("hello"));
        assert_ne!(SegmentKey::of("hello"), SegmentKey::of("hello "));
    }
}
