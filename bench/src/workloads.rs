//! The routing benchmark's workloads, each a fixed list of requests with arrival times in model
//! (simulated) time and prompts made of token ids.
//!
//! A prompt is a list of [`Segment`]s, each a run of token ids drawn from a PRNG seeded by the
//! segment's seed: two prompts share a prefix exactly as far as their segment lists agree, so
//! sharing is decided by the workload's structure and nothing else. Prompts are expanded to token
//! ids only when sent (a Mooncake window holds tens of millions of tokens).
//!
//! * Mooncake (FAST'25) conversation and synthetic traces: each `hash_id` is one 512-token segment
//!   seeded by the id, the last cut to `input_length`; arrival times from the trace.
//! * llm-d's shared-prefix workload: groups sharing a system prompt, each prompt with its own
//!   question, Poisson arrivals at a given rate (the load ladder).
//! * Multi-turn chat: conversations under a few shared system prompts; turn k carries the whole
//!   conversation so far.
//! * No-sharing control: every prompt unique.

use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::chat_traffic::Rng;

/// Token ids are drawn from `0..PROMPT_VOCAB` (below Qwen3's special tokens at 151,643).
pub const PROMPT_VOCAB: u64 = 150_000;
/// Tokens per Mooncake hash id.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// A run of deterministic token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Seeds the PRNG the tokens come from; equal seeds give equal tokens.
    pub seed: u64,
    /// Tokens in the segment.
    pub len: u32,
}

impl Segment {
    /// A segment of `len` tokens in namespace `ns` (a workload-specific tag) with id `id`.
    pub fn new(ns: &str, id: u64, len: u32) -> Self {
        Self {
            seed: seed_of(ns, id),
            len,
        }
    }

    /// Appends this segment's token ids to `out`.
    pub fn push_tokens(&self, out: &mut Vec<u32>) {
        let mut rng = Rng::new(self.seed);
        out.extend((0..self.len).map(|_| rng.below(PROMPT_VOCAB) as u32));
    }
}

/// A stable 64-bit seed from a namespace and an id (FNV-1a over both, then mixed).
pub fn seed_of(ns: &str, id: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in ns.bytes().chain(id.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    Rng::new(h).next_u64()
}

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct BenchRequest {
    /// Arrival time, model (simulated) milliseconds from the start of the run.
    pub at_ms: f64,
    /// The prompt.
    pub segments: Vec<Segment>,
    /// Output tokens asked for.
    pub max_tokens: u32,
    /// The session (conversation, user) it belongs to, sent as `x-session-id`.
    pub session: String,
}

impl BenchRequest {
    /// Prompt length in tokens.
    pub fn num_tokens(&self) -> usize {
        self.segments.iter().map(|s| s.len as usize).sum()
    }

    /// The prompt's token ids.
    pub fn tokens(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_tokens());
        for s in &self.segments {
            s.push_tokens(&mut out);
        }
        out
    }
}

/// A workload ready to replay.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Short name (`shared-prefix`, `mooncake-synthetic`, ...).
    pub name: String,
    /// The load point, for ladders: offered rate in requests per model second.
    pub rate: Option<f64>,
    /// One line on what it is.
    pub description: String,
    /// Requests, sorted by arrival.
    pub requests: Vec<BenchRequest>,
    /// Things the report must say (requests dropped and why, ...).
    pub notes: Vec<String>,
}

impl Workload {
    /// Label of the load point (`4 req/s`, or `trace` for recorded arrivals).
    pub fn load_label(&self) -> String {
        match self.rate {
            Some(r) => format!("{} req/s", trim_float(r)),
            None => "trace".to_string(),
        }
    }

    /// Span of the arrivals, model seconds.
    pub fn span_s(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => (b.at_ms - a.at_ms) / 1000.0,
            _ => 0.0,
        }
    }

    /// Mean offered rate over the span, requests per model second.
    pub fn offered_rate(&self) -> f64 {
        let span = self.span_s();
        if span > 0.0 {
            self.requests.len() as f64 / span
        } else {
            0.0
        }
    }

    /// Total prompt tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.requests.iter().map(BenchRequest::num_tokens).sum()
    }

    /// Sorts the requests by arrival (stable: equal arrivals keep their order).
    pub fn sort(&mut self) {
        self.requests.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    }
}

