//! A model's files as transformers reads them, merged into the two documents kvroute tokenises
//! with: `tokenizer.json` and the effective `tokenizer_config.json`.
//!
//! transformers (`AutoTokenizer.from_pretrained`, and vLLM's processor lookup for the template)
//! reads, in a model directory:
//!
//! | file                      | what kvroute takes from it                                      |
//! |---------------------------|-----------------------------------------------------------------|
//! | `tokenizer.json`          | the tokenizer (required)                                        |
//! | `tokenizer_config.json`   | chat template, special tokens, `model_max_length` (else `{}`)   |
//! | `chat_template.json`      | `chat_template` (string or named list): replaces the config's  |
//! | `chat_template.jinja`     | the template text: replaces both of the above                   |
//! | `special_tokens_map.json` | `bos_token`, `eos_token`, ...: replace the config's             |
//!
//! `generation_config.json` holds sampling defaults (vLLM's `--generation-config auto`); it changes
//! no prompt token, so it is not read.
//!
//! Every reader goes through [`ModelFiles::from_dir`] (CLI, indexer bundle, simulator, tests) or
//! [`ModelFileSet::merge`] (bytes from elsewhere), so they cannot disagree on precedence.

/// A model's tokenizer files after merging, as bytes (so they can come from disk, a callout or the
/// plugin configuration alike).
#[derive(Clone, PartialEq, Eq)]
pub struct ModelFiles {
    /// Hugging Face `tokenizer.json`.
    pub tokenizer_json: Vec<u8>,
    /// The effective `tokenizer_config.json`: the file, with the chat template and special tokens
    /// of the other files merged in as transformers does.
    pub tokenizer_config_json: Vec<u8>,
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles")
            .field("tokenizer_json_bytes", &self.tokenizer_json.len())
            .field(
                "tokenizer_config_json_bytes",
                &self.tokenizer_config_json.len(),
            )
            .finish()
    }
}

/// The file names [`ModelFiles::from_dir`] reads, in the order they are merged.
pub const MODEL_FILE_NAMES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
];

/// The raw files of a model directory, each present or not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFileSet {
    /// `tokenizer.json`.
    pub tokenizer_json: Option<Vec<u8>>,
    /// `tokenizer_config.json`.
    pub tokenizer_config_json: Option<Vec<u8>>,
    /// `special_tokens_map.json`.
    pub special_tokens_map_json: Option<Vec<u8>>,
    /// `chat_template.json`.
    pub chat_template_json: Option<Vec<u8>>,
    /// `chat_template.jinja`.
    pub chat_template_jinja: Option<Vec<u8>>,
}

fn files_error(message: impl Into<String>) -> super::RequestError {
    super::RequestError::ModelFiles(message.into())
}

fn json_object(
    name: &str,
    bytes: &[u8],
) -> Result<serde_json::Map<String, serde_json::Value>, super::RequestError> {
    match serde_json::from_slice(bytes) {
        Ok(serde_json::Value::Object(o)) => Ok(o),
        Ok(_) => Err(files_error(format!("{name} is not a JSON object"))),
        Err(e) => Err(files_error(format!("{name} is not JSON: {e}"))),
    }
}

