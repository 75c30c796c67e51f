//! Open-loop replay of a workload: every request is sent at its arrival time (model time divided
//! by the simulator's time scale), whatever happened to the ones before, by a bounded pool of
//! client threads; every response is streamed to time the first token and the gaps between
//! tokens. Loopback only, bounded in concurrency, in time and in bytes read.

use std::io::BufRead;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::spread::Targets;
use super::workloads::{BenchRequest, Workload};
use crate::http;
use crate::supervisor;

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Where to send: one listener, or several gateways' (spread as a Service would).
    pub targets: Targets,
    /// Model name of every request.
    pub model: String,
    /// The simulator's time scale: a model second lasts `1 / time_scale` wall seconds.
    pub time_scale: f64,
    /// Client threads, i.e. requests in flight at most.
    pub concurrency: usize,
    /// Bounds connecting and every read.
    pub io_timeout: Duration,
    /// Requests not sent within this wall time are recorded as not sent.
    pub max_wall: Duration,
    /// How requests are shaped for the router (peer routers may need text prompts, a key, or
    /// another session header).
    pub client: ClientForm,
}

/// How requests are shaped for a router. The default is the benchmark's own form: token-id
/// prompts, the session in `x-session-id`, no other headers.
#[derive(Debug, Clone)]
pub struct ClientForm {
    /// Send prompts as text (each token id one single-token word) instead of token ids.
    pub text: Option<std::sync::Arc<crate::text_vocab::TextVocab>>,
    /// Headers added to every request.
    pub headers: Vec<(String, String)>,
    /// The header carrying the request's session id.
    pub session_header: &'static str,
}

impl Default for ClientForm {
    fn default() -> Self {
        Self {
            text: None,
            headers: Vec::new(),
            session_header: "x-session-id",
        }
    }
}

/// What happened to one request. Times in wall milliseconds unless named `model`.
#[derive(Debug, Clone, Default)]
pub struct RequestOutcome {
    /// Index in the workload.
    pub index: usize,
    /// How late it was sent compared with its arrival time (client pool saturated), wall ms.
    pub send_lag_ms: f64,
    /// Client-side time to first token, wall ms.
    pub ttft_wall_ms: Option<f64>,
    /// The engine's own TTFT (`kvroute_sim.ttft_s`), model ms.
    pub engine_ttft_model_ms: Option<f64>,
    /// The engine's queue time before the request's first step (`kvroute_sim.queue_s`), model ms.
    pub engine_queue_model_ms: Option<f64>,
    /// The engine's time from the first step to the first token (`kvroute_sim.prefill_s`),
    /// model ms.
    pub engine_prefill_model_ms: Option<f64>,
    /// The HTTP port of the replica that served it (`kvroute_sim.port`).
    pub replica_port: Option<u16>,
    /// Mean gap between output tokens seen by the client, wall ms (None with fewer than 2).
    pub itl_wall_ms: Option<f64>,
    /// The engine's mean gap between output tokens, `(e2e_s - ttft_s) / (tokens - 1)`, model ms.
    pub engine_itl_model_ms: Option<f64>,
    /// End-to-end latency, wall ms.
    pub latency_wall_ms: f64,
    /// Output tokens (`usage.completion_tokens`, else token chunks counted).
    pub output_tokens: u64,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// Why it failed.
    pub error: Option<String>,
}

impl RequestOutcome {
    /// TTFT in model time: the engine's TTFT plus the measured overhead of the client, Envoy, the
    /// filter, the indexer and HTTP (which ran at real speed, so it is not multiplied by the
    /// time scale). Without the engine's figure: the client's wall time times the time scale.
    pub fn ttft_model_ms(&self, time_scale: f64) -> Option<f64> {
        let wall = self.ttft_wall_ms?;
        Some(match self.engine_ttft_model_ms {
            Some(engine) => engine + (wall - engine / time_scale).max(0.0),
            None => wall * time_scale,
        })
    }

