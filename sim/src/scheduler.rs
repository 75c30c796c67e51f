//! vLLM's v1 scheduler (vllm/v1/core/sched/scheduler.py, 0.33.0), for the default FCFS policy with
//! chunked prefill and no speculative decoding, connectors or multimodal inputs:
//!
//! 1. Running sequences first, in order: each gets `min(uncomputed tokens, token budget)`.
//!    If its slots cannot be allocated, the *last* running sequence is preempted (blocks freed,
//!    progress dropped, put back at the head of the waiting queue; it recomputes on resume) until
//!    the allocation succeeds or the sequence preempted itself.
//! 2. If nothing was preempted this step, waiting sequences are admitted in FIFO order while the
//!    token budget lasts and fewer than `max_num_seqs` run: prefix-cache lookup (hit capped at
//!    `(num_tokens - 1) // block_size` blocks), then an allocation that requires the whole prompt
//!    to fit (`scheduler_reserve_full_isl`); the first one that does not fit stops admission.
//! 3. After the step's forward pass, every sequence whose tokens are all computed samples one
//!    token; a sequence with `max_tokens` outputs finishes and frees its blocks.

use std::collections::VecDeque;

use crate::block_pool::{PoolError, PoolEvent};
use kvroute_core::hybrid::GroupKind;

use crate::kv_manager::{Hit, KvCacheManager};
use crate::latency::StepShape;
use crate::sequence::{SeqId, Sequence};

/// Scheduler limits (vLLM flag names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// `--max-num-seqs`: sequences running at once.
    pub max_num_seqs: usize,
    /// `--max-num-batched-tokens`: tokens computed per step.
    pub max_num_batched_tokens: usize,
    /// `--num-gpu-blocks-override`: KV blocks (including the null block).
    pub num_gpu_blocks: usize,
    /// `--block-size`.
    pub block_size: usize,
    /// The KV cache groups (group id = position; `--kv-cache-layout`), sharing the blocks.
    pub kv_cache_groups: Vec<GroupKind>,
    /// `--max-model-len` (bounds a sliding-window group's admission cap).
    pub max_model_len: usize,
    /// Tokens per request block hash (`--prefix-match-unit`; the block size by default). The
    /// engine hashes its sequences at this granularity.
    pub hash_block_size: usize,
}

/// vLLM's `max_concurrent_batches` with its default async scheduling (one pipeline stage): its
/// `max_in_flight_tokens` is this many `max_num_batched_tokens`.
pub const CONCURRENT_BATCHES: usize = 2;

/// Counters exported as metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// `vllm:prefix_cache_queries_total` (tokens of newly admitted requests).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total` (hit tokens of newly admitted requests).
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
}

/// The work chosen for one step: indices into the running list and their token counts.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    entries: Vec<(usize, usize)>,
    /// The step's shape for the cost model.
    pub shape: StepShape,
}

impl StepPlan {
    /// Whether nothing was scheduled.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Tokens scheduled this step.
    pub fn num_scheduled_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.1).sum()
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    /// The sequence.
    pub seq: SeqId,
    /// The token id.
    pub token: u32,
    /// Whether it is the sequence's first output token.
    pub first: bool,
    /// Time since the sequence's previous token (vLLM's inter-token latency); `None` for the first.
    pub itl_s: Option<f64>,
}

/// A sequence whose first token was sampled this step (its prefill is complete).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillDone {
    /// Arrival time, simulated clock.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prefix-cache hit at first admission, tokens (the rest were computed).
    pub cached_tokens: usize,
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Tokens sampled this step, in running order.
    pub sampled: Vec<SampledToken>,
    /// Sequences that finished this step (their blocks are already freed).
    pub finished: Vec<Sequence>,
    /// Sequences that sampled their first token this step.
    pub prefills_done: Vec<PrefillDone>,
}

/// The scheduler with its KV cache manager.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: SchedulerStats,
    plan_pending: bool,
}

impl Scheduler {
    /// A scheduler with an empty cache.
    pub fn new(cfg: SchedulerConfig, emit_events: bool) -> Result<Self, PoolError> {
        Ok(Scheduler {
            kv: KvCacheManager::with_groups(
                cfg.num_gpu_blocks,
                cfg.block_size,
                cfg.kv_cache_groups.clone(),
                emit_events,
            )?
            .with_admission_cap(
                CONCURRENT_BATCHES * cfg.max_num_batched_tokens,
                cfg.max_model_len,
            )
            .with_hash_block_size(cfg.hash_block_size)?,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: SchedulerStats::default(),
            plan_pending: false,
        })
    }

