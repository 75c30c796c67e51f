//! A sum whose parts fade with age: the building block of the indexer's recent rates.

use std::time::Instant;

/// An exponentially decayed sum: each amount added fades by `exp(-age / tau)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Decayed {
    level: f64,
    at: Option<Instant>,
}

impl Decayed {
    /// The sum at `now`, faded over `tau_s` seconds.
    pub fn at(&self, now: Instant, tau_s: f64) -> f64 {
        self.at.map_or(0.0, |at| {
            let age = now.saturating_duration_since(at).as_secs_f64();
            self.level * (-age / tau_s.max(f64::MIN_POSITIVE)).exp()
        })
    }

    /// Adds `amount` at `now` (a non-finite amount adds nothing).
    pub fn add(&mut self, now: Instant, tau_s: f64, amount: f64) {
        let amount = if amount.is_finite() { amount } else { 0.0 };
        self.level = self.at(now, tau_s) + amount;
        self.at = Some(now);
    }
}
