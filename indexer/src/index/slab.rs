//! Block nodes and their storage: a chunked slab (no large reallocations, stable `u32` ids) and a
//! compact holder list per node.

use std::sync::atomic::{AtomicU8, Ordering};

/// Nodes per slab chunk (a chunk is allocated whole; `CHUNK * size_of::<Node>()` bytes).
pub(crate) const CHUNK_SHIFT: u32 = 12;
pub(crate) const CHUNK: usize = 1 << CHUNK_SHIFT;
const CHUNK_MASK: u32 = (CHUNK as u32) - 1;

/// Bytes one more chunk costs: its nodes, its pointer, and room for its nodes in the free list.
pub(crate) const CHUNK_BYTES: usize =
    CHUNK * std::mem::size_of::<Node>() + std::mem::size_of::<Box<[Node]>>() + CHUNK * 4;

/// Holders stored inline before spilling to the heap.
pub(crate) const INLINE_HOLDERS: usize = 3;

/// Medium bits of a holder.
pub(crate) const MEDIA_SHIFT: u32 = 24;
pub(crate) const SLOT_MASK: u32 = (1 << MEDIA_SHIFT) - 1;
/// The largest dense replica slot a holder can name.
pub(crate) const MAX_SLOTS: u32 = 1 << MEDIA_SHIFT;

/// Bits of a holder above the medium bits: GPU copies beyond the first.
pub(crate) const COPIES_SHIFT: u32 = 27;
/// The most extra GPU copies a holder counts.
pub(crate) const MAX_EXTRA_COPIES: u32 = (1 << (32 - COPIES_SHIFT)) - 1;

/// A holder packed in 32 bits: replica slot (24 bits), medium bits (bits 24..27) and no extra
/// GPU copies (bits 27..32, see [`with_extra_copies`]).
#[inline]
pub(crate) fn pack(slot: u32, media: u8) -> u32 {
    (slot & SLOT_MASK) | (u32::from(media & 0x7) << MEDIA_SHIFT)
}

/// GPU copies of the block the holder's slot holds beyond the first: vLLM caches a second
/// physical block under a hash it already holds when a request recomputes a prefix it could not
/// take from the cache (a hybrid model whose sliding-window blocks were evicted), and evicts
/// each copy with its own `BlockRemoved`.
#[inline]
pub(crate) fn extra_copies_of(h: u32) -> u32 {
    h >> COPIES_SHIFT
}

/// `h` with `n` extra GPU copies (saturating at [`MAX_EXTRA_COPIES`]).
#[inline]
pub(crate) fn with_extra_copies(h: u32, n: u32) -> u32 {
    (h & ((1 << COPIES_SHIFT) - 1)) | (n.min(MAX_EXTRA_COPIES) << COPIES_SHIFT)
}

/// The slot of a packed holder.
#[inline]
pub(crate) fn slot_of(h: u32) -> u32 {
    h & SLOT_MASK
}

/// The medium bits of a packed holder.
#[inline]
pub(crate) fn media_of(h: u32) -> u8 {
    ((h >> MEDIA_SHIFT) & 0x7) as u8
}

/// One cached block (a router key) and which replicas hold it on which media. 40 bytes.
#[derive(Debug)]
pub(crate) struct Node {
    /// The router key.
    pub key: u64,
    /// The engine wire hash first reported for this block (others live in the alias map).
    pub engine_hash: u64,
    /// Holders beyond the inline ones. Boxed on purpose: 8 bytes in the node instead of 24,
    /// for the rare blocks held by more than three replicas.
    #[allow(clippy::box_collection)]
    pub spill: Option<Box<Vec<u32>>>,
    /// The first holders.
    pub inline: [u32; INLINE_HOLDERS],
    /// Number of holders.
    pub len: u16,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// CLOCK reference bit: set on every touch (event or lookup), cleared by the eviction hand.
    pub referenced: AtomicU8,
}

/// The node is in use (not on the free list).
pub(crate) const FLAG_LIVE: u8 = 1;
/// Some replica reported this block under another engine hash (see the alias maps).
pub(crate) const FLAG_ALIASED: u8 = 2;

