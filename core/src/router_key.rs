//! kvroute's own chained 64-bit block key, the key of the indexer's block index.
//!
//! ```text
//! key_0 = ROOT
//! key_{i+1} = xxh3_64_with_seed(encode(tokens of block i, event-style extra keys of block i), key_i)
//! ```
//!
//! Why two hashes exist:
//! * The **engine hash** ([`crate::hashing`]) is what vLLM itself computes; it depends on the
//!   engine's `--prefix-caching-hash-algo`, its `PYTHONHASHSEED`, its version's extra-key shapes
//!   and, for LoRA, the adapter *path*, which events never publish. kvroute needs it to apply
//!   each replica's events (a `BlockRemoved` names blocks only by engine hash) and to check,
//!   online, that it reproduces the engine exactly.
//! * The **router key** depends only on what every `BlockStored` carries (token ids and the
//!   published extra keys), so the index works whatever algorithm or seed the engines use (even
//!   a random per-process seed), replicas configured differently still share keys, and a
//!   request's keys come from its tokens with one fast non-cryptographic hash per block.
//!
//! Encoding of one block (all integers little-endian, so the byte string is unambiguous):
//! `u32 token count, u32 tokens...`, then `0x00` when the block has no extra keys, or `0x01`,
//! `u32 count` and each value as `0x01 u32 len utf8` (str), `0x02 i64` (int), `0x03 u32 len
//! bytes` (bytes) or `0x04 u32 count values...` (list).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::events::{BlockStored, ExtraKeyValue};
use crate::hashing::{ExtraKeyStyle, RequestExtras};

/// A router key: kvroute's chained 64-bit hash of a block and everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RouterKey(pub u64);

/// The parent of the first block of every chain.
pub const ROOT: RouterKey = RouterKey(0x6b76_726f_7574_6521); // "kvroute!"

/// Errors computing router keys from an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterKeyError {
    /// The event's block size is zero.
    #[error("BlockStored has block_size 0")]
    ZeroBlockSize,
    /// `token_ids` does not hold exactly `block_size` tokens per block hash.
    #[error(
        "BlockStored has {got} token ids for {blocks} blocks of {block_size} (expected {expected})"
    )]
    TokenCountMismatch {
        /// Number of block hashes.
        blocks: usize,
        /// Tokens per block.
        block_size: usize,
        /// `blocks * block_size`.
        expected: usize,
        /// `token_ids.len()`.
        got: usize,
    },
    /// `extra_keys` does not have one entry per block.
    #[error("BlockStored has {got} extra_keys entries for {blocks} blocks")]
    ExtraKeysCountMismatch {
        /// Number of block hashes.
        blocks: usize,
        /// `extra_keys.len()`.
        got: usize,
    },
}

fn put_u32(buf: &mut Vec<u8>, v: usize) {
    // Lengths above u32::MAX cannot occur in a block; saturate rather than wrap.
    buf.extend_from_slice(&u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &ExtraKeyValue) {
    match v {
        ExtraKeyValue::Str(s) => {
            buf.push(0x01);
            put_u32(buf, s.len());
            buf.extend_from_slice(s.as_bytes());
        }
        ExtraKeyValue::Int(i) => {
            buf.push(0x02);
            buf.extend_from_slice(&i.to_le_bytes());
        }
        ExtraKeyValue::Bytes(b) => {
            buf.push(0x03);
            put_u32(buf, b.len());
            buf.extend_from_slice(b);
        }
        ExtraKeyValue::List(items) => {
            buf.push(0x04);
            put_u32(buf, items.len());
            for item in items {
                put_value(buf, item);
            }
        }
    }
}

fn chain_with(
    buf: &mut Vec<u8>,
    parent: RouterKey,
    block_tokens: &[u32],
    extra: Option<&[ExtraKeyValue]>,
) -> RouterKey {
    buf.clear();
    put_u32(buf, block_tokens.len());
    // The tokens' little-endian bytes, written into place (one resize, no per-token growth).
    let start = buf.len();
    buf.resize(start + 4 * block_tokens.len(), 0);
    for (to, t) in buf[start..].chunks_exact_mut(4).zip(block_tokens) {
        to.copy_from_slice(&t.to_le_bytes());
    }
    match extra {
        None => buf.push(0x00),
        Some(values) => {
            buf.push(0x01);
            put_u32(buf, values.len());
            for v in values {
                put_value(buf, v);
            }
        }
    }
    RouterKey(xxh3_64_with_seed(buf, parent.0))
}

/// The key of a block given its parent's key, its tokens and its extra keys as events publish
/// them (`BlockStored.extra_keys[i]`; `None` when the block has none).
pub fn chain(
    parent: RouterKey,
    block_tokens: &[u32],
    extra: Option<&[ExtraKeyValue]>,
) -> RouterKey {
    let mut buf = Vec::with_capacity(8 + block_tokens.len() * 4);
    chain_with(&mut buf, parent, block_tokens, extra)
}

/// The keys of every full block of a request's prompt, chained from [`ROOT`].
pub fn request_keys(
    tokens: &[u32],
    block_size: usize,
    extras: &RequestExtras,
    style: ExtraKeyStyle,
) -> Vec<RouterKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut buf = Vec::with_capacity(16 + block_size * 4);
    let mut parent = ROOT;
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        let keys = extras.block_extra_keys(i, block_size, style);
        parent = chain_with(&mut buf, parent, block, keys.event.as_deref());
        out.push(parent);
    }
    out
}

