//! What a placement commits the future to: how many later requests continue a request's prompt
//! (a session's next turns follow its context wherever it goes), learned from the requests
//! themselves ([`Continuations`]), and how busy each replica's prefill has recently been with
//! what kvroute sent it ([`RecentWork`]), which the sessions resident there keep bringing. The
//! cost model's `successors` term (`kvroute_core::scoring`, docs/scoring.md) prices a
//! placement with both.
//!
//! Locking: each value sits behind its owner's mutex (the model's `continuations`, the
//! replica's `recent_work`), held for one update or one read and never with another lock taken
//! inside it.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use kvroute_core::router_key::RouterKey;

use crate::decayed::Decayed;
use crate::index::IdBuildHasher;

/// Recent prompts' last full blocks, to learn how many later requests continue a request.
///
/// A request continues an earlier one when its prompt starts with that one's whole prompt: its
/// router keys then include the earlier prompt's last full block's key (block keys chain, so the
/// key names the whole prefix). A request that continues none starts a chain. Over the window,
/// continuations per chain start is the mean number of requests that follow a chain's first:
/// the successors a placement commits when it places a chain's first request (a later request
/// follows its context anyway). While chains are young (a run's first minutes) this reads
/// short, not long: the term it feeds starts weak and grows as chains show their length.
#[derive(Debug)]
pub struct Continuations {
    ends: HashSet<u64, IdBuildHasher>,
    order: VecDeque<u64>,
    max: usize,
    tau_s: f64,
    starts: Decayed,
    continued: Decayed,
}

impl Continuations {
    /// Remembers at most `max` prompts (the oldest forgotten first); counts fade over `tau_s`.
    pub fn new(max: usize, tau_s: f64) -> Self {
        Self {
            ends: HashSet::default(),
            order: VecDeque::new(),
            max: max.max(1),
            tau_s,
            starts: Decayed::default(),
            continued: Decayed::default(),
        }
    }

    /// Notes a request whose usable router keys are `keys` at `now`; true when it continues a
    /// remembered prompt.
    pub fn observe(&mut self, keys: &[RouterKey], now: Instant) -> bool {
        let Some(last) = keys.last() else {
            return false;
        };
        let continues = keys.iter().any(|k| self.ends.contains(&k.0));
        if continues {
            self.continued.add(now, self.tau_s, 1.0);
        } else {
            self.starts.add(now, self.tau_s, 1.0);
        }
        if self.ends.insert(last.0) {
            self.order.push_back(last.0);
            while self.order.len() > self.max {
                if let Some(old) = self.order.pop_front() {
                    self.ends.remove(&old);
                }
            }
        }
        continues
    }

    /// Later requests expected to continue a chain's first request: recent continuations per
    /// recent chain start (0 before any start).
    pub fn expected_successors(&self, now: Instant) -> f64 {
        let starts = self.starts.at(now, self.tau_s);
        if starts < f64::MIN_POSITIVE {
            return 0.0;
        }
        self.continued.at(now, self.tau_s) / starts
    }
}

/// A replica's recent prefill work from kvroute's decisions: the seconds of prefill routed
/// there and their squares, faded over a window, since the replica joined.
#[derive(Debug, Clone, Copy)]
pub struct RecentWork {
    since: Instant,
    seconds: Decayed,
    squares: Decayed,
}

impl RecentWork {
    /// No work yet, counted from `since` (when the replica joined).
    pub fn since(since: Instant) -> Self {
        Self {
            since,
            seconds: Decayed::default(),
            squares: Decayed::default(),
        }
    }

    /// Counts a prefill of `seconds` routed at `now`.
    pub fn add(&mut self, now: Instant, tau_s: f64, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        self.seconds.add(now, tau_s, seconds);
        self.squares.add(now, tau_s, seconds * seconds);
    }

