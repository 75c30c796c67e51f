//! The per-block "extra keys" vLLM mixes into a block hash (LoRA, multimodal items, cache salt),
//! in both shapes vLLM has used, and the untagged form the same keys take in KV events.
//!
//! vLLM (`generate_block_hash_extra_keys`) orders them LoRA, multimodal, cache_salt, and gives a
//! block `None` when it has none:
//!
//! | key | [`ExtraKeyStyle::Tagged`] (>= 0.31) | [`ExtraKeyStyle::Plain`] (0.15..=0.30) | event (both) |
//! |---|---|---|---|
//! | LoRA, every block | `("lora", name, path)` | `name` | `name` |
//! | mm item overlapping the block | `("mm", id, offset - block_start)` | `(id, offset - block_start)` | `[id, offset - block_start]` |
//! | cache salt, block 0, non-empty | `("cache_salt", salt)` | `salt` | `salt` |

use serde::{Deserialize, Serialize};

use crate::events::ExtraKeyValue;

/// Which shape of extra keys the engine hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExtraKeyStyle {
    /// vLLM >= 0.31: keys are tuples tagged `"lora"`, `"mm"`, `"cache_salt"`.
    #[default]
    Tagged,
    /// vLLM 0.15..=0.30: LoRA name and salt as plain strings, mm items as `(id, offset)`.
    Plain,
}

impl ExtraKeyStyle {
    /// The style a vLLM release uses, from its version string (`"0.33.0"`, `"0.30.1+cu128"`,
    /// `"v0.31.0rc1"`). Unparsable versions get the current style ([`ExtraKeyStyle::Tagged`]).
    /// Releases before 0.15 hashed the LoRA int id instead of its name, which neither style
    /// models; they map to `Plain`.
    pub fn for_engine_version(version: &str) -> Self {
        match parse_version(version) {
            Some((major, minor)) if (major, minor) < (0, 31) => ExtraKeyStyle::Plain,
            _ => ExtraKeyStyle::Tagged,
        }
    }
}

/// `(major, minor)` of a vLLM version string, ignoring a leading `v` and any suffix.
pub(crate) fn parse_version(version: &str) -> Option<(u32, u32)> {
    let v = version.trim().trim_start_matches('v');
    let mut parts = v.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor_part = parts.next()?;
    let digits: String = minor_part
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    let minor = digits.parse().ok()?;
    Some((major, minor))
}

/// A multimodal item placed in the prompt (vLLM's `MultiModalFeatureSpec`): its identifier
/// (the mm hash or user-given uuid) and its placeholder token range.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MmFeature {
    /// `identifier` as the engine hashes it.
    pub identifier: String,
    /// First placeholder token of the item in the prompt.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// A LoRA adapter as the engine knows it: the name clients use and the path it was loaded from
/// (vLLM >= 0.31 hashes both; events carry only the name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoraRef {
    /// `lora_name`.
    pub name: String,
    /// `lora_path`.
    pub path: String,
}

/// Everything about a request besides its tokens that goes into its block hashes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RequestExtras {
    /// The LoRA adapter the request uses, if any.
    pub lora: Option<LoraRef>,
    /// `cache_salt` of the request body (an empty salt counts as none, as in vLLM).
    pub cache_salt: Option<String>,
    /// Multimodal items, sorted by offset (as vLLM keeps them).
    pub mm_features: Vec<MmFeature>,
}

/// One element of a block's hashed extra keys, mirroring the Python object vLLM hashes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HashExtraKey {
    /// A string that is a fresh Python object (names, paths, salts, identifiers).
    Str(String),
    /// A string literal of vLLM's code (`"lora"`, `"mm"`, `"cache_salt"`): one shared Python
    /// object, so pickle writes a repeat inside one preimage as a memo reference. Same bytes as
    /// [`HashExtraKey::Str`] in CBOR.
    Tag(&'static str),
    /// An integer (multimodal offset).
    Int(i64),
    /// A tuple.
    Tuple(Vec<HashExtraKey>),
    /// Raw bytes (prompt-embeds digests).
    Bytes(Vec<u8>),
}

/// A block's extra keys in the two shapes that matter: what the engine hashes and what its
/// `BlockStored` event publishes. Both are `None` when the block has no extra keys.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockExtraKeys {
    /// The keys hashed into the block (`None` = Python `None`).
    pub hash: Option<Vec<HashExtraKey>>,
    /// The same keys as `BlockStored.extra_keys[i]` carries them.
    pub event: Option<Vec<ExtraKeyValue>>,
}

