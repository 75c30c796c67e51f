//! The `agentic` workload: session-structured coding-agent traffic, generated from a seed.
//!
//! An agent session (SWE-agent style: think, call a tool, read its output, repeat) is a chain of
//! turns over one growing context: a system prompt with the tool definitions (shared by every
//! session using the same agent scaffold), a task (issue text, repository summary), then per turn
//! the assistant's short reply (the tool call) and the tool's output (file contents, test logs,
//! grep results), each appended for the next turn. Nothing is ever dropped from the context, so
//! turn k's prompt starts with turn k-1's whole prompt: the reuse is long, per session, and only
//! the newest tool output is new work.
//!
//! Why these shapes (see [`Agentic::coding_agents`]):
//! * Mooncake's FAST'25 paper publishes a tool & agent trace next to its conversation trace and
//!   describes that traffic as long prompts with heavy prefix reuse and short outputs; this is
//!   the structure generated here. The trace itself (`toolagent_trace.jsonl`) is not shipped;
//!   who has it replays it with `--trace path/toolagent_trace.jsonl`.
//! * SWE-agent-style loops run tens of steps per task (10-40 here), each step's observation a
//!   few hundred to a few thousand tokens (500-4,000), the action a short command or edit
//!   (50-400 tokens), with contexts in the tens of thousands of tokens (capped at 48k here).
//! * The system prompt (tool schemas, instructions: 1.5-4k tokens) is the same for every run of
//!   one scaffold: 4 scaffolds are shared across the sessions; the task adds 0.5-4k of its own.
//! * Between a turn and the next, the tool runs and the agent framework acts: modelled as an
//!   exponential think time (mean 10 model s) after the turn's estimated completion. The replay
//!   client sends on a fixed schedule, so the next turn arrives at previous arrival + estimated
//!   service time (new prompt tokens at 30k tokens/s + 8 ms per output token, an idle replica's
//!   pace) + think time.
//! * Sessions start spread over the first 240 model s (Poisson), so many run at once (48 over
//!   the run for 4 replicas).

use anyhow::{bail, Result};

use super::workloads::{seed_of, BenchRequest, Segment, Workload};
use crate::chat_traffic::Rng;

/// The generator's parameters (ranges are inclusive, drawn uniformly).
#[derive(Debug, Clone, Copy)]
pub struct Agentic {
    /// Sessions over the run.
    pub sessions: usize,
    /// Distinct system prompts (agent scaffolds); session i uses one drawn at random.
    pub scaffolds: usize,
    /// Tokens of a scaffold's system prompt.
    pub system_tokens: (u32, u32),
    /// Tokens of a session's task.
    pub task_tokens: (u32, u32),
    /// Turns of a session (fewer if the context cap is reached).
    pub turns: (u32, u32),
    /// Tokens of one tool output.
    pub tool_tokens: (u32, u32),
    /// Tokens of one assistant reply (asked as max_tokens, replayed in the next prompt).
    pub reply_tokens: (u32, u32),
    /// No prompt plus reply grows beyond this.
    pub max_context_tokens: u32,
    /// Mean think time between a turn's estimated completion and the next turn, model s.
    pub think_mean_s: f64,
    /// Mean gap between session starts, model s.
    pub start_gap_s: f64,
    /// Prefill rate assumed when estimating a turn's completion, tokens per model s.
    pub est_prefill_tokens_per_s: f64,
    /// Decode time assumed per output token, model ms.
    pub est_ms_per_output_token: f64,
    /// Seed.
    pub seed: u64,
}

impl Agentic {
    /// The shape described in the module docs, with `sessions` sessions starting over ~240
    /// model s.
    pub fn coding_agents(sessions: usize, seed: u64) -> Self {
        Self {
            sessions,
            scaffolds: 4,
            system_tokens: (1_500, 4_000),
            task_tokens: (500, 4_000),
            turns: (10, 40),
            tool_tokens: (500, 4_000),
            reply_tokens: (50, 400),
            max_context_tokens: 48_000,
            think_mean_s: 10.0,
            // Starts spread over ~240 model s whatever the count: more sessions, more at once.
            start_gap_s: 240.0 / sessions.max(1) as f64,
            est_prefill_tokens_per_s: 30_000.0,
            est_ms_per_output_token: 8.0,
            seed,
        }
    }

