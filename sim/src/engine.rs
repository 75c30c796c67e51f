//! One simulated engine (a data-parallel rank): the scheduler's step loop on tokio.
//!
//! Each iteration takes new requests, schedules a step, sleeps the step's modelled time divided
//! by `--time-scale`, applies the results, publishes the step's KV events (one batch, like vLLM's
//! `update_from_output`) and hands sampled tokens to the HTTP handlers. Latencies are measured
//! on the simulated clock (wall time x time scale), so they come out unscaled. Each step's
//! modelled time is divided by the replica's current speed factor ([`Speed`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::events::EventBatch;
use tokio::sync::{mpsc, oneshot, watch};

use crate::events::{to_kv_events, EventSink};
use crate::latency::{LatencyModel, Speed};
use crate::metrics::{EngineMetrics, FinishedRequest};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::sequence::{ChainHasher, SeqId, SeqMeta, Sequence, SequenceSpec, TokenSource};

/// The simulated clock: wall time since start, multiplied by the time scale.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    start: Instant,
    scale: f64,
}

impl SimClock {
    /// A clock starting now.
    pub fn new(scale: f64) -> Self {
        SimClock {
            start: Instant::now(),
            scale,
        }
    }

    /// Simulated seconds at wall instant `t`.
    pub fn at(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * self.scale
    }

    /// Simulated seconds now.
    pub fn now(&self) -> f64 {
        self.at(Instant::now())
    }

    /// Wall duration of `sim_s` simulated seconds.
    pub fn wall(&self, sim_s: f64) -> Duration {
        Duration::from_secs_f64((sim_s / self.scale).max(0.0))
    }
}

/// A request for the engine.
pub struct NewRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Output tokens to generate.
    pub max_tokens: usize,
    /// The request's hash chain (engine hash + its extra keys).
    pub hasher: Arc<dyn ChainHasher>,
    /// Event metadata.
    pub meta: SeqMeta,
    /// `kv_cache_report_mode: full`.
    pub report_full: bool,
    /// Output token seed.
    pub seed: u64,
    /// When the HTTP server received it.
    pub arrived: Instant,
}

/// What the engine sends back for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqOutput {
    /// A sampled token.
    Token(u32),
    /// The request finished.
    Finished(FinishInfo),
}

/// Per-request results.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishInfo {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens.
    pub completion_tokens: usize,
    /// Prefix-cache hit at admission, tokens (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Time to first token, simulated seconds.
    pub ttft_s: f64,
    /// Waiting before its first step (vLLM's queue time, last queued), simulated seconds.
    pub queue_s: f64,
    /// From its first step to its first token (vLLM's prefill time), simulated seconds.
    pub prefill_s: f64,
    /// End-to-end latency, simulated seconds.
    pub e2e_s: f64,
    /// Times the request was preempted.
    pub preemptions: u32,
    /// Engine rank that served it.
    pub engine: usize,
}

enum Command {
    Add(Box<NewRequest>, mpsc::UnboundedSender<SeqOutput>),
    Reset(oneshot::Sender<bool>),
}

/// The HTTP side's handle to an engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// Live metrics, updated every step.
    pub metrics: Arc<Mutex<EngineMetrics>>,
    in_flight: Arc<AtomicUsize>,
    waiting: Arc<AtomicUsize>,
    /// Data-parallel rank.
    pub rank: usize,
}

/// Why a request could not be handed to the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine loop has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

impl EngineHandle {
    /// Submits a request; its tokens arrive on the returned channel, then `Finished`.
    pub fn submit(
        &self,
        req: NewRequest,
    ) -> Result<mpsc::UnboundedReceiver<SeqOutput>, EngineError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.tx
            .send(Command::Add(Box::new(req), tx))
            .map_err(|_| EngineError::Stopped)?;
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        Ok(rx)
    }

    /// Resets the prefix cache; false while requests hold blocks.
    pub async fn reset_prefix_cache(&self) -> Result<bool, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Reset(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// vLLM's DP load-balancing score: waiting * 4 + running.
    pub fn load_score(&self) -> usize {
        let inflight = self.in_flight.load(Ordering::Relaxed);
        let waiting = self.waiting.load(Ordering::Relaxed).min(inflight);
        waiting * 4 + (inflight - waiting)
    }
}

/// Everything an engine needs.
pub struct EngineConfig {
    /// Rank.
    pub rank: usize,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Cost model at speed 1.
    pub latency: LatencyModel,
    /// The replica's speed factor (shared by its engines and the admin endpoint).
    pub speed: Arc<Speed>,
    /// Longest prompt + output (the token-count histograms' top bucket, as vLLM's).
    pub max_model_len: usize,
    /// Clock.
    pub clock: SimClock,
    /// Event sink (None = events off).
    pub events: Option<EventSink>,
    /// Vocabulary size for output tokens (ordinary tokens only).
    pub vocab: u32,
}

