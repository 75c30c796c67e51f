//! Online hash self-check: for `BlockStored` events whose chain starts at block 0 (no parent),
//! recompute vLLM's block hashes with the configured algorithm, seed and LoRA paths and compare
//! them with the wire values. A mismatch means the operator's description of the engines is wrong
//! (routing by router key still works, but anything that relies on engine hashes does not): it is
//! logged loudly once per replica, counted, and shown on `/readyz` with its likely cause.
//!
//! Events are sampled: the first 32 of every stream, then one in 256.

use std::sync::atomic::Ordering;

use kvroute_core::events::{BlockStored, ExtraKeyValue};
use kvroute_core::hashing::{wire_u64, BlockHasher, HashAlgo, HashConfig, LoraRef, RequestExtras};

use crate::membership::{lock, Replica, Stream};
use crate::state::{AppState, ModelRuntime};

const ALWAYS_CHECK_FIRST: u64 = 32;
const SAMPLE_EVERY: u64 = 256;

/// Result of comparing one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckOutcome {
    /// All hashes matched.
    Match,
    /// A hash differed; the likely cause.
    Mismatch(String),
    /// The event cannot be checked (extra keys we cannot reconstruct, unknown LoRA path).
    Skipped,
}

/// Samples and checks one parentless BlockStored.
pub fn maybe_check(
    state: &AppState,
    replica: &Replica,
    stream: &Stream,
    model: &ModelRuntime,
    ev: &BlockStored,
) {
    if let Some(bs) = model.block_size() {
        if bs != ev.block_size && ev.block_size > 0 && !ev.is_hash_block_of(bs) {
            record(
                state,
                replica,
                format!(
                    "block size: the engine publishes block_size {} but models.{}.block_size is {bs}; request keys will never match",
                    ev.block_size, model.name
                ),
            );
        }
    }
    let Some(cfg) = &model.hash else {
        return;
    };
    let n = stream.stats.hash_checks.fetch_add(1, Ordering::Relaxed);
    if n >= ALWAYS_CHECK_FIRST && !n.is_multiple_of(SAMPLE_EVERY) {
        return;
    }
    state.metrics.hash_checks.fetch_add(1, Ordering::Relaxed);
    if let CheckOutcome::Mismatch(cause) = check(cfg, model, ev) {
        record(state, replica, cause);
    }
}

fn record(state: &AppState, replica: &Replica, cause: String) {
    state
        .metrics
        .hash_mismatches
        .fetch_add(1, Ordering::Relaxed);
    let mut slot = lock(&replica.hash_mismatch);
    if slot.is_none() {
        tracing::error!(
            replica = %replica.name,
            model = %replica.model,
            cause = %cause,
            "HASH SELF-CHECK FAILED: the engine's block hashes differ from what the configuration describes"
        );
        *slot = Some(cause);
    }
}

/// Compares the event's wire hashes with ours; on mismatch, tries the other algorithms and seeds
/// to name the likely cause.
pub fn check(cfg: &HashConfig, model: &ModelRuntime, ev: &BlockStored) -> CheckOutcome {
    let Some(extras) = extras_of(model, ev) else {
        return CheckOutcome::Skipped;
    };
    let Ok(hasher) = BlockHasher::new(cfg) else {
        return CheckOutcome::Skipped;
    };
    if matches_event(&hasher, &extras, ev) {
        return CheckOutcome::Match;
    }
    for algo in [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
    ] {
        for seed in [cfg.seed.clone(), None] {
            let alt = HashConfig {
                algo,
                seed: seed.clone(),
                style: cfg.style,
            };
            let Ok(h) = BlockHasher::new(&alt) else {
                continue;
            };
            if matches_event(&h, &extras, ev) {
                if algo != cfg.algo {
                    return CheckOutcome::Mismatch(format!(
                        "algorithm: the engine hashes with {algo} (seed {seed:?}), configured {}",
                        cfg.algo
                    ));
                }
                return CheckOutcome::Mismatch(format!(
                    "seed: the engine's PYTHONHASHSEED is {seed:?}, configured {:?}",
                    cfg.seed
                ));
            }
        }
    }
    if let Some(lora) = &ev.lora_name {
        return CheckOutcome::Mismatch(format!(
            "LoRA path: blocks of adapter {lora:?} do not hash with the configured path; check models.{}.loras",
            model.name
        ));
    }
    CheckOutcome::Mismatch(format!(
        "unknown: no algorithm matched with the configured seed {:?}; check the engines' PYTHONHASHSEED and models.{}.hash.engine_version",
        cfg.seed, model.name
    ))
}