    /// Generates the workload.
    pub fn build(&self) -> Result<Workload> {
        let ranges = [
            self.system_tokens,
            self.task_tokens,
            self.turns,
            self.tool_tokens,
            self.reply_tokens,
        ];
        if self.sessions == 0 || self.scaffolds == 0 || ranges.iter().any(|r| r.0 == 0 || r.1 < r.0)
        {
            bail!("agentic: sessions, scaffolds and every range must be > 0 with min <= max");
        }
        let positive = [
            self.think_mean_s,
            self.start_gap_s,
            self.est_prefill_tokens_per_s,
            self.est_ms_per_output_token,
        ];
        if positive.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
            bail!("agentic: times and rates must be > 0");
        }
        let mut rng = Rng::new(seed_of("agentic", self.seed));
        let scaffold_len: Vec<u32> = (0..self.scaffolds)
            .map(|_| draw(&mut rng, self.system_tokens))
            .collect();
        let mut start_ms = 0.0;
        let mut requests = Vec::new();
        let mut capped = 0usize;
        for s in 0..self.sessions {
            if s > 0 {
                start_ms += exponential(&mut rng, self.start_gap_s) * 1000.0;
            }
            let mut r = Rng::new(seed_of(&format!("agentic-{}", self.seed), s as u64));
            let scaffold = r.below(self.scaffolds as u64) as usize;
            let mut segments = vec![
                Segment::new("ag-system", scaffold as u64, scaffold_len[scaffold]),
                Segment::new("ag-task", s as u64, draw(&mut r, self.task_tokens)),
            ];
            let turns = draw(&mut r, self.turns);
            let mut at_ms = start_ms;
            let mut new_tokens = segments.iter().map(|g| g.len).sum::<u32>();
            for t in 0..turns {
                let key = (s as u64) << 16 | u64::from(t);
                let reply = draw(&mut r, self.reply_tokens);
                if t > 0 {
                    let tool = draw(&mut r, self.tool_tokens);
                    let context: u32 = segments.iter().map(|g| g.len).sum();
                    if context + tool + reply > self.max_context_tokens {
                        capped += 1;
                        break;
                    }
                    segments.push(Segment::new("ag-tool", key, tool));
                    new_tokens += tool;
                }
                requests.push(BenchRequest {
                    at_ms,
                    segments: segments.clone(),
                    max_tokens: reply,
                    session: format!("ag-s{s}"),
                });
                let service_ms = f64::from(new_tokens) * 1000.0 / self.est_prefill_tokens_per_s
                    + f64::from(reply) * self.est_ms_per_output_token;
                at_ms += service_ms + exponential(&mut r, self.think_mean_s) * 1000.0;
                // The reply joins the context; the next turn's new work is it plus a tool output.
                segments.push(Segment::new("ag-reply", key, reply));
                new_tokens = reply;
            }
        }
        let mut w = Workload {
            name: "agentic".to_string(),
            rate: None,
            description: format!(
                "agentic coding sessions: {} sessions under {} shared {}..{}-token system prompts, {}..{}-token tasks, {}..{} turns each adding a {}..{}-token tool output and a {}..{}-token reply (context up to {}k), think time exponential mean {} s, sessions starting every {:.1} s on average (Poisson)",
                self.sessions,
                self.scaffolds,
                self.system_tokens.0,
                self.system_tokens.1,
                self.task_tokens.0,
                self.task_tokens.1,
                self.turns.0,
                self.turns.1,
                self.tool_tokens.0,
                self.tool_tokens.1,
                self.reply_tokens.0,
                self.reply_tokens.1,
                self.max_context_tokens / 1000,
                self.think_mean_s,
                self.start_gap_s
            ),
            requests,
            notes: vec![
                "the replies in later prompts are synthetic tokens, not the ones the replica generated: only the prompt part of earlier turns can hit".to_string(),
            ],
        };
        if capped > 0 {
            w.notes.push(format!(
                "{capped} of {} sessions stopped early at the {}-token context cap",
                self.sessions, self.max_context_tokens
            ));
        }
        w.sort();
        w.rate = Some(w.offered_rate());
        Ok(w)
    }
}

/// Uniform in `lo..=hi`.
fn draw(rng: &mut Rng, (lo, hi): (u32, u32)) -> u32 {
    lo + rng.below(u64::from(hi - lo) + 1) as u32
}

