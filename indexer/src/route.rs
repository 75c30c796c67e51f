//! The routing decision, in three steps: look up (request -> router keys -> per-replica matches
//! and load), choose (the policy), record (load, predicted entries, policy state). Independent of
//! HTTP so tests and benchmarks can call it directly.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::api::CandidateExplain;
use kvroute_core::hashing::{LoraRef, RequestExtras};
use kvroute_core::peers::SharedPrompt;
use kvroute_core::router_key::{request_keys, RouterKey};
use kvroute_core::scoring::{
    Candidate, Decision, DecisionReason, MatchedBlocks, ReplicaRates, RequestShape, Scored,
};

use crate::load::NewDecision;
pub use crate::lookup::{
    exact_matches, now_ms, replica_rates, Lookup, RemoteRecord, RequestKeys, RoutePolicy,
};
use crate::membership::{lock, Replica};
use crate::policies::route_policy;
use crate::state::AppState;

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

/// Computes the router keys of a request.
pub fn request_router_keys(
    state: &AppState,
    req: &RouteRequest,
) -> Result<RequestKeys, RouteError> {
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
            Ok(RequestKeys {
                model,
                block_size: bs,
                keys,
                num_tokens: tokens.len(),
                partial: req.partial,
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
            Ok(RequestKeys {
                model,
                block_size: bs,
                keys: keys.iter().map(|k| RouterKey(*k)).collect(),
                num_tokens,
                partial: req.partial,
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

/// How long `uncached_blocks` of prefill take at `rates`.
fn prefill_estimate(rates: &ReplicaRates, uncached_blocks: u32, block_size: u32) -> Duration {
    let tokens = f64::from(uncached_blocks) * f64::from(block_size);
    let rate = rates.prefill_tokens_per_s;
    if !(rate.is_finite() && rate > 0.0) {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(tokens / rate).unwrap_or(crate::load::MAX_PREFILL_ESTIMATE)
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
    // Keys are computed outside the model's decision lock; reading the fleet, choosing and
    // recording happen inside it, so concurrent decisions see each other's predictions.
    let keys = request_router_keys(state, req)?;
    let model = Arc::clone(&keys.model);
    let _deciding = lock(&model.deciding);
    let lookup = look_up(state, req, header_session, keys)?;
    let policy = route_policy(state.policy);
    let matched = policy.matches(&lookup);
    let cands = lookup.candidates(&matched);
    let (decision, label) = policy
        .choose(&lookup, &cands)
        .ok_or_else(|| RouteError::NoReplica(req.model.clone()))?;
    let chosen = lookup
        .replicas
        .get(decision.replica as usize)
        .cloned()
        .ok_or_else(|| RouteError::NoReplica(req.model.clone()))?;
    if !req.shadow {
        // A shadowed request is not sent there: nothing to predict or remember.
        policy.record(&lookup, &chosen, &decision.matched);
        if let Some(last) = lookup.usable().last() {
            lock(&lookup.keys.model.continuations).place(
                *last,
                &chosen.name,
                decision.matched.on_gpu(),
            );
        }
    }
    let explain = req.explain.then(|| explain(&lookup, &cands, &decision));
    Ok(record(
        state, req, &lookup, &cands, &decision, label, &chosen, explain, policy,
    ))
}

/// Step one: the model's replicas and the request's shape, beside its keys.
fn look_up<'a>(
    state: &'a AppState,
    req: &'a RouteRequest,
    header_session: Option<&'a str>,
    keys: RequestKeys,
) -> Result<Lookup<'a>, RouteError> {
    let replicas = state.fleet.of_model(&keys.model.name);
    if replicas.is_empty() {
        return Err(RouteError::NoReplica(req.model.clone()));
    }
    // Prefill estimated done by now no longer counts as queued work.
    state.load.expire(std::time::Instant::now());
    let output = req
        .max_tokens
        .unwrap_or(state.load.config().default_max_tokens);
    let mut shape = RequestShape {
        prompt_tokens: u32::try_from(keys.num_tokens).unwrap_or(u32::MAX),
        block_size: keys.block_size,
        usable_blocks: keys.usable().len() as u32,
        output_tokens: u32::try_from(output).unwrap_or(u32::MAX),
        expected_successors: 0.0,
        session_blocks: 0.0,
    };
    let now = std::time::Instant::now();
    let mut resident_session_blocks = vec![0.0; replicas.len()];
    let mut continues = None;
    if !req.shadow {
        let mut continuations = lock(&keys.model.continuations);
        continues = continuations.observe(keys.usable(), now);
        let outlook = continuations.outlook(now);
        // Only a session's first request places the session: a later one follows its context.
        if continues.is_none() {
            shape.expected_successors = outlook.successors as f32;
            shape.session_blocks = outlook.wanted_blocks(1, keys.usable().len() as u64) as f32;
        }
        for (wanted, r) in resident_session_blocks.iter_mut().zip(&replicas) {
            let (sessions, blocks) = continuations.resident(&r.name);
            *wanted = outlook.wanted_blocks(sessions, blocks) as f32;
        }
    }
    let arrivals = {
        let mut meter = lock(&keys.model.arrivals);
        meter.record(now);
        meter.rate(now)
    };
    let healthy = replicas.iter().filter(|r| r.healthy()).count().max(1);
    Ok(Lookup {
        state,
        keys,
        arrival_rate_per_replica: arrivals / healthy as f64,
        replicas,
        shape,
        session: req.session.as_deref().or(header_session),
        seed: state.policy_state.next_seed(),
        resident_session_blocks,
        continues,
    })
}

fn matched_tokens(m: &MatchedBlocks, block_size: u32) -> MatchedTokens {
    let bs = u64::from(block_size);
    MatchedTokens {
        gpu: u64::from(m.gpu) * bs,
        cpu: u64::from(m.cpu) * bs,
        storage: u64::from(m.storage) * bs,
        predicted: u64::from(m.predicted) * bs,
    }
}

/// Logs (debug) the candidate holding the longest prefix when the decision went elsewhere: its
/// load and terms beside the chosen one's, to see which term gave the hit away.
fn log_prefix_given_away(lookup: &Lookup<'_>, cands: &[Candidate], d: &Decision) {
    let hit = |s: &&Scored| s.terms.gpu_hit_tokens + s.terms.offload_hit_tokens;
    let Some(holder) = d.candidates.iter().max_by_key(hit) else {
        return;
    };
    let Some((c, r)) = cands
        .iter()
        .zip(&lookup.replicas)
        .find(|(c, _)| c.replica == holder.replica)
    else {
        return;
    };
    let t = &holder.terms;
    let l = &c.load;
    tracing::debug!(
        holder = %r.name,
        hit_tokens = hit(&holder),
        in_flight = l.in_flight,
        decoding = l.decoding(),
        waiting = l.waiting,
        kv = l.kv_fraction(),
        cache_fill = l.cache_fill,
        pending_tokens = l.pending_prefill_tokens,
        pending_requests = l.pending_prefill_requests,
        rate = c.rates.prefill_tokens_per_s,
        cost_s = t.cost_s,
        queue_wait_s = t.queue_wait_s,
        prefill_s = t.prefill_s,
        kv_pressure_s = t.kv_pressure_s,
        harm_s = t.harm_s,
        arrivals_harm_s = t.arrivals_harm_s,
        displace_s = t.displace_s,
        successors_s = t.successors_s,
        crowding_s = t.crowding_s,
        recent_busy = l.recent_prefill_busy,
        resident_session_blocks = l.resident_session_blocks,
        chosen_cost_s = d.terms.cost_s,
        "prefix given away"
    );
}

/// Every candidate's inputs and terms, for `explain`.
fn explain(lookup: &Lookup<'_>, cands: &[Candidate], d: &Decision) -> Vec<CandidateExplain> {
    cands
        .iter()
        .zip(&lookup.replicas)
        .map(|(c, r)| CandidateExplain {
            replica: r.name.clone(),
            chosen: c.replica == d.replica,
            eligible: c.healthy,
            matched_tokens: matched_tokens(&c.matched, lookup.keys.block_size),
            load: c.load,
            rates: c.rates,
            terms: d
                .candidates
                .iter()
                .find(|s| s.replica == c.replica)
                .map(|s| s.terms),
        })
        .collect()
}

/// Where the request may go when the chosen replica cannot take it: the runner-up, when the
/// policy ranked one and it is another endpoint.
fn alternates(lookup: &Lookup<'_>, decision: &Decision) -> Vec<String> {
    let chosen = lookup.replicas.get(decision.replica as usize);
    decision
        .runner_up
        .and_then(|(i, _)| lookup.replicas.get(i as usize))
        .filter(|r| chosen.is_none_or(|c| c.endpoint != r.endpoint))
        .map(|r| vec![r.endpoint.clone()])
        .unwrap_or_default()
}

/// Step three: the decision's load and metrics, and the answer.
#[allow(clippy::too_many_arguments)]
fn record(
    state: &AppState,
    req: &RouteRequest,
    lookup: &Lookup<'_>,
    cands: &[Candidate],
    decision: &Decision,
    label: Option<&'static str>,
    chosen: &Arc<Replica>,
    explain: Option<Vec<CandidateExplain>>,
    policy: &dyn RoutePolicy,
) -> RouteResponse {
    let reason = label.unwrap_or(decision.reason.as_str()).to_string();
    let bs = lookup.keys.block_size;
    let m = decision.matched;
    let matched_tokens = matched_tokens(&m, bs);
    let predicted_tokens = matched_tokens.gpu + matched_tokens.cpu + matched_tokens.storage;
    let prompt_blocks = lookup.shape.usable_blocks;
    let uncached_blocks = prompt_blocks.saturating_sub(m.total());
    let rates = cands
        .get(decision.replica as usize)
        .map_or_else(|| state.config.scoring.prior_rates(), |c| c.rates);
    let prefill_time = prefill_estimate(&rates, uncached_blocks, bs);
    let decode_time = state.load.config().decode_time(req.max_tokens);
    if req.shadow {
        let keys: Vec<u64> = lookup.keys.usable().iter().map(|k| k.0).collect();
        let decision_id = state.shadow.decided(crate::shadow::NewShadow {
            model: &lookup.keys.model.name,
            endpoint: &chosen.endpoint,
            predicted_tokens,
            prompt_tokens: lookup.keys.num_tokens as u64,
            session: lookup.session,
            keys: &keys,
            block_size: bs,
            fleet_capacity_blocks: state.fleet_kv_capacity_blocks(&lookup.keys.model.name),
        });
        state.metrics.count_decision(&reason);
        tracing::debug!(model = %lookup.keys.model.name, replica = %chosen.name, %reason, predicted_tokens, %decision_id, "shadow decision");
        return RouteResponse {
            endpoint: chosen.endpoint.clone(),
            alternates: alternates(lookup, decision),
            replica: chosen.name.clone(),
            matched_tokens,
            reason,
            request_id: req
                .request_id
                .clone()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| decision_id.clone()),
            decision_id,
            policy: state.policy.as_str().to_string(),
            prompt_blocks,
            cost: decision.terms.cost_s,
            predicted_ttft_ms: decision.terms.ttft_s * 1000.0,
            explain,
            report_hold_ms: Some(state.config.report_hold_ms()),
        };
    }
    let routed = state.load.routed(NewDecision {
        replica: chosen.clone(),
        predicted_tokens,
        prefill_blocks: uncached_blocks,
        prefill_time,
        decode_time,
        output_tokens: u64::from(lookup.shape.output_tokens),
        output_blocks: lookup.shape.output_tokens.div_ceil(bs.max(1)),
        predicted_ttft_s: decision.terms.ttft_s,
        partial: lookup.keys.partial,
        callout: req.callout_id.clone(),
    });
    if routed.counted {
        chosen.count_routed_prefill(state.config.inflight.recent_work_window_s, prefill_time);
    }
    let decision_id = routed.id.to_string();
    let request_id = req
        .request_id
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| decision_id.clone());
    if let (Some(link), true) = (&state.peers, routed.counted) {
        let (skip, keys) = policy.shared_keys(lookup, &m);
        let keys = &keys[..keys.len().min(kvroute_core::peers::MAX_SHARED_KEYS)];
        let ms = |d: Duration| u32::try_from(d.as_millis()).unwrap_or(u32::MAX);
        let short = |s: &str| s.len() <= kvroute_core::peers::MAX_SHARED_STRING_BYTES;
        link.publish(kvroute_core::peers::PeerMessage::Routed(
            kvroute_core::peers::SharedDecision {
                decision_id: decision_id.clone(),
                request_id: req.request_id.clone().filter(|s| short(s)),
                model: lookup.keys.model.name.clone(),
                replica: chosen.name.clone(),
                block_size: bs,
                uncached_blocks,
                prefill_ms: ms(prefill_time),
                decode_ms: ms(decode_time),
                output_tokens: u64::from(lookup.shape.output_tokens),
                ttft_ms: ms(Duration::try_from_secs_f64(decision.terms.ttft_s).unwrap_or_default()),
                predicted_keys: keys.iter().map(|k| k.0).collect(),
                skip,
                session: lookup.session.filter(|s| short(s)).map(str::to_string),
                prompt: lookup.usable().last().map(|last| SharedPrompt {
                    last_key: last.0,
                    blocks: u32::try_from(lookup.usable().len()).unwrap_or(u32::MAX),
                    continues: lookup.continues.map(|k| k.0),
                }),
            },
        ));
    }
    state.metrics.routed.fetch_add(1, Ordering::Relaxed);
    if lookup.keys.partial {
        state
            .metrics
            .partial_predictions
            .fetch_add(1, Ordering::Relaxed);
    }
    state.metrics.count_decision(&reason);
    let t = &decision.terms;
    let load = cands
        .iter()
        .find(|c| c.replica == decision.replica)
        .map(|c| c.load)
        .unwrap_or_default();
    tracing::debug!(
        model = %lookup.keys.model.name,
        replica = %chosen.name,
        in_flight = load.in_flight,
        running = load.running,
        waiting = load.waiting,
        kv = load.kv_fraction(),
        cache_fill = load.cache_fill,
        pending_tokens = load.pending_prefill_tokens,
        %reason,
        prompt_blocks,
        gpu = m.gpu, cpu = m.cpu, storage = m.storage, predicted = m.predicted,
        cost_s = t.cost_s,
        ttft_s = t.ttft_s,
        queue_wait_s = t.queue_wait_s,
        prefill_s = t.prefill_s,
        tier_load_s = t.tier_load_s,
        kv_pressure_s = t.kv_pressure_s,
        harm_s = t.harm_s,
        arrivals_harm_s = t.arrivals_harm_s,
        displace_s = t.displace_s,
        successors_s = t.successors_s,
        expected_successors = lookup.shape.expected_successors,
        crowding_s = t.crowding_s,
        session_blocks = lookup.shape.session_blocks,
        resident_session_blocks = load.resident_session_blocks,
        recent_busy = load.recent_prefill_busy,
        runner_up = ?decision.runner_up,
        tied = decision.tied,
        %decision_id,
        counted = routed.counted,
        "route decision"
    );
    if decision.reason == DecisionReason::LoadOverPrefix && tracing::enabled!(tracing::Level::DEBUG)
    {
        log_prefix_given_away(lookup, cands, decision);
    }
    RouteResponse {
        endpoint: chosen.endpoint.clone(),
        alternates: alternates(lookup, decision),
        replica: chosen.name.clone(),
        matched_tokens,
        reason,
        decision_id,
        request_id,
        policy: state.policy.as_str().to_string(),
        prompt_blocks,
        cost: t.cost_s,
        predicted_ttft_ms: t.ttft_s * 1000.0,
        explain,
        report_hold_ms: Some(state.config.report_hold_ms()),
    }
}
