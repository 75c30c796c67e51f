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

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use kvroute_core::peers::SharedPrompt;
use kvroute_core::router_key::RouterKey;

use crate::decayed::Decayed;
use crate::index::IdBuildHasher;

/// Recent prompts' last full blocks, to learn how sessions continue and where they live.
///
/// A request continues an earlier one when its prompt starts with that one's whole prompt: its
/// router keys then include the earlier prompt's last full block's key (block keys chain, so the
/// key names the whole prefix). A request that continues none starts a chain.
///
/// Each remembered prompt is **judged** once it is old enough that a continuation would have
/// come (four mean gaps between a prompt and its continuation: an exponential gap is longer 1.8 %
/// of the time; the window `tau_s` while no gap has been seen): continued or not. Over the
/// window, `p` = continued / (judged + 1) is the chance a request is continued, and a chain's
/// first request expects `n = p / (1 - p)` later ones (a geometric chain; for any mix of chain
/// lengths, requests-weighted, it is the mean number after the first). Judging every prompt at
/// the same age keeps young chains from reading short and a run's late turns (whose chains
/// started long ago) from reading long; the `+ 1` makes the estimate start at 0 and grow with
/// the evidence. The window fades both counts. While a fleet fills up its judged prompts are
/// mostly early turns, all continued, and `p / (1 - p)` runs far past any chain's length (40-47
/// on 4-turn conversations): `n` is capped at the deepest chain seen so far (requests after a
/// chain's first), what the evidence shows at least one chain did.
///
/// A prompt not judged yet and not continued is a **resident session** of the replica it was
/// routed to ([`Continuations::place`]): its blocks and what it will add stay wanted there. Per
/// replica the sums of those are kept, so that the cost model can price what a new session's
/// footprint does to them ([`Continuations::resident`]).
#[derive(Debug)]
pub struct Continuations {
    ends: HashMap<u64, End, IdBuildHasher>,
    /// Remembered prompts, oldest first (the memory bound forgets from the front).
    order: VecDeque<u64>,
    /// Prompts not judged yet, oldest first.
    unjudged: VecDeque<(u64, Instant)>,
    max: usize,
    tau_s: f64,
    judged: Decayed,
    continued: Decayed,
    /// Seconds from a prompt to its continuation (sum and count).
    gap_s: Decayed,
    gaps: Decayed,
    /// Blocks a continuation adds to the prompt it continues (sum and count).
    growth_blocks: Decayed,
    growths: Decayed,
    /// Replica names to their slot in `resident` ([`End::replica`]). A slot with no resident
    /// session is freed when the map reaches [`MAX_REPLICA_SLOTS`] (replicas come and go by name).
    replicas: HashMap<String, u32>,
    /// Per slot: resident sessions and their own blocks ([`End::own`]).
    resident: Vec<Resident>,
    /// The deepest request seen in a chain (requests before it).
    deepest: u32,
}

/// A remembered prompt.
#[derive(Debug, Clone, Copy)]
struct End {
    at: Instant,
    /// Requests before it in its chain (0 for a chain's first).
    depth: u32,
    blocks: u32,
    /// Leading blocks its replica held for others before its session came (a shared system
    /// prompt): counted once there, not once per session.
    shared: u32,
    /// The replica slot and `shared` of the prompt it continues, which it inherits when placed
    /// on the same replica.
    inherited: Option<(u32, u32)>,
    /// Index into [`Continuations::replicas`] once placed.
    replica: Option<u32>,
    continued: bool,
    judged: bool,
}

impl End {
    /// Counted among its replica's resident sessions.
    fn resident(&self) -> Option<u32> {
        self.replica.filter(|_| !self.continued && !self.judged)
    }

    /// The blocks its session holds at its replica beyond what it shares with others there.
    fn own(&self) -> u32 {
        self.blocks.saturating_sub(self.shared)
    }
}