fn trim_float(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

// ---------------------------------------------------------------------------------------------
// Mooncake

/// The two Mooncake traces shipped in `bench/data/mooncake/`, with their published sha256s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MooncakeTrace {
    /// `conversation_trace.jsonl`.
    Conversation,
    /// `synthetic_trace.jsonl`.
    Synthetic,
}

impl MooncakeTrace {
    /// File name under `bench/data/mooncake/`.
    pub fn file(self) -> &'static str {
        match self {
            Self::Conversation => "conversation_trace.jsonl",
            Self::Synthetic => "synthetic_trace.jsonl",
        }
    }

    /// sha256 published with the trace (kvcache-ai/Mooncake FAST25-release/traces).
    pub fn sha256(self) -> &'static str {
        match self {
            Self::Conversation => {
                "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
            }
            Self::Synthetic => "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
        }
    }

    /// Workload name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Conversation => "mooncake-conversation",
            Self::Synthetic => "mooncake-synthetic",
        }
    }
}

/// One line of a Mooncake trace.
#[derive(Debug, Clone, Deserialize)]
pub struct MooncakeRecord {
    /// Arrival, ms.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// One id per block (and everything before it): 512 tokens in Mooncake's traces.
    pub hash_ids: Vec<u64>,
    /// The session (conversation, agent run) the record belongs to, if the trace says; a string
    /// or a number. Sent as the session header.
    #[serde(default)]
    pub session: Option<serde_json::Value>,
}

impl MooncakeRecord {
    /// The `session` field as a header value (`None` if absent, null or empty).
    pub fn session_id(&self) -> Option<String> {
        match self.session.as_ref()? {
            serde_json::Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }
}

/// Reads a trace file, checking its sha256.
pub fn read_mooncake(dir: &Path, trace: MooncakeTrace) -> Result<Vec<MooncakeRecord>> {
    let path = dir.join(trace.file());
    let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let digest = hex_lower(&Sha256::digest(&bytes));
    if digest != trace.sha256() {
        bail!(
            "{} has sha256 {digest}, expected {} (the file is not the published trace)",
            path.display(),
            trace.sha256()
        );
    }
    parse_mooncake(&String::from_utf8_lossy(&bytes))
        .with_context(|| format!("parsing {}", path.display()))
}

fn hex_lower(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses JSON lines of a Mooncake trace (blank lines skipped).
pub fn parse_mooncake(text: &str) -> Result<Vec<MooncakeRecord>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("line {}: not a trace record", i + 1))
        })
        .collect()
}

/// How to cut a Mooncake trace down to a run.
#[derive(Debug, Clone, Copy)]
pub struct MooncakeWindow {
    /// First record (0-based).
    pub start: usize,
    /// Records at most.
    pub count: usize,
    /// Arrivals are compressed by this factor (2 = twice the trace's rate).
    pub rate_multiplier: f64,
    /// Records with input + output above this are dropped (the engine's max-model-len).
    pub max_model_len: u32,
    /// Output tokens are capped at this.
    pub max_output_tokens: u32,
}

/// Builds a workload from a window of a Mooncake trace: each hash id becomes a 512-token segment
/// seeded by the id, the last cut to `input_length`; arrivals start at 0.
pub fn mooncake(
    trace: MooncakeTrace,
    records: &[MooncakeRecord],
    window: MooncakeWindow,
) -> Result<Workload> {
    let ns = format!("mooncake-{}", trace.name());
    let source = RecordSource {
        name: trace.name(),
        file: trace.file(),
        ns: &ns,
        block_tokens: MOONCAKE_BLOCK_TOKENS,
        sessions_from_trace: false,
    };
    records_workload(&source, records, window)
}