impl Node {
    fn vacant() -> Node {
        Node {
            key: 0,
            engine_hash: 0,
            spill: None,
            inline: [0; INLINE_HOLDERS],
            len: 0,
            flags: 0,
            referenced: AtomicU8::new(0),
        }
    }

    /// Whether the node holds a block.
    #[inline]
    pub fn live(&self) -> bool {
        self.flags & FLAG_LIVE != 0
    }

    /// Marks the node recently used (cheap when already marked).
    #[inline]
    pub fn touch(&self) {
        if self.referenced.load(Ordering::Relaxed) == 0 {
            self.referenced.store(1, Ordering::Relaxed);
        }
    }

    /// Number of holders.
    #[inline]
    pub fn holders_len(&self) -> usize {
        usize::from(self.len)
    }

    /// The holders, inline part then spilled part.
    #[inline]
    pub fn holders(&self) -> impl Iterator<Item = u32> + '_ {
        let inline = usize::from(self.len).min(INLINE_HOLDERS);
        self.inline[..inline]
            .iter()
            .copied()
            .chain(self.spill.iter().flat_map(|v| v.iter().copied()))
    }

    /// Position of `slot`'s holder, if any.
    pub fn find_slot(&self, slot: u32) -> Option<usize> {
        self.holders().position(|h| slot_of(h) == slot)
    }

    /// The holder at `pos` (`pos < holders_len()`).
    pub fn holder(&self, pos: usize) -> u32 {
        if pos < INLINE_HOLDERS {
            self.inline[pos]
        } else {
            self.spill
                .as_ref()
                .and_then(|v| v.get(pos - INLINE_HOLDERS).copied())
                .unwrap_or(0)
        }
    }

    /// Overwrites the holder at `pos`.
    pub fn set_holder(&mut self, pos: usize, h: u32) {
        if pos < INLINE_HOLDERS {
            self.inline[pos] = h;
        } else if let Some(slot) = self
            .spill
            .as_mut()
            .and_then(|v| v.get_mut(pos - INLINE_HOLDERS))
        {
            *slot = h;
        }
    }

    /// Heap bytes a push would add (0 when capacity remains).
    pub fn push_growth(&self) -> usize {
        let len = usize::from(self.len);
        if len < INLINE_HOLDERS {
            return 0;
        }
        match &self.spill {
            None => spill_bytes(4),
            Some(v) if v.len() == v.capacity() => {
                spill_bytes(v.capacity() * 2) - spill_bytes(v.capacity())
            }
            Some(_) => 0,
        }
    }

    /// Appends a holder. Returns the heap bytes added.
    pub fn push(&mut self, h: u32) -> usize {
        let len = usize::from(self.len);
        let mut grown = 0;
        if len < INLINE_HOLDERS {
            self.inline[len] = h;
        } else {
            let spill = self.spill.get_or_insert_with(|| {
                grown = spill_bytes(4);
                Box::new(Vec::with_capacity(4))
            });
            if spill.len() == spill.capacity() {
                let before = spill_bytes(spill.capacity());
                spill.reserve_exact(spill.capacity());
                grown += spill_bytes(spill.capacity()) - before;
            }
            spill.push(h);
        }
        self.len = self.len.saturating_add(1);
        grown
    }

    /// Removes the holder at `pos` (the last one takes its place). Returns heap bytes freed.
    pub fn swap_remove(&mut self, pos: usize) -> usize {
        let len = usize::from(self.len);
        if pos >= len {
            return 0;
        }
        let last = self.holder(len - 1);
        self.set_holder(pos, last);
        self.len -= 1;
        let mut freed = 0;
        if len > INLINE_HOLDERS {
            if let Some(spill) = self.spill.as_mut() {
                spill.pop();
                if spill.is_empty() {
                    freed = spill_bytes(spill.capacity());
                    self.spill = None;
                }
            }
        }
        freed
    }

    /// Heap bytes held by the spill list.
    pub fn spill_heap_bytes(&self) -> usize {
        self.spill.as_ref().map_or(0, |v| spill_bytes(v.capacity()))
    }
}

/// Heap bytes of a spill list of `cap` holders: the boxed `Vec` header, its buffer, and an
/// allocator overhead estimate of 16 bytes per allocation.
pub(crate) fn spill_bytes(cap: usize) -> usize {
    std::mem::size_of::<Vec<u32>>() + 16 + cap * 4 + 16
}

