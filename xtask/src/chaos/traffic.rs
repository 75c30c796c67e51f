//! Background traffic for the chaos scenarios: small chat requests that share a few system
//! prompts, sent at a fixed rate through the kvroute listener while a fault is injected, each one's
//! outcome recorded so a scenario can say whether every request was answered.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::chat_traffic::Rng;
use crate::http;

/// Words the prompts are made of (any text works; the tokenizer is real).
const WORDS: &[&str] = &[
    "cache", "replica", "prefix", "block", "token", "router", "engine", "request", "stream",
    "prompt", "batch", "queue", "decode", "prefill", "model", "fleet", "index", "event",
];

/// What one request of the background load came to.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// When it was sent, relative to the start of the load.
    pub sent_at: Duration,
    /// Time to the whole response.
    pub latency: Duration,
    /// The HTTP status, or `None` when no response arrived (connection error, timeout).
    pub status: Option<u16>,
    /// Transport error, when there was no status.
    pub error: Option<String>,
}

/// A running background load; [`Load::stop`] ends it and returns every outcome.
pub struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    workers: Vec<JoinHandle<()>>,
}

/// A chat request body of `group`'s system prompt and a user message unique to `n`.
pub fn chat_body(model: &str, group: u64, n: u64, max_tokens: u32) -> String {
    let mut rng = Rng::new(group.wrapping_mul(7919).wrapping_add(1));
    let system: Vec<&str> = (0..240)
        .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
        .collect();
    let mut rng = Rng::new(n.wrapping_mul(104_729).wrapping_add(group));
    let user: Vec<&str> = (0..12)
        .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
        .collect();
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": format!("group {group}: {}", system.join(" "))},
            {"role": "user", "content": format!("question {n}: {}", user.join(" "))},
        ],
        "max_tokens": max_tokens,
    })
    .to_string()
}

/// Sends one chat request and reads the whole answer.
pub fn send_chat(addr: &str, body: &str, timeout: Duration) -> (Option<u16>, Option<String>) {
    match http::request(
        "POST",
        addr,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
        timeout,
    ) {
        Ok(resp) => {
            let status = resp.status;
            match resp.text(1 << 20) {
                Ok(_) => (Some(status), None),
                Err(e) => (Some(status), Some(format!("{e:#}"))),
            }
        }
        Err(e) => (None, Some(format!("{e:#}"))),
    }
}

impl Load {
    /// Starts `rate` requests per second against `addr` (spread over `workers` client threads;
    /// a worker that falls behind sends late rather than piling up).
    pub fn start(addr: &str, model: &str, rate: f64, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let interval = Duration::from_secs_f64(1.0 / rate.max(0.1));
        let handles = (0..workers.max(1))
            .map(|_| {
                let (stop, outcomes, next) = (stop.clone(), outcomes.clone(), next.clone());
                let (addr, model) = (addr.to_string(), model.to_string());
                thread::spawn(move || loop {
                    let n = next.fetch_add(1, Ordering::Relaxed) as u64;
                    let due = started + interval * n as u32;
                    while Instant::now() < due {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        thread::sleep((due - Instant::now()).min(Duration::from_millis(20)));
                    }
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let body = chat_body(&model, n % 4, n, 8);
                    let sent = Instant::now();
                    let (status, error) = send_chat(&addr, &body, Duration::from_secs(30));
                    let outcome = Outcome {
                        sent_at: sent - started,
                        latency: sent.elapsed(),
                        status,
                        error,
                    };
                    if let Ok(mut all) = outcomes.lock() {
                        all.push(outcome);
                    }
                })
            })
            .collect();
        Self {
            stop,
            outcomes,
            workers: handles,
        }
    }

    /// Requests finished so far.
    pub fn finished(&self) -> usize {
        self.outcomes.lock().map(|o| o.len()).unwrap_or(0)
    }

    /// Stops sending, waits for the requests in flight and returns every outcome by send time.
    pub fn stop(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers {
            let _ = worker.join();
        }
        let mut all = self.outcomes.lock().map(|o| o.clone()).unwrap_or_default();
        all.sort_by_key(|o| o.sent_at);
        all
    }
}

/// Summary figures of a load: requests, answered with 200, other statuses, no answer, p99 ms.
#[derive(Debug, Clone, Default)]
pub struct LoadSummary {
    /// Requests sent.
    pub sent: usize,
    /// Answered 200.
    pub ok: usize,
    /// Answered with another status.
    pub other_status: usize,
    /// No answer at all (connection error or timeout).
    pub unanswered: usize,
    /// Slowest 1 % of answers, ms.
    pub p99_ms: f64,
    /// Slowest answer, ms.
    pub max_ms: f64,
    /// The first failure's error or status, for the report.
    pub first_failure: Option<String>,
}

impl LoadSummary {
    /// Figures over `outcomes`.
    pub fn of(outcomes: &[Outcome]) -> Self {
        let mut latencies: Vec<f64> = outcomes
            .iter()
            .map(|o| o.latency.as_secs_f64() * 1e3)
            .collect();
        latencies.sort_by(f64::total_cmp);
        Self {
            sent: outcomes.len(),
            ok: outcomes.iter().filter(|o| o.status == Some(200)).count(),
            other_status: outcomes
                .iter()
                .filter(|o| o.status.is_some_and(|s| s != 200))
                .count(),
            unanswered: outcomes.iter().filter(|o| o.status.is_none()).count(),
            p99_ms: crate::stats::percentile(&latencies, 99.0).unwrap_or(0.0),
            max_ms: latencies.last().copied().unwrap_or(0.0),
            first_failure: outcomes.iter().find(|o| o.status != Some(200)).map(|o| {
                match (&o.status, &o.error) {
                    (_, Some(e)) => e.clone(),
                    (Some(s), None) => format!("HTTP {s}"),
                    (None, None) => "no answer".to_string(),
                }
            }),
        }
    }

    /// `sent / ok / other / none, p99`, for a report.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{} sent, {} ok, {} other status, {} unanswered, p99 {:.0} ms, max {:.0} ms",
            self.sent, self.ok, self.other_status, self.unanswered, self.p99_ms, self.max_ms
        );
        if let Some(first) = &self.first_failure {
            let first: String = first.chars().take(120).collect();
            text.push_str(&format!(" (first failure: {first})"));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_share_the_system_prompt_of_their_group_only() {
        let system = |body: &str| -> String {
            let v: serde_json::Value = serde_json::from_str(body).expect("json");
            v["messages"][0]["content"]
                .as_str()
                .expect("system")
                .to_string()
        };
        assert_eq!(
            system(&chat_body("m", 1, 5, 8)),
            system(&chat_body("m", 1, 9, 8))
        );
        assert_ne!(
            system(&chat_body("m", 1, 5, 8)),
            system(&chat_body("m", 2, 5, 8))
        );
        assert_ne!(chat_body("m", 1, 5, 8), chat_body("m", 1, 6, 8));
    }

    #[test]
    fn summary_counts_each_kind_of_outcome() {
        let o = |status, ms| Outcome {
            sent_at: Duration::ZERO,
            latency: Duration::from_millis(ms),
            status,
            error: None,
        };
        let s = LoadSummary::of(&[o(Some(200), 10), o(Some(503), 20), o(None, 30)]);
        assert_eq!((s.sent, s.ok, s.other_status, s.unanswered), (3, 1, 1, 1));
        assert_eq!(s.max_ms, 30.0);
    }
}