/// Starts an engine; it stops when `shutdown` turns true or every handle is dropped.
pub fn spawn(
    cfg: EngineConfig,
    shutdown: watch::Receiver<bool>,
) -> Result<(EngineHandle, tokio::task::JoinHandle<()>), crate::block_pool::PoolError> {
    let sched = Scheduler::new(cfg.scheduler.clone(), cfg.events.is_some())?;
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = EngineHandle {
        tx,
        metrics: Arc::new(Mutex::new(EngineMetrics {
            cache_blocks: (cfg.scheduler.num_gpu_blocks, cfg.scheduler.block_size),
            ..EngineMetrics::new(cfg.max_model_len)
        })),
        in_flight: Arc::new(AtomicUsize::new(0)),
        waiting: Arc::new(AtomicUsize::new(0)),
        rank: cfg.rank,
    };
    let state = Loop {
        sched,
        cfg,
        rx,
        outputs: HashMap::new(),
        next_id: AtomicU64::new(1),
        metrics: handle.metrics.clone(),
        in_flight: handle.in_flight.clone(),
        waiting: handle.waiting.clone(),
        shutdown,
        deadline: Instant::now(),
    };
    let task = tokio::spawn(state.run());
    Ok((handle, task))
}

struct Loop {
    sched: Scheduler,
    cfg: EngineConfig,
    rx: mpsc::UnboundedReceiver<Command>,
    outputs: HashMap<SeqId, mpsc::UnboundedSender<SeqOutput>>,
    next_id: AtomicU64,
    metrics: Arc<Mutex<EngineMetrics>>,
    in_flight: Arc<AtomicUsize>,
    waiting: Arc<AtomicUsize>,
    shutdown: watch::Receiver<bool>,
    deadline: Instant,
}

/// How far (wall time) the engine may lag its own schedule before the clock snaps forward.
const MAX_LAG: Duration = Duration::from_millis(1);