/// Where records come from and how they expand (shipped traces and `--trace` files).
#[derive(Debug, Clone, Copy)]
pub struct RecordSource<'a> {
    /// Workload name.
    pub name: &'a str,
    /// File name, for the description and errors.
    pub file: &'a str,
    /// Seed namespace of the segments.
    pub ns: &'a str,
    /// Tokens per hash id.
    pub block_tokens: u32,
    /// Use each record's `session` field (else every record is its own session, `mc-<index>`).
    pub sessions_from_trace: bool,
}

/// Builds a workload from a window of trace records (see [`mooncake`]). With sessions from the
/// trace, a session's requests keep their file order: a record never arrives before an earlier
/// record of its session.
pub fn records_workload(
    source: &RecordSource<'_>,
    records: &[MooncakeRecord],
    window: MooncakeWindow,
) -> Result<Workload> {
    if !(window.rate_multiplier.is_finite() && window.rate_multiplier > 0.0) {
        bail!("the rate multiplier must be > 0");
    }
    if source.block_tokens == 0 {
        bail!("tokens per hash id must be > 0");
    }
    let end = window.start.saturating_add(window.count).min(records.len());
    let picked = records.get(window.start..end).unwrap_or(&[]);
    if picked.is_empty() {
        bail!(
            "{} has {} records; window starting at {} is empty",
            source.file,
            records.len(),
            window.start
        );
    }
    // The clock starts at the window's earliest record (the first, in a sorted trace).
    let t0 = picked
        .iter()
        .map(|r| r.timestamp)
        .fold(f64::INFINITY, f64::min);
    let mut requests = Vec::with_capacity(picked.len());
    let (mut too_long, mut capped) = (0usize, 0usize);
    let mut session_last: std::collections::HashMap<String, f64> = Default::default();
    for (offset, rec) in picked.iter().enumerate() {
        let index = window.start + offset;
        if rec.input_length == 0 {
            bail!("{} record {index}: input_length 0", source.file);
        }
        if !rec.timestamp.is_finite() {
            bail!("{} record {index}: timestamp is not a number", source.file);
        }
        let max_tokens = rec.output_length.clamp(1, window.max_output_tokens.max(1));
        if max_tokens < rec.output_length {
            capped += 1;
        }
        if rec.input_length.saturating_add(max_tokens) > window.max_model_len {
            too_long += 1;
            continue;
        }
        let mut at_ms = (rec.timestamp - t0) / window.rate_multiplier;
        let session = match rec.session_id().filter(|_| source.sessions_from_trace) {
            Some(id) => {
                let last = session_last.entry(id.clone()).or_insert(at_ms);
                at_ms = at_ms.max(*last);
                *last = at_ms;
                id
            }
            None => format!("mc-{index}"),
        };
        requests.push(BenchRequest {
            at_ms,
            segments: record_segments(source.ns, rec, index as u64, source.block_tokens),
            max_tokens,
            session,
        });
    }
    let mut notes = Vec::new();
    if too_long > 0 {
        notes.push(format!(
            "{too_long} of {} records dropped: input + output above max-model-len {}",
            picked.len(),
            window.max_model_len
        ));
    }
    if capped > 0 {
        notes.push(format!(
            "{capped} records had their output capped at {} tokens",
            window.max_output_tokens
        ));
    }
    let mut w = Workload {
        name: source.name.to_string(),
        rate: None,
        description: format!(
            "Mooncake {} records {}..{} ({} requests), trace arrivals{}",
            source.file,
            window.start,
            end,
            requests.len(),
            if window.rate_multiplier == 1.0 {
                String::new()
            } else {
                format!(" x{} rate", trim_float(window.rate_multiplier))
            }
        ),
        requests,
        notes,
    };
    w.sort();
    if window.rate_multiplier != 1.0 {
        w.rate = Some(w.offered_rate());
    }
    Ok(w)
}

