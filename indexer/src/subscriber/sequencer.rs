//! The sequencing of one stream as a pure state machine: which batches to apply, which to drop,
//! when to replay and when to drop the stream's entries. No sockets, no clocks, no index: the
//! driver feeds it [`Input`]s and carries out the [`Action`]s it returns, in order.
//!
//! * Live batch `last + 1`: apply. A seq inside the window the last replay filled: a duplicate.
//!   A seq further on: a gap, replay from `last + 1`. A seq at or below `last` outside that
//!   window: the engine restarted, drop the entries and replay from 0.
//! * (Re)connect with a known last batch: replay from `last` itself; the same engine sends back
//!   the batch we applied (same [`fingerprint`]), a new one does not and the stream starts over.
//! * A replay that fails, or cannot cover the seq it was asked for, drops the entries (when there
//!   was anything to lose), then whatever it returned is applied, then the live batch that
//!   caused it.
//! * While a replay is in flight every other input waits, in arrival order, and is handled after
//!   it as if it came then (as a socket queue would hold it).

use std::collections::VecDeque;

/// FNV-1a 64 of a payload: stable across processes and builds (it goes into snapshots).
pub fn fingerprint(payload: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in payload {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// What happened to the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input<P> {
    /// The stream (re)connected (connect mode), or an engine connected to the bound socket.
    Connected,
    /// A live batch.
    Frame {
        /// Its seq.
        seq: u64,
        /// Its payload.
        payload: P,
    },
    /// One batch of the replay in flight, oldest first.
    ReplayReply {
        /// Its seq.
        seq: u64,
        /// Its payload.
        payload: P,
    },
    /// The replay in flight ended (end marker).
    ReplayEnd,
    /// The replay in flight failed, or the stream has no replay endpoint.
    ReplayFailed,
    /// An engine restart was detected elsewhere (metrics): start over from seq 0.
    RestartDetected,
}

/// Why a batch is not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// A live copy of a batch the last replay applied (counted).
    Duplicate,
    /// A batch at or below the last applied seq, from a replay or right after one.
    Stale,
}

/// Why a replay is requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayCause {
    /// Live seq `to` came after a gap.
    Gap {
        /// The live seq that revealed the gap.
        to: u64,
    },
    /// The sequence went backwards: a new engine's earlier batches.
    Restart,
    /// After a (re)connect: what was missed, or (with a known last batch) the resume check.
    Connect,
    /// The resume check failed: the new engine's whole buffer.
    NewEngine,
    /// [`Input::RestartDetected`].
    Resync,
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<P> {
    /// Decode and apply this batch; it is now the stream's last.
    Apply {
        /// Its seq.
        seq: u64,
        /// Its [`fingerprint`].
        fingerprint: u64,
        /// Its payload.
        payload: P,
    },
    /// Skip this batch.
    Drop {
        /// Its seq.
        seq: u64,
        /// Why.
        why: DropReason,
    },
    /// Clear this stream's index entries and sequence state.
    ResetStream {
        /// Whether anything was known (the reset is counted and logged).
        counted: bool,
        /// Why.
        reason: &'static str,
    },
    /// Ask the replay endpoint for every batch with seq >= `from`; answer with
    /// [`Input::ReplayReply`]s then [`Input::ReplayEnd`], or [`Input::ReplayFailed`]. Always the
    /// last action of a step.
    RequestReplay {
        /// First seq wanted.
        from: u64,
        /// Why.
        cause: ReplayCause,
    },
    /// A live batch held until the replay in flight ends.
    Buffer {
        /// Its seq.
        seq: u64,
    },
}

/// What to do with a live seq, given the stream's sequence state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch: apply it.
    Apply,
    /// Already applied (seen in a replay): skip it.
    Duplicate,
    /// Batches `from..seq` are missing: replay them.
    Gap {
        /// First missing seq.
        from: u64,
    },
    /// The sequence went backwards outside a replay window: the engine restarted.
    Restart,
}