/// Most replica names followed at once (per model).
const MAX_REPLICA_SLOTS: usize = 4_096;

/// Sessions resident on one replica.
#[derive(Debug, Clone, Copy, Default)]
struct Resident {
    sessions: u64,
    blocks: u64,
}

/// What [`Continuations`] expects of sessions now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SessionOutlook {
    /// Chance that a request is continued.
    pub continue_p: f64,
    /// Later requests a chain's first request expects (`p / (1 - p)`).
    pub successors: f64,
    /// Blocks a continuation adds, on average.
    pub growth_blocks: f64,
}

impl SessionOutlook {
    /// KV blocks `sessions` sessions whose prompts are `blocks` long in all will want again on
    /// their replica: their prompts if continued, and what their expected successors add.
    pub fn wanted_blocks(&self, sessions: u64, blocks: u64) -> f64 {
        self.continue_p * blocks as f64 + sessions as f64 * self.successors * self.growth_blocks
    }
}

impl Continuations {
    /// Remembers at most `max` prompts (the oldest forgotten first); counts fade over `tau_s`.
    pub fn new(max: usize, tau_s: f64) -> Self {
        Self {
            ends: HashMap::default(),
            order: VecDeque::new(),
            unjudged: VecDeque::new(),
            max: max.max(1),
            tau_s,
            judged: Decayed::default(),
            continued: Decayed::default(),
            gap_s: Decayed::default(),
            gaps: Decayed::default(),
            growth_blocks: Decayed::default(),
            growths: Decayed::default(),
            replicas: HashMap::new(),
            resident: Vec::new(),
            deepest: 0,
        }
    }

    /// Notes a request whose usable router keys are `keys` at `now`; returns the last key of the
    /// remembered prompt it continues, if any.
    pub fn observe(&mut self, keys: &[RouterKey], now: Instant) -> Option<RouterKey> {
        self.judge_due(now);
        let last = keys.last()?;
        // The prompt it continues is the longest remembered one it starts with.
        let continues = keys
            .iter()
            .rposition(|k| self.ends.contains_key(&k.0))
            .map(|at| keys[at]);
        self.remember(last.0, keys.len(), continues.map(|k| k.0), now);
        continues
    }

    /// Notes a request a peer gateway routed at `now`, from the prompt it shared: as
    /// [`Continuations::observe`], the prompt it continues being the one the peer found (a chain's
    /// first here when that one is not remembered here).
    pub fn observe_peer(&mut self, prompt: &SharedPrompt, now: Instant) {
        self.judge_due(now);
        let continues = prompt.continues.filter(|k| self.ends.contains_key(k));
        self.remember(prompt.last_key, prompt.blocks as usize, continues, now);
    }

    /// Remembers the prompt ending in `last` (`blocks` long, continuing `continues`).
    fn remember(&mut self, last: u64, blocks: usize, continues: Option<u64>, now: Instant) {
        let inherited = continues
            .and_then(|key| self.ends.get(&key))
            .and_then(|end| end.replica.map(|slot| (slot, end.shared)));
        let depth = continues.map_or(0, |key| {
            self.continue_end(key, blocks, now).saturating_add(1)
        });
        self.deepest = self.deepest.max(depth);
        if let std::collections::hash_map::Entry::Vacant(slot) = self.ends.entry(last) {
            slot.insert(End {
                at: now,
                depth,
                blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
                shared: 0,
                inherited,
                replica: None,
                continued: false,
                judged: false,
            });
            self.order.push_back(last);
            self.unjudged.push_back((last, now));
            while self.order.len() > self.max {
                if let Some(old) = self.order.pop_front() {
                    self.forget(old);
                }
            }
        }
    }