    /// Queues a new sequence at the tail of the waiting queue.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Removes a sequence wherever it is and frees its blocks (client went away). Must not be
    /// called between [`Scheduler::schedule`] and [`Scheduler::finish_step`].
    pub fn abort(&mut self, id: SeqId) -> bool {
        debug_assert!(!self.plan_pending);
        if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos);
            self.kv.free(id);
            return true;
        }
        if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(pos);
            self.kv.free(id);
            return true;
        }
        false
    }

    /// Sequences running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether there is anything to do.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// The KV cache manager (read-only).
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// KV usage fraction.
    pub fn kv_usage(&self) -> f64 {
        self.kv.usage()
    }

    /// Resets the prefix cache; false while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }

    /// Takes the KV events produced since the last call.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.kv.take_events()
    }

    /// Chooses this step's work and allocates its slots (caching blocks that become full).
    pub fn schedule(&mut self) -> StepPlan {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = StepPlan::default();
        let mut preempted = false;

        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let num_new = (seq.num_tokens() - seq.num_computed_tokens).min(budget);
            if num_new == 0 {
                i += 1;
                continue;
            }
            loop {
                if self
                    .kv
                    .allocate_slots(&self.running[i], num_new, None, false)
                {
                    break;
                }
                let Some(mut victim) = self.running.pop() else {
                    break 'running;
                };
                let victim_was_current = self.running.len() == i;
                self.kv.free(victim.id);
                victim.num_computed_tokens = 0;
                victim.num_preemptions += 1;
                self.stats.preemptions += 1;
                preempted = true;
                self.waiting.push_front(victim);
                if victim_was_current {
                    break 'running;
                }
            }
            plan.entries.push((i, num_new));
            budget -= num_new;
            i += 1;
        }

        if !preempted {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(seq) = self.waiting.front() else {
                    break;
                };
                let hit = if seq.num_computed_tokens == 0 {
                    self.kv.get_computed_blocks(seq)
                } else {
                    Hit::default()
                };
                let remaining = seq.num_tokens() - seq.num_computed_tokens - hit.num_tokens;
                let num_new = remaining.min(budget);
                if num_new == 0 || !self.kv.allocate_slots(seq, num_new, Some(&hit), true) {
                    break;
                }
                let Some(mut seq) = self.waiting.pop_front() else {
                    break;
                };
                if seq.num_preemptions == 0 {
                    self.stats.prefix_cache_queries += seq.num_tokens() as u64;
                    self.stats.prefix_cache_hits += hit.num_tokens as u64;
                }
                if seq.cached_tokens.is_none() {
                    seq.cached_tokens = Some(hit.num_tokens);
                }
                seq.num_computed_tokens += hit.num_tokens;
                self.running.push(seq);
                plan.entries.push((self.running.len() - 1, num_new));
                budget -= num_new;
            }
        }

        for &(idx, n) in &plan.entries {
            let seq = &self.running[idx];
            if n == 1 && seq.num_output_tokens() > 0 {
                plan.shape.decode_seqs += 1;
                plan.shape.decode_context_tokens += seq.num_computed_tokens + 1;
            } else {
                plan.shape.prefill_tokens += n;
            }
        }
        self.plan_pending = !plan.is_empty();
        plan
    }

    /// Stamps `now_s` as the first-scheduled time of every planned sequence that has none yet
    /// (vLLM's first `SCHEDULED` event), never earlier than its queue time. Call between
    /// [`Scheduler::schedule`] and [`Scheduler::finish_step`].
    pub fn mark_scheduled(&mut self, plan: &StepPlan, now_s: f64) {
        for &(idx, _) in &plan.entries {
            if let Some(seq) = self.running.get_mut(idx) {
                if seq.scheduled_s.is_none() {
                    seq.scheduled_s = Some(now_s.max(seq.queued_s));
                }
            }
        }
    }

    /// Applies a step's results: advances computed tokens, samples a token for every sequence
    /// that caught up, records first-token times (`now_s`), finishes and frees done sequences.
    pub fn finish_step(&mut self, plan: StepPlan, now_s: f64) -> StepOutcome {
        self.plan_pending = false;
        let mut out = StepOutcome::default();
        let mut any_finished = false;
        for (idx, n) in plan.entries {
            let Some(seq) = self.running.get_mut(idx) else {
                continue;
            };
            seq.num_computed_tokens += n;
            if seq.num_computed_tokens >= seq.num_tokens() {
                let token = seq.source.next_token();
                seq.append_token(token);
                let first = seq.first_token_s.is_none();
                if first {
                    seq.first_token_s = Some(now_s);
                    out.prefills_done.push(PrefillDone {
                        arrival_s: seq.arrival_s,
                        prompt_tokens: seq.num_prompt_tokens,
                        cached_tokens: seq.cached_tokens.unwrap_or(0),
                    });
                }
                let itl_s = seq.last_token_s.map(|t| (now_s - t).max(0.0));
                seq.last_token_s = Some(now_s);
                out.sampled.push(SampledToken {
                    seq: seq.id,
                    token,
                    first,
                    itl_s,
                });
                any_finished |= seq.is_finished();
            }
        }
        if any_finished {
            let mut keep = Vec::with_capacity(self.running.len());
            for seq in self.running.drain(..) {
                if seq.is_finished() {
                    out.finished.push(seq);
                } else {
                    keep.push(seq);
                }
            }
            self.running = keep;
            for seq in &out.finished {
                self.kv.free(seq.id);
            }
        }
        out
    }
}
