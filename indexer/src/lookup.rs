//! What a routing policy sees and does: the request's keys and the model's replicas as
//! candidates ([`Lookup`]), the exact index's matches, and the [`RoutePolicy`] trait the
//! policies (`crate::policies`) implement and `crate::route` drives.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvroute_core::hashing::usable_hit_blocks;
use kvroute_core::router_key::RouterKey;
use kvroute_core::scoring::{Candidate, Decision, Load, MatchedBlocks, ReplicaRates, RequestShape};

use crate::membership::{lock, Replica};
use crate::state::{AppState, ModelRuntime};

/// The model, its block size and the request's router keys and prompt length.
pub struct RequestKeys {
    /// Model settings.
    pub model: Arc<ModelRuntime>,
    /// Block size used.
    pub block_size: u32,
    /// Router keys of the full blocks.
    pub keys: Vec<RouterKey>,
    /// Prompt length in tokens.
    pub num_tokens: usize,
    /// The keys cover only the prompt's leading tokens (`RouteRequest::partial`).
    pub partial: bool,
}

impl RequestKeys {
    /// Keys that could be hits (the last token is always recomputed; a partial prompt's last
    /// token is further on, so all of its full blocks could be).
    pub fn usable(&self) -> &[RouterKey] {
        if self.partial {
            return &self.keys;
        }
        let n = usable_hit_blocks(self.num_tokens, self.block_size as usize).min(self.keys.len());
        &self.keys[..n]
    }
}

/// Per replica (same order as `replicas`), its best match over its DP ranks.
pub fn exact_matches(
    state: &AppState,
    replicas: &[Arc<Replica>],
    keys: &[RouterKey],
) -> Vec<MatchedBlocks> {
    let mut found = state.index.lookup(keys, now_ms());
    if found.is_empty() {
        return vec![MatchedBlocks::default(); replicas.len()];
    }
    // By stream id, so each replica finds its ranks' matches by search, not by a scan of all
    // (100 replicas made that 10,000 comparisons per decision).
    found.sort_unstable_by_key(|m| m.replica);
    replicas
        .iter()
        .map(|r| {
            r.index_ids()
                .iter()
                .filter_map(|id| {
                    let at = found.binary_search_by_key(id, |m| m.replica).ok()?;
                    found.get(at)
                })
                .map(|m| MatchedBlocks {
                    gpu: m.gpu,
                    cpu: m.cpu,
                    storage: m.storage,
                    predicted: m.predicted,
                })
                .max_by_key(|m| (m.total(), m.gpu))
                .unwrap_or_default()
        })
        .collect()
}

/// Milliseconds on the index's clock (monotonic since process start).
pub fn now_ms() -> u64 {
    use std::sync::OnceLock;
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// Copies the blocks the index holds for every replica (all its streams) into
/// [`Replica::held_blocks`], where decisions read them without taking the index.
pub fn refresh_held_blocks(state: &AppState) {
    let held = state.index.held_blocks();
    for r in state.fleet.all() {
        let blocks: u64 = r.index_ids().iter().filter_map(|id| held.get(id)).sum();
        r.held_blocks.store(blocks, Ordering::Relaxed);
    }
}

/// How full `r`'s prefix cache is: the blocks the index holds for it over its KV capacity
/// (0 while the capacity is unknown), at most 1.
fn cache_fill(r: &Replica, rates: &ReplicaRates) -> f32 {
    let capacity = rates.kv_capacity_blocks;
    if capacity == 0 {
        return 0.0;
    }
    (r.held_blocks.load(Ordering::Relaxed) as f64 / f64::from(capacity)).min(1.0) as f32
}

/// The rates `r` is scored with: its own calibration after its model's (all its replicas'
/// windows), after the configured priors; its own KV capacity.
pub fn replica_rates(state: &AppState, r: &Replica) -> ReplicaRates {
    replica_rates_after(state, r, model_rates(state, &r.model))
}

/// The rates of `model` (all its replicas' windows after the configured priors).
pub fn model_rates(state: &AppState, model: &str) -> ReplicaRates {
    let pool = state
        .models
        .get(model)
        .map(|m| *lock(&m.rates))
        .unwrap_or_default();
    pool.model_rates(
        &state.config.calibration,
        state.config.scoring.prior_rates(),
    )
}

/// [`replica_rates`] with its model's rates already read (once per decision, not per replica).
fn replica_rates_after(state: &AppState, r: &Replica, model: ReplicaRates) -> ReplicaRates {
    let prior = state.config.scoring.prior_rates();
    lock(&r.calibration).as_ref().map_or(model, |own| {
        own.rates_after(&state.config.calibration, prior, model)
    })
}

/// Everything the policies may look at: the replicas of the model, in order, as candidates.
pub struct Lookup<'a> {
    /// The indexer.
    pub state: &'a AppState,
    /// The request's keys and model.
    pub keys: RequestKeys,
    /// The model's replicas (candidates are in this order).
    pub replicas: Vec<Arc<Replica>>,
    /// The request, as the cost model sees it.
    pub shape: RequestShape,
    /// Session key (body, else header).
    pub session: Option<&'a str>,
    /// Seed for random choices.
    pub seed: u64,
    /// Requests expected per second at each healthy replica.
    pub arrival_rate_per_replica: f64,
    /// Per replica (same order), the KV blocks its resident sessions are expected to want again
    /// (`Load::resident_session_blocks`).
    pub resident_session_blocks: Vec<f32>,
    /// Last key of the remembered prompt this request continues (a session's later turn).
    pub continues: Option<RouterKey>,
}

