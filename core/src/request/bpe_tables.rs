//! The compact form of a BPE `tokenizer.json`: the document with the model's `vocab` and
//! `merges` emptied, plus [`BpeTables`] holding them as a token list and id pairs.
//!
//! Why: `tokenizers` deserialises a model (an internally tagged enum) by first buffering the
//! whole of it, vocabulary and merges, as intermediate trees, so building Qwen3's tokenizer from
//! its 11 MB `tokenizer.json` peaks at several times the tokenizer's own size, and a Wasm VM
//! keeps that peak as linear memory for ever. From the compact form the tables deserialise
//! straight into two vectors and the BPE model is built directly ([`BPE::builder`]) with the
//! options the document names; the rest of the document is a few KiB.
//!
//! Exactness: the BPE model gets the same vocabulary, merges (same ranks) and options, and
//! the added tokens are added after the model is in place, as `tokenizers`' own deserialiser
//! does, so they get the same ids. The tokenizer digest is computed from the built tokenizer
//! (`digest.rs`), so a compact build that differed would not match the indexer's digest; the
//! tests compare the two builds' serialisation and ids on a varied corpus.

use std::collections::HashMap;
use std::fmt;

use indexmap::IndexMap;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{AddedToken, ModelWrapper, Tokenizer};

use super::RequestError;

/// A BPE model's vocabulary and merges in compact form.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BpeTables {
    /// The tokens, the one with id `i` at position `i` (ids are dense from 0).
    pub vocab: Vec<String>,
    /// The merges in rank order, each as the ids of its two tokens.
    pub merges: Vec<[u32; 2]>,
}

/// A `tokenizer.json` split into its compact form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompactTokenizerJson {
    /// The document with `model.vocab` = `{}` and `model.merges` = `[]`, every other member
    /// (including the model's options and the added tokens) as it was.
    pub tokenizer_json: Vec<u8>,
    /// The vocabulary and merges taken out.
    pub tables: BpeTables,
}

fn files_error(message: impl Into<String>) -> RequestError {
    RequestError::ModelFiles(message.into())
}

/// Splits a `tokenizer.json` into its compact form. `Ok(None)` when the compact form does not
/// cover it (not a BPE model, ids not dense from 0, a merge naming an unknown token, legacy
/// merges that are not two space-separated tokens): serve the document as it is then.
///
/// Only the model's vocabulary and merges are parsed, straight into typed tables; every other
/// member is kept as raw text in its order. (Parsed into a `Value` tree, Qwen3's 11 MB document
/// peaked at ~135 MB in the indexer that serves the form.)
pub fn compact_tokenizer_json(
    tokenizer_json: &[u8],
) -> Result<Option<CompactTokenizerJson>, RequestError> {
    let mut doc: RawMembers = serde_json::from_slice(tokenizer_json)
        .map_err(|e| files_error(format!("tokenizer.json is not JSON: {e}")))?;
    let Some(model) = doc.get("model") else {
        return Ok(None);
    };
    let Ok(mut model) = serde_json::from_str::<RawMembers>(model.get()) else {
        return Ok(None);
    };
    let model_type = model
        .get("type")
        .and_then(|t| serde_json::from_str::<String>(t.get()).ok());
    if model_type.as_deref() != Some("BPE") {
        return Ok(None);
    }
    let (Some(vocab), Some(merges)) = (model.get("vocab"), model.get("merges")) else {
        return Ok(None);
    };
    let Some(tables) = tables_of(vocab, merges) else {
        return Ok(None);
    };
    let empty_vocab = raw("{}")?;
    let empty_merges = raw("[]")?;
    model.insert("vocab".to_owned(), &empty_vocab);
    model.insert("merges".to_owned(), &empty_merges);
    let model = serde_json::value::to_raw_value(&model).map_err(|e| files_error(e.to_string()))?;
    doc.insert("model".to_owned(), &model);
    let tokenizer_json = serde_json::to_vec(&doc).map_err(|e| files_error(e.to_string()))?;
    Ok(Some(CompactTokenizerJson {
        tokenizer_json,
        tables,
    }))
}

/// An object's members, in order, each as its raw JSON text borrowed from the document.
type RawMembers<'a> = IndexMap<String, &'a RawValue>;

fn raw(json: &str) -> Result<Box<RawValue>, RequestError> {
    RawValue::from_string(json.to_owned()).map_err(|e| files_error(e.to_string()))
}

/// A merge as `tokenizers` writes it: `"a b"` (legacy) or `["a", "b"]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Merge {
    Legacy(String),
    Pair([String; 2]),
}

