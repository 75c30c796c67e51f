//! What the model is given: the request's shape, and per replica what it holds of the request,
//! what is already asked of it, and how fast it is.

use serde::{Deserialize, Serialize};

/// Leading blocks of the request a replica holds, split by the tier they would be served from.
///
/// The tiers are disjoint and consecutive: first `gpu` blocks on GPU, then `predicted` blocks only
/// predicted (being computed for a sibling routed there; GPU-to-be), then `cpu` blocks from host
/// memory, then `storage` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MatchedBlocks {
    /// Leading blocks in GPU memory.
    pub gpu: u32,
    /// Blocks after those, in host memory.
    pub cpu: u32,
    /// Blocks after those, on storage.
    pub storage: u32,
    /// Blocks only predicted (sibling of a recent decision), counted after `gpu` and before `cpu`.
    #[serde(default)]
    pub predicted: u32,
}

impl MatchedBlocks {
    /// Total matched blocks over every tier.
    pub fn total(&self) -> u32 {
        self.gpu
            .saturating_add(self.cpu)
            .saturating_add(self.storage)
            .saturating_add(self.predicted)
    }

    /// Blocks that cost no compute and no transfer (GPU and predicted).
    pub fn on_gpu(&self) -> u32 {
        self.gpu.saturating_add(self.predicted)
    }
}