/// The segments of one trace record: one per hash id (`block_tokens` tokens, the last cut to
/// `input_length`); if `input_length` exceeds the blocks, a tail unique to the record.
pub fn record_segments(
    ns: &str,
    rec: &MooncakeRecord,
    index: u64,
    block_tokens: u32,
) -> Vec<Segment> {
    let mut left = rec.input_length;
    let mut out = Vec::with_capacity(rec.hash_ids.len() + 1);
    for &id in &rec.hash_ids {
        if left == 0 {
            break;
        }
        let len = left.min(block_tokens);
        // A cut block is not the block the id stands for: it never repeats, so seed it apart.
        let seg = if len == block_tokens {
            Segment::new(ns, id, len)
        } else {
            Segment::new(&format!("{ns}-tail"), index, len)
        };
        out.push(seg);
        left -= len;
    }
    if left > 0 {
        out.push(Segment::new(&format!("{ns}-extra"), index, left));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Synthetic workloads

/// llm-d's shared-prefix workload (inference-perf `shared_prefix`): `groups` system prompts, each
/// followed by `prompts_per_group` different questions.
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    /// Groups (llm-d: 150).
    pub groups: usize,
    /// Prompts per group (llm-d: 5).
    pub prompts_per_group: usize,
    /// System prompt tokens (llm-d: 6,000).
    pub system_tokens: u32,
    /// Question tokens (llm-d: 1,200).
    pub question_tokens: u32,
    /// Output tokens (llm-d: 1,000).
    pub output_tokens: u32,
    /// Seed of the order and the arrival times.
    pub seed: u64,
}

impl SharedPrefix {
    /// llm-d's published shape.
    pub fn llm_d(seed: u64) -> Self {
        Self {
            groups: 150,
            prompts_per_group: 5,
            system_tokens: 6_000,
            question_tokens: 1_200,
            output_tokens: 1_000,
            seed,
        }
    }

    /// The workload at `rate` requests per model second: prompts in a seeded random order,
    /// Poisson arrivals. Every rate uses the same order and the same unit-rate gaps, scaled.
    pub fn at_rate(&self, rate: f64) -> Result<Workload> {
        let mut rng = Rng::new(self.seed);
        let mut order: Vec<(usize, usize)> = (0..self.groups)
            .flat_map(|g| (0..self.prompts_per_group).map(move |p| (g, p)))
            .collect();
        shuffle(&mut order, &mut rng);
        let arrivals = poisson_arrivals(order.len(), rate, &mut rng)?;
        let requests = order
            .iter()
            .zip(arrivals)
            .map(|(&(g, p), at_ms)| BenchRequest {
                at_ms,
                segments: vec![
                    Segment::new("sp-system", g as u64, self.system_tokens),
                    Segment::new(
                        "sp-question",
                        (g * self.prompts_per_group + p) as u64,
                        self.question_tokens,
                    ),
                ],
                max_tokens: self.output_tokens,
                session: format!("sp-g{g}-p{p}"),
            })
            .collect();
        Ok(Workload {
            name: "shared-prefix".to_string(),
            rate: Some(rate),
            description: format!(
                "llm-d shared prefix: {} groups x {} prompts, {}-token system prompt, {}-token question, {} output tokens, Poisson arrivals",
                self.groups, self.prompts_per_group, self.system_tokens, self.question_tokens, self.output_tokens
            ),
            requests,
            notes: Vec::new(),
        })
    }
}

/// Multi-turn chat: conversations under `system_prompts` shared system prompts; turn k's prompt
/// is the system prompt and every earlier user message and reply, then the new user message.
#[derive(Debug, Clone, Copy)]
pub struct MultiTurn {
    /// Conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts (conversation i uses i % system_prompts).
    pub system_prompts: usize,
    /// System prompt tokens.
    pub system_tokens: u32,
    /// Tokens of each user message.
    pub user_tokens: u32,
    /// Tokens of each reply (asked as max_tokens, and replayed in the next turn's prompt).
    pub reply_tokens: u32,
    /// Model seconds between a turn and the next one of the same conversation.
    pub turn_gap_s: f64,
    /// Seed.
    pub seed: u64,
}

impl MultiTurn {
    /// The workload with conversations starting at `rate` per model second (Poisson).
    pub fn at_rate(&self, rate: f64) -> Result<Workload> {
        let mut rng = Rng::new(self.seed);
        let starts = poisson_arrivals(self.conversations, rate, &mut rng)?;
        let mut requests = Vec::with_capacity(self.conversations * self.turns);
        for (c, start) in starts.into_iter().enumerate() {
            let mut segments = vec![Segment::new(
                "mt-system",
                (c % self.system_prompts.max(1)) as u64,
                self.system_tokens,
            )];
            for t in 0..self.turns {
                let key = (c * self.turns + t) as u64;
                if t > 0 {
                    segments.push(Segment::new("mt-reply", key - 1, self.reply_tokens));
                }
                segments.push(Segment::new("mt-user", key, self.user_tokens));
                requests.push(BenchRequest {
                    at_ms: start + t as f64 * self.turn_gap_s * 1000.0,
                    segments: segments.clone(),
                    max_tokens: self.reply_tokens,
                    session: format!("mt-c{c}"),
                });
            }
        }
        let mut w = Workload {
            name: "multi-turn".to_string(),
            rate: None,
            description: format!(
                "multi-turn chat: {} conversations x {} turns under {} shared {}-token system prompts, {}-token user messages, {}-token replies, {} s between turns",
                self.conversations, self.turns, self.system_prompts, self.system_tokens,
                self.user_tokens, self.reply_tokens, trim_float(self.turn_gap_s)
            ),
            requests,
            notes: vec!["the replies in later prompts are synthetic tokens, not the ones the replica generated: only the prompt part of earlier turns can hit".to_string()],
        };
        w.sort();
        w.rate = Some(w.offered_rate());
        Ok(w)
    }
}

/// The control: every prompt unique, lengths uniform in `min_tokens..=max_tokens`.
#[derive(Debug, Clone, Copy)]
pub struct NoSharing {
    /// Requests.
    pub requests: usize,
    /// Shortest prompt.
    pub min_tokens: u32,
    /// Longest prompt.
    pub max_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// Seed.
    pub seed: u64,
}

impl NoSharing {
    /// The workload at `rate` requests per model second (Poisson).
    pub fn at_rate(&self, rate: f64) -> Result<Workload> {
        if self.min_tokens == 0 || self.max_tokens < self.min_tokens {
            bail!("no-sharing prompt lengths must satisfy 0 < min <= max");
        }
        let mut rng = Rng::new(self.seed);
        let arrivals = poisson_arrivals(self.requests, rate, &mut rng)?;
        let span = u64::from(self.max_tokens - self.min_tokens) + 1;
        let requests = arrivals
            .into_iter()
            .enumerate()
            .map(|(i, at_ms)| BenchRequest {
                at_ms,
                segments: vec![Segment::new(
                    "unique",
                    i as u64,
                    self.min_tokens + rng.below(span) as u32,
                )],
                max_tokens: self.output_tokens,
                session: format!("ns-{i}"),
            })
            .collect();
        Ok(Workload {
            name: "no-sharing".to_string(),
            rate: Some(rate),
            description: format!(
                "no-sharing control: {} unique prompts of {}..{} tokens, {} output tokens, Poisson arrivals",
                self.requests, self.min_tokens, self.max_tokens, self.output_tokens
            ),
            requests,
            notes: Vec::new(),
        })
    }
}

/// `n` Poisson arrival times (ms) at `rate` per second, the first at 0.
fn poisson_arrivals(n: usize, rate: f64, rng: &mut Rng) -> Result<Vec<f64>> {
    if !(rate.is_finite() && rate > 0.0) {
        bail!("arrival rate must be > 0, got {rate}");
    }
    let mut t = 0.0;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if i > 0 {
            // Exponential gap; u in (0, 1].
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / rate * 1000.0;
        }
        out.push(t);
    }
    Ok(out)
}