/// A chunked slab of nodes addressed by `u32`.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    chunks: Vec<Box<[Node]>>,
    /// Next never-used index.
    high: u32,
    free: Vec<u32>,
}

impl Slab {
    /// The node at `i` (must be `< capacity`).
    #[inline]
    pub fn get(&self, i: u32) -> &Node {
        &self.chunks[(i >> CHUNK_SHIFT) as usize][(i & CHUNK_MASK) as usize]
    }

    /// The node at `i`, mutably.
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut Node {
        &mut self.chunks[(i >> CHUNK_SHIFT) as usize][(i & CHUNK_MASK) as usize]
    }

    /// Bytes an `alloc` would add now: a new chunk and its share of the free list.
    pub fn alloc_growth(&self) -> usize {
        if !self.free.is_empty() || (self.high as usize) < self.chunks.len() * CHUNK {
            0
        } else {
            CHUNK_BYTES
        }
    }

    /// Takes a vacant node, marks it live and returns its index; `None` when `u32` ids ran out.
    pub fn alloc(&mut self, key: u64, engine_hash: u64) -> Option<u32> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                if (self.high as usize) >= self.chunks.len() * CHUNK {
                    if self.chunks.len() >= (u32::MAX as usize >> CHUNK_SHIFT) {
                        return None;
                    }
                    let chunk: Vec<Node> = (0..CHUNK).map(|_| Node::vacant()).collect();
                    self.chunks.push(chunk.into_boxed_slice());
                    // The free list can then hold every node: releasing never reallocates it,
                    // so evictions cannot grow memory behind the budget's back.
                    let nodes = self.chunks.len() * CHUNK;
                    self.free.reserve_exact(nodes - self.free.len());
                }
                let i = self.high;
                self.high += 1;
                i
            }
        };
        let n = self.get_mut(i);
        n.key = key;
        n.engine_hash = engine_hash;
        n.spill = None;
        n.len = 0;
        n.flags = FLAG_LIVE;
        n.referenced.store(1, Ordering::Relaxed);
        Some(i)
    }

    /// Returns node `i` to the free list.
    pub fn release(&mut self, i: u32) {
        let n = self.get_mut(i);
        n.flags = 0;
        n.len = 0;
        n.spill = None;
        self.free.push(i);
    }

    /// One past the highest index ever handed out (iteration bound).
    pub fn high(&self) -> u32 {
        self.high
    }

    /// Bytes held by the slab itself (chunks and the free list sized for all their nodes).
    pub fn bytes(&self) -> usize {
        self.chunks.len()
            * (CHUNK * std::mem::size_of::<Node>() + std::mem::size_of::<Box<[Node]>>())
            + self.free.capacity() * 4
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.chunks = Vec::new();
        self.free = Vec::new();
        self.high = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_is_forty_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 40);
    }

    #[test]
    fn releasing_nodes_never_grows_the_slab() {
        let mut slab = Slab::default();
        let ids: Vec<u32> = (0..2 * CHUNK as u64 + 5)
            .map(|k| slab.alloc(k, k).expect("alloc"))
            .collect();
        let bytes = slab.bytes();
        assert_eq!(bytes, 3 * CHUNK_BYTES);
        for i in ids {
            slab.release(i);
        }
        assert_eq!(slab.bytes(), bytes);
        // Reuse comes from the free list: no new chunk.
        assert_eq!(slab.alloc_growth(), 0);
        for k in 0..3 * CHUNK as u64 {
            slab.alloc(k, k).expect("alloc");
        }
        assert_eq!(slab.bytes(), bytes);
        assert_eq!(slab.alloc_growth(), CHUNK_BYTES);
    }

    #[test]
    fn holders_spill_and_shrink() {
        let mut slab = Slab::default();
        let i = slab.alloc(1, 2).expect("alloc");
        let n = slab.get_mut(i);
        for s in 0..10 {
            n.push(pack(s, 1));
        }
        assert_eq!(n.holders_len(), 10);
        assert_eq!(
            n.holders().map(slot_of).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        while n.holders_len() > 0 {
            let pos = n.holders_len() / 2;
            n.swap_remove(pos);
        }
        assert!(n.spill.is_none());
    }
}
