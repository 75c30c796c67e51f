//! The routing decision: request -> router keys -> per-replica matches -> policy -> replica.
//! Independent of HTTP so tests and benchmarks can call it directly.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hashing::{usable_hit_blocks, LoraRef, RequestExtras};
use kvroute_core::router_key::{request_keys, RouterKey};
use kvroute_core::scoring::{
    choose, choose_least_loaded, choose_random, choose_round_robin, Candidate, Decision, Load,
    MatchedBlocks, ScoringConfig,
};

use crate::load::NewDecision;
use crate::membership::{lock, Replica};
use crate::policies::Policy;
use crate::state::{AppState, ModelRuntime};

/// Block size assumed while neither the config nor an event has told it.
pub const FALLBACK_BLOCK_SIZE: u32 = 16;

pub use kvroute_core::api::{MatchedTokens, RouteAnswer as RouteResponse, RouteRequest};

/// Why a route request failed.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// Unknown model (404).
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    /// Bad request (400).
    #[error("{0}")]
    BadRequest(String),
    /// No healthy replica (503).
    #[error("no healthy replica for model {0:?}")]
    NoReplica(String),
}

impl RouteError {
    /// HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            RouteError::UnknownModel(_) => 404,
            RouteError::BadRequest(_) => 400,
            RouteError::NoReplica(_) => 503,
        }
    }
}

/// The model, its block size and the request's router keys and prompt length.
pub struct Keys {
    /// Model settings.
    pub model: Arc<ModelRuntime>,
    /// Block size used.
    pub block_size: u32,
    /// Router keys of the full blocks.
    pub keys: Vec<RouterKey>,
    /// Prompt length in tokens.
    pub num_tokens: usize,
}

impl Keys {
    /// Keys that could be hits (the last token is always recomputed).
    pub fn usable(&self) -> &[RouterKey] {
        let n = usable_hit_blocks(self.num_tokens, self.block_size as usize).min(self.keys.len());
        &self.keys[..n]
    }
}

/// Computes the router keys of a request.
pub fn request_router_keys(state: &AppState, req: &RouteRequest) -> Result<Keys, RouteError> {
    let model = state
        .models
        .get(&req.model)
        .cloned()
        .ok_or_else(|| RouteError::UnknownModel(req.model.clone()))?;
    let known = model.block_size();
    match (&req.token_ids, &req.router_keys) {
        (Some(tokens), None) => {
            let bs = known.unwrap_or(FALLBACK_BLOCK_SIZE);
            let extras = RequestExtras {
                lora: req.lora.as_ref().map(|name| LoraRef {
                    name: name.clone(),
                    path: model.loras.get(name).cloned().unwrap_or_default(),
                }),
                cache_salt: req.cache_salt.clone().filter(|s| !s.is_empty()),
                mm_features: Vec::new(),
            };
            let keys = request_keys(tokens, bs as usize, &extras, model.style);
            Ok(Keys {
                model,
                block_size: bs,
                keys,
                num_tokens: tokens.len(),
            })
        }
        (None, Some(keys)) => {
            let bs = match (known, req.block_size) {
                (Some(k), Some(r)) if k != r => {
                    return Err(RouteError::BadRequest(format!(
                        "block_size {r} does not match model {:?}'s block size {k}",
                        req.model
                    )))
                }
                (Some(k), _) => k,
                (None, Some(r)) if r > 0 => r,
                _ => FALLBACK_BLOCK_SIZE,
            };
            let num_tokens = req
                .num_tokens
                .unwrap_or_else(|| keys.len().saturating_mul(bs as usize));
            Ok(Keys {
                model,
                block_size: bs,
                keys: keys.iter().map(|k| RouterKey(*k)).collect(),
                num_tokens,
            })
        }
        (Some(_), Some(_)) => Err(RouteError::BadRequest(
            "give either token_ids or router_keys, not both".into(),
        )),
        (None, None) => Err(RouteError::BadRequest(
            "missing token_ids (or router_keys)".into(),
        )),
    }
}