    /// Marks the remembered prompt `key` continued by a request of `blocks` blocks at `now`;
    /// returns its depth in its chain.
    fn continue_end(&mut self, key: u64, blocks: usize, now: Instant) -> u32 {
        let tau = self.tau_s;
        let Some(end) = self.ends.get_mut(&key) else {
            return 0;
        };
        let depth = end.depth;
        if end.continued {
            return depth;
        }
        let resident = end.resident();
        end.continued = true;
        let (at, was, own, judged) = (end.at, end.blocks, end.own(), end.judged);
        if judged {
            // Judged ended too early (its gap was longer than the judging age): counted now, so
            // that long gaps do not bias `p` down.
            self.continued.add(now, tau, 1.0);
        }
        self.leave(resident, own);
        self.gap_s
            .add(now, tau, now.saturating_duration_since(at).as_secs_f64());
        self.gaps.add(now, tau, 1.0);
        let grew = (blocks as f64 - f64::from(was)).max(0.0);
        self.growth_blocks.add(now, tau, grew);
        self.growths.add(now, tau, 1.0);
        depth
    }

    /// Counts `replica`'s resident session of `blocks` own blocks as gone.
    fn leave(&mut self, replica: Option<u32>, blocks: u32) {
        if let Some(r) = replica.and_then(|r| self.resident.get_mut(r as usize)) {
            r.sessions = r.sessions.saturating_sub(1);
            r.blocks = r.blocks.saturating_sub(u64::from(blocks));
        }
    }

    /// Forgets a prompt (the memory bound): judged now if it was not.
    fn forget(&mut self, key: u64) {
        if let Some(end) = self.ends.remove(&key) {
            self.leave(end.resident(), end.own());
        }
    }

    /// How old a prompt is when it is judged.
    fn judge_after_s(&self, now: Instant) -> f64 {
        let gaps = self.gaps.at(now, self.tau_s);
        if gaps < 0.5 {
            return self.tau_s;
        }
        (4.0 * self.gap_s.at(now, self.tau_s) / gaps).min(self.tau_s)
    }

    /// Judges the prompts old enough at `now` (and the oldest past the memory bound).
    fn judge_due(&mut self, now: Instant) {
        let after = self.judge_after_s(now);
        let tau = self.tau_s;
        while let Some(&(key, at)) = self.unjudged.front() {
            let young = now.saturating_duration_since(at).as_secs_f64() < after;
            if young && self.unjudged.len() <= self.max {
                break;
            }
            self.unjudged.pop_front();
            let Some(end) = self.ends.get_mut(&key) else {
                continue;
            };
            if end.judged || end.at != at {
                continue;
            }
            let resident = end.resident();
            end.judged = true;
            let (continued, own) = (end.continued, end.own());
            self.leave(resident, own);
            self.judged.add(now, tau, 1.0);
            if continued {
                self.continued.add(now, tau, 1.0);
            }
        }
    }

    /// Records that the request whose last usable key is `key` went to `replica`, which held its
    /// first `cached` blocks: until it is continued or judged, it is one of that replica's
    /// resident sessions. Its footprint there is what it does not share with others: a chain's
    /// first request shares what was cached (a system prompt other sessions brought); a later
    /// one on the same replica shares what its chain's first did, and its own earlier turns
    /// stay its own.
    pub fn place(&mut self, key: RouterKey, replica: &str, cached: u32) {
        let Some(slot) = self.slot(replica) else {
            return;
        };
        let Some(end) = self.ends.get_mut(&key.0) else {
            return;
        };
        if end.replica.is_some() || end.continued || end.judged {
            return;
        }
        end.replica = Some(slot);
        end.shared = match end.inherited {
            Some((from, shared)) if from == slot => shared,
            _ => cached,
        }
        .min(end.blocks);
        let own = u64::from(end.own());
        if let Some(r) = self.resident.get_mut(slot as usize) {
            r.sessions += 1;
            r.blocks += own;
        }
    }

