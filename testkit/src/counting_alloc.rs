//! A global allocator that counts live heap bytes and their peak, for tests that measure memory:
//!
//! ```ignore
//! #[global_allocator]
//! static HEAP: CountingAllocator = CountingAllocator::new();
//! let (_, peak) = HEAP.peak_during(|| work());
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes it hands out (process-wide: tests that read the
/// peak must not run concurrently).
pub struct CountingAllocator {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl CountingAllocator {
    /// Nothing counted yet.
    pub const fn new() -> Self {
        Self {
            current: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// Heap bytes live now.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::SeqCst)
    }

    /// The highest [`Self::current`] since the last [`Self::reset_peak`].
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Starts a new peak at what is live now; returns that.
    pub fn reset_peak(&self) -> usize {
        let now = self.current();
        self.peak.store(now, Ordering::SeqCst);
        now
    }

    /// Runs `f`; returns its result and the heap bytes at its peak above what was live before.
    pub fn peak_during<R>(&self, f: impl FnOnce() -> R) -> (R, usize) {
        let base = self.reset_peak();
        let r = f();
        (r, self.peak().saturating_sub(base))
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = self.current.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            self.peak.fetch_max(now, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc` is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) };
        self.current.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_it_hands_out_and_keeps_the_peak() {
        let a = CountingAllocator::new();
        let layout = Layout::from_size_align(1000, 8).expect("layout");
        let ((), peak) = a.peak_during(|| {
            // SAFETY: the layout is non-zero; each block is freed with its layout.
            unsafe {
                let p = a.alloc(layout);
                let q = a.alloc(layout);
                assert_eq!(a.current(), 2000);
                a.dealloc(p, layout);
                a.dealloc(q, layout);
            }
        });
        assert_eq!((peak, a.current()), (2000, 0));
    }
}
