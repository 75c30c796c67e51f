//! Chat workloads and the client that replays them.
//!
//! A workload is a fixed, seeded list of sessions: each belongs to a group that shares one long
//! system prompt (an assistant persona, a RAG document), starts at a planned time, and plays a few
//! user turns one after the other, each turn carrying the conversation so far (with the replies
//! the server actually gave). The same seed gives the same sessions, the same texts and the same
//! start times, so two routing policies can be compared on identical traffic.
//!
//! The client streams every response (SSE) and measures time to first token, end-to-end latency
//! and output tokens, on a pool of worker threads.

use std::collections::VecDeque;
use std::io::BufRead;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvroute_core::rng::{SplitMix64, GOLDEN_GAMMA};
use serde_json::{json, Value};

use crate::http;

/// What traffic to generate.
#[derive(Debug, Clone)]
pub struct ChatWorkload {
    /// Model name sent in every request.
    pub model: String,
    /// Groups, each with its own shared system prompt.
    pub groups: usize,
    /// Sessions (users) per group.
    pub users_per_group: usize,
    /// User turns per session.
    pub turns: usize,
    /// Approximate length of each group's system prompt, in words (~1.3 tokens per word).
    pub system_prompt_words: usize,
    /// Approximate length of each user message, in words.
    pub user_message_words: usize,
    /// `max_tokens` of every request.
    pub max_tokens: usize,
    /// Sessions start over this window, in random order and at random times.
    pub arrival_window: Duration,
    /// Pause between a reply and the session's next turn.
    pub think_time: Duration,
    /// Seed of every random choice.
    pub seed: u64,
}

/// One user's conversation.
#[derive(Debug, Clone)]
pub struct Session {
    /// Stable name, also sent as the `x-session-id` header.
    pub id: String,
    /// When it starts, relative to the start of the run.
    pub start: Duration,
    /// The system prompt.
    pub system: Arc<str>,
    /// The user messages, in order.
    pub user_messages: Vec<String>,
}

impl ChatWorkload {
    /// Every session, ordered by start time.
    pub fn sessions(&self) -> Vec<Session> {
        let mut rng = Rng::new(self.seed);
        let systems: Vec<Arc<str>> = (0..self.groups)
            .map(|g| Arc::from(system_prompt(&mut rng, g, self.system_prompt_words)))
            .collect();
        let window_ms = self.arrival_window.as_millis().max(1) as u64;
        let mut sessions = Vec::with_capacity(self.groups * self.users_per_group);
        for user in 0..self.users_per_group {
            for (group, system) in systems.iter().enumerate() {
                let user_messages = (0..self.turns)
                    .map(|turn| user_message(&mut rng, group, user, turn, self.user_message_words))
                    .collect();
                sessions.push(Session {
                    id: format!("g{group}-u{user}"),
                    start: Duration::from_millis(rng.below(window_ms)),
                    system: Arc::clone(system),
                    user_messages,
                });
            }
        }
        sessions.sort_by_key(|s| s.start);
        sessions
    }

    /// Number of requests the workload sends.
    pub fn total_requests(&self) -> usize {
        self.groups * self.users_per_group * self.turns
    }
}

/// What happened to one request.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// The session it belongs to.
    pub session: String,
    /// Turn index within the session.
    pub turn: usize,
    /// When it was sent, relative to the start of the run.
    pub sent_at: Duration,
    /// Time to the first content token (None if it failed before one arrived).
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub latency: Duration,
    /// Output tokens (the server's `usage.completion_tokens`, else content chunks counted).
    pub output_tokens: u64,
    /// Prompt tokens cached on the replica, when the server reports them.
    pub cached_tokens: Option<u64>,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// Live counters a progress display can read while a run is going.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests finished (ok or not).
    pub done: AtomicUsize,
    /// Requests that failed.
    pub errors: AtomicUsize,
}

/// Where and how to send the requests.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` of the endpoint (Envoy's listener).
    pub addr: String,
    /// Extra headers on every request.
    pub headers: Vec<(String, String)>,
    /// Timeout of connecting and of every read.
    pub io_timeout: Duration,
}

