//! How often a host calls [`Plugin::on_tick`]: every [`TICK`] while work is due within
//! [`IDLE_TICK`] (a tokenizer fetch, a held completion report), else once per [`IDLE_TICK`], so an
//! idle gateway is not woken twenty times a second for nothing.
//!
//! The Wasm build's timer is periodic (`proxy_set_tick_period`, one per root context), so its root
//! keeps a [`TickPeriod`]: re-planned after every tick, and hastened by the plugin's waker when a
//! stream adds work due sooner than the running period would reach. The native build's ticker
//! thread sleeps until the work is due instead, [`IDLE_TICK`] at most.
//!
//! [`Plugin::on_tick`]: crate::plugin::Plugin::on_tick

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::plugin::TICK;

/// Longest an idle host goes between ticks (a bound, should a wake-up ever be missed).
pub const IDLE_TICK: Duration = Duration::from_secs(1);

/// The period for work next due at `next_due_ms` (host ms; `None`: nothing pending) at `now_ms`.
pub fn period_for(now_ms: u64, next_due_ms: Option<u64>) -> Duration {
    match next_due_ms {
        Some(due) if due.saturating_sub(now_ms) < millis(IDLE_TICK) => TICK,
        _ => IDLE_TICK,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The period a host's periodic timer runs at, so that it is set only when the plan changes.
#[derive(Debug, Default)]
pub struct TickPeriod {
    /// The running period in ms; 0 until one is set.
    running_ms: AtomicU64,
}

impl TickPeriod {
    /// The period to set after a tick (or at start), if it is not the one running.
    pub fn replanned(&self, now_ms: u64, next_due_ms: Option<u64>) -> Option<Duration> {
        let want = period_for(now_ms, next_due_ms);
        (millis(want) != self.running_ms.load(Ordering::Relaxed)).then_some(want)
    }

    /// The period to set now that work is due at `due_ms`, if the running one (or none) would
    /// tick too late for it; never a longer one (the next tick re-plans).
    pub fn hastened(&self, now_ms: u64, due_ms: u64) -> Option<Duration> {
        let want = period_for(now_ms, Some(due_ms));
        let running = self.running_ms.load(Ordering::Relaxed);
        (running == 0 || millis(want) < running).then_some(want)
    }

    /// Records that the host now runs `period`.
    pub fn set(&self, period: Duration) {
        self.running_ms.store(millis(period), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_due_within_the_idle_tick_ticks_every_tick_and_nothing_pending_ticks_once_a_second() {
        assert_eq!(period_for(10_000, None), IDLE_TICK);
        assert_eq!(period_for(10_000, Some(9_000)), TICK, "overdue");
        assert_eq!(period_for(10_000, Some(10_250)), TICK, "a held report");
        assert_eq!(period_for(10_000, Some(10_999)), TICK);
        assert_eq!(
            period_for(10_000, Some(11_000)),
            IDLE_TICK,
            "the next idle tick is in time"
        );
        assert_eq!(
            period_for(10_000, Some(40_000)),
            IDLE_TICK,
            "a fetch retry far ahead"
        );
        assert_eq!(
            period_for(u64::MAX - 5, Some(u64::MAX)),
            TICK,
            "no overflow"
        );
    }

    #[test]
    fn a_period_is_set_only_when_the_plan_changes() {
        let p = TickPeriod::default();
        assert_eq!(p.replanned(0, None), Some(IDLE_TICK), "nothing set yet");
        p.set(IDLE_TICK);
        assert_eq!(p.replanned(5, None), None);
        assert_eq!(p.replanned(5, Some(100)), Some(TICK));
        p.set(TICK);
        assert_eq!(p.replanned(60, Some(100)), None);
        assert_eq!(p.replanned(120, None), Some(IDLE_TICK), "idle again");
    }

    #[test]
    fn new_work_hastens_an_idle_period_and_never_slows_a_busy_one() {
        let p = TickPeriod::default();
        assert_eq!(p.hastened(0, 250), Some(TICK), "nothing set yet");
        p.set(IDLE_TICK);
        assert_eq!(p.hastened(0, 250), Some(TICK));
        assert_eq!(p.hastened(0, 5_000), None, "the idle tick reaches it");
        p.set(TICK);
        assert_eq!(p.hastened(0, 250), None, "already ticking");
        assert_eq!(p.hastened(0, 5_000), None, "left to the next tick's plan");
    }
}