/// An input that waits for the replay in flight.
#[derive(Debug)]
enum Queued<P> {
    Connected,
    Frame(u64, P),
    RestartDetected,
}

#[derive(Debug)]
enum Purpose<P> {
    /// After a reconnect: is the batch at `last` still the one we applied?
    Resume { last: u64, fingerprint: u64 },
    /// Fill from `from`, then apply `live` (the batch that caused the replay) if still new.
    Fill { from: u64, live: Option<(u64, P)> },
}

#[derive(Debug)]
struct Replay<P> {
    purpose: Purpose<P>,
    batches: Vec<(u64, P)>,
}

/// The sequence state of one stream.
#[derive(Debug)]
pub struct Sequencer<P> {
    last: Option<u64>,
    last_fingerprint: Option<u64>,
    /// Seqs `lo..=hi` were applied from a replay; live copies of them are duplicates.
    dup_window: Option<(u64, u64)>,
    replay: Option<Replay<P>>,
    queued: VecDeque<Queued<P>>,
}

impl<P> Default for Sequencer<P> {
    fn default() -> Self {
        Self::resume(None, None)
    }
}

impl<P> Sequencer<P> {
    /// Resumes from a stream's saved state (a snapshot, or nothing).
    pub fn resume(last: Option<u64>, last_fingerprint: Option<u64>) -> Self {
        Self {
            last,
            last_fingerprint,
            dup_window: None,
            replay: None,
            queued: VecDeque::new(),
        }
    }
}

impl<P: AsRef<[u8]>> Sequencer<P> {
    /// Last applied seq.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Whether a replay is in flight.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// Classifies a live seq.
    pub fn classify(&self, seq: u64) -> Verdict {
        let Some(last) = self.last else {
            return Verdict::Apply;
        };
        if seq == last.wrapping_add(1) {
            Verdict::Apply
        } else if seq <= last {
            match self.dup_window {
                Some((lo, hi)) if seq >= lo && seq <= hi => Verdict::Duplicate,
                _ => Verdict::Restart,
            }
        } else {
            Verdict::Gap { from: last + 1 }
        }
    }

    /// The first seq a replay should start from.
    pub fn next_needed(&self) -> u64 {
        self.last.map(|l| l.saturating_add(1)).unwrap_or(0)
    }

    /// Handles one input; returns the actions to carry out, in order.
    pub fn step(&mut self, input: Input<P>) -> Vec<Action<P>> {
        let mut out = Vec::new();
        match input {
            Input::ReplayReply { seq, payload } => {
                if let Some(r) = &mut self.replay {
                    r.batches.push((seq, payload));
                }
            }
            Input::ReplayEnd => self.finish_replay(true, &mut out),
            Input::ReplayFailed => self.finish_replay(false, &mut out),
            Input::Connected => self.handle(Queued::Connected, &mut out),
            Input::RestartDetected => self.handle(Queued::RestartDetected, &mut out),
            Input::Frame { seq, payload } => self.handle(Queued::Frame(seq, payload), &mut out),
        }
        out
    }

    fn handle(&mut self, input: Queued<P>, out: &mut Vec<Action<P>>) {
        if self.replay.is_some() {
            if let Queued::Frame(seq, _) = &input {
                out.push(Action::Buffer { seq: *seq });
            }
            self.queued.push_back(input);
            return;
        }
        match input {
            Queued::Connected => match (self.last, self.last_fingerprint) {
                (Some(last), Some(fingerprint)) => self.request(
                    last,
                    ReplayCause::Connect,
                    Purpose::Resume { last, fingerprint },
                    out,
                ),
                _ => self.fill(self.next_needed(), None, ReplayCause::Connect, out),
            },
            Queued::RestartDetected => {
                self.reset("engine restart detected from metrics", out);
                self.fill(0, None, ReplayCause::Resync, out);
            }
            Queued::Frame(seq, payload) => match self.classify(seq) {
                Verdict::Apply => {
                    self.dup_window = None;
                    self.apply(seq, payload, out);
                }
                Verdict::Duplicate => out.push(Action::Drop {
                    seq,
                    why: DropReason::Duplicate,
                }),
                Verdict::Gap { from } => self.fill(
                    from,
                    Some((seq, payload)),
                    ReplayCause::Gap { to: seq },
                    out,
                ),
                Verdict::Restart => {
                    self.reset("sequence went backwards (engine restart)", out);
                    self.fill(0, Some((seq, payload)), ReplayCause::Restart, out);
                }
            },
        }
    }