impl RequestExtras {
    /// True when no block of this request has extra keys.
    pub fn is_empty(&self) -> bool {
        self.lora.is_none() && self.salt().is_none() && self.mm_features.is_empty()
    }

    fn salt(&self) -> Option<&str> {
        self.cache_salt.as_deref().filter(|s| !s.is_empty())
    }

    /// The extra keys of block `block_index` (tokens `block_index * block_size ..` of the
    /// prompt), in vLLM's order: LoRA, multimodal, cache_salt.
    pub fn block_extra_keys(
        &self,
        block_index: usize,
        block_size: usize,
        style: ExtraKeyStyle,
    ) -> BlockExtraKeys {
        if self.is_empty() {
            return BlockExtraKeys::default();
        }
        let start = block_index.saturating_mul(block_size);
        let end = start.saturating_add(block_size);
        let mut hash = Vec::new();
        let mut event = Vec::new();

        if let Some(lora) = &self.lora {
            hash.push(match style {
                ExtraKeyStyle::Tagged => HashExtraKey::Tuple(vec![
                    HashExtraKey::Tag("lora"),
                    HashExtraKey::Str(lora.name.clone()),
                    HashExtraKey::Str(lora.path.clone()),
                ]),
                ExtraKeyStyle::Plain => HashExtraKey::Str(lora.name.clone()),
            });
            event.push(ExtraKeyValue::Str(lora.name.clone()));
        }

        for (mm, rel) in mm_items_in_block(&self.mm_features, start, end) {
            let id = HashExtraKey::Str(mm.identifier.clone());
            hash.push(HashExtraKey::Tuple(match style {
                ExtraKeyStyle::Tagged => vec![HashExtraKey::Tag("mm"), id, HashExtraKey::Int(rel)],
                ExtraKeyStyle::Plain => vec![id, HashExtraKey::Int(rel)],
            }));
            event.push(ExtraKeyValue::List(vec![
                ExtraKeyValue::Str(mm.identifier.clone()),
                ExtraKeyValue::Int(rel),
            ]));
        }

        if let (0, Some(salt)) = (start, self.salt()) {
            hash.push(match style {
                ExtraKeyStyle::Tagged => HashExtraKey::Tuple(vec![
                    HashExtraKey::Tag("cache_salt"),
                    HashExtraKey::Str(salt.to_owned()),
                ]),
                ExtraKeyStyle::Plain => HashExtraKey::Str(salt.to_owned()),
            });
            event.push(ExtraKeyValue::Str(salt.to_owned()));
        }

        if hash.is_empty() {
            BlockExtraKeys::default()
        } else {
            BlockExtraKeys {
                hash: Some(hash),
                event: Some(event),
            }
        }
    }
}

/// The multimodal items vLLM keys block `[start, end)` with, and each one's offset relative to
/// the block start (negative when the item began in an earlier block).
///
/// This is vLLM 0.33's `_gen_mm_extra_hash_keys` walked from the first item: it skips items that
/// ended before the block, takes every item starting before the block end, and stops after an
/// item that runs past the block end. Nothing is keyed once the *last* item has ended.
fn mm_items_in_block(
    items: &[MmFeature],
    start: usize,
    end: usize,
) -> impl Iterator<Item = (&MmFeature, i64)> {
    let last_ended = items
        .last()
        .is_none_or(|last| last.offset.saturating_add(last.length) <= start);
    let mut done = last_ended;
    items.iter().filter_map(move |mm| {
        if done {
            return None;
        }
        let mm_end = mm.offset.saturating_add(mm.length);
        if end <= mm.offset {
            done = true;
            return None;
        }
        if start >= mm_end {
            return None;
        }
        if end < mm_end {
            done = true;
        }
        Some((mm, offset_diff(mm.offset, start)))
    })
}

