//! Applying a peer's message: its decision counts in the load, replays the policy's record
//! (predicted blocks, approx-prefix guesses, session pin) and places its prompt among the
//! sessions followed (`crate::successors`) as if this indexer had made it; its end releases that
//! count.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvroute_core::peers::{PeerEnvelope, PeerMessage, PeerWireError, SharedDecision};
use kvroute_core::router_key::RouterKey;

use super::PeerLink;
use crate::load::{NewDecision, MAX_PREFILL_ESTIMATE};
use crate::lookup::RemoteRecord;
use crate::membership::lock;
use crate::policies::route_policy;
use crate::state::AppState;

/// Applies one message received on the peers channel (undecodable, foreign-version, own and
/// unknown-replica messages are counted and skipped).
pub fn apply_message(state: &AppState, bytes: &[u8]) {
    let Some(link) = &state.peers else {
        return;
    };
    let stats = &link.stats;
    stats.received.fetch_add(1, Ordering::Relaxed);
    let env = match PeerEnvelope::decode(bytes) {
        Ok(env) => env,
        Err(e) => {
            stats.reject(match e {
                PeerWireError::Version(_) => "version",
                PeerWireError::TooLarge(_) => "too_large",
                PeerWireError::Decode(_) => "undecodable",
            });
            tracing::debug!(error = %e, "peer message refused");
            return;
        }
    };
    if env.origin == link.origin {
        stats.own_skipped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    match env.message {
        PeerMessage::Routed(d) => match routed(state, link, env.origin, &d) {
            Ok(()) => {
                stats.applied_routed.fetch_add(1, Ordering::Relaxed);
            }
            Err(reason) => stats.reject(reason),
        },
        PeerMessage::Ended { decision_id } => {
            if state
                .load
                .ended_remote(&remote_key(env.origin, &decision_id))
                .is_some()
            {
                stats.applied_ended.fetch_add(1, Ordering::Relaxed);
            } else {
                // Expired, evicted, or its decision was lost: nothing to release.
                stats.reject("unknown_decision");
            }
        }
    }
}

/// The load table's key of a peer's decision.
fn remote_key(origin: u64, decision_id: &str) -> String {
    format!("{origin:016x}/{decision_id}")
}

fn routed(
    state: &AppState,
    link: &PeerLink,
    origin: u64,
    d: &SharedDecision,
) -> Result<(), &'static str> {
    let model = state.models.get(&d.model).ok_or("unknown_model")?;
    let replica = state
        .fleet
        .get(&d.replica)
        .filter(|r| r.model == model.name)
        .ok_or("unknown_replica")?;
    if model.block_size().is_some_and(|bs| bs != d.block_size) {
        return Err("block_size");
    }
    let counted = state.load.routed_remote(
        &remote_key(origin, &d.decision_id),
        NewDecision {
            replica: replica.clone(),
            predicted_tokens: 0,
            prefill_blocks: d.uncached_blocks,
            prefill_time: Duration::from_millis(u64::from(d.prefill_ms)).min(MAX_PREFILL_ESTIMATE),
            decode_time: Duration::from_millis(u64::from(d.decode_ms)),
            output_tokens: d.output_tokens,
            output_blocks: u32::try_from(d.output_tokens.div_ceil(u64::from(d.block_size.max(1))))
                .unwrap_or(u32::MAX),
            predicted_ttft_s: f64::from(d.ttft_ms) / 1000.0,
            // A peer's decision is never compared here (its completion goes to its gateway).
            partial: false,
            callout: None,
        },
        link.cfg.max_remote_pending,
    );
    if !counted {
        return Err("duplicate");
    }
    // An arrival at the fleet, as the scorer's arrival rate counts it, and work at the replica.
    let now = Instant::now();
    lock(&model.arrivals).record(now);
    if let Some(prompt) = &d.prompt {
        // A session the peer placed: its turns and footprint count here as if placed here.
        let mut continuations = lock(&model.continuations);
        continuations.observe_peer(prompt, now);
        continuations.place(RouterKey(prompt.last_key), &replica.name, d.skip);
    }
    replica.count_routed_prefill(
        state.config.inflight.recent_work_window_s,
        Duration::from_millis(u64::from(d.prefill_ms)),
    );
    let keys: Vec<RouterKey> = d.predicted_keys.iter().map(|k| RouterKey(*k)).collect();
    route_policy(state.policy).record_remote(
        state,
        &RemoteRecord {
            model: &model.name,
            replica: &replica,
            keys: &keys,
            session: d.session.as_deref(),
        },
    );
    Ok(())
}