impl Lookup<'_> {
    /// Usable router keys (could be hits).
    pub fn usable(&self) -> &[RouterKey] {
        self.keys.usable()
    }

    /// The candidates with `matched` (per replica, in order; missing = nothing matched).
    pub fn candidates(&self, matched: &[MatchedBlocks]) -> Vec<Candidate> {
        let state = self.state;
        let stale_after = state.stale_after();
        let bs = u64::from(self.keys.block_size);
        let now = std::time::Instant::now();
        let model = self
            .replicas
            .first()
            .map(|r| model_rates(state, &r.model))
            .unwrap_or_else(|| state.config.scoring.prior_rates());
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let rates = replica_rates_after(state, r, model);
                // The readings used, not a clone of the whole scrape (maps included).
                let (waiting, running, kv_usage, read_at) = {
                    let s = lock(&r.scraped);
                    (s.waiting, s.running, s.kv_usage, s.last_ok)
                };
                let get = |a: &std::sync::atomic::AtomicI64| a.load(Ordering::Relaxed).max(0);
                let (recent_busy, recent_residual) = lock(&r.recent_work)
                    .busy_and_residual(now, state.config.inflight.recent_work_window_s);
                Candidate {
                    replica: i as u32,
                    matched: matched.get(i).copied().unwrap_or_default(),
                    load: Load {
                        in_flight: clamp_u32(get(&r.in_flight)),
                        waiting: waiting.max(0.0) as u32,
                        running: running.max(0.0) as u32,
                        kv_usage: kv_usage as f32,
                        kv_usage_age_s: read_at
                            .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f32()),
                        pending_prefill_tokens: (get(&r.pending_prefill_blocks) as u64)
                            .saturating_mul(bs),
                        pending_prefill_requests: clamp_u32(get(&r.pending_prefill_requests)),
                        pending_prefill_done_tokens: state
                            .load
                            .pending_prefill_done_blocks(r, now)
                            .saturating_mul(bs),
                        in_flight_uncached_tokens: (get(&r.in_flight_uncached_blocks) as u64)
                            .saturating_mul(bs),
                        // Requests in flight are on average half way through their output.
                        remaining_output_tokens: get(&r.remaining_output_tokens) as u64 / 2,
                        arrival_rate_per_s: self.arrival_rate_per_replica,
                        kv_release: state
                            .load
                            .kv_release(r, |r| replica_rates(state, r).decode_step_s),
                        cache_fill: cache_fill(r, &rates),
                        recent_prefill_busy: recent_busy as f32,
                        recent_prefill_residual_s: recent_residual as f32,
                        resident_session_blocks: self
                            .resident_session_blocks
                            .get(i)
                            .copied()
                            .unwrap_or(0.0),
                    },
                    rates,
                    healthy: r.healthy(),
                    stale: r.stale(stale_after),
                }
            })
            .collect()
    }
}

fn clamp_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

/// A routing policy: what it believes each replica holds, how it chooses, what it remembers.
pub trait RoutePolicy: Send + Sync {
    /// Per replica (in [`Lookup::replicas`] order), the request's blocks this policy believes are
    /// cached there. Default: none (cache-blind policies).
    fn matches(&self, _lookup: &Lookup<'_>) -> Vec<MatchedBlocks> {
        Vec::new()
    }

    /// Chooses among `cands`; `Some(reason)` overrides the decision's own reason label.
    fn choose(
        &self,
        lookup: &Lookup<'_>,
        cands: &[Candidate],
    ) -> Option<(Decision, Option<&'static str>)>;

    /// Remembers the decision (predicted entries, router-side guesses, session bindings);
    /// `matched` is what the chosen replica holds of the request.
    fn record(&self, _lookup: &Lookup<'_>, _chosen: &Replica, _matched: &MatchedBlocks) {}

    /// What peer gateways need to replay [`RoutePolicy::record`] for this decision: the number of
    /// leading usable blocks they need not be told about, and the router keys after them.
    /// Default: nothing.
    fn shared_keys<'a>(
        &self,
        _lookup: &'a Lookup<'_>,
        _matched: &MatchedBlocks,
    ) -> (u32, &'a [RouterKey]) {
        (0, &[])
    }

    /// Replays a peer gateway's decision as [`RoutePolicy::record`] did there.
    fn record_remote(&self, _state: &AppState, _remote: &RemoteRecord<'_>) {}
}

/// A peer gateway's decision, as a policy replays it (see `crate::peers`).
pub struct RemoteRecord<'a> {
    /// Model name.
    pub model: &'a str,
    /// The replica it chose.
    pub replica: &'a Replica,
    /// The router keys it shared ([`RoutePolicy::shared_keys`]).
    pub keys: &'a [RouterKey],
    /// The request's session, if any.
    pub session: Option<&'a str>,
}