impl ModelFileSet {
    /// Merges the files with transformers' precedence: `chat_template.jinja` over
    /// `chat_template.json` over the config's `chat_template`; `special_tokens_map.json` entries
    /// over the config's.
    pub fn merge(self) -> Result<ModelFiles, super::RequestError> {
        let tokenizer_json = self
            .tokenizer_json
            .ok_or_else(|| files_error("no tokenizer.json"))?;
        let config_bytes: &[u8] = self.tokenizer_config_json.as_deref().unwrap_or(b"{}");
        let untouched = self.special_tokens_map_json.is_none()
            && self.chat_template_json.is_none()
            && self.chat_template_jinja.is_none();
        if untouched {
            // Byte for byte what the file says (and `{}` without one).
            return Ok(ModelFiles {
                tokenizer_json,
                tokenizer_config_json: config_bytes.to_vec(),
            });
        }
        let mut config = json_object("tokenizer_config.json", config_bytes)?;
        if let Some(bytes) = &self.special_tokens_map_json {
            for (name, value) in json_object("special_tokens_map.json", bytes)? {
                config.insert(name, value);
            }
        }
        if let Some(bytes) = &self.chat_template_json {
            let doc = json_object("chat_template.json", bytes)?;
            let template = doc
                .get("chat_template")
                .filter(|t| t.is_string() || t.is_array())
                .ok_or_else(|| {
                    files_error("chat_template.json has no \"chat_template\" string or list")
                })?;
            config.insert("chat_template".into(), template.clone());
        }
        if let Some(bytes) = self.chat_template_jinja {
            let text = String::from_utf8(bytes)
                .map_err(|_| files_error("chat_template.jinja is not UTF-8"))?;
            config.insert("chat_template".into(), serde_json::Value::String(text));
        }
        let tokenizer_config_json = serde_json::to_vec(&serde_json::Value::Object(config))
            .map_err(|e| files_error(e.to_string()))?;
        Ok(ModelFiles {
            tokenizer_json,
            tokenizer_config_json,
        })
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl ModelFileSet {
    /// Reads every file of [`MODEL_FILE_NAMES`] present in `dir`.
    pub fn read_dir(dir: impl AsRef<std::path::Path>) -> Result<Self, super::RequestError> {
        let dir = dir.as_ref();
        let read = |name: &str| -> Result<Option<Vec<u8>>, super::RequestError> {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => Ok(Some(bytes)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(files_error(format!("cannot read {}: {e}", path.display()))),
            }
        };
        let set = Self {
            tokenizer_json: read("tokenizer.json")?,
            tokenizer_config_json: read("tokenizer_config.json")?,
            special_tokens_map_json: read("special_tokens_map.json")?,
            chat_template_json: read("chat_template.json")?,
            chat_template_jinja: read("chat_template.jinja")?,
        };
        if set.tokenizer_json.is_none() {
            return Err(files_error(format!(
                "{} has no tokenizer.json",
                dir.display()
            )));
        }
        Ok(set)
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl ModelFiles {
    /// Reads and merges a model directory's files (see the module documentation); a missing
    /// `tokenizer_config.json` is treated as `{}`.
    pub fn from_dir(dir: impl AsRef<std::path::Path>) -> Result<Self, super::RequestError> {
        ModelFileSet::read_dir(dir)?.merge()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn config_of(set: ModelFileSet) -> Value {
        let files = set.merge().expect("merge");
        serde_json::from_slice(&files.tokenizer_config_json).expect("json")
    }

    fn base() -> ModelFileSet {
        ModelFileSet {
            tokenizer_json: Some(b"{}".to_vec()),
            tokenizer_config_json: Some(
                json!({"chat_template": "config", "eos_token": "<e>", "model_max_length": 8})
                    .to_string()
                    .into_bytes(),
            ),
            ..ModelFileSet::default()
        }
    }

    #[test]
    fn the_config_alone_is_kept_byte_for_byte() {
        let set = base();
        let raw = set.tokenizer_config_json.clone().expect("config");
        assert_eq!(set.merge().expect("merge").tokenizer_config_json, raw);
        let bare = ModelFileSet {
            tokenizer_json: Some(b"{}".to_vec()),
            ..ModelFileSet::default()
        };
        assert_eq!(bare.merge().expect("merge").tokenizer_config_json, b"{}");
    }

    #[test]
    fn templates_follow_transformers_precedence() {
        let json_file = ModelFileSet {
            chat_template_json: Some(br#"{"chat_template": "json"}"#.to_vec()),
            ..base()
        };
        let c = config_of(json_file.clone());
        assert_eq!(c["chat_template"], "json");
        assert_eq!(c["model_max_length"], 8, "other fields kept");
        let jinja = ModelFileSet {
            chat_template_jinja: Some(b"jinja {{ x }}".to_vec()),
            ..json_file
        };
        assert_eq!(config_of(jinja)["chat_template"], "jinja {{ x }}");
    }

    #[test]
    fn special_tokens_map_overrides_the_config() {
        let set = ModelFileSet {
            special_tokens_map_json: Some(
                br#"{"eos_token": {"content": "<end>"}, "bos_token": "<b>"}"#.to_vec(),
            ),
            ..base()
        };
        let c = config_of(set);
        assert_eq!(c["eos_token"]["content"], "<end>");
        assert_eq!(c["bos_token"], "<b>");
        assert_eq!(c["chat_template"], "config");
    }

    #[test]
    fn malformed_files_are_named() {
        let bad = ModelFileSet {
            chat_template_json: Some(br#"{"template": "x"}"#.to_vec()),
            ..base()
        };
        let e = bad.merge().expect_err("no chat_template key").to_string();
        assert!(e.contains("chat_template.json"), "{e}");
        let bad = ModelFileSet {
            chat_template_jinja: Some(vec![0xff, 0xfe]),
            ..base()
        };
        assert!(bad.merge().is_err());
        assert!(
            ModelFileSet::default().merge().is_err(),
            "no tokenizer.json"
        );
    }
}
