//! vLLM's `FreeKVCacheBlockQueue`: an intrusive doubly linked list of free block ids in eviction
//! order (head = next to be reused), with O(1) removal from the middle when a cached block is hit.

const NIL: u32 = u32::MAX;

/// Free block ids in eviction order.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    in_queue: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding `0..num_blocks` in id order.
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks as u32;
        let mut q = FreeQueue {
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            in_queue: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..n {
            q.push_back(id);
        }
        q
    }

    /// Number of free blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no block is free.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `id` is in the queue.
    pub fn contains(&self, id: u32) -> bool {
        self.in_queue.get(id as usize).copied().unwrap_or(false)
    }

    /// Removes and returns the head.
    pub fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }

    /// Appends `id` at the tail (evicted last).
    pub fn push_back(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(!self.in_queue[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.in_queue[i] = true;
        self.len += 1;
    }

    /// Puts `ids` at the head, keeping their order (the first of `ids` becomes the head).
    pub fn prepend(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            self.push_front(id);
        }
    }

    fn push_front(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(!self.in_queue[i]);
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.in_queue[i] = true;
        self.len += 1;
    }

    /// Unlinks `id` (no-op if it is not queued).
    pub fn remove(&mut self, id: u32) {
        let i = id as usize;
        if !self.contains(id) {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_queue[i] = false;
        self.len -= 1;
    }

    /// The ids from head to tail (for tests and debugging).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        let mut cur = self.head;
        while cur != NIL {
            out.push(cur);
            cur = self.next[cur as usize];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_remove_prepend_append() {
        let mut q = FreeQueue::new(5);
        assert_eq!(q.to_vec(), vec![0, 1, 2, 3, 4]);
        q.remove(2);
        assert_eq!(q.to_vec(), vec![0, 1, 3, 4]);
        assert_eq!(q.pop_front(), Some(0));
        q.prepend(&[2, 0]);
        assert_eq!(q.to_vec(), vec![2, 0, 1, 3, 4]);
        q.remove(4);
        q.push_back(4);
        q.remove(2);
        assert_eq!(q.to_vec(), vec![0, 1, 3, 4]);
        assert_eq!(q.len(), 4);
    }
}
