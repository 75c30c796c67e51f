//! Predicted entries: "replica R will hold these blocks", written when a request is routed, before
//! any event can confirm it, so that sibling requests arriving in the same burst follow it.
//!
//! Each entry lives until `expires` (caller's clock, milliseconds), is replaced (removed) as soon as
//! a real `BlockStored` for the same (block, replica) arrives, and the store holds at most
//! `max_entries`; when full, the entries closest to expiry go first. Expiry is lazy: a min-heap of
//! expiry times is popped on every insert and on [`PredictedStore::expire`]; heap items whose entry
//! was refreshed or replaced are skipped (lazy deletion) and the heap is rebuilt when stale items
//! outnumber live ones.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::hasher::IdBuildHasher;

#[derive(Debug, Default)]
pub(crate) struct PredictedStore {
    /// Router key -> (slot, expiry ms).
    map: HashMap<u64, Vec<(u32, u64)>, IdBuildHasher>,
    heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    len: usize,
}

/// What an expiry pass or insert did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PredictedChange {
    pub inserted: u64,
    pub refreshed: u64,
    pub expired: u64,
    pub evicted: u64,
}

impl PredictedStore {
    /// Live (not yet pruned) entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no entries (the fast path for lookups and stores).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Approximate heap bytes.
    pub fn bytes(&self) -> usize {
        self.map.capacity() * (8 + 24 + 1) + self.len * 16 + self.heap.capacity() * 24
    }

    /// Whether `slot` has an unexpired prediction for `key` at `now`.
    #[inline]
    pub fn holds(&self, key: u64, slot: u32, now: u64) -> bool {
        self.map
            .get(&key)
            .is_some_and(|v| v.iter().any(|&(s, e)| s == slot && e > now))
    }

    /// Unexpired predicted slots for `key` at `now`.
    pub fn slots(&self, key: u64, now: u64) -> impl Iterator<Item = u32> + '_ {
        self.map
            .get(&key)
            .into_iter()
            .flat_map(move |v| v.iter().filter(move |&&(_, e)| e > now).map(|&(s, _)| s))
    }

    /// Predicts `slot` holds `key` until `expires`.
    pub fn insert(&mut self, key: u64, slot: u32, expires: u64, change: &mut PredictedChange) {
        let list = self.map.entry(key).or_default();
        if let Some(e) = list.iter_mut().find(|(s, _)| *s == slot) {
            e.1 = e.1.max(expires);
            change.refreshed += 1;
        } else {
            list.push((slot, expires));
            self.len += 1;
            change.inserted += 1;
        }
        self.heap.push(Reverse((expires, key, slot)));
    }

    /// Removes `slot`'s prediction for `key` (a real event confirmed it). Returns whether it existed.
    pub fn remove(&mut self, key: u64, slot: u32) -> bool {
        let Some(list) = self.map.get_mut(&key) else {
            return false;
        };
        let Some(pos) = list.iter().position(|&(s, _)| s == slot) else {
            return false;
        };
        list.swap_remove(pos);
        if list.is_empty() {
            self.map.remove(&key);
        }
        self.len -= 1;
        true
    }

    /// Removes every prediction for `slot`.
    pub fn remove_slot(&mut self, slot: u32) {
        let mut removed = 0;
        self.map.retain(|_, list| {
            let before = list.len();
            list.retain(|&(s, _)| s != slot);
            removed += before - list.len();
            !list.is_empty()
        });
        self.len -= removed;
    }

    /// Drops entries expired at `now`, then the soonest-expiring ones while above `max_entries`.
    pub fn expire(&mut self, now: u64, max_entries: usize, change: &mut PredictedChange) {
        while let Some(&Reverse((exp, key, slot))) = self.heap.peek() {
            let over = self.len > max_entries;
            if exp > now && !over {
                break;
            }
            self.heap.pop();
            // Only the heap item matching the entry's current expiry removes it.
            let current = self
                .map
                .get(&key)
                .and_then(|v| v.iter().find(|&&(s, _)| s == slot).map(|&(_, e)| e));
            if current == Some(exp) && self.remove(key, slot) {
                if exp <= now {
                    change.expired += 1;
                } else {
                    change.evicted += 1;
                }
            }
        }
        if self.heap.len() > 2 * self.len + 1024 {
            self.heap = self
                .map
                .iter()
                .flat_map(|(&k, v)| v.iter().map(move |&(s, e)| Reverse((e, k, s))))
                .collect();
        }
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.map.clear();
        self.heap.clear();
        self.len = 0;
    }
}