impl Loop {
    async fn run(mut self) {
        loop {
            if *self.shutdown.borrow() {
                break;
            }
            if !self.sched.has_work() {
                tokio::select! {
                    cmd = self.rx.recv() => match cmd {
                        Some(c) => self.handle(c),
                        None => break,
                    },
                    _ = self.shutdown.changed() => break,
                }
                self.deadline = Instant::now();
            }
            while let Ok(c) = self.rx.try_recv() {
                self.handle(c);
            }
            self.abort_disconnected();
            self.step().await;
        }
        tracing::debug!(rank = self.cfg.rank, "engine stopped");
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add(req, out) => {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let mut seq = Sequence::new(
                    SequenceSpec {
                        id,
                        prompt: req.prompt,
                        max_tokens: req.max_tokens,
                        meta: Arc::new(req.meta),
                        report_full: req.report_full,
                        source: TokenSource::new(req.seed, self.cfg.vocab),
                        arrival_s: self.cfg.clock.at(req.arrived),
                    },
                    self.cfg.scheduler.hash_block_size,
                    req.hasher,
                );
                seq.queued_s = self.cfg.clock.now().max(seq.arrival_s);
                self.outputs.insert(id, out);
                self.sched.add(seq);
            }
            Command::Reset(reply) => {
                let ok = self.sched.reset_prefix_cache();
                let _ = reply.send(ok);
                // vLLM publishes the AllBlocksCleared with its next step; an idle engine here
                // publishes it at once.
                if !self.sched.has_work() {
                    self.publish();
                }
            }
        }
    }

    fn abort_disconnected(&mut self) {
        let gone: Vec<SeqId> = self
            .outputs
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.outputs.remove(&id);
            if self.sched.abort(id) {
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                tracing::debug!(seq = id, "request aborted (client gone)");
            }
        }
    }

    async fn step(&mut self) {
        let waiting_before = self.sched.num_waiting();
        let plan = self.sched.schedule();
        let admitted = waiting_before.saturating_sub(self.sched.num_waiting());
        if admitted > 0 {
            let _ = self
                .waiting
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                    Some(w.saturating_sub(admitted))
                });
        }
        if plan.is_empty() {
            // Nothing fits (should not happen with validated request sizes): publish what the
            // lookups produced and back off briefly instead of spinning.
            self.publish();
            self.update_gauges();
            tokio::time::sleep(Duration::from_millis(1)).await;
            return;
        }
        let dt = self
            .cfg
            .latency
            .scaled(self.cfg.speed.get())
            .step_seconds(&plan.shape);
        let start_s = self.cfg.clock.at(self.deadline);
        self.sched.mark_scheduled(&plan, start_s);
        let now = Instant::now();
        let floor = now.checked_sub(MAX_LAG).unwrap_or(now);
        self.deadline = (self.deadline + self.cfg.clock.wall(dt)).max(floor);
        tokio::time::sleep_until(self.deadline.into()).await;
        let end_s = self.cfg.clock.at(self.deadline);

        let outcome = self.sched.finish_step(plan, end_s);
        self.publish();

        // Metrics first, then the outputs: a client that scrapes right after its response sees
        // its request counted.
        let generated = outcome.sampled.len() as u64;
        let mut finished = Vec::with_capacity(outcome.finished.len());
        let mut infos = Vec::with_capacity(outcome.finished.len());
        for seq in &outcome.finished {
            let first_s = seq.first_token_s.unwrap_or(end_s);
            let last_s = seq.last_token_s.unwrap_or(end_s);
            let scheduled_s = seq.scheduled_s.unwrap_or(first_s);
            let ttft = (first_s - seq.arrival_s).max(0.0);
            let e2e = (end_s - seq.arrival_s).max(0.0);
            let cached_tokens = seq.cached_tokens.unwrap_or(0);
            let queued_s = (scheduled_s - seq.queued_s).max(0.0);
            let prefill_s = (first_s - scheduled_s).max(0.0);
            finished.push(FinishedRequest {
                e2e_s: e2e,
                queued_s,
                prefill_s,
                decode_s: (last_s - first_s).max(0.0),
                inference_s: (last_s - scheduled_s).max(0.0),
                prompt_tokens: seq.num_prompt_tokens,
                generation_tokens: seq.num_output_tokens(),
                cached_tokens,
                preemptions: seq.num_preemptions,
            });
            infos.push((
                seq.id,
                FinishInfo {
                    prompt_tokens: seq.num_prompt_tokens,
                    completion_tokens: seq.num_output_tokens(),
                    cached_tokens,
                    ttft_s: ttft,
                    queue_s: queued_s,
                    prefill_s,
                    e2e_s: e2e,
                    preemptions: seq.num_preemptions,
                    engine: self.cfg.rank,
                },
            ));
        }
        {
            // vLLM's order within one `record` call: first tokens, inter-token gaps, the step's
            // token count, then finished requests.
            let mut g = self.lock_metrics();
            g.steps += 1;
            g.generation_tokens += generated;
            let mut computed = 0u64;
            for p in &outcome.prefills_done {
                g.record_first_token(
                    (end_s - p.arrival_s).max(0.0),
                    p.prompt_tokens,
                    p.cached_tokens,
                );
                computed += p.prompt_tokens.saturating_sub(p.cached_tokens) as u64;
            }
            for itl in outcome.sampled.iter().filter_map(|s| s.itl_s) {
                g.itl.observe(itl);
            }
            if generated > 0 {
                g.iteration_tokens.observe((computed + generated) as f64);
            }
            for r in &finished {
                g.record_finished(r);
            }
        }
        for s in &outcome.sampled {
            if let Some(tx) = self.outputs.get(&s.seq) {
                let _ = tx.send(SeqOutput::Token(s.token));
            }
        }
        for (id, info) in infos {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            if let Some(tx) = self.outputs.remove(&id) {
                let _ = tx.send(SeqOutput::Finished(info));
            }
        }
        self.update_gauges();
    }

    fn publish(&mut self) {
        let pool_events = self.sched.take_events();
        let Some(sink) = &self.cfg.events else {
            return;
        };
        let events = to_kv_events(&pool_events, self.sched.kv().groups());
        if events.is_empty() {
            return;
        }
        let n = events.len() as u64;
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let ok = sink.try_publish(EventBatch {
            ts,
            events,
            data_parallel_rank: Some(self.cfg.rank as i64),
        });
        let mut g = self.lock_metrics();
        if ok {
            g.event_batches += 1;
            g.events += n;
        } else {
            g.event_batches_dropped += 1;
        }
    }

    fn update_gauges(&mut self) {
        let stats = self.sched.stats();
        let (running, waiting, usage, cached) = (
            self.sched.num_running(),
            self.sched.num_waiting(),
            self.sched.kv_usage(),
            self.sched.kv().pool().num_cached_hashes(),
        );
        let mut g = self.lock_metrics();
        g.running = running;
        g.waiting = waiting;
        g.kv_usage = usage;
        g.cached_blocks = cached;
        g.prefix_cache_queries = stats.prefix_cache_queries;
        g.prefix_cache_hits = stats.prefix_cache_hits;
        g.preemptions = stats.preemptions;
    }

    fn lock_metrics(&self) -> std::sync::MutexGuard<'_, EngineMetrics> {
        match self.metrics.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}