/// What is already asked of a replica, as the indexer knows it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Load {
    /// Requests kvroute routed here that have not completed.
    pub in_flight: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc` (a fraction 0..1).
    pub kv_usage: f32,
    /// How old that reading is, seconds (the batch has grown since).
    #[serde(default)]
    pub kv_usage_age_s: f32,
    /// Uncached prompt tokens of requests kvroute routed here whose prefill is estimated not done.
    #[serde(default)]
    pub pending_prefill_tokens: u64,
    /// How many requests those tokens belong to.
    #[serde(default)]
    pub pending_prefill_requests: u32,
    /// Of `pending_prefill_tokens`, the part estimated computed already: the pending prefills
    /// run one after another, and the one at the head of the queue is part way through.
    #[serde(default)]
    pub pending_prefill_done_tokens: u64,
    /// Uncached prompt tokens of every request kvroute routed here that has not completed (its
    /// prefill done or not): with `in_flight`, the typical size of what kvroute sends here.
    #[serde(default)]
    pub in_flight_uncached_tokens: u64,
    /// Output tokens the requests kvroute routed here are still expected to generate (sum).
    #[serde(default)]
    pub remaining_output_tokens: u64,
    /// Requests expected to arrive here per second (the model's recent arrival rate over its
    /// healthy replicas).
    #[serde(default)]
    pub arrival_rate_per_s: f64,
    /// When the KV blocks of kvroute's requests running here are expected back (empty when
    /// kvroute has none here).
    #[serde(default)]
    pub kv_release: KvRelease,
    /// How full its prefix cache is (0..1): blocks it holds over its KV capacity, from the index.
    /// At 1, every block it computes pushes a cached one out.
    #[serde(default)]
    pub cache_fill: f32,
    /// The share of recent time its prefill was busy with what kvroute sent it (0..1): routed
    /// prefill seconds over a window (`[inflight] recent_work_window_s`), what its resident
    /// sessions and groups keep bringing.
    #[serde(default)]
    pub recent_prefill_busy: f32,
    /// Mean residual of those prefills, seconds: `E[s^2] / (2 E[s])`, how long an arrival that
    /// finds one under way waits for it to end, on average.
    #[serde(default)]
    pub recent_prefill_residual_s: f32,
    /// KV blocks the sessions resident here (their last request routed here, not yet continued
    /// and recent enough that it may be) are expected to want again: the same estimate as
    /// [`RequestShape::session_blocks`], summed over them.
    #[serde(default)]
    pub resident_session_blocks: f32,
}

/// One point of a [`KvRelease`] curve.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ReleasePoint {
    /// Seconds from now.
    pub after_s: f32,
    /// KV blocks freed by then (cumulative).
    pub blocks: u32,
    /// Requests finished by then (cumulative).
    pub requests: u32,
}

/// When a replica gets its KV blocks back: a cumulative curve of the blocks its running requests
/// free as they finish (prompt and output blocks each), sampled at the 1st, 2nd, 4th, ... finishing
/// request and the last. Between points the blocks come back linearly.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct KvRelease {
    /// The points, ascending in time and blocks; only the first `len` are set.
    pub points: [ReleasePoint; KvRelease::MAX_POINTS],
    /// How many points are set.
    pub len: u8,
}

impl KvRelease {
    /// Points kept.
    pub const MAX_POINTS: usize = 8;

    /// The curve of requests finishing after `(seconds from now, blocks they free)`; `finishes`
    /// is sorted in place. Negative or non-finite times count as now.
    pub fn from_finishes(finishes: &mut [(f64, u32)]) -> Self {
        let mut out = KvRelease::default();
        if finishes.is_empty() {
            return out;
        }
        for f in finishes.iter_mut() {
            if !(f.0.is_finite() && f.0 > 0.0) {
                f.0 = 0.0;
            }
        }
        finishes.sort_by(|a, b| a.0.total_cmp(&b.0));
        let last = finishes.len() - 1;
        let mut cumulative: u32 = 0;
        let mut next_sample = 0usize;
        for (i, &(after_s, blocks)) in finishes.iter().enumerate() {
            cumulative = cumulative.saturating_add(blocks);
            let sample = i == next_sample || i == last;
            if i == next_sample {
                next_sample = 2 * next_sample + 1;
            }
            if !sample {
                continue;
            }
            let slot = usize::from(out.len).min(Self::MAX_POINTS - 1);
            if i == last || slot < Self::MAX_POINTS - 1 {
                out.points[slot] = ReleasePoint {
                    after_s: after_s as f32,
                    blocks: cumulative,
                    requests: u32::try_from(i + 1).unwrap_or(u32::MAX),
                };
                out.len = (slot + 1) as u8;
            }
        }
        out
    }

    /// The set points.
    pub fn points(&self) -> &[ReleasePoint] {
        &self.points[..usize::from(self.len).min(Self::MAX_POINTS)]
    }
}

impl Load {
    /// Sequences decoding in the replica's batch: the engine's count, or kvroute's own requests
    /// past their prefill when that is larger (the scrape lags).
    pub fn decoding(&self) -> u32 {
        let own = self.in_flight.saturating_sub(self.pending_prefill_requests);
        self.running.max(own)
    }

    /// Mean uncached prompt tokens of kvroute's requests here: of those whose prefill is pending,
    /// else of those in flight; `None` when kvroute has none here.
    pub fn mean_routed_uncached_tokens(&self) -> Option<u64> {
        if self.pending_prefill_requests > 0 {
            Some(self.pending_prefill_tokens / u64::from(self.pending_prefill_requests))
        } else if self.in_flight > 0 && self.in_flight_uncached_tokens > 0 {
            Some(self.in_flight_uncached_tokens / u64::from(self.in_flight))
        } else {
            None
        }
    }

    /// The KV usage as a fraction in 0..=1 (0 when the engine reported nonsense).
    pub fn kv_fraction(&self) -> f64 {
        let kv = f64::from(self.kv_usage);
        if kv.is_finite() {
            kv.clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// How fast a replica is: calibrated from its own metrics, or the configured priors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReplicaRates {
    /// Prefill throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Duration of one engine step at its current batch (its inter-token latency), seconds.
    pub decode_step_s: f64,
    /// KV blocks the replica has in all (0 = unknown: no KV-pressure term).
    #[serde(default)]
    pub kv_capacity_blocks: u32,
}

impl ReplicaRates {
    /// Its step time, or `prior` when it has none usable.
    pub fn step_or(&self, prior: f64) -> f64 {
        positive(self.decode_step_s, prior)
    }

    /// Its prefill rate, or `prior` when it has none usable.
    pub fn prefill_rate_or(&self, prior: f64) -> f64 {
        positive(self.prefill_tokens_per_s, prior)
    }
}

/// `v` when it is a finite number > 0, else `fallback` when that is, else 1.
pub(super) fn positive(v: f64, fallback: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else if fallback.is_finite() && fallback > 0.0 {
        fallback
    } else {
        1.0
    }
}

/// One replica the request could go to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The caller's replica index (returned in [`super::Decision::replica`]).
    pub replica: u32,
    /// Leading blocks of the request this replica holds.
    pub matched: MatchedBlocks,
    /// What is already asked of it.
    pub load: Load,
    /// How fast it is.
    pub rates: ReplicaRates,
    /// False excludes the replica (failed health checks, draining, removed).
    pub healthy: bool,
    /// True when its event stream is silent or broken: its index entries may be out of date.
    pub stale: bool,
}

/// The request being routed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RequestShape {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Blocks that can be cache hits (`hashing::usable_hit_blocks`: the last token is always
    /// computed); matches are capped at this.
    pub usable_blocks: u32,
    /// Output tokens expected (`max_tokens`, or the configured default).
    pub output_tokens: u32,
    /// Later requests expected to continue this one's prompt (a session's next turns): they
    /// follow it to whichever replica it goes to. Learned by the caller from how often requests
    /// continue an earlier one; 0 when none do, and for a request that itself continues one (its
    /// session is placed already).
    #[serde(default)]
    pub expected_successors: f32,
    /// KV blocks the session this request starts is expected to want again on its replica
    /// after it (its prompt, if continued, and what its successors add); 0 for a request that
    /// continues an earlier one (its session is placed already) and for one-off requests.
    #[serde(default)]
    pub session_blocks: f32,
}
