//! SplitMix64: the one small deterministic generator of the workspace (tie-breaking in scoring,
//! synthetic workloads, simulated output tokens, benchmark data). Its algorithm is fixed here so
//! that seeded results never depend on a crate's choice of generator.

/// The golden-ratio increment of SplitMix64.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64: 64 bits of state, statistically good enough for ties and test data, reproducible
/// everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator starting at `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        finalise(self.0)
    }

    /// A uniform value in `0..n` (`n > 0`; returns 0 for `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift reduction: bias is negligible for fleet-sized n.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// One SplitMix64 step from state `x` as a stateless hash: `SplitMix64::new(x).next_u64()`.
pub fn mix(x: u64) -> u64 {
    finalise(x.wrapping_add(GOLDEN_GAMMA))
}

/// SplitMix64's output function (a bijection spreading every input bit over the output).
fn finalise(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // The first outputs of SplitMix64 seeded with 0 (Vigna's reference implementation).
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(mix(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn below_stays_in_range() {
        let mut rng = SplitMix64::new(7);
        assert!((0..1000).all(|_| rng.below(3) < 3));
        assert_eq!(rng.below(0), 0);
    }
}