/// The tables of a BPE model's `vocab` and `merges`, `None` when they do not fit the compact
/// form. Both are read entry by entry straight into the tables (no map of the vocabulary and
/// no list of merge strings is held).
fn tables_of(vocab: &RawValue, merges: &RawValue) -> Option<BpeTables> {
    let entries = serde_json::from_str::<VocabEntries>(vocab.get()).ok()?.0;
    if entries.is_empty() {
        return None;
    }
    let mut by_id: Vec<Option<String>> = vec![None; entries.len()];
    for (token, id) in entries {
        let slot = by_id.get_mut(usize::try_from(id).ok()?)?;
        if slot.is_some() {
            return None;
        }
        *slot = Some(token);
    }
    let vocab: Vec<String> = by_id.into_iter().collect::<Option<_>>()?;
    let ids: HashMap<&str, u32> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| Some((t.as_str(), u32::try_from(i).ok()?)))
        .collect::<Option<_>>()?;
    if ids.len() != vocab.len() {
        // A token listed twice: not what the whole document's parse would build.
        return None;
    }
    let mut de = serde_json::Deserializer::from_str(merges.get());
    let merges = MergeIds(&ids).deserialize(&mut de).ok()?;
    Some(BpeTables { vocab, merges })
}

/// A JSON object's `(token, id)` members in document order.
struct VocabEntries(Vec<(String, u64)>);

impl<'de> Deserialize<'de> for VocabEntries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = VocabEntries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of token to id")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(entry) = map.next_entry::<String, u64>()? {
                    entries.push(entry);
                }
                Ok(VocabEntries(entries))
            }
        }
        deserializer.deserialize_map(Entries)
    }
}

/// Reads a merges list as token id pairs, one merge at a time (an error where the compact form
/// does not cover a merge).
struct MergeIds<'a>(&'a HashMap<&'a str, u32>);

impl<'de> DeserializeSeed<'de> for MergeIds<'_> {
    type Value = Vec<[u32; 2]>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MergeIds<'_> {
    type Value = Vec<[u32; 2]>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of merges")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(merge) = seq.next_element::<Merge>()? {
            let (a, b) = match &merge {
                // `tokenizers`' legacy form: exactly two tokens separated by one space.
                Merge::Legacy(s) => {
                    let mut parts = s.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(a), Some(b), None) => (a, b),
                        _ => return Err(A::Error::custom("not two space-separated tokens")),
                    }
                }
                Merge::Pair([a, b]) => (a.as_str(), b.as_str()),
            };
            match (self.0.get(a), self.0.get(b)) {
                (Some(&a), Some(&b)) => pairs.push([a, b]),
                _ => return Err(A::Error::custom("a merge names an unknown token")),
            }
        }
        Ok(pairs)
    }
}

/// Whether a parsed `tokenizer.json` is a compact one (a BPE model with empty vocab and merges),
/// which only loads together with its [`BpeTables`].
pub(crate) fn is_compact(tokenizer_json: &Value) -> bool {
    tokenizer_json.get("model").is_some_and(|m| {
        m.get("type").and_then(Value::as_str) == Some("BPE")
            && m.get("vocab")
                .and_then(Value::as_object)
                .is_some_and(Map::is_empty)
            && m.get("merges")
                .and_then(Value::as_array)
                .is_some_and(Vec::is_empty)
    })
}

/// Builds the tokenizer from a compact `tokenizer.json` (parsed) and its tables.
pub(crate) fn build_tokenizer(
    compact_json: &Value,
    tables: BpeTables,
) -> Result<Tokenizer, RequestError> {
    if !is_compact(compact_json) {
        return Err(files_error(
            "BPE tables given with a tokenizer.json whose model is not a BPE with empty vocab and merges",
        ));
    }
    // The document without its added tokens: they are added once the real model is in place
    // (their ids depend on it), as `tokenizers`' deserialiser does.
    let mut doc = compact_json.clone();
    let added: Vec<AddedToken> = match doc.get_mut("added_tokens").map(Value::take) {
        None | Some(Value::Null) => Vec::new(),
        Some(list) => serde_json::from_value(list)
            .map_err(|e| files_error(format!("tokenizer.json added_tokens: {e}")))?,
    };
    if let Some(obj) = doc.as_object_mut() {
        obj.insert("added_tokens".into(), Value::Array(Vec::new()));
    }
    let mut tokenizer: Tokenizer =
        serde_json::from_value(doc).map_err(|e| files_error(format!("tokenizer.json: {e}")))?;
    let ModelWrapper::BPE(options) = tokenizer.get_model() else {
        return Err(files_error("tokenizer.json: the model is not BPE"));
    };
    let bpe = bpe_from_tables(options, tables)?;
    tokenizer.with_model(bpe);
    tokenizer
        .add_tokens(added)
        .map_err(|e| files_error(format!("tokenizer.json added_tokens: {e}")))?;
    Ok(tokenizer)
}