    /// Mean inter-token latency in model time: the engine's own figure, else the client's wall
    /// gaps times the time scale (coarse: chunks coalesce in buffers at high time scales).
    pub fn itl_model_ms(&self, time_scale: f64) -> Option<f64> {
        self.engine_itl_model_ms
            .or_else(|| self.itl_wall_ms.map(|v| v * time_scale))
    }
}

/// Live counters for a progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests finished.
    pub done: AtomicUsize,
    /// Requests failed.
    pub errors: AtomicUsize,
}

/// Replays `workload`; returns one outcome per request (in workload order) and the wall time from
/// the first arrival to the last response.
pub fn replay(
    cfg: &ReplayConfig,
    workload: &Workload,
    progress: &Progress,
) -> Result<(Vec<RequestOutcome>, Duration)> {
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        bail!("time scale must be > 0");
    }
    let next = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::with_capacity(workload.requests.len()));
    let started = Instant::now();
    let deadline = started + cfg.max_wall;
    thread::scope(|scope| {
        for _ in 0..cfg.concurrency.clamp(1, 1024) {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(request) = workload.requests.get(index) else {
                    break;
                };
                let due =
                    started + Duration::from_secs_f64(request.at_ms / 1000.0 / cfg.time_scale);
                let outcome = if due > deadline {
                    RequestOutcome {
                        index,
                        prompt_tokens: request.num_tokens() as u64,
                        error: Some(format!(
                            "not sent: beyond the run's {} s wall-time limit",
                            cfg.max_wall.as_secs()
                        )),
                        ..RequestOutcome::default()
                    }
                } else if !sleep_until(due) {
                    RequestOutcome {
                        index,
                        error: Some("not sent: interrupted".into()),
                        ..RequestOutcome::default()
                    }
                } else {
                    let lag = Instant::now().saturating_duration_since(due);
                    let mut o = send(cfg, index, request);
                    o.send_lag_ms = ms(lag);
                    o
                };
                progress.done.fetch_add(1, Ordering::Relaxed);
                if outcome.error.is_some() {
                    progress.errors.fetch_add(1, Ordering::Relaxed);
                }
                if let Ok(mut all) = outcomes.lock() {
                    all.push(outcome);
                }
            });
        }
    });
    let wall = started.elapsed();
    let mut all = outcomes.into_inner().unwrap_or_default();
    all.sort_by_key(|o| o.index);
    Ok((all, wall))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Sleeps until `when`; false if interrupted meanwhile.
fn sleep_until(when: Instant) -> bool {
    loop {
        if supervisor::interrupted() {
            return false;
        }
        let now = Instant::now();
        if now >= when {
            return true;
        }
        thread::sleep((when - now).min(Duration::from_millis(50)));
    }
}

/// The `/v1/completions` body of a request (token-id prompt, streamed, usage included).
pub fn completion_body(model: &str, request: &BenchRequest) -> String {
    let tokens = request.tokens();
    let mut prompt = String::with_capacity(tokens.len() * 7 + 2);
    prompt.push('[');
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            prompt.push(',');
        }
        prompt.push_str(&t.to_string());
    }
    prompt.push(']');
    format!(
        "{{\"model\":{},\"prompt\":{prompt},\"max_tokens\":{},\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}",
        Value::from(model),
        request.max_tokens
    )
}