/// Whether hashing the event's tokens reproduces its wire hashes, with requests hashed every
/// block (the usual case) or every `hash_block_size` tokens for any divisor of the block size
/// (`--prefix-match-unit`, which the engine does not announce).
fn matches_event(hasher: &BlockHasher, extras: &RequestExtras, ev: &BlockStored) -> bool {
    let bs = ev.block_size as usize;
    hash_block_sizes(bs).any(|hbs| {
        let digests = hasher.coarse_block_hashes(&ev.token_ids, bs, hbs, extras);
        digests.len() >= ev.block_hashes.len()
            && ev
                .block_hashes
                .iter()
                .zip(&digests)
                .all(|(w, d)| w.as_u64() == wire_u64(d))
    })
}

/// `block_size`, then its proper divisors from the largest.
fn hash_block_sizes(block_size: usize) -> impl Iterator<Item = usize> {
    std::iter::once(block_size).chain(
        (1..block_size)
            .rev()
            .filter(move |d| block_size.is_multiple_of(*d)),
    )
}

/// The request extras that produced this event, when they can be reconstructed: none, or a LoRA
/// whose path is configured (cache salts and multimodal identifiers are not checkable).
fn extras_of(model: &ModelRuntime, ev: &BlockStored) -> Option<RequestExtras> {
    if let Some(keys) = &ev.extra_keys {
        for k in keys.iter().flatten() {
            let only_lora =
                matches!(k.as_slice(), [ExtraKeyValue::Str(s)] if Some(s) == ev.lora_name.as_ref());
            if !only_lora {
                return None;
            }
        }
    }
    let mut extras = RequestExtras::default();
    if let Some(name) = &ev.lora_name {
        let path = model.loras.get(name)?;
        extras.lora = Some(LoraRef {
            name: name.clone(),
            path: path.clone(),
        });
    }
    Some(extras)
}

#[cfg(test)]
mod tests {
    use kvroute_core::events::WireBlockHash;

    use super::*;

    fn event(
        hasher: &BlockHasher,
        tokens: &[u32],
        block_size: u32,
        hash_block: usize,
    ) -> BlockStored {
        let none = RequestExtras::default();
        let hashes = hasher.coarse_block_hashes(tokens, block_size as usize, hash_block, &none);
        BlockStored {
            block_hashes: hashes
                .iter()
                .map(|d| WireBlockHash::Int(wire_u64(d)))
                .collect(),
            token_ids: tokens.to_vec(),
            block_size,
            ..BlockStored::default()
        }
    }

    #[test]
    fn events_hashed_every_block_or_every_hash_block_both_check_and_a_wrong_seed_does_not() {
        let ours = BlockHasher::new(&HashConfig::new(HashAlgo::Sha256, None)).expect("hasher");
        let other =
            BlockHasher::new(&HashConfig::new(HashAlgo::Sha256, Some("7".into()))).expect("hasher");
        let tokens: Vec<u32> = (100..164).collect();
        let none = RequestExtras::default();
        for hash_block in [16, 8, 4, 1] {
            let ev = event(&ours, &tokens, 16, hash_block);
            assert!(matches_event(&ours, &none, &ev), "hash block {hash_block}");
            assert!(
                !matches_event(&other, &none, &ev),
                "hash block {hash_block}"
            );
        }
        // A key of one hash block (8 tokens) checks at its own size.
        let partial = event(&ours, &tokens[..8], 8, 8);
        assert!(matches_event(&ours, &none, &partial));
        assert!(partial.is_hash_block_of(16));
    }
}