/// A BPE model with `options`' settings and the tables' vocabulary and merges.
fn bpe_from_tables(options: &BPE, tables: BpeTables) -> Result<BPE, RequestError> {
    let BpeTables { vocab, merges } = tables;
    let token = |id: u32| {
        vocab.get(id as usize).cloned().ok_or_else(|| {
            files_error(format!(
                "BPE tables: merge names token id {id}, out of the vocabulary"
            ))
        })
    };
    let merges = merges
        .iter()
        .map(|&[a, b]| Ok((token(a)?, token(b)?)))
        .collect::<Result<Vec<_>, RequestError>>()?;
    let vocab: Vocab = vocab
        .into_iter()
        .enumerate()
        .map(|(id, t)| (t, id as u32))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(options.fuse_unk)
        .byte_fallback(options.byte_fallback)
        .ignore_merges(options.ignore_merges);
    if let Some(p) = options.dropout {
        builder = builder.dropout(p);
    }
    if let Some(unk) = &options.unk_token {
        builder = builder.unk_token(unk.clone());
    }
    if let Some(prefix) = &options.continuing_subword_prefix {
        builder = builder.continuing_subword_prefix(prefix.clone());
    }
    if let Some(suffix) = &options.end_of_word_suffix {
        builder = builder.end_of_word_suffix(suffix.clone());
    }
    builder
        .build()
        .map_err(|e| files_error(format!("BPE tables: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny(merges: Value) -> Value {
        json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 5, "content": "<s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                      "continuing_subword_prefix": null, "end_of_word_suffix": "</w>",
                      "fuse_unk": true, "byte_fallback": false, "ignore_merges": true,
                      "vocab": {"<unk>": 0, "a": 1, "b</w>": 2, "ab</w>": 3, "b": 4},
                      "merges": merges}
        })
    }

    #[test]
    fn both_merge_forms_give_the_same_tokenizer_as_the_document() {
        for merges in [json!(["a b</w>"]), json!([["a", "b</w>"]])] {
            let doc = tiny(merges);
            let bytes = serde_json::to_vec(&doc).expect("json");
            let c = compact_tokenizer_json(&bytes)
                .expect("ok")
                .expect("covered");
            assert_eq!(c.tables.vocab, ["<unk>", "a", "b</w>", "ab</w>", "b"]);
            assert_eq!(c.tables.merges, [[1, 2]]);
            let stripped: Value = serde_json::from_slice(&c.tokenizer_json).expect("json");
            assert!(is_compact(&stripped));
            assert_eq!(stripped["model"]["end_of_word_suffix"], "</w>");
            let built = build_tokenizer(&stripped, c.tables).expect("build");
            let direct = Tokenizer::from_bytes(&bytes).expect("direct");
            assert_eq!(built.to_string(false).ok(), direct.to_string(false).ok());
            for text in ["ab", "a b <s>ab", "zz", "<s>"] {
                let ids = |t: &Tokenizer| t.encode(text, true).expect("encode").get_ids().to_vec();
                assert_eq!(ids(&built), ids(&direct), "{text:?}");
            }
        }
    }

    #[test]
    fn what_the_compact_form_does_not_cover_is_left_alone() {
        let mut holes = tiny(json!([]));
        holes["model"]["vocab"]["b"] = json!(9);
        let unknown_merge = tiny(json!(["a zz"]));
        let three_parts = tiny(json!(["a b c"]));
        let mut wordpiece = tiny(json!([]));
        wordpiece["model"]["type"] = json!("WordPiece");
        for doc in [holes, unknown_merge, three_parts, wordpiece] {
            let bytes = serde_json::to_vec(&doc).expect("json");
            assert_eq!(compact_tokenizer_json(&bytes).expect("json"), None, "{doc}");
        }
        assert!(compact_tokenizer_json(b"not json").is_err());
    }

    #[test]
    fn tables_must_match_a_compact_document() {
        let full = tiny(json!(["a b</w>"]));
        let e = build_tokenizer(&full, BpeTables::default()).expect_err("not compact");
        assert!(e.to_string().contains("empty vocab"), "{e}");
        let bytes = serde_json::to_vec(&full).expect("json");
        let c = compact_tokenizer_json(&bytes)
            .expect("ok")
            .expect("covered");
        let stripped: Value = serde_json::from_slice(&c.tokenizer_json).expect("json");
        let bad = BpeTables {
            merges: vec![[1, 99]],
            ..c.tables
        };
        let e = build_tokenizer(&stripped, bad).expect_err("out of range");
        assert!(e.to_string().contains("99"), "{e}");
    }
}
