//! The message that a gateway's indexer shares with the other gateways' indexers in front of the
//! same fleet: each routing decision it made and each end of one (completion, abandon), so that a
//! peer counts that load and follows the predicted blocks of a sibling burst as if it had decided
//! itself. Carried over Redis/Valkey pub/sub by the indexer (`[peers]`).
//!
//! Encoded with postcard: a decision carries up to thousands of 64-bit router keys, which postcard
//! writes as varints (JSON would spell each in up to 20 digits, about 2.5x the bytes and a slower
//! parse on the route path of every peer). Every message starts with [`PEER_WIRE_VERSION`]: a peer
//! of another version is ignored (counted), never misread.

use serde::{Deserialize, Serialize};

/// Version of the encoding below; bumped on any incompatible change (2: [`SharedPrompt`]).
pub const PEER_WIRE_VERSION: u16 = 2;

/// Most router keys one shared decision carries (blocks past it are not predicted at peers).
pub const MAX_SHARED_KEYS: usize = 16_384;

/// Longest string field (ids, names, session) accepted from a peer, in bytes.
pub const MAX_SHARED_STRING_BYTES: usize = 256;

/// Most blocks a shared count of prompt blocks may say (`uncached_blocks`, `skip`, a prompt's
/// `blocks`): 2^20, 16M tokens at 16 per block, past any model's context.
pub const MAX_SHARED_BLOCKS: u32 = 1 << 20;

/// Most output tokens a shared decision may expect (2^24).
pub const MAX_SHARED_OUTPUT_TOKENS: u64 = 1 << 24;

/// One message on the peers channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerEnvelope {
    /// [`PEER_WIRE_VERSION`] of the sender.
    pub version: u16,
    /// The sending indexer process (random per start): a receiver drops its own messages.
    pub origin: u64,
    /// What happened.
    pub message: PeerMessage,
}

/// A decision or the end of one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PeerMessage {
    /// A request was routed.
    Routed(SharedDecision),
    /// A request that was routed ended (completed, abandoned); its decision id.
    Ended {
        /// The sender's `decision_id`.
        decision_id: String,
    },
}

/// One routing decision, as a peer needs it to count its load and follow its prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedDecision {
    /// The sender's decision id (unique per sender process; keys the later [`PeerMessage::Ended`]).
    pub decision_id: String,
    /// The client's request id, when it gave one (logs only).
    pub request_id: Option<String>,
    /// Served model name.
    pub model: String,
    /// Replica name (replica names are global and the same in every gateway's configuration).
    pub replica: String,
    /// Tokens per block of the router keys below.
    pub block_size: u32,
    /// Prompt blocks not cached on the replica (its pending prefill).
    pub uncached_blocks: u32,
    /// The sender's estimate of that prefill's duration, ms.
    pub prefill_ms: u32,
    /// The sender's estimate of the decode time, ms.
    pub decode_ms: u32,
    /// Output tokens expected.
    pub output_tokens: u64,
    /// The sender's predicted time to first token, ms (when its KV blocks come back).
    pub ttft_ms: u32,
    /// Router keys of the blocks the decision predicts the replica will hold (the new part of the
    /// prefix, in prompt order, starting right after what was already matched there: `skip`).
    pub predicted_keys: Vec<u64>,
    /// How many prompt blocks precede `predicted_keys` (already held by the replica).
    pub skip: u32,
    /// Session id, when the request had one.
    pub session: Option<String>,
    /// The prompt as a session's turn, so that a peer follows the sessions this gateway placed
    /// (`None` for a prompt with no full block).
    pub prompt: Option<SharedPrompt>,
}

/// A routed prompt as the chain of requests it belongs to: a session's turn continues the prompt
/// before it when it starts with that whole prompt (router keys chain, so a prompt's last key
/// names all of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedPrompt {
    /// Router key of the prompt's last usable block.
    pub last_key: u64,
    /// Usable blocks of the prompt.
    pub blocks: u32,
    /// Last key of the earlier prompt it continues, as the sender found it (`None`: a chain's
    /// first request).
    pub continues: Option<u64>,
}

/// Why a peer message was refused.
#[derive(Debug, thiserror::Error)]
pub enum PeerWireError {
    /// Not postcard of a [`PeerEnvelope`].
    #[error("undecodable peer message: {0}")]
    Decode(String),
    /// Another wire version.
    #[error("peer message of wire version {0}, this indexer speaks {PEER_WIRE_VERSION}")]
    Version(u16),
    /// A field over its limit.
    #[error("peer message field {0} over its limit")]
    TooLarge(&'static str),
}

impl PeerEnvelope {
    /// A message of this version from `origin`.
    pub fn new(origin: u64, message: PeerMessage) -> Self {
        Self {
            version: PEER_WIRE_VERSION,
            origin,
            message,
        }
    }

    /// The bytes to publish.
    pub fn encode(&self) -> Vec<u8> {
        // Serialising plain structs into a Vec cannot fail.
        postcard::to_stdvec(self).unwrap_or_default()
    }

    /// Decodes and checks the limits.
    pub fn decode(bytes: &[u8]) -> Result<Self, PeerWireError> {
        // The version is the first field: read it alone first, so another version is named.
        let (version, _): (u16, _) =
            postcard::take_from_bytes(bytes).map_err(|e| PeerWireError::Decode(e.to_string()))?;
        if version != PEER_WIRE_VERSION {
            return Err(PeerWireError::Version(version));
        }
        let env: PeerEnvelope =
            postcard::from_bytes(bytes).map_err(|e| PeerWireError::Decode(e.to_string()))?;
        env.check()?;
        Ok(env)
    }