fn offset_diff(offset: usize, start: usize) -> i64 {
    let (o, s) = (offset as i128, start as i128);
    i64::try_from(o - s).unwrap_or(if o > s { i64::MAX } else { i64::MIN })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mm(id: &str, offset: usize, length: usize) -> MmFeature {
        MmFeature {
            identifier: id.into(),
            offset,
            length,
        }
    }

    fn mm_keys(items: &[MmFeature], block: usize, bs: usize) -> Vec<(String, i64)> {
        mm_items_in_block(items, block * bs, block * bs + bs)
            .map(|(m, o)| (m.identifier.clone(), o))
            .collect()
    }

    #[test]
    fn versions_pick_the_style() {
        assert_eq!(
            ExtraKeyStyle::for_engine_version("0.33.0"),
            ExtraKeyStyle::Tagged
        );
        assert_eq!(
            ExtraKeyStyle::for_engine_version("v0.31.0rc1"),
            ExtraKeyStyle::Tagged
        );
        assert_eq!(
            ExtraKeyStyle::for_engine_version("0.30.1+cu128"),
            ExtraKeyStyle::Plain
        );
        assert_eq!(
            ExtraKeyStyle::for_engine_version("0.15.0"),
            ExtraKeyStyle::Plain
        );
        assert_eq!(
            ExtraKeyStyle::for_engine_version("1.0.0"),
            ExtraKeyStyle::Tagged
        );
        assert_eq!(
            ExtraKeyStyle::for_engine_version("garbage"),
            ExtraKeyStyle::Tagged
        );
    }

    #[test]
    fn mm_item_spanning_three_blocks_gets_negative_offsets() {
        let items = [mm("img", 10, 30)];
        assert_eq!(mm_keys(&items, 0, 16), vec![("img".into(), 10)]);
        assert_eq!(mm_keys(&items, 1, 16), vec![("img".into(), -6)]);
        assert_eq!(mm_keys(&items, 2, 16), vec![("img".into(), -22)]);
        assert!(mm_keys(&items, 3, 16).is_empty());
    }

    #[test]
    fn mm_scan_stops_after_an_item_running_past_the_block() {
        // vLLM stops at the first item that runs past the block end, even if a later
        // (overlapping) item starts inside the block.
        let items = [mm("a", 0, 40), mm("b", 4, 2)];
        assert_eq!(mm_keys(&items, 0, 16), vec![("a".into(), 0)]);
        // Once the last item has ended, vLLM keys nothing, even if an earlier one is still open.
        assert!(mm_keys(&items, 1, 16).is_empty());
        // Items touching the block boundary: [16, 16) has zero length and sits in block 1.
        let items = [mm("a", 12, 4), mm("b", 16, 0), mm("c", 16, 3)];
        assert_eq!(mm_keys(&items, 0, 16), vec![("a".into(), 12)]);
        assert_eq!(mm_keys(&items, 1, 16), vec![("c".into(), 0)]);
    }

    #[test]
    fn plain_style_shapes_and_order() {
        let extras = RequestExtras {
            lora: Some(LoraRef {
                name: "sql-lora".into(),
                path: "/p".into(),
            }),
            cache_salt: Some("salt".into()),
            mm_features: vec![mm("img", 3, 20)],
        };
        let b0 = extras.block_extra_keys(0, 16, ExtraKeyStyle::Plain);
        assert_eq!(
            b0.hash,
            Some(vec![
                HashExtraKey::Str("sql-lora".into()),
                HashExtraKey::Tuple(vec![HashExtraKey::Str("img".into()), HashExtraKey::Int(3)]),
                HashExtraKey::Str("salt".into()),
            ])
        );
        let b1 = extras.block_extra_keys(1, 16, ExtraKeyStyle::Plain);
        assert_eq!(
            b1.hash,
            Some(vec![
                HashExtraKey::Str("sql-lora".into()),
                HashExtraKey::Tuple(vec![
                    HashExtraKey::Str("img".into()),
                    HashExtraKey::Int(-13)
                ]),
            ])
        );
        // Events look the same whatever the style.
        assert_eq!(
            b0.event,
            extras.block_extra_keys(0, 16, ExtraKeyStyle::Tagged).event
        );
        assert_eq!(
            b1.event,
            extras.block_extra_keys(1, 16, ExtraKeyStyle::Tagged).event
        );
        let b2 = extras.block_extra_keys(2, 16, ExtraKeyStyle::Plain);
        assert_eq!(b2.hash, Some(vec![HashExtraKey::Str("sql-lora".into())]));
    }

    #[test]
    fn empty_salt_is_no_salt() {
        let extras = RequestExtras {
            cache_salt: Some(String::new()),
            ..Default::default()
        };
        assert_eq!(
            extras.block_extra_keys(0, 16, ExtraKeyStyle::Tagged),
            BlockExtraKeys::default()
        );
    }
}