    fn request(
        &mut self,
        from: u64,
        cause: ReplayCause,
        purpose: Purpose<P>,
        out: &mut Vec<Action<P>>,
    ) {
        self.replay = Some(Replay {
            purpose,
            batches: Vec::new(),
        });
        out.push(Action::RequestReplay { from, cause });
    }

    fn fill(
        &mut self,
        from: u64,
        live: Option<(u64, P)>,
        cause: ReplayCause,
        out: &mut Vec<Action<P>>,
    ) {
        self.request(from, cause, Purpose::Fill { from, live }, out);
    }

    fn apply(&mut self, seq: u64, payload: P, out: &mut Vec<Action<P>>) {
        let fp = fingerprint(payload.as_ref());
        self.last = Some(seq);
        self.last_fingerprint = Some(fp);
        out.push(Action::Apply {
            seq,
            fingerprint: fp,
            payload,
        });
    }

    fn reset(&mut self, reason: &'static str, out: &mut Vec<Action<P>>) {
        out.push(Action::ResetStream {
            counted: self.last.is_some(),
            reason,
        });
        self.last = None;
        self.last_fingerprint = None;
        self.dup_window = None;
    }

    /// Applies replayed batches newer than the last applied one; they become the duplicate
    /// window.
    fn apply_replayed(&mut self, batches: Vec<(u64, P)>, out: &mut Vec<Action<P>>) {
        let before = self.last;
        let mut applied_any = false;
        for (seq, payload) in batches {
            if self.last.is_some_and(|l| seq <= l) {
                out.push(Action::Drop {
                    seq,
                    why: DropReason::Stale,
                });
                continue;
            }
            self.apply(seq, payload, out);
            applied_any = true;
        }
        if applied_any {
            self.dup_window = Some((
                before.map(|b| b.wrapping_add(1)).unwrap_or(0),
                self.last.unwrap_or(0),
            ));
        }
    }