    fn check(&self) -> Result<(), PeerWireError> {
        let long = |s: &str| s.len() > MAX_SHARED_STRING_BYTES;
        match &self.message {
            PeerMessage::Ended { decision_id } if long(decision_id) => {
                Err(PeerWireError::TooLarge("decision_id"))
            }
            PeerMessage::Ended { .. } => Ok(()),
            PeerMessage::Routed(d) => {
                if long(&d.decision_id) {
                    return Err(PeerWireError::TooLarge("decision_id"));
                }
                if long(&d.model) {
                    return Err(PeerWireError::TooLarge("model"));
                }
                if long(&d.replica) {
                    return Err(PeerWireError::TooLarge("replica"));
                }
                if d.request_id.as_deref().is_some_and(long) {
                    return Err(PeerWireError::TooLarge("request_id"));
                }
                if d.session.as_deref().is_some_and(long) {
                    return Err(PeerWireError::TooLarge("session"));
                }
                if d.predicted_keys.len() > MAX_SHARED_KEYS {
                    return Err(PeerWireError::TooLarge("predicted_keys"));
                }
                let blocks = [
                    ("uncached_blocks", d.uncached_blocks),
                    ("skip", d.skip),
                    ("prompt.blocks", d.prompt.map_or(0, |p| p.blocks)),
                ];
                if let Some(&(field, _)) = blocks.iter().find(|(_, n)| *n > MAX_SHARED_BLOCKS) {
                    return Err(PeerWireError::TooLarge(field));
                }
                if d.output_tokens > MAX_SHARED_OUTPUT_TOKENS {
                    return Err(PeerWireError::TooLarge("output_tokens"));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision() -> SharedDecision {
        SharedDecision {
            decision_id: "0a0b0c0d-1f".into(),
            request_id: Some("req-1".into()),
            model: "qwen3".into(),
            replica: "r1".into(),
            block_size: 16,
            uncached_blocks: 100,
            prefill_ms: 40,
            decode_ms: 5_000,
            output_tokens: 128,
            ttft_ms: 60,
            predicted_keys: (0..100u64)
                .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect(),
            skip: 3,
            session: None,
            prompt: Some(SharedPrompt {
                last_key: 99,
                blocks: 103,
                continues: Some(42),
            }),
        }
    }

    #[test]
    fn round_trips_and_refuses_other_versions_and_oversized_fields() {
        let env = PeerEnvelope::new(7, PeerMessage::Routed(decision()));
        let bytes = env.encode();
        assert_eq!(PeerEnvelope::decode(&bytes).expect("decodes"), env);
        let ended = PeerEnvelope::new(
            7,
            PeerMessage::Ended {
                decision_id: "x".into(),
            },
        );
        assert_eq!(
            PeerEnvelope::decode(&ended.encode()).expect("decodes"),
            ended
        );

        let mut other = env.clone();
        other.version = PEER_WIRE_VERSION + 1;
        assert!(matches!(
            PeerEnvelope::decode(&other.encode()),
            Err(PeerWireError::Version(v)) if v == PEER_WIRE_VERSION + 1
        ));
        let mut big = decision();
        big.predicted_keys = vec![1; MAX_SHARED_KEYS + 1];
        let big = PeerEnvelope::new(7, PeerMessage::Routed(big));
        assert!(matches!(
            PeerEnvelope::decode(&big.encode()),
            Err(PeerWireError::TooLarge("predicted_keys"))
        ));
        // Counts past any prompt or reply: a buggy or hostile peer cannot inflate the load.
        for (field, over) in [
            (
                "uncached_blocks",
                SharedDecision {
                    uncached_blocks: MAX_SHARED_BLOCKS + 1,
                    ..decision()
                },
            ),
            (
                "skip",
                SharedDecision {
                    skip: u32::MAX,
                    ..decision()
                },
            ),
            (
                "prompt.blocks",
                SharedDecision {
                    prompt: Some(SharedPrompt {
                        last_key: 1,
                        blocks: MAX_SHARED_BLOCKS + 1,
                        continues: None,
                    }),
                    ..decision()
                },
            ),
            (
                "output_tokens",
                SharedDecision {
                    output_tokens: MAX_SHARED_OUTPUT_TOKENS + 1,
                    ..decision()
                },
            ),
        ] {
            let env = PeerEnvelope::new(7, PeerMessage::Routed(over));
            assert!(
                matches!(PeerEnvelope::decode(&env.encode()), Err(PeerWireError::TooLarge(f)) if f == field),
                "{field}"
            );
        }
        let at_limit = SharedDecision {
            uncached_blocks: MAX_SHARED_BLOCKS,
            output_tokens: MAX_SHARED_OUTPUT_TOKENS,
            ..decision()
        };
        let env = PeerEnvelope::new(7, PeerMessage::Routed(at_limit));
        assert!(PeerEnvelope::decode(&env.encode()).is_ok());
        assert!(matches!(
            PeerEnvelope::decode(&bytes[..bytes.len() / 2]),
            Err(PeerWireError::Decode(_))
        ));
        assert!(PeerEnvelope::decode(&[]).is_err());
    }
}