/// The `/v1/completions` body with the prompt as text (see [`ClientForm::text`]).
pub fn text_completion_body(
    model: &str,
    request: &BenchRequest,
    vocab: &crate::text_vocab::TextVocab,
) -> String {
    serde_json::json!({
        "model": model,
        "prompt": vocab.render(&request.tokens()),
        "max_tokens": request.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

fn send(cfg: &ReplayConfig, index: usize, request: &BenchRequest) -> RequestOutcome {
    let body = match &cfg.client.text {
        Some(vocab) => text_completion_body(&cfg.model, request, vocab),
        None => completion_body(&cfg.model, request),
    };
    let mut outcome = RequestOutcome {
        index,
        prompt_tokens: request.num_tokens() as u64,
        ..RequestOutcome::default()
    };
    let started = Instant::now();
    if let Err(e) = stream(cfg, request, &body, started, &mut outcome) {
        outcome.error = Some(format!("{e:#}"));
    }
    outcome.latency_wall_ms = ms(started.elapsed());
    outcome
}

/// What a stream told us, fed one SSE `data:` payload at a time.
#[derive(Debug, Default)]
pub struct StreamTally {
    /// Token chunks seen.
    pub token_chunks: u64,
    /// Seconds since the request was sent, of the first and the last token chunk.
    pub first: Option<f64>,
    /// See `first`.
    pub last: Option<f64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `kvroute_sim.ttft_s` (model seconds).
    pub engine_ttft_s: Option<f64>,
    /// `kvroute_sim.e2e_s` (model seconds).
    pub engine_e2e_s: Option<f64>,
    /// `kvroute_sim.queue_s` (model seconds).
    pub engine_queue_s: Option<f64>,
    /// `kvroute_sim.prefill_s` (model seconds).
    pub engine_prefill_s: Option<f64>,
    /// `kvroute_sim.port`.
    pub replica_port: Option<u16>,
    /// `[DONE]` seen.
    pub done: bool,
}

impl StreamTally {
    /// Takes one `data:` payload received `at` seconds after sending.
    pub fn feed(&mut self, data: &str, at: f64) -> Result<()> {
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value =
            serde_json::from_str(data).with_context(|| format!("bad stream chunk {data:?}"))?;
        if let Some(err) = chunk.get("error") {
            bail!("error in stream: {err}");
        }
        if let Some(choice) = chunk.pointer("/choices/0") {
            if choice.get("finish_reason").is_none_or(Value::is_null) {
                self.token_chunks += 1;
                self.first.get_or_insert(at);
                self.last = Some(at);
            }
        }
        if let Some(sim) = chunk.get("kvroute_sim") {
            self.engine_ttft_s = sim.get("ttft_s").and_then(Value::as_f64);
            self.engine_e2e_s = sim.get("e2e_s").and_then(Value::as_f64);
            self.engine_queue_s = sim.get("queue_s").and_then(Value::as_f64);
            self.engine_prefill_s = sim.get("prefill_s").and_then(Value::as_f64);
            self.replica_port = sim
                .get("port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok());
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.completion_tokens = usage.get("completion_tokens").and_then(Value::as_u64);
            self.cached_tokens = usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64);
        }
        Ok(())
    }
}

fn stream(
    cfg: &ReplayConfig,
    request: &BenchRequest,
    body: &str,
    started: Instant,
    outcome: &mut RequestOutcome,
) -> Result<()> {
    let mut headers: Vec<(&str, &str)> = vec![
        ("content-type", "application/json"),
        ("accept", "text/event-stream"),
        (cfg.client.session_header, request.session.as_str()),
    ];
    headers.extend(
        cfg.client
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str())),
    );
    let mut resp = http::post_ok(
        cfg.targets.pick(outcome.index, &request.session),
        "/v1/completions",
        &headers,
        body.as_bytes(),
        cfg.io_timeout,
    )?;
    let mut tally = StreamTally::default();
    let mut line = String::new();
    // A stream can be long (1,000 tokens), but not unbounded.
    let limit = 64 + 4 * request.max_tokens as usize;
    let mut lines = 0usize;
    loop {
        line.clear();
        let n = resp
            .body()
            .read_line(&mut line)
            .context("reading the event stream")?;
        if n == 0 {
            break;
        }
        lines += 1;
        if lines > limit * 2 {
            bail!(
                "more than {} stream lines for {} tokens",
                limit * 2,
                request.max_tokens
            );
        }
        let Some(data) = line.trim_end().strip_prefix("data:") else {
            continue;
        };
        tally.feed(data.trim(), started.elapsed().as_secs_f64())?;
        if tally.done {
            break;
        }
    }
    if !tally.done {
        bail!("the event stream ended without [DONE]");
    }
    outcome.output_tokens = tally.completion_tokens.unwrap_or(tally.token_chunks);
    outcome.cached_tokens = tally.cached_tokens;
    outcome.engine_ttft_model_ms = tally.engine_ttft_s.map(|s| s * 1000.0);
    outcome.engine_queue_model_ms = tally.engine_queue_s.map(|s| s * 1000.0);
    outcome.engine_prefill_model_ms = tally.engine_prefill_s.map(|s| s * 1000.0);
    outcome.replica_port = tally.replica_port;
    outcome.ttft_wall_ms = tally.first.map(|s| s * 1000.0);
    if let (Some(first), Some(last)) = (tally.first, tally.last) {
        if tally.token_chunks >= 2 {
            outcome.itl_wall_ms = Some((last - first) * 1000.0 / (tally.token_chunks - 1) as f64);
        }
    }
    if let (Some(ttft), Some(e2e)) = (tally.engine_ttft_s, tally.engine_e2e_s) {
        if outcome.output_tokens >= 2 {
            outcome.engine_itl_model_ms =
                Some((e2e - ttft).max(0.0) * 1000.0 / (outcome.output_tokens - 1) as f64);
        }
    }
    if outcome.output_tokens > 0 && outcome.ttft_wall_ms.is_none() {
        bail!("usage reports output tokens but no token chunk arrived");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::workloads::Segment;
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn tally_reads_a_vllm_completion_stream() {
        let mut t = StreamTally::default();
        let chunks = [
            r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"b","logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"text":"","finish_reason":"length"}],"kvroute_sim":{"ttft_s":0.25,"e2e_s":1.0,"queue_s":0.05,"prefill_s":0.2,"port":8001}}"#,
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#,
            "[DONE]",
        ];
        for (i, c) in chunks.iter().enumerate() {
            t.feed(c, i as f64).expect("chunk");
        }
        assert_eq!(t.token_chunks, 3);
        assert_eq!((t.first, t.last), (Some(0.0), Some(2.0)));
        assert_eq!(t.completion_tokens, Some(3));
        assert_eq!(t.cached_tokens, Some(32));
        assert_eq!(t.engine_ttft_s, Some(0.25));
        assert_eq!(t.engine_queue_s, Some(0.05));
        assert_eq!(t.engine_prefill_s, Some(0.2));
        assert_eq!(t.replica_port, Some(8001));
        assert_eq!(t.engine_e2e_s, Some(1.0));
        assert!(t.done);
        assert!(StreamTally::default().feed("{not json", 0.0).is_err());
        assert!(StreamTally::default()
            .feed(r#"{"error":{"message":"x"}}"#, 0.0)
            .is_err());
    }

    #[test]
    fn model_time_ttft_adds_overhead_unscaled() {
        let o = RequestOutcome {
            ttft_wall_ms: Some(30.0),
            engine_ttft_model_ms: Some(200.0),
            itl_wall_ms: Some(1.5),
            ..RequestOutcome::default()
        };
        // Engine part: 200 model ms = 20 wall ms at x10; the other 10 wall ms are overhead.
        assert_eq!(o.ttft_model_ms(10.0), Some(210.0));
        assert_eq!(o.itl_model_ms(10.0), Some(15.0));
        let engine_itl = RequestOutcome {
            engine_itl_model_ms: Some(7.0),
            ..o.clone()
        };
        assert_eq!(
            engine_itl.itl_model_ms(10.0),
            Some(7.0),
            "the engine's figure wins"
        );
        let no_engine = RequestOutcome {
            ttft_wall_ms: Some(30.0),
            ..RequestOutcome::default()
        };
        assert_eq!(no_engine.ttft_model_ms(10.0), Some(300.0));
    }

    #[test]
    fn completion_body_carries_the_token_ids() {
        let r = BenchRequest {
            at_ms: 0.0,
            segments: vec![Segment::new("x", 1, 5)],
            max_tokens: 7,
            session: "s".into(),
        };
        let body: Value = serde_json::from_str(&completion_body("qwen3", &r)).expect("json");
        let prompt: Vec<u32> = body["prompt"]
            .as_array()
            .expect("array")
            .iter()
            .map(|v| v.as_u64().expect("int") as u32)
            .collect();
        assert_eq!(prompt, r.tokens());
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["stream"], true);
    }

    /// A tiny streaming server: answers every connection with a fixed SSE stream.
    fn sse_server(connections: usize) -> (String, thread::JoinHandle<Vec<String>>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let handle = thread::spawn(move || {
            let mut sessions = Vec::new();
            for _ in 0..connections {
                let (mut conn, _) = listener.accept().expect("accept");
                let mut buf = vec![0u8; 1 << 16];
                let mut got = Vec::new();
                // Read headers and the declared body.
                loop {
                    let n = conn.read(&mut buf).expect("read");
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len: usize = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if got.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let text = String::from_utf8_lossy(&got).to_string();
                sessions.push(
                    text.lines()
                        .find_map(|l| l.strip_prefix("x-session-id: "))
                        .unwrap_or("")
                        .to_string(),
                );
                let events = "data: {\"choices\":[{\"index\":0,\"text\":\"x\",\"finish_reason\":null}]}\n\n\
                              data: {\"choices\":[{\"index\":0,\"text\":\"y\",\"finish_reason\":null}]}\n\n\
                              data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}],\"kvroute_sim\":{\"ttft_s\":0.1,\"e2e_s\":0.3}}\n\n\
                              data: {\"choices\":[],\"usage\":{\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
                              data: [DONE]\n\n";
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{events}",
                    events.len()
                );
            }
            sessions
        });
        (addr, handle)
    }

    #[test]
    fn replay_sends_every_request_once_and_reads_the_streams() {
        let (addr, server) = sse_server(3);
        let requests = (0..3)
            .map(|i| BenchRequest {
                at_ms: i as f64 * 100.0,
                segments: vec![Segment::new("r", i, 20)],
                max_tokens: 2,
                session: format!("s{i}"),
            })
            .collect();
        let workload = Workload {
            name: "t".into(),
            rate: None,
            description: String::new(),
            requests,
            notes: Vec::new(),
        };
        let cfg = ReplayConfig {
            targets: Targets::one(addr),
            model: "m".into(),
            time_scale: 10.0,
            concurrency: 2,
            io_timeout: Duration::from_secs(5),
            max_wall: Duration::from_secs(30),
            client: ClientForm::default(),
        };
        let progress = Progress::default();
        let (outcomes, wall) = replay(&cfg, &workload, &progress).expect("replay");
        assert_eq!(outcomes.len(), 3);
        for (i, o) in outcomes.iter().enumerate() {
            assert_eq!(o.index, i);
            assert_eq!(o.error, None);
            assert_eq!(o.output_tokens, 2);
            assert_eq!(o.cached_tokens, Some(16));
            assert_eq!(o.engine_ttft_model_ms, Some(100.0));
            assert!(o.itl_wall_ms.is_some());
            assert!((o.engine_itl_model_ms.unwrap_or(0.0) - 200.0).abs() < 1e-9);
        }
        // Arrivals at 0, 100 and 200 model ms at x10: the last is sent >= 20 wall ms in.
        assert!(wall >= Duration::from_millis(20));
        let mut sessions = server.join().expect("server");
        sessions.sort();
        assert_eq!(sessions, ["s0", "s1", "s2"]);
        assert_eq!(progress.done.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn requests_beyond_the_wall_time_limit_are_not_sent() {
        let workload = Workload {
            name: "t".into(),
            rate: None,
            description: String::new(),
            requests: vec![BenchRequest {
                at_ms: 1e9,
                segments: vec![Segment::new("r", 0, 4)],
                max_tokens: 1,
                session: "s".into(),
            }],
            notes: Vec::new(),
        };
        let cfg = ReplayConfig {
            targets: Targets::one("127.0.0.1:9".into()),
            model: "m".into(),
            time_scale: 1.0,
            concurrency: 1,
            io_timeout: Duration::from_secs(1),
            max_wall: Duration::from_secs(1),
            client: ClientForm::default(),
        };
        let (outcomes, _) = replay(&cfg, &workload, &Progress::default()).expect("replay");
        assert!(outcomes[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("not sent")));
    }
}
