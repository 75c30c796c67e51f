//! The two files kvroute needs from a model: `tokenizer.json` and `tokenizer_config.json`.

/// A model's tokenizer files, as bytes (so they can come from disk, a callout or the plugin
/// configuration alike).
#[derive(Clone, PartialEq, Eq)]
pub struct ModelFiles {
    /// Hugging Face `tokenizer.json`.
    pub tokenizer_json: Vec<u8>,
    /// Hugging Face `tokenizer_config.json` (chat template, special tokens).
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

#[cfg(not(target_arch = "wasm32"))]
impl ModelFiles {
    /// Reads `tokenizer.json` and `tokenizer_config.json` from `dir`. A `chat_template.jinja`
    /// next to them replaces the config's `chat_template`, as transformers does; a missing
    /// `tokenizer_config.json` is treated as `{}` (no chat template).
    pub fn from_dir(dir: impl AsRef<std::path::Path>) -> Result<Self, super::RequestError> {
        use super::RequestError;
        let dir = dir.as_ref();
        let read = |name: &str| -> Result<Option<Vec<u8>>, RequestError> {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => Ok(Some(bytes)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(RequestError::ModelFiles(format!(
                    "cannot read {}: {e}",
                    path.display()
                ))),
            }
        };
        let tokenizer_json = read("tokenizer.json")?.ok_or_else(|| {
            RequestError::ModelFiles(format!("{} has no tokenizer.json", dir.display()))
        })?;
        let mut tokenizer_config_json =
            read("tokenizer_config.json")?.unwrap_or_else(|| b"{}".to_vec());
        if let Some(template) = read("chat_template.jinja")? {
            let template = String::from_utf8(template)
                .map_err(|_| RequestError::ModelFiles("chat_template.jinja is not UTF-8".into()))?;
            let mut config: serde_json::Value = serde_json::from_slice(&tokenizer_config_json)
                .map_err(|e| {
                    RequestError::ModelFiles(format!("tokenizer_config.json is not JSON: {e}"))
                })?;
            let obj = config.as_object_mut().ok_or_else(|| {
                RequestError::ModelFiles("tokenizer_config.json is not an object".into())
            })?;
            obj.insert("chat_template".into(), serde_json::Value::String(template));
            tokenizer_config_json =
                serde_json::to_vec(&config).map_err(|e| RequestError::ModelFiles(e.to_string()))?;
        }
        Ok(Self {
            tokenizer_json,
            tokenizer_config_json,
        })
    }
}
