//! Text prompts for routers that only accept text (`smg`, `sglang-router` and LiteLLM reject
//! token-id prompts). Each token id becomes one word of the model's vocabulary that is a single
//! token with its leading space (`Ġword`), so the replica tokenises the text back to exactly one
//! token per word: the same prompt lengths and the same shared prefixes as the token-id form.

use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// Fewer single-token words than this means the tokenizer is not the one this was written for.
const MIN_WORDS: usize = 1_000;

/// Maps token ids to single-token words.
#[derive(Debug, Clone)]
pub struct TextVocab {
    words: Vec<String>,
}

impl TextVocab {
    /// Reads `tokenizer.json` in `model_dir`: every vocabulary entry `Ġ` + two or more ASCII
    /// lowercase letters, in id order.
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("tokenizer.json");
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let vocab = json
            .pointer("/model/vocab")
            .and_then(Value::as_object)
            .with_context(|| format!("{} has no model.vocab", path.display()))?;
        let mut words: Vec<(u64, String)> = vocab
            .iter()
            .filter_map(|(token, id)| {
                let word = token.strip_prefix('\u{120}')?;
                let plain = word.len() >= 2 && word.bytes().all(|b| b.is_ascii_lowercase());
                plain.then(|| Some((id.as_u64()?, word.to_string())))?
            })
            .collect();
        if words.len() < MIN_WORDS {
            bail!(
                "{} has only {} single-token words (need {MIN_WORDS})",
                path.display(),
                words.len()
            );
        }
        words.sort();
        Ok(Self {
            words: words.into_iter().map(|(_, w)| w).collect(),
        })
    }

    /// The text form of `tokens`: one ` word` per token id.
    pub fn render(&self, tokens: &[u32]) -> String {
        let mut out = String::with_capacity(tokens.len() * 8);
        for &t in tokens {
            out.push(' ');
            out.push_str(&self.words[t as usize % self.words.len()]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_come_from_the_vocab_in_id_order() {
        let dir = std::env::temp_dir().join(format!("kvroute-textvocab-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let mut vocab = serde_json::Map::new();
        for i in 0..1200u64 {
            let mut w = String::new();
            let mut n = i;
            loop {
                w.push((b'a' + (n % 26) as u8) as char);
                n /= 26;
                if n == 0 {
                    break;
                }
            }
            w.push('z');
            vocab.insert(format!("\u{120}{w}"), Value::from(5000 - i));
        }
        vocab.insert("\u{120}A".into(), Value::from(1)); // not lowercase
        vocab.insert("plain".into(), Value::from(2)); // no leading space
        let json = serde_json::json!({"model": {"vocab": vocab}});
        fs::write(dir.join("tokenizer.json"), json.to_string()).expect("write");
        let v = TextVocab::load(&dir).expect("load");
        assert_eq!(v.words.len(), 1200);
        // Highest i has the lowest id and comes first.
        assert_eq!(v.render(&[0]), format!(" {}", v.words[0]));
        assert!(v
            .render(&[0, 1, 2])
            .split(' ')
            .skip(1)
            .all(|w| w.ends_with('z')));
        // Same ids, same text; a shared token-id prefix is a shared text prefix.
        assert!(v.render(&[5, 6, 7, 8]).starts_with(&v.render(&[5, 6])));
        assert_eq!(v.render(&[1200]), v.render(&[0]));
        fs::remove_dir_all(&dir).expect("cleanup");
        assert!(TextVocab::load(Path::new("/nonexistent")).is_err());
    }
}