/// Replays `sessions` against `target` with `workers` concurrent clients; `stop` ends it early.
/// Returns every request's record, in completion order, and the run's wall time.
pub fn replay(
    target: &Target,
    workload: &ChatWorkload,
    sessions: Vec<Session>,
    workers: usize,
    progress: &Progress,
    stop: &(dyn Fn() -> bool + Sync),
) -> (Vec<RequestRecord>, Duration) {
    let queue = Mutex::new(VecDeque::from(sessions));
    let records = Mutex::new(Vec::with_capacity(workload.total_requests()));
    let started = Instant::now();
    thread::scope(|scope| {
        for _ in 0..workers.max(1) {
            scope.spawn(|| loop {
                let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some(session) = next else { break };
                if !sleep_until(started + session.start, stop) {
                    break;
                }
                let mut history: Vec<Value> =
                    vec![json!({"role": "system", "content": &*session.system})];
                for (turn, message) in session.user_messages.iter().enumerate() {
                    if turn > 0 && !sleep_until(Instant::now() + workload.think_time, stop) {
                        break;
                    }
                    history.push(json!({"role": "user", "content": message}));
                    let sent_at = started.elapsed();
                    let (record, reply) =
                        chat_turn(target, workload, &session, turn, &history, sent_at);
                    let failed = record.error.is_some();
                    progress.done.fetch_add(1, Ordering::Relaxed);
                    if failed {
                        progress.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Ok(mut all) = records.lock() {
                        all.push(record);
                    }
                    if failed {
                        // A real user would not continue a conversation that broke.
                        let remaining = session.user_messages.len() - turn - 1;
                        progress.done.fetch_add(remaining, Ordering::Relaxed);
                        break;
                    }
                    history.push(json!({"role": "assistant", "content": reply}));
                }
            });
        }
    });
    let wall = started.elapsed();
    (records.into_inner().unwrap_or_default(), wall)
}

/// Sleeps until `when`, waking early (and returning false) if `stop` turns true.
fn sleep_until(when: Instant, stop: &(dyn Fn() -> bool + Sync)) -> bool {
    loop {
        if stop() {
            return false;
        }
        let now = Instant::now();
        if now >= when {
            return true;
        }
        thread::sleep((when - now).min(Duration::from_millis(50)));
    }
}

fn chat_turn(
    target: &Target,
    workload: &ChatWorkload,
    session: &Session,
    turn: usize,
    history: &[Value],
    sent_at: Duration,
) -> (RequestRecord, String) {
    let body = json!({
        "model": workload.model,
        "messages": history,
        "max_tokens": workload.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let started = Instant::now();
    let mut record = RequestRecord {
        session: session.id.clone(),
        turn,
        sent_at,
        ttft: None,
        latency: Duration::ZERO,
        output_tokens: 0,
        cached_tokens: None,
        error: None,
    };
    let mut reply = String::new();
    let result = stream_chat(target, &session.id, &body, started, &mut record, &mut reply);
    record.latency = started.elapsed();
    if let Err(e) = result {
        record.error = Some(format!("{e:#}"));
    }
    (record, reply)
}

fn stream_chat(
    target: &Target,
    session_id: &str,
    body: &str,
    started: Instant,
    record: &mut RequestRecord,
    reply: &mut String,
) -> Result<()> {
    let mut headers: Vec<(&str, &str)> = vec![
        ("content-type", "application/json"),
        ("accept", "text/event-stream"),
        ("x-session-id", session_id),
    ];
    headers.extend(target.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    let mut resp = http::post_ok(
        &target.addr,
        "/v1/chat/completions",
        &headers,
        body.as_bytes(),
        target.io_timeout,
    )?;
    let mut content_chunks = 0u64;
    let mut usage_tokens = None;
    let mut finished = false;
    let mut line = String::new();
    loop {
        line.clear();
        let n = resp
            .body()
            .read_line(&mut line)
            .context("reading the event stream")?;
        if n == 0 {
            break;
        }
        let Some(data) = line.trim_end().strip_prefix("data:") else {
            continue;
        };
        let data = data.trim();
        if data == "[DONE]" {
            finished = true;
            break;
        }
        let chunk: Value =
            serde_json::from_str(data).with_context(|| format!("bad stream chunk {data:?}"))?;
        if let Some(err) = chunk.get("error") {
            bail!("error in stream: {err}");
        }
        let content = chunk
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !content.is_empty() {
            if record.ttft.is_none() {
                record.ttft = Some(started.elapsed());
            }
            content_chunks += 1;
            reply.push_str(content);
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage_tokens = usage.get("completion_tokens").and_then(Value::as_u64);
            record.cached_tokens = usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64);
        }
    }
    if !finished {
        bail!("the event stream ended without [DONE]");
    }
    record.output_tokens = usage_tokens.unwrap_or(content_chunks);
    if record.ttft.is_none() && record.output_tokens > 0 {
        bail!("the stream reported output tokens but carried no content");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Text

/// The workloads' deterministic generator: kvroute-core's SplitMix64 seeded with `seed` mixed
/// with the golden gamma, drawing by modulo (fixed: the same seed must give the same workload).
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed ^ GOLDEN_GAMMA))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

const TOPICS: [&str; 16] = [
    "billing and invoices",
    "a travel booking service",
    "an internal IT help desk",
    "a cooking and recipe site",
    "a legal research assistant",
    "a fitness coaching app",
    "a bank's customer support",
    "a university admissions office",
    "a cloud hosting provider",
    "a car rental company",
    "a medical appointment service",
    "a home insurance company",
    "a video game publisher",
    "a public library",
    "an electronics retailer",
    "a logistics and shipping firm",
];

const WORDS: [&str; 96] = [
    "account",
    "policy",
    "customer",
    "request",
    "service",
    "order",
    "refund",
    "delivery",
    "schedule",
    "document",
    "payment",
    "support",
    "question",
    "answer",
    "process",
    "system",
    "record",
    "update",
    "review",
    "report",
    "detail",
    "option",
    "contract",
    "invoice",
    "address",
    "always",
    "never",
    "carefully",
    "politely",
    "clearly",
    "quickly",
    "briefly",
    "exactly",
    "verify",
    "explain",
    "confirm",
    "describe",
    "mention",
    "include",
    "avoid",
    "offer",
    "check",
    "the",
    "a",
    "of",
    "to",
    "and",
    "for",
    "with",
    "when",
    "if",
    "before",
    "after",
    "every",
    "their",
    "your",
    "this",
    "that",
    "any",
    "each",
    "all",
    "other",
    "same",
    "new",
    "current",
    "previous",
    "monthly",
    "annual",
    "standard",
    "premium",
    "basic",
    "special",
    "local",
    "international",
    "urgent",
    "routine",
    "simple",
    "complex",
    "written",
    "verbal",
    "formal",
    "friendly",
    "accurate",
    "complete",
    "relevant",
    "personal",
    "private",
    "public",
    "secure",
    "available",
    "required",
    "optional",
    "pending",
    "approved",
    "rejected",
    "final",
];

fn sentence(rng: &mut Rng, words: usize) -> String {
    let mut out = String::new();
    for i in 0..words.max(3) {
        if i > 0 {
            out.push(' ');
        }
        let word = rng.pick(&WORDS);
        if i == 0 {
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                out.extend(first.to_uppercase());
                out.push_str(chars.as_str());
            }
        } else {
            out.push_str(word);
        }
    }
    out.push('.');
    out
}

fn system_prompt(rng: &mut Rng, group: usize, words: usize) -> String {
    let topic = TOPICS[group % TOPICS.len()];
    let mut text = format!(
        "You are assistant number {group}, the virtual agent of {topic}. \
         Follow the rules below in every answer.\n\n"
    );
    let mut written = 0;
    let mut rule = 1;
    while written < words {
        let len = 8 + rng.below(12) as usize;
        text.push_str(&format!("Rule {rule}: {}\n", sentence(rng, len)));
        written += len + 2;
        rule += 1;
    }
    text
}

fn user_message(rng: &mut Rng, group: usize, user: usize, turn: usize, words: usize) -> String {
    format!(
        "(user {user} of group {group}, message {turn}) {}",
        sentence(rng, words)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ChatWorkload {
        ChatWorkload {
            model: "m".into(),
            groups: 3,
            users_per_group: 4,
            turns: 2,
            system_prompt_words: 300,
            user_message_words: 20,
            max_tokens: 8,
            arrival_window: Duration::from_secs(10),
            think_time: Duration::ZERO,
            seed: 7,
        }
    }

    #[test]
    fn sessions_are_reproducible_and_share_prompts_within_a_group() {
        let a = small().sessions();
        let b = small().sessions();
        assert_eq!(a.len(), 12);
        assert_eq!(small().total_requests(), 24);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (&x.id, x.start, &x.user_messages),
                (&y.id, y.start, &y.user_messages)
            );
        }
        assert!(a.windows(2).all(|w| w[0].start <= w[1].start));
        assert!(a.iter().all(|s| s.start < Duration::from_secs(10)));
        let group_of = |s: &Session| s.id.split('-').next().map(str::to_string);
        for s in &a {
            let same_group = a.iter().find(|o| group_of(o) == group_of(s));
            assert_eq!(same_group.map(|o| &*o.system), Some(&*s.system));
        }
        let distinct: std::collections::HashSet<&str> = a.iter().map(|s| &*s.system).collect();
        assert_eq!(distinct.len(), 3);
        let words = a[0].system.split_whitespace().count();
        assert!((300..400).contains(&words), "{words} words");
    }

    #[test]
    fn a_different_seed_gives_different_text() {
        let mut other = small();
        other.seed = 8;
        assert_ne!(small().sessions()[0].system, other.sessions()[0].system);
    }
}