/// The keys of the blocks a `BlockStored` announces, chained from `parent` (the key of the
/// event's parent block, or [`ROOT`] when it has none).
///
/// Engines that publish no `extra_keys` but a `lora_name` (before extra keys were published)
/// get the name as each block's only extra key, which is what such engines hashed.
pub fn event_keys(parent: RouterKey, ev: &BlockStored) -> Result<Vec<RouterKey>, RouterKeyError> {
    let block_size = ev.block_size as usize;
    if block_size == 0 {
        return Err(RouterKeyError::ZeroBlockSize);
    }
    let blocks = ev.block_hashes.len();
    let expected = blocks.saturating_mul(block_size);
    if ev.token_ids.len() != expected {
        return Err(RouterKeyError::TokenCountMismatch {
            blocks,
            block_size,
            expected,
            got: ev.token_ids.len(),
        });
    }
    if let Some(extra) = &ev.extra_keys {
        if extra.len() != blocks {
            return Err(RouterKeyError::ExtraKeysCountMismatch {
                blocks,
                got: extra.len(),
            });
        }
    }
    let lora_only = match (&ev.extra_keys, &ev.lora_name) {
        (None, Some(name)) => Some(vec![ExtraKeyValue::Str(name.clone())]),
        _ => None,
    };
    let mut buf = Vec::with_capacity(16 + block_size * 4);
    let mut key = parent;
    let mut out = Vec::with_capacity(blocks);
    for (i, block) in ev.token_ids.chunks_exact(block_size).enumerate() {
        let extra = match &ev.extra_keys {
            Some(per_block) => per_block.get(i).and_then(|e| e.as_deref()),
            None => lora_only.as_deref(),
        };
        key = chain_with(&mut buf, key, block, extra);
        out.push(key);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::WireBlockHash;
    use crate::hashing::{LoraRef, MmFeature};

    fn tokens(n: u32) -> Vec<u32> {
        (0..n)
            .map(|i| i.wrapping_mul(2_654_435_761) % 151_000)
            .collect()
    }

    #[test]
    fn keys_are_the_ones_earlier_versions_computed() {
        // Snapshots and gateways sharing decisions hold these values (the ones revision 8503c5d
        // computed): a change of the byte layout or the hash would orphan every saved key.
        let t = tokens(48);
        let plain = chain(ROOT, &t[..16], None);
        let next = chain(plain, &t[16..32], None);
        let extra = vec![
            ExtraKeyValue::Str("lora-a".into()),
            ExtraKeyValue::Int(-7),
            ExtraKeyValue::Bytes(vec![1, 2, 3]),
            ExtraKeyValue::List(vec![ExtraKeyValue::Int(5)]),
        ];
        let with_extra = chain(next, &t[32..48], Some(&extra));
        assert_eq!(
            [plain.0, next.0, with_extra.0],
            [
                0x8065_d93e_a73c_46e3,
                0x7811_c62c_53fa_5706,
                0x126d_c8e9_3f1a_5a5c
            ],
            "{:#018x} {:#018x} {:#018x}",
            plain.0,
            next.0,
            with_extra.0
        );
    }

    #[test]
    fn keys_depend_on_parent_tokens_and_extras() {
        let t = tokens(16);
        let a = chain(ROOT, &t, None);
        assert_ne!(a, chain(RouterKey(1), &t, None));
        assert_ne!(a, chain(ROOT, &t[..15], None));
        let salt = [ExtraKeyValue::Str("s".into())];
        assert_ne!(a, chain(ROOT, &t, Some(&salt)));
        assert_ne!(chain(ROOT, &t, Some(&[])), a);
        // Nesting is part of the encoding: ["a", 1] differs from [["a", 1]].
        let flat = [ExtraKeyValue::Str("a".into()), ExtraKeyValue::Int(1)];
        let nested = [ExtraKeyValue::List(flat.to_vec())];
        assert_ne!(chain(ROOT, &t, Some(&flat)), chain(ROOT, &t, Some(&nested)));
    }

    #[test]
    fn request_and_event_keys_agree_with_mm_lora_and_salt() {
        let t = tokens(50);
        let extras = RequestExtras {
            lora: Some(LoraRef {
                name: "l".into(),
                path: "/p".into(),
            }),
            cache_salt: Some("salt".into()),
            mm_features: vec![MmFeature {
                identifier: "img".into(),
                offset: 5,
                length: 30,
            }],
        };
        let req = request_keys(&t, 16, &extras, ExtraKeyStyle::Tagged);
        assert_eq!(req.len(), 3);
        let ev = BlockStored {
            block_hashes: (0..3).map(WireBlockHash::Int).collect(),
            token_ids: t[..48].to_vec(),
            block_size: 16,
            extra_keys: Some(
                (0..3)
                    .map(|i| extras.block_extra_keys(i, 16, ExtraKeyStyle::Tagged).event)
                    .collect(),
            ),
            ..Default::default()
        };
        assert_eq!(event_keys(ROOT, &ev), Ok(req.clone()));
        // The continuation of a chain from its parent's key.
        let tail = BlockStored {
            block_hashes: vec![WireBlockHash::Int(9)],
            token_ids: t[32..48].to_vec(),
            block_size: 16,
            extra_keys: ev.extra_keys.as_ref().map(|e| e[2..].to_vec()),
            ..Default::default()
        };
        assert_eq!(event_keys(req[1], &tail), Ok(vec![req[2]]));
    }

    #[test]
    fn lora_name_without_extra_keys_is_the_block_key() {
        let t = tokens(32);
        let extras = RequestExtras {
            lora: Some(LoraRef {
                name: "l".into(),
                path: "/p".into(),
            }),
            ..Default::default()
        };
        let ev = BlockStored {
            block_hashes: vec![WireBlockHash::Int(1), WireBlockHash::Int(2)],
            token_ids: t.clone(),
            block_size: 16,
            lora_name: Some("l".into()),
            ..Default::default()
        };
        assert_eq!(
            event_keys(ROOT, &ev),
            Ok(request_keys(&t, 16, &extras, ExtraKeyStyle::Plain))
        );
    }

    #[test]
    fn malformed_events_are_errors() {
        let ev = BlockStored {
            block_hashes: vec![WireBlockHash::Int(1), WireBlockHash::Int(2)],
            token_ids: tokens(31),
            block_size: 16,
            ..Default::default()
        };
        assert!(matches!(
            event_keys(ROOT, &ev),
            Err(RouterKeyError::TokenCountMismatch {
                expected: 32,
                got: 31,
                ..
            })
        ));
        let ev = BlockStored {
            block_size: 0,
            ..ev
        };
        assert_eq!(event_keys(ROOT, &ev), Err(RouterKeyError::ZeroBlockSize));
        let ev = BlockStored {
            block_hashes: vec![WireBlockHash::Int(1)],
            token_ids: tokens(16),
            block_size: 16,
            extra_keys: Some(vec![None, None]),
            ..Default::default()
        };
        assert!(matches!(
            event_keys(ROOT, &ev),
            Err(RouterKeyError::ExtraKeysCountMismatch { blocks: 1, got: 2 })
        ));
    }
}