/// Per replica (same order as `replicas`), its best match over its DP ranks.
pub fn exact_matches(
    state: &AppState,
    replicas: &[Arc<Replica>],
    keys: &[RouterKey],
) -> Vec<MatchedBlocks> {
    let found = if keys.is_empty() {
        Vec::new()
    } else {
        lock(&state.index).lookup(keys, now_ms())
    };
    replicas
        .iter()
        .map(|r| {
            let ids = r.index_ids();
            found
                .iter()
                .filter(|m| ids.contains(&m.replica))
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

/// How long `uncached_blocks` of prefill are estimated to take at the configured prefill rate.
fn prefill_estimate(cfg: &ScoringConfig, uncached_blocks: u32, block_size: u32) -> Duration {
    let tokens = f64::from(uncached_blocks) * f64::from(block_size);
    let rate = cfg.prefill_tokens_per_s;
    if !(rate.is_finite() && rate > 0.0) {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(tokens / rate).unwrap_or(crate::load::MAX_PREFILL_ESTIMATE)
}

fn candidates(
    state: &AppState,
    replicas: &[Arc<Replica>],
    matched: &[MatchedBlocks],
) -> Vec<Candidate> {
    let stale_after = state.stale_after();
    replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let s = lock(&r.scraped).clone();
            Candidate {
                replica: i as u32,
                matched: matched.get(i).copied().unwrap_or_default(),
                load: Load {
                    in_flight: r.in_flight.load(Ordering::Relaxed).max(0) as u32,
                    pending_prefill_blocks: r
                        .pending_prefill_blocks
                        .load(Ordering::Relaxed)
                        .clamp(0, i64::from(u32::MAX))
                        as u32,
                    waiting: s.waiting.max(0.0) as u32,
                    running: s.running.max(0.0) as u32,
                    kv_usage: s.kv_usage as f32,
                },
                healthy: r.healthy(),
                stale: r.stale(stale_after),
            }
        })
        .collect()
}

/// Decides where a request goes and records the decision (load, predicted entries, policy state).
pub fn route(
    state: &AppState,
    req: &RouteRequest,
    header_session: Option<&str>,
) -> Result<RouteResponse, RouteError> {
    if req
        .callout_id
        .as_ref()
        .is_some_and(|c| c.len() > crate::load::MAX_CALLOUT_ID_BYTES)
    {
        return Err(RouteError::BadRequest(format!(
            "callout_id longer than {} bytes",
            crate::load::MAX_CALLOUT_ID_BYTES
        )));
    }
    let keys = request_router_keys(state, req)?;
    let replicas = state.fleet.of_model(&keys.model.name);
    if replicas.is_empty() {
        return Err(RouteError::NoReplica(req.model.clone()));
    }
    // Prefill estimated done by now no longer counts as queued work.
    state.load.expire(std::time::Instant::now());
    let usable = keys.usable();
    let prompt_blocks = usable.len() as u32;
    let seed = state.policy_state.next_seed();
    let cfg = &state.config.scoring;
    let session = req.session.as_deref().or(header_session);

    let (decision, reason): (Option<Decision>, Option<&str>) = match state.policy {
        Policy::Kv => {
            let matched = exact_matches(state, &replicas, usable);
            let c = candidates(state, &replicas, &matched);
            (choose(cfg, prompt_blocks, &c, seed), None)
        }
        Policy::ApproxPrefix => {
            let guessed = state.policy_state.approx_matches(usable);
            let matched: Vec<MatchedBlocks> = replicas
                .iter()
                .map(|r| MatchedBlocks {
                    gpu: r
                        .index_ids()
                        .iter()
                        .filter_map(|id| guessed.get(id))
                        .copied()
                        .max()
                        .unwrap_or(0),
                    ..Default::default()
                })
                .collect();
            let c = candidates(state, &replicas, &matched);
            (choose(cfg, prompt_blocks, &c, seed), None)
        }
        Policy::RoundRobin => {
            let c = candidates(state, &replicas, &[]);
            let n = state.policy_state.rr.fetch_add(1, Ordering::Relaxed);
            (choose_round_robin(&c, n), None)
        }
        Policy::Random => {
            let c = candidates(state, &replicas, &[]);
            (choose_random(&c, seed), None)
        }
        Policy::LeastLoaded => {
            let c = candidates(state, &replicas, &[]);
            (choose_least_loaded(cfg, &c, seed), None)
        }
        Policy::Session => {
            let c = candidates(state, &replicas, &[]);
            let bound = session
                .and_then(|s| state.policy_state.session_get(&keys.model.name, s))
                .and_then(|name| replicas.iter().position(|r| r.name == name))
                .filter(|&i| c[i].healthy);
            match bound {
                Some(i) => {
                    let mut d = choose_round_robin(&c[i..=i], 0);
                    if let Some(d) = d.as_mut() {
                        d.replica = i as u32;
                    }
                    (d, Some("session"))
                }
                None => (choose_least_loaded(cfg, &c, seed), Some("session_new")),
            }
        }
    };
    let decision = decision.ok_or_else(|| RouteError::NoReplica(req.model.clone()))?;
    let chosen = replicas
        .get(decision.replica as usize)
        .cloned()
        .ok_or_else(|| RouteError::NoReplica(req.model.clone()))?;
    let reason = reason.unwrap_or(decision.reason.as_str()).to_string();

    // Record the decision.
    match state.policy {
        Policy::Kv if !usable.is_empty() => {
            if let Some(first) = chosen.streams().first() {
                let ttl = state.config.index.predicted_ttl_ms;
                if let Err(e) =
                    lock(&state.index).insert_predicted(first.index_id, usable, now_ms(), ttl)
                {
                    tracing::debug!(error = %e, "predicted entries not written");
                }
            }
        }
        Policy::ApproxPrefix if !usable.is_empty() => {
            if let Some(first) = chosen.streams().first() {
                state.policy_state.approx_record(first.index_id, usable);
            }
        }
        Policy::Session => {
            if let Some(s) = session {
                state
                    .policy_state
                    .session_put(&keys.model.name, s, &chosen.name);
            }
        }
        _ => {}
    }
    let bs = u64::from(keys.block_size);
    let m = decision.matched;
    let matched_tokens = MatchedTokens {
        gpu: u64::from(m.gpu) * bs,
        cpu: u64::from(m.cpu) * bs,
        storage: u64::from(m.storage) * bs,
        predicted: u64::from(m.predicted) * bs,
    };
    let predicted_tokens = matched_tokens.gpu + matched_tokens.cpu + matched_tokens.storage;
    let uncached_blocks = prompt_blocks.saturating_sub(m.total());
    let routed = state.load.routed(NewDecision {
        replica: chosen.clone(),
        predicted_tokens,
        prefill_blocks: uncached_blocks,
        prefill_time: prefill_estimate(cfg, uncached_blocks, keys.block_size),
        decode_time: state.load.config().decode_time(req.max_tokens),
        callout: req.callout_id.clone(),
    });
    let decision_id = routed.id.to_string();
    let request_id = req
        .request_id
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| decision_id.clone());
    state.metrics.routed.fetch_add(1, Ordering::Relaxed);
    state.metrics.count_decision(&reason);
    tracing::debug!(
        model = %keys.model.name,
        replica = %chosen.name,
        %reason,
        prompt_blocks,
        gpu = m.gpu, cpu = m.cpu, storage = m.storage, predicted = m.predicted,
        cost = decision.cost,
        raw_credit = decision.terms.raw_credit,
        decay = decision.terms.decay,
        load_cost = decision.terms.load_cost,
        overloaded = decision.terms.overloaded,
        mean_load = decision.mean_load,
        runner_up = ?decision.runner_up,
        tied = decision.tied,
        %decision_id,
        counted = routed.counted,
        "route decision"
    );
    Ok(RouteResponse {
        endpoint: chosen.endpoint.clone(),
        replica: chosen.name.clone(),
        matched_tokens,
        reason,
        decision_id,
        request_id,
        policy: state.policy.as_str().to_string(),
        prompt_blocks,
        cost: decision.cost,
    })
}