    fn finish_replay(&mut self, ok: bool, out: &mut Vec<Action<P>>) {
        let Some(replay) = self.replay.take() else {
            return;
        };
        let result = ok.then_some(replay.batches);
        match replay.purpose {
            Purpose::Resume {
                last,
                fingerprint: fp,
            } => {
                let same_engine = result
                    .as_ref()
                    .and_then(|b| b.first())
                    .is_some_and(|(seq, p)| *seq == last && fingerprint(p.as_ref()) == fp);
                if !same_engine {
                    self.reset(
                        "reconnected to a different engine lifetime, or replay cannot resume",
                        out,
                    );
                    self.fill(0, None, ReplayCause::NewEngine, out);
                    return;
                }
                self.apply_replayed(result.unwrap_or_default(), out);
            }
            Purpose::Fill { from, live } => {
                let first = result.as_ref().and_then(|b| b.first()).map(|(s, _)| *s);
                let needs_history = live.is_some() || self.last.is_some();
                let covered = match (&result, first) {
                    (None, _) => false,
                    (Some(_), Some(f)) => f <= from,
                    // Nothing buffered at or after `from`: fine after a reconnect (nothing new),
                    // not when a live batch proves newer ones exist.
                    (Some(_), None) => live.as_ref().map(|(s, _)| *s == from).unwrap_or(true),
                };
                if !covered && needs_history {
                    self.reset("replay cannot cover the missing batches", out);
                }
                self.apply_replayed(result.unwrap_or_default(), out);
                if let Some((seq, payload)) = live {
                    if self.last.is_none_or(|l| seq > l) {
                        self.apply(seq, payload, out);
                    } else {
                        out.push(Action::Drop {
                            seq,
                            why: DropReason::Stale,
                        });
                    }
                }
            }
        }
        while self.replay.is_none() {
            let Some(next) = self.queued.pop_front() else {
                break;
            };
            self.handle(next, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type A = Action<Vec<u8>>;

    fn p(seq: u64) -> Vec<u8> {
        format!("batch {seq}").into_bytes()
    }

    fn frame(seq: u64) -> Input<Vec<u8>> {
        Input::Frame {
            seq,
            payload: p(seq),
        }
    }

    fn reply(seq: u64) -> Input<Vec<u8>> {
        Input::ReplayReply {
            seq,
            payload: p(seq),
        }
    }

    fn apply(seq: u64) -> A {
        Action::Apply {
            seq,
            fingerprint: fingerprint(&p(seq)),
            payload: p(seq),
        }
    }

    fn replay(from: u64, cause: ReplayCause) -> A {
        Action::RequestReplay { from, cause }
    }

    /// Feeds a replay's replies then its end; returns the actions of the end.
    fn replay_returns(s: &mut Sequencer<Vec<u8>>, seqs: impl IntoIterator<Item = u64>) -> Vec<A> {
        for seq in seqs {
            assert_eq!(s.step(reply(seq)), vec![]);
        }
        s.step(Input::ReplayEnd)
    }

    /// A stream that applied 0..=last live after a connect with nothing to replay.
    fn following(last: u64) -> Sequencer<Vec<u8>> {
        let mut s = Sequencer::default();
        assert_eq!(
            s.step(Input::Connected),
            vec![replay(0, ReplayCause::Connect)]
        );
        assert_eq!(replay_returns(&mut s, []), vec![]);
        for seq in 0..=last {
            assert_eq!(s.step(frame(seq)), vec![apply(seq)]);
        }
        s
    }

    #[test]
    fn classify_sequences() {
        let mut s = Sequencer::<Vec<u8>>::default();
        assert_eq!(s.classify(5), Verdict::Apply);
        s.last = Some(5);
        assert_eq!(s.classify(6), Verdict::Apply);
        assert_eq!(s.classify(9), Verdict::Gap { from: 6 });
        assert_eq!(s.classify(3), Verdict::Restart);
        s.dup_window = Some((2, 5));
        assert_eq!(s.classify(3), Verdict::Duplicate);
        assert_eq!(s.classify(1), Verdict::Restart);
        assert_eq!(s.next_needed(), 6);
    }

    #[test]
    fn gap_replays_the_missing_batches_then_the_live_one() {
        let mut s = following(2);
        assert_eq!(
            s.step(frame(6)),
            vec![replay(3, ReplayCause::Gap { to: 6 })]
        );
        assert_eq!(
            replay_returns(&mut s, [3, 4, 5, 6]),
            vec![
                apply(3),
                apply(4),
                apply(5),
                apply(6),
                Action::Drop {
                    seq: 6,
                    why: DropReason::Stale
                }
            ]
        );
        assert_eq!(s.last(), Some(6));
        // Live copies of replayed batches are duplicates; the next one applies.
        assert_eq!(
            s.step(frame(5)),
            vec![Action::Drop {
                seq: 5,
                why: DropReason::Duplicate
            }]
        );
        assert_eq!(s.step(frame(7)), vec![apply(7)]);
        // Applying live closes the window: 5 is now a restart.
        assert_eq!(
            s.step(frame(5)),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "sequence went backwards (engine restart)"
                },
                replay(0, ReplayCause::Restart)
            ]
        );
    }

    #[test]
    fn gap_the_replay_cannot_cover_resets_the_stream() {
        let mut s = following(2);
        assert_eq!(
            s.step(frame(9)),
            vec![replay(3, ReplayCause::Gap { to: 9 })]
        );
        // The buffer rotated: it starts at 5.
        assert_eq!(
            replay_returns(&mut s, [5, 6, 7, 8]),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "replay cannot cover the missing batches"
                },
                apply(5),
                apply(6),
                apply(7),
                apply(8),
                apply(9)
            ]
        );
        // An empty replay cannot cover a gap a live batch proves.
        assert_eq!(
            s.step(frame(12)),
            vec![replay(10, ReplayCause::Gap { to: 12 })]
        );
        assert_eq!(
            replay_returns(&mut s, []),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "replay cannot cover the missing batches"
                },
                apply(12)
            ]
        );
    }

    #[test]
    fn reset_by_sequence_going_backwards_replays_the_new_engine_from_zero() {
        let mut s = following(4);
        assert_eq!(
            s.step(frame(1)),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "sequence went backwards (engine restart)"
                },
                replay(0, ReplayCause::Restart)
            ]
        );
        assert_eq!(s.last(), None);
        assert_eq!(
            replay_returns(&mut s, [0, 1]),
            vec![
                apply(0),
                apply(1),
                Action::Drop {
                    seq: 1,
                    why: DropReason::Stale
                }
            ]
        );
        assert_eq!(s.step(frame(2)), vec![apply(2)]);
    }

    #[test]
    fn replay_failure_falls_back_to_clearing_the_stream() {
        let mut s = following(2);
        assert_eq!(
            s.step(frame(5)),
            vec![replay(3, ReplayCause::Gap { to: 5 })]
        );
        // Replies then a failure (e.g. over replay_max_bytes): none of them is applied.
        assert_eq!(s.step(reply(3)), vec![]);
        assert_eq!(
            s.step(Input::ReplayFailed),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "replay cannot cover the missing batches"
                },
                apply(5)
            ]
        );
        assert_eq!(s.step(frame(6)), vec![apply(6)]);
    }

    #[test]
    fn failed_replay_of_a_fresh_stream_resets_nothing() {
        let mut s = Sequencer::<Vec<u8>>::default();
        assert_eq!(
            s.step(Input::Connected),
            vec![replay(0, ReplayCause::Connect)]
        );
        assert_eq!(s.step(Input::ReplayFailed), vec![]);
        assert_eq!(s.step(frame(3)), vec![apply(3)]);
    }

    #[test]
    fn reconnect_to_the_same_engine_resumes() {
        let mut s = following(3);
        assert_eq!(
            s.step(Input::Connected),
            vec![replay(3, ReplayCause::Connect)]
        );
        assert_eq!(
            replay_returns(&mut s, [3, 4, 5]),
            vec![
                Action::Drop {
                    seq: 3,
                    why: DropReason::Stale
                },
                apply(4),
                apply(5)
            ]
        );
        assert_eq!(
            s.step(frame(5)),
            vec![Action::Drop {
                seq: 5,
                why: DropReason::Duplicate
            }]
        );
        assert_eq!(s.step(frame(6)), vec![apply(6)]);
    }

    #[test]
    fn reconnect_to_a_new_engine_starts_over() {
        let mut s = following(3);
        assert_eq!(
            s.step(Input::Connected),
            vec![replay(3, ReplayCause::Connect)]
        );
        // Seq 3 exists but is another batch: a new engine whose seq passed ours.
        assert_eq!(
            s.step(Input::ReplayReply {
                seq: 3,
                payload: b"other".to_vec()
            }),
            vec![]
        );
        assert_eq!(
            s.step(Input::ReplayEnd),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "reconnected to a different engine lifetime, or replay cannot resume"
                },
                replay(0, ReplayCause::NewEngine)
            ]
        );
        assert_eq!(replay_returns(&mut s, [0, 1]), vec![apply(0), apply(1)]);
        assert_eq!(s.step(frame(2)), vec![apply(2)]);
    }

    #[test]
    fn reconnect_without_replay_clears_the_stream() {
        let mut s = Sequencer::resume(Some(7), Some(fingerprint(&p(7))));
        assert_eq!(
            s.step(Input::Connected),
            vec![replay(7, ReplayCause::Connect)]
        );
        assert_eq!(
            s.step(Input::ReplayFailed),
            vec![
                Action::ResetStream {
                    counted: true,
                    reason: "reconnected to a different engine lifetime, or replay cannot resume"
                },
                replay(0, ReplayCause::NewEngine)
            ]
        );
        // Nothing left to lose: the second failure resets nothing.
        assert_eq!(s.step(Input::ReplayFailed), vec![]);
    }

    #[test]
    fn live_frames_during_a_replay_are_applied_in_order_after_it() {
        let mut s = following(1);
        assert_eq!(
            s.step(frame(4)),
            vec![replay(2, ReplayCause::Gap { to: 4 })]
        );
        for seq in [3, 5, 6, 4] {
            assert_eq!(s.step(frame(seq)), vec![Action::Buffer { seq }]);
        }
        assert_eq!(
            replay_returns(&mut s, [2, 3, 4, 5]),
            vec![
                apply(2),
                apply(3),
                apply(4),
                apply(5),
                Action::Drop {
                    seq: 4,
                    why: DropReason::Stale
                },
                // The held frames, as if read now: 3 and 5 were replayed, 6 is next, then 4
                // is outside the replay window.
                Action::Drop {
                    seq: 3,
                    why: DropReason::Duplicate
                },
                Action::Drop {
                    seq: 5,
                    why: DropReason::Duplicate
                },
                apply(6),
                Action::ResetStream {
                    counted: true,
                    reason: "sequence went backwards (engine restart)"
                },
                replay(0, ReplayCause::Restart)
            ]
        );
        assert!(s.replaying());
    }

    #[test]
    fn held_frames_wait_for_a_replay_started_while_draining() {
        let mut s = following(0);
        assert_eq!(
            s.step(frame(2)),
            vec![replay(1, ReplayCause::Gap { to: 2 })]
        );
        for seq in [5, 6] {
            assert_eq!(s.step(frame(seq)), vec![Action::Buffer { seq }]);
        }
        // 5 reveals a second gap: 6 waits for that replay too.
        assert_eq!(
            replay_returns(&mut s, [1, 2]),
            vec![
                apply(1),
                apply(2),
                Action::Drop {
                    seq: 2,
                    why: DropReason::Stale
                },
                replay(3, ReplayCause::Gap { to: 5 })
            ]
        );
        assert_eq!(
            replay_returns(&mut s, [3, 4]),
            vec![apply(3), apply(4), apply(5), apply(6)]
        );
        assert!(!s.replaying());
    }

    #[test]
    fn restart_detected_elsewhere_starts_over_after_the_replay_in_flight() {
        let mut s = following(2);
        assert_eq!(
            s.step(frame(4)),
            vec![replay(3, ReplayCause::Gap { to: 4 })]
        );
        assert_eq!(s.step(Input::RestartDetected), vec![]);
        assert_eq!(
            replay_returns(&mut s, [3]),
            vec![
                apply(3),
                apply(4),
                Action::ResetStream {
                    counted: true,
                    reason: "engine restart detected from metrics"
                },
                replay(0, ReplayCause::Resync)
            ]
        );
    }

    #[test]
    fn replay_inputs_without_a_replay_are_ignored() {
        let mut s = following(1);
        assert_eq!(s.step(reply(2)), vec![]);
        assert_eq!(s.step(Input::ReplayEnd), vec![]);
        assert_eq!(s.step(Input::ReplayFailed), vec![]);
        assert_eq!(s.step(frame(2)), vec![apply(2)]);
    }
}