    /// The share of the window its prefill was busy with that work, and the mean residual of
    /// those prefills (`E[s^2] / (2 E[s])`, seconds). A replica younger than the window is
    /// measured over its life (the faded window's weight `tau * (1 - exp(-age / tau))`), so
    /// that a fleet that just started does not read idle.
    pub fn busy_and_residual(&self, now: Instant, tau_s: f64) -> (f64, f64) {
        let seconds = self.seconds.at(now, tau_s);
        if seconds <= 0.0 {
            return (0.0, 0.0);
        }
        let tau_s = tau_s.max(f64::MIN_POSITIVE);
        let age = now.saturating_duration_since(self.since).as_secs_f64();
        // At least one second, so that the first prefill of a replica just joined is not a
        // whole replica's worth of work.
        let span = tau_s * (1.0 - (-age.max(1.0) / tau_s).exp());
        (
            seconds / span,
            self.squares.at(now, tau_s) / (2.0 * seconds),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn keys(ids: &[u64]) -> Vec<RouterKey> {
        ids.iter().map(|&k| RouterKey(k)).collect()
    }

    /// Sessions of `turns` turns, one turn of each session every `gap` seconds from `t0`; each
    /// turn's prompt extends its previous one. Returns the continuations seen and the last time.
    fn sessions(
        c: &mut Continuations,
        t0: Instant,
        sessions: u64,
        turns: u64,
        gap: f64,
    ) -> (usize, Instant) {
        let mut prompts: Vec<Vec<u64>> = vec![vec![]; sessions as usize];
        let mut seen = 0;
        let mut now = t0;
        for t in 0..turns {
            now = t0 + Duration::from_secs_f64(t as f64 * gap);
            for (s, prompt) in prompts.iter_mut().enumerate() {
                prompt.push(s as u64 * 1_000 + t);
                if c.observe(&keys(prompt), now) {
                    seen += 1;
                }
            }
        }
        (seen, now)
    }

    #[test]
    fn chains_of_turns_expect_the_turns_after_their_first() {
        // 10 sessions of 5 turns: 4 continuations per start.
        let mut c = Continuations::new(1_000, 1e9);
        let t0 = Instant::now();
        let (seen, end) = sessions(&mut c, t0, 10, 5, 2.0);
        assert_eq!(seen, 40);
        let n = c.expected_successors(end);
        assert!((n - 4.0).abs() < 1e-6, "{n}");
        // Young chains read short: after two turns, one continuation per start.
        let mut young = Continuations::new(1_000, 1e9);
        let (_, end) = sessions(&mut young, t0, 10, 2, 2.0);
        assert!((young.expected_successors(end) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn siblings_under_a_shared_prefix_are_not_continuations() {
        // Members of a group share a prefix (keys 1, 2) and end differently: none continues
        // another's whole prompt.
        let mut c = Continuations::new(1_000, 1e9);
        let t0 = Instant::now();
        for m in 0..20u64 {
            let now = t0 + Duration::from_secs(m);
            assert!(!c.observe(&keys(&[1, 2, 100 + m]), now));
        }
        assert_eq!(c.expected_successors(t0 + Duration::from_secs(20)), 0.0);
        assert_eq!(
            Continuations::new(10, 60.0).expected_successors(t0),
            0.0,
            "nothing seen"
        );
    }

    #[test]
    fn memory_is_bounded_and_forgets_the_oldest() {
        let mut c = Continuations::new(3, 1e9);
        let now = Instant::now();
        for k in 0..10u64 {
            c.observe(&keys(&[k]), now);
        }
        assert_eq!((c.order.len(), c.ends.len()), (3, 3));
        assert!(!c.observe(&keys(&[0, 1000]), now), "forgotten");
        assert!(c.observe(&keys(&[9, 1001]), now), "remembered");
        assert!(!c.observe(&[], now));
    }

    #[test]
    fn counts_fade_with_the_window() {
        let mut c = Continuations::new(1_000, 30.0);
        let t0 = Instant::now();
        let (_, end) = sessions(&mut c, t0, 20, 10, 1.0);
        let chained = c.expected_successors(end + Duration::from_secs(5));
        // Ten minutes of one-off requests later, the chains have faded from the estimate.
        let mut now = end;
        for k in 0..600u64 {
            now = end + Duration::from_secs(k);
            c.observe(&keys(&[1_000_000 + k]), now);
        }
        let late = c.expected_successors(now);
        assert!(chained > 2.0 && late < 0.1, "{chained} {late}");
    }

    #[test]
    fn recent_work_reads_busy_share_and_residual() {
        let now = Instant::now();
        let mut w = RecentWork::since(now - Duration::from_secs(3_600));
        assert_eq!(w.busy_and_residual(now, 60.0), (0.0, 0.0));
        // Prefills of 1 s and 3 s: 4 s over a 1e9 s window; E[s^2] / 2E[s] = (1 + 9) / 8.
        w.add(now, 1e9, 1.0);
        w.add(now, 1e9, 3.0);
        w.add(now, 1e9, f64::NAN);
        w.add(now, 1e9, -1.0);
        let (busy, residual) = w.busy_and_residual(now, 1e9);
        // Over the hour it has been there (a window much longer than its life).
        assert!((busy - 4.0 / 3_600.0).abs() < 1e-6, "{busy}");
        assert!((residual - 1.25).abs() < 1e-12, "{residual}");
        // Over a window shorter than its life: the window.
        let mut w = RecentWork::since(now - Duration::from_secs(3_600));
        w.add(now, 60.0, 6.0);
        let (busy, _) = w.busy_and_residual(now, 60.0);
        assert!((busy - 0.1).abs() < 1e-9, "{busy}");
    }
}