/// Exponential with mean `mean`.
fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    -(1.0 - u).ln() * mean
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashSet};

    fn by_session(w: &Workload) -> BTreeMap<String, Vec<&BenchRequest>> {
        let mut out: BTreeMap<String, Vec<&BenchRequest>> = BTreeMap::new();
        for r in &w.requests {
            out.entry(r.session.clone()).or_default().push(r);
        }
        out
    }

    #[test]
    fn the_same_seed_gives_the_same_workload() {
        let a = Agentic::coding_agents(12, 3).build().expect("a");
        let b = Agentic::coding_agents(12, 3).build().expect("b");
        assert_eq!(a.requests.len(), b.requests.len());
        for (x, y) in a.requests.iter().zip(&b.requests) {
            assert_eq!(
                (x.at_ms, &x.segments, x.max_tokens),
                (y.at_ms, &y.segments, y.max_tokens)
            );
            assert_eq!(x.session, y.session);
        }
        let c = Agentic::coding_agents(12, 4).build().expect("c");
        assert_ne!(
            a.requests.iter().map(|r| r.at_ms).collect::<Vec<_>>(),
            c.requests.iter().map(|r| r.at_ms).collect::<Vec<_>>()
        );
    }

    #[test]
    fn sessions_grow_their_context_in_order_and_share_scaffolds() {
        let p = Agentic::coding_agents(48, 1);
        let w = p.build().expect("workload");
        let sessions = by_session(&w);
        assert_eq!(sessions.len(), 48);
        assert!(w.requests.windows(2).all(|q| q[0].at_ms <= q[1].at_ms));
        for (id, turns) in &sessions {
            assert!(id.starts_with("ag-s"));
            assert!(
                !turns.is_empty() && turns.len() <= 40,
                "{id}: {}",
                turns.len()
            );
            let first = turns[0].num_tokens() as u32;
            assert!((2_000..=8_000).contains(&first), "{id}: {first}");
            for pair in turns.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                // Arrivals in turn order, at least the think-free service time apart.
                assert!(b.at_ms > a.at_ms);
                // The next prompt is this one + its reply + a tool output.
                assert!(b.segments.starts_with(&a.segments));
                assert_eq!(b.segments.len(), a.segments.len() + 2);
                let grown = b.num_tokens() - a.num_tokens();
                assert_eq!(b.segments[a.segments.len()].len, a.max_tokens);
                assert!((550..=4_400).contains(&grown), "{id}: +{grown}");
            }
            let last = turns[turns.len() - 1];
            assert!(last.num_tokens() as u32 + last.max_tokens <= p.max_context_tokens);
        }
        // Most sessions run 10+ turns; the cap stops some long ones.
        let long = sessions.values().filter(|t| t.len() >= 10).count();
        assert!(long >= 40, "{long}");
        // Fewer distinct system prompts than sessions: scaffolds are shared.
        let systems: HashSet<u64> = w.requests.iter().map(|r| r.segments[0].seed).collect();
        assert!(systems.len() > 1 && systems.len() <= 4, "{}", systems.len());
        // Many sessions at once: at the median arrival, several are between first and last turn.
        let mid = w.requests[w.requests.len() / 2].at_ms;
        let live = sessions
            .values()
            .filter(|t| t[0].at_ms <= mid && mid <= t[t.len() - 1].at_ms)
            .count();
        assert!(live >= 10, "{live} sessions live at the median arrival");
    }

    #[test]
    fn more_sessions_start_in_the_same_window() {
        let first_turns = |n: usize| -> f64 {
            let w = Agentic::coding_agents(n, 2).build().expect("workload");
            by_session(&w)
                .values()
                .map(|t| t[0].at_ms)
                .fold(0.0, f64::max)
        };
        // Poisson starts: the last of n starts lands near 240 s for any n.
        let (few, many) = (first_turns(48), first_turns(96));
        assert!((150_000.0..350_000.0).contains(&few), "{few}");
        assert!((150_000.0..350_000.0).contains(&many), "{many}");
    }

    #[test]
    fn bad_parameters_are_refused() {
        let mut p = Agentic::coding_agents(4, 1);
        p.turns = (5, 2);
        assert!(p.build().is_err());
        let mut p = Agentic::coding_agents(0, 1);
        assert!(p.build().is_err());
        p.sessions = 2;
        p.think_mean_s = 0.0;
        assert!(p.build().is_err());
    }
}