    /// What sessions are expected to do, from the prompts judged over the window.
    pub fn outlook(&self, now: Instant) -> SessionOutlook {
        let judged = self.judged.at(now, self.tau_s);
        let p = (self.continued.at(now, self.tau_s) / (judged + 1.0)).clamp(0.0, 1.0);
        let growths = self.growths.at(now, self.tau_s);
        SessionOutlook {
            continue_p: p,
            successors: (p / (1.0 - p).max(f64::MIN_POSITIVE)).min(f64::from(self.deepest)),
            growth_blocks: if growths > f64::MIN_POSITIVE {
                self.growth_blocks.at(now, self.tau_s) / growths
            } else {
                0.0
            },
        }
    }

    /// Later requests expected to continue a chain's first request (see [`Continuations`]).
    pub fn expected_successors(&self, now: Instant) -> f64 {
        self.outlook(now).successors
    }

    /// `replica`'s resident sessions and their own blocks (their prompts beyond what they share
    /// with the sessions there before them).
    pub fn resident(&self, replica: &str) -> (u64, u64) {
        self.replicas
            .get(replica)
            .and_then(|&i| self.resident.get(i as usize))
            .map_or((0, 0), |r| (r.sessions, r.blocks))
    }

    /// `replica`'s slot, made if new; `None` when every slot holds resident sessions.
    fn slot(&mut self, replica: &str) -> Option<u32> {
        if let Some(&slot) = self.replicas.get(replica) {
            return Some(slot);
        }
        if self.replicas.len() >= MAX_REPLICA_SLOTS {
            // No resident session names a slot with none: its name can go, its slot be reused.
            let resident = &self.resident;
            self.replicas
                .retain(|_, slot| resident.get(*slot as usize).is_some_and(|r| r.sessions > 0));
        }
        let used: HashSet<u32> = self.replicas.values().copied().collect();
        let free = (0..self.resident.len() as u32).find(|s| !used.contains(s));
        if let Some(r) = free.and_then(|s| self.resident.get_mut(s as usize)) {
            *r = Resident::default();
        }
        let slot = free.or_else(|| {
            (self.replicas.len() < MAX_REPLICA_SLOTS).then(|| {
                self.resident.push(Resident::default());
                (self.resident.len() - 1) as u32
            })
        })?;
        self.replicas.insert(replica.to_string(), slot);
        Some(slot)
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
                if c.observe(&keys(prompt), now).is_some() {
                    seen += 1;
                }
            }
        }
        (seen, now)
    }

    /// `sessions` sessions of `turns` turns, one starting every `start_every` s, turns `gap` s
    /// apart, each turn's prompt extending the last: (seconds from the start, prompt) in time
    /// order.
    fn staggered(sessions: u64, turns: u64, start_every: f64, gap: f64) -> Vec<(f64, Vec<u64>)> {
        let mut arrivals: Vec<(f64, Vec<u64>)> = (0..sessions)
            .flat_map(|s| {
                (0..turns).map(move |t| {
                    let prompt = (0..=t).map(|k| s * 1_000 + k).collect();
                    (s as f64 * start_every + t as f64 * gap, prompt)
                })
            })
            .collect();
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
        arrivals
    }

    /// Judges everything remembered: a request with no keys a long time after `at`.
    fn judge_all(c: &mut Continuations, at: Instant) -> Instant {
        let later = at + Duration::from_secs(3_600);
        c.observe(&[], later);
        later
    }

    #[test]
    fn chains_of_turns_expect_the_turns_after_their_first() {
        // 100 sessions of 5 turns: 4 continuations per start, 400 of 500 requests continued.
        let mut c = Continuations::new(10_000, 1e9);
        let t0 = Instant::now();
        let (seen, end) = sessions(&mut c, t0, 100, 5, 2.0);
        assert_eq!(seen, 400);
        let later = judge_all(&mut c, end);
        let o = c.outlook(later);
        // p = 400 / 501, n = p / (1 - p) = 400 / 101.
        // (The window is 1e9 s: an hour fades the counts by 4e-6.)
        assert!((o.successors - 400.0 / 101.0).abs() < 1e-3, "{o:?}");
        assert!((o.continue_p - 400.0 / 501.0).abs() < 1e-3, "{o:?}");
        // Each turn added one block.
        assert!((o.growth_blocks - 1.0).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn young_chains_read_as_long_as_they_have_shown() {
        // 20 sessions of 10 turns, 2 s apart; six turns in, only the prompts older than four
        // gaps (8 s) are judged, and all of them were continued: the chains read as long as the
        // deepest has gone (5 successors), not as long as the average has been so far (2.5).
        let mut c = Continuations::new(10_000, 1e9);
        let t0 = Instant::now();
        let (_, now) = sessions(&mut c, t0, 20, 6, 2.0);
        let n = c.expected_successors(now);
        assert!((n - 5.0).abs() < 1e-9, "{n}");
        // Nothing judged yet: nothing expected.
        let mut fresh = Continuations::new(10_000, 1e9);
        let (_, now) = sessions(&mut fresh, t0, 20, 1, 2.0);
        assert_eq!(fresh.expected_successors(now), 0.0);
    }

    #[test]
    fn short_conversations_starting_together_do_not_read_long() {
        // 4-turn conversations, a new one every 0.5 s, 2.5 s between turns: while the fleet
        // fills, the judged prompts are mostly early turns; `n` stays at the 3 the chains show.
        let mut c = Continuations::new(10_000, 15.0);
        let t0 = Instant::now();
        for (at, prompt) in staggered(60, 4, 0.5, 2.5) {
            let now = t0 + Duration::from_secs_f64(at);
            c.observe(&keys(&prompt), now);
            let n = c.expected_successors(now);
            assert!(n <= 3.0 + 1e-9, "at {at} s: {n}");
        }
    }

    #[test]
    fn sessions_longer_than_the_window_read_their_length_and_not_more_once_starts_stop() {
        // Sessions of 20 turns 4 s apart (76 s each, longer than the 60 s window), one starting
        // every 2 s for 300 s: 19 later turns per start.
        let mut c = Continuations::new(100_000, 60.0);
        let t0 = Instant::now();
        let mut steady = None;
        let mut last = t0;
        for (at, prompt) in staggered(150, 20, 2.0, 4.0) {
            last = t0 + Duration::from_secs_f64(at);
            c.observe(&keys(&prompt), last);
            if at >= 200.0 && steady.is_none() {
                steady = Some(c.expected_successors(last));
            }
        }
        let steady = steady.expect("the run passes 200 s");
        assert!((15.0..=22.0).contains(&steady), "{steady}");
        // Once starts have stopped, the recent continuations are not counted over the few
        // recent starts: the estimate does not grow past the sessions' length.
        for wait in [0, 20, 40, 80] {
            let now = last + Duration::from_secs(wait);
            c.observe(&[], now);
            let n = c.expected_successors(now);
            assert!(n <= 22.0, "{wait} s after the last turn: {n}");
        }
    }

    #[test]
    fn siblings_under_a_shared_prefix_are_not_continuations() {
        // Members of a group share a prefix (keys 1, 2) and end differently: none continues
        // another's whole prompt. With no continuation seen, prompts are judged after the
        // window (60 s).
        let mut c = Continuations::new(1_000, 60.0);
        let t0 = Instant::now();
        for m in 0..20u64 {
            let now = t0 + Duration::from_secs(m);
            assert!(c.observe(&keys(&[1, 2, 100 + m]), now).is_none());
            c.place(RouterKey(100 + m), "a", 0);
        }
        let later = judge_all(&mut c, t0 + Duration::from_secs(20));
        assert_eq!(c.expected_successors(later), 0.0);
        assert_eq!(c.outlook(later).wanted_blocks(20, 60), 0.0);
        assert_eq!(c.resident("a"), (0, 0), "judged: resident no more");
        assert_eq!(
            Continuations::new(10, 60.0).expected_successors(t0),
            0.0,
            "nothing seen"
        );
    }

    #[test]
    fn a_remembered_prompt_stays_within_its_documented_size() {
        // `inflight.max_tracked_prompts` is documented at ~110 bytes a prompt: the entry, its
        // hash-map slot (key and control byte at 7/8 load) and its places in the two queues.
        let entry = std::mem::size_of::<(u64, End)>() + 1;
        let per_prompt =
            entry * 8 / 7 + std::mem::size_of::<u64>() + std::mem::size_of::<(u64, Instant)>();
        assert!(per_prompt <= 110, "{per_prompt} bytes a prompt");
    }

    #[test]
    fn sessions_sharing_a_system_prompt_count_it_once() {
        let mut c = Continuations::new(1_000, 1e9);
        let t0 = Instant::now();
        let system: Vec<u64> = (1..=6).collect();
        let with = |own: &[u64]| -> Vec<u64> { system.iter().chain(own).copied().collect() };
        // The first session brings the system prompt (6 blocks) and 4 of its own: 10 there.
        c.observe(&keys(&with(&[7, 8, 9, 10])), t0);
        c.place(RouterKey(10), "a", 0);
        assert_eq!(c.resident("a"), (1, 10));
        // The second finds the system prompt cached there: only its 3 own blocks count.
        c.observe(&keys(&with(&[20, 21, 22])), t0);
        c.place(RouterKey(22), "a", 6);
        assert_eq!(c.resident("a"), (2, 13));
        // Its next turn there hits its own earlier turn too (9 cached), yet still shares only the
        // system prompt: its footprint is its 5 own blocks.
        let t1 = t0 + Duration::from_secs(1);
        assert!(c.observe(&keys(&with(&[20, 21, 22, 23, 24])), t1).is_some());
        c.place(RouterKey(24), "a", 9);
        assert_eq!(c.resident("a"), (2, 15));
        // Moved to a replica holding nothing of it, the session's whole prompt is its own.
        let t2 = t1 + Duration::from_secs(1);
        assert!(c
            .observe(&keys(&with(&[20, 21, 22, 23, 24, 25, 26])), t2)
            .is_some());
        c.place(RouterKey(26), "b", 0);
        assert_eq!(c.resident("a"), (1, 10));
        assert_eq!(c.resident("b"), (1, 13));
    }

    #[test]
    fn resident_sessions_follow_their_last_turn_until_judged() {
        let mut c = Continuations::new(1_000, 1e9);
        let t0 = Instant::now();
        // Three first turns on "a" (3, 4 and 5 blocks), one on "b".
        for (i, r) in ["a", "a", "a", "b"].iter().enumerate() {
            let i = i as u64;
            let prompt: Vec<u64> = (0..3 + i).map(|k| 100 * (i + 1) + k).collect();
            assert!(c.observe(&keys(&prompt), t0).is_none());
            c.place(RouterKey(*prompt.last().expect("keys")), r, 0);
        }
        assert_eq!(c.resident("a"), (3, 12));
        assert_eq!(c.resident("b"), (1, 6));
        assert_eq!(c.resident("nowhere"), (0, 0));
        // The first session's next turn (two more blocks) goes to "b": it leaves "a".
        let t1 = t0 + Duration::from_secs(1);
        assert!(c.observe(&keys(&[100, 101, 102, 103, 104]), t1).is_some());
        c.place(RouterKey(104), "b", 0);
        assert_eq!(c.resident("a"), (2, 9));
        assert_eq!(c.resident("b"), (2, 11));
        // Placing twice counts once.
        c.place(RouterKey(104), "a", 0);
        assert_eq!(c.resident("b"), (2, 11));
        // A gap of 1 s was seen: four gaps later every prompt is judged, none stays resident.
        c.observe(&[], t1 + Duration::from_secs(5));
        assert_eq!((c.resident("a"), c.resident("b")), ((0, 0), (0, 0)));
    }

    #[test]
    fn a_peer_gateway_s_sessions_count_as_if_placed_here_and_continue_across_gateways() {
        let mut c = Continuations::new(1_000, 1e9);
        let t0 = Instant::now();
        // A peer placed a session's first turn (4 blocks) on "a".
        let first = SharedPrompt {
            last_key: 3,
            blocks: 4,
            continues: None,
        };
        c.observe_peer(&first, t0);
        c.place(RouterKey(first.last_key), "a", 0);
        assert_eq!(c.resident("a"), (1, 4));
        // Its next turn reaches this gateway: a continuation of the peer's prompt, not a chain's
        // first; the session leaves "a" for wherever this turn goes.
        let t1 = t0 + Duration::from_secs(1);
        let turn = keys(&[0, 1, 2, 3, 4, 5]);
        assert_eq!(c.observe(&turn, t1), Some(RouterKey(3)));
        c.place(RouterKey(5), "b", 0);
        assert_eq!((c.resident("a"), c.resident("b")), ((0, 0), (1, 6)));
        // The peer routes the turn after (it found this gateway's prompt, key 5): "b" is left.
        let third = SharedPrompt {
            last_key: 7,
            blocks: 8,
            continues: Some(5),
        };
        c.observe_peer(&third, t1 + Duration::from_secs(1));
        c.place(RouterKey(7), "c", 0);
        assert_eq!((c.resident("b"), c.resident("c")), ((0, 0), (1, 8)));
        // A peer's continuation of a prompt not remembered here starts a chain here.
        let orphan = SharedPrompt {
            last_key: 99,
            blocks: 2,
            continues: Some(98),
        };
        c.observe_peer(&orphan, t1 + Duration::from_secs(1));
        c.place(RouterKey(99), "a", 0);
        assert_eq!(c.resident("a"), (1, 2));
        // Two continuations in a chain of three were seen: the deepest request had two before it.
        assert_eq!(c.deepest, 2);
    }

    #[test]
    fn replica_names_are_bounded_and_a_resident_session_keeps_its_replica() {
        let mut c = Continuations::new(100_000, 1e9);
        let t0 = Instant::now();
        c.observe(&keys(&[1]), t0);
        c.place(RouterKey(1), "kept", 0);
        // Thousands of replicas come and go by name; each session there is continued a second
        // later (so nothing is judged yet: the mean gap is 1 s).
        for i in 0..(MAX_REPLICA_SLOTS as u64 + 1_000) {
            let k = 10 + 2 * i;
            c.observe(&keys(&[k]), t0);
            c.place(RouterKey(k), &format!("r{i}"), 0);
            c.observe(&keys(&[k, k + 1]), t0 + Duration::from_secs(1));
        }
        assert!(
            c.replicas.len() <= MAX_REPLICA_SLOTS,
            "{}",
            c.replicas.len()
        );
        assert!(
            c.resident.len() <= MAX_REPLICA_SLOTS,
            "{}",
            c.resident.len()
        );
        assert_eq!(c.resident("kept"), (1, 1));
    }

    #[test]
    fn memory_is_bounded_and_forgets_the_oldest() {
        let mut c = Continuations::new(3, 1e9);
        let now = Instant::now();
        for k in 0..10u64 {
            c.observe(&keys(&[k]), now);
            c.place(RouterKey(k), "a", 0);
        }
        assert_eq!((c.order.len(), c.ends.len()), (3, 3));
        assert!(c.unjudged.len() <= 4, "{}", c.unjudged.len());
        assert!(c.resident("a").0 <= 3, "{:?}", c.resident("a"));
        assert!(c.observe(&keys(&[0, 1000]), now).is_none(), "forgotten");
        assert!(c.observe(&keys(&[9, 1001]), now).is_some(), "remembered");
        assert!(c.observe(&[], now).is_none());
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
