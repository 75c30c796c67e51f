//! The hasher of the index's maps keyed by 64-bit hashes and replica ids.

use std::hash::{BuildHasherDefault, Hasher};

/// Spreads a 64-bit key over all bits (a SplitMix64 finaliser, ~1 ns). Router keys and real engine
/// hashes are already uniform, but an engine or simulator that emits structured hashes (counters,
/// small integers) must not turn the tables into long probe chains.
#[inline]
pub(crate) fn mix(x: u64) -> u64 {
    let x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A hasher for 64-bit hash keys: [`mix`] only, no per-byte work.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used by u64/u32 keys; FNV-1a keeps it correct for anything else.
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = mix(v);
    }
    fn write_u32(&mut self, v: u32) {
        // Replica ids are small: spread them.
        self.0 = u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// `BuildHasher` of [`IdHasher`].
pub type IdBuildHasher = BuildHasherDefault<IdHasher>;