fn shuffle<T>(items: &mut [T], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// A test workload of `requests` (one a millisecond, each its own session, one output token).
#[cfg(test)]
pub(crate) fn workload_of(requests: Vec<Vec<Segment>>) -> Workload {
    Workload {
        name: "t".into(),
        rate: None,
        description: String::new(),
        requests: requests
            .into_iter()
            .enumerate()
            .map(|(i, segments)| BenchRequest {
                at_ms: i as f64,
                segments,
                max_tokens: 1,
                session: i.to_string(),
            })
            .collect(),
        notes: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_deterministic_and_distinct() {
        let a = Segment::new("x", 1, 64);
        let mut t1 = Vec::new();
        let mut t2 = Vec::new();
        a.push_tokens(&mut t1);
        Segment::new("x", 1, 64).push_tokens(&mut t2);
        assert_eq!(t1, t2);
        assert_eq!(t1.len(), 64);
        assert!(t1.iter().all(|&t| u64::from(t) < PROMPT_VOCAB));
        let mut t3 = Vec::new();
        Segment::new("y", 1, 64).push_tokens(&mut t3);
        assert_ne!(t1, t3, "namespaces must not collide");
        let mut t4 = Vec::new();
        Segment::new("x", 2, 64).push_tokens(&mut t4);
        assert_ne!(t1, t4);
    }

    #[test]
    fn mooncake_records_expand_to_input_length_and_share_by_hash_id() {
        let text = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 2000, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]}

{"timestamp": 4000, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]}"#;
        let recs = parse_mooncake(text).expect("parse");
        assert_eq!(recs.len(), 3);
        let w = mooncake(
            MooncakeTrace::Synthetic,
            &recs,
            MooncakeWindow {
                start: 0,
                count: 10,
                rate_multiplier: 2.0,
                max_model_len: 100_000,
                max_output_tokens: 6,
            },
        )
        .expect("workload");
        let r = &w.requests;
        assert_eq!(r.len(), 3);
        assert_eq!(
            r.iter().map(BenchRequest::num_tokens).collect::<Vec<_>>(),
            [1100, 1024, 600]
        );
        assert_eq!(
            r.iter().map(|q| q.at_ms).collect::<Vec<_>>(),
            [0.0, 1000.0, 2000.0]
        );
        assert_eq!(r[0].max_tokens, 5);
        assert_eq!(r[1].max_tokens, 6, "capped");
        let (t0, t1, t2) = (r[0].tokens(), r[1].tokens(), r[2].tokens());
        assert_eq!(t0[..1024], t1[..], "hash ids 0,1 are the same 1024 tokens");
        assert_eq!(t0[..512], t2[..512]);
        // Record 2's second block is cut (88 tokens): not hash id 9's block, not record 0's.
        assert_ne!(t2[512..600], t0[512..600]);
        assert!(w.notes.iter().any(|n| n.contains("capped")));
    }

    #[test]
    fn mooncake_drops_records_above_max_model_len_and_rejects_bad_windows() {
        let recs = parse_mooncake(
            "{\"timestamp\":0,\"input_length\":2000,\"output_length\":10,\"hash_ids\":[1,2,3,4]}\n\
             {\"timestamp\":5,\"input_length\":10,\"output_length\":10,\"hash_ids\":[1]}",
        )
        .expect("parse");
        let window = MooncakeWindow {
            start: 0,
            count: 2,
            rate_multiplier: 1.0,
            max_model_len: 1000,
            max_output_tokens: 100,
        };
        let w = mooncake(MooncakeTrace::Conversation, &recs, window).expect("workload");
        assert_eq!(w.requests.len(), 1);
        assert!(w.notes[0].contains("1 of 2 records dropped"));
        let empty = MooncakeWindow { start: 5, ..window };
        assert!(mooncake(MooncakeTrace::Conversation, &recs, empty).is_err());
        assert!(parse_mooncake("{\"timestamp\": 1}").is_err());
    }

    #[test]
    fn shipped_traces_match_their_published_sha256() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/data/mooncake");
        let recs = read_mooncake(&dir, MooncakeTrace::Synthetic).expect("synthetic trace");
        assert_eq!(recs.len(), 3993);
        assert!(recs.windows(2).all(|p| p[0].timestamp <= p[1].timestamp));
        let recs = read_mooncake(&dir, MooncakeTrace::Conversation).expect("conversation trace");
        assert_eq!(recs.len(), 12031);
        // Sorted by time (the window's clock starts at its first record).
        assert!(recs.windows(2).all(|p| p[0].timestamp <= p[1].timestamp));
        // Hash ids cover input_length in every record (the expansion relies on it).
        assert!(recs.iter().all(|r| {
            let blocks = r.hash_ids.len() as u32;
            r.input_length <= blocks * MOONCAKE_BLOCK_TOKENS
                && r.input_length > (blocks - 1) * MOONCAKE_BLOCK_TOKENS
        }));
    }

    #[test]
    fn shared_prefix_has_llm_d_shape_and_the_same_order_at_every_rate() {
        let sp = SharedPrefix::llm_d(7);
        let slow = sp.at_rate(2.0).expect("slow");
        let fast = sp.at_rate(8.0).expect("fast");
        assert_eq!(slow.requests.len(), 750);
        assert!(slow
            .requests
            .iter()
            .all(|r| r.num_tokens() == 7_200 && r.max_tokens == 1_000));
        for (a, b) in slow.requests.iter().zip(&fast.requests) {
            assert_eq!(a.segments, b.segments);
            assert!((a.at_ms - 4.0 * b.at_ms).abs() < 1e-6);
        }
        // 150 distinct system prompts, 750 distinct questions.
        let systems: std::collections::HashSet<u64> =
            slow.requests.iter().map(|r| r.segments[0].seed).collect();
        let questions: std::collections::HashSet<u64> =
            slow.requests.iter().map(|r| r.segments[1].seed).collect();
        assert_eq!((systems.len(), questions.len()), (150, 750));
        // Offered rate close to the asked one (750 samples).
        assert!(
            (slow.offered_rate() - 2.0).abs() < 0.3,
            "{}",
            slow.offered_rate()
        );
        assert!(sp.at_rate(0.0).is_err());
    }

    #[test]
    fn multi_turn_prompts_extend_the_previous_turn() {
        let mt = MultiTurn {
            conversations: 3,
            turns: 3,
            system_prompts: 2,
            system_tokens: 100,
            user_tokens: 10,
            reply_tokens: 20,
            turn_gap_s: 5.0,
            seed: 1,
        };
        let w = mt.at_rate(1.0).expect("workload");
        assert_eq!(w.requests.len(), 9);
        let mut conv0: Vec<&BenchRequest> =
            w.requests.iter().filter(|r| r.session == "mt-c0").collect();
        conv0.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
        assert_eq!(
            conv0.iter().map(|r| r.num_tokens()).collect::<Vec<_>>(),
            [110, 140, 170]
        );
        for pair in conv0.windows(2) {
            assert!(pair[1].segments.starts_with(&pair[0].segments));
            assert!((pair[1].at_ms - pair[0].at_ms - 5000.0).abs() < 1e-9);
        }
        assert!(w.requests.windows(2).all(|p| p[0].at_ms <= p[1].at_ms));
    }

    #[test]
    fn no_sharing_prompts_are_unique_and_in_range() {
        let w = NoSharing {
            requests: 50,
            min_tokens: 100,
            max_tokens: 200,
            output_tokens: 8,
            seed: 3,
        }
        .at_rate(5.0)
        .expect("workload");
        let seeds: std::collections::HashSet<u64> =
            w.requests.iter().map(|r| r.segments[0].seed).collect();
        assert_eq!(seeds.len(), 50);
        assert!(w
            .requests
            .iter()
            .all(|r| (100..=200).contains(&r.num_tokens())));
    }
}
