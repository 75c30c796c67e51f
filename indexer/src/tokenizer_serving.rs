//! The tokenizer bundles the indexer serves to filters, and its own digest of the tokenizer
//! they build (docs/filter.md, "Memory"; docs/indexer.md, the tokenizer endpoint).
//!
//! Each model's bundle is built from its `model_dir` on the first request for each form and
//! kept. The compact form and the digest are built **together, in one blocking task**: the
//! digest needs a whole tokenizer built from the compact tables, and built right after the split
//! on the same thread it reuses memory the split just freed (Qwen3: the indexer's peak 111 ->
//! 100 MiB; 56 MiB with the allocator settings of `allocator.rs`; docs/operations.md, "Sizing").
//! A fetch shares the kept tables with its answer instead of copying them. A failed build is
//! answered from memory for [`RETRY_FAILED_BUILD_AFTER`] before the files are read again, so
//! filters fetching a broken model and the agreement reports asking for its digest do not each
//! re-read and re-parse its files (one warning per attempt, not per request).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::api::{TokenizerBundle, TokenizerDigest};
use kvroute_core::request::{ModelFiles, ModelTokenizer, TokenizerOptions};
use tokio::sync::OnceCell;

use crate::membership::lock;

/// How long a failed build is answered from memory before the model's files are read again
/// (fixed files are picked up this long after the failure, without a restart).
pub const RETRY_FAILED_BUILD_AFTER: Duration = Duration::from_secs(30);

/// Why a model's tokenizer is not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServeError {
    /// The model has no `model_dir`: nothing to serve.
    #[error("model {0:?} has no model_dir configured")]
    NoModelDir(String),
    /// Its files did not load or build (kept for [`RETRY_FAILED_BUILD_AFTER`]).
    #[error("{0}")]
    Build(String),
}

/// The last failed build of one form.
#[derive(Debug)]
struct Failure {
    at: Instant,
    error: String,
}

/// A bundle as served, with the indexer's digest of the tokenizer a filter builds from it
/// (computed for the compact form only; `None` when that tokenizer does not build).
#[derive(Debug)]
pub struct ServedBundle {
    /// The bundle, without the members filled in per answer (block size and the like).
    pub bundle: TokenizerBundle,
    /// The digest of the tokenizer built from `bundle`.
    pub digest: Option<TokenizerDigest>,
}

/// One model's tokenizer files and what is built from them: the bundle in each form
/// (`[whole, compact]`), built on the first request for it and kept, the compact one with the
/// indexer's digest. At most two per model; a failed build is tried again on a request
/// [`RETRY_FAILED_BUILD_AFTER`] after it. Files changed on disk after a successful build are
/// read again only after a restart.
#[derive(Debug)]
pub struct TokenizerServing {
    model: String,
    model_dir: Option<PathBuf>,
    options: TokenizerOptions,
    bundles: [OnceCell<Arc<ServedBundle>>; 2],
    failures: [Mutex<Option<Failure>>; 2],
    retry_failed_after: Duration,
}

impl TokenizerServing {
    /// For `model`, its tokenizer directory (none: nothing to serve) and the engines'
    /// chat-template options (part of the digest).
    pub fn new(model: &str, model_dir: Option<PathBuf>, options: TokenizerOptions) -> Self {
        Self {
            model: model.to_owned(),
            model_dir,
            options,
            bundles: Default::default(),
            failures: Default::default(),
            retry_failed_after: RETRY_FAILED_BUILD_AFTER,
        }
    }

    /// As [`TokenizerServing::new`], retrying a failed build `after` it (tests).
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_failed_after = after;
        self
    }

    /// The tokenizer directory, when configured.
    pub fn model_dir(&self) -> Option<&Path> {
        self.model_dir.as_deref()
    }

    /// The model's tokenizer bundle in one form, built on first use and kept.
    pub async fn bundle(&self, compact: bool) -> Result<Arc<ServedBundle>, ServeError> {
        let Some(dir) = self.model_dir.clone() else {
            return Err(ServeError::NoModelDir(self.model.clone()));
        };
        let form = usize::from(compact);
        self.bundles[form]
            .get_or_try_init(|| async move {
                if let Some(f) = lock(&self.failures[form]).as_ref() {
                    let age = f.at.elapsed();
                    if age < self.retry_failed_after {
                        return Err(ServeError::Build(format!(
                            "{} (failed {:.0} s ago; the files are read again {:.0} s after a failure)",
                            f.error,
                            age.as_secs_f64(),
                            self.retry_failed_after.as_secs_f64()
                        )));
                    }
                }
                let name = self.model.clone();
                let opts = self.options.clone();
                let built = tokio::task::spawn_blocking(move || build(&name, dir, compact, opts))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r);
                let mut failure = lock(&self.failures[form]);
                match built {
                    Ok(served) => {
                        *failure = None;
                        Ok(Arc::new(served))
                    }
                    Err(error) => {
                        tracing::warn!(model = %self.model, %error, "model files do not load: no tokenizer to serve, no digest");
                        *failure = Some(Failure {
                            at: Instant::now(),
                            error: error.clone(),
                        });
                        Err(ServeError::Build(error))
                    }
                }
            })
            .await
            .cloned()
    }

    /// The indexer's digest of the model's tokenizer, as a filter loading the compact bundle
    /// builds it (`None`: no `model_dir`, or files that do not load, which the bundle endpoint
    /// reports and [`TokenizerServing::bundle`] logs).
    pub async fn own_digest(&self) -> Option<TokenizerDigest> {
        self.bundle(true).await.ok()?.digest.clone()
    }
}

/// Reads the files and builds the bundle; for the compact form, then the digest too.
fn build(
    name: &str,
    dir: std::path::PathBuf,
    compact: bool,
    opts: TokenizerOptions,
) -> Result<ServedBundle, String> {
    let bundle = ModelFiles::from_dir(dir)
        .and_then(|files| TokenizerBundle::from_files(name, files, compact))
        .map_err(|e| e.to_string())?;
    let digest = if compact {
        digest_of(name, &bundle, opts)
    } else {
        None
    };
    Ok(ServedBundle { bundle, digest })
}

/// Builds the tokenizer a filter builds from `bundle` (a second or more for a large
/// vocabulary) and digests it.
fn digest_of(
    name: &str,
    bundle: &TokenizerBundle,
    opts: TokenizerOptions,
) -> Option<TokenizerDigest> {
    let opts = TokenizerOptions {
        // The digest needs no segment cache.
        segment_cache_max_bytes: 0,
        segment_cache_max_entries: 0,
        ..opts
    };
    let files = ModelFiles {
        tokenizer_json: bundle.tokenizer_json.as_bytes().to_vec(),
        tokenizer_config_json: bundle.tokenizer_config_json.as_bytes().to_vec(),
    };
    match ModelTokenizer::from_bundle_parts(&files, bundle.bpe_tables.as_deref().cloned(), opts) {
        Ok(t) => Some(t.digest().clone()),
        Err(e) => {
            tracing::warn!(model = %name, error = %e, "the model's tokenizer does not build: no tokenizer digest");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_testkit::paths::TempDir;

    /// A tokenizer that builds: three tokens, one merge.
    const TINY_BPE: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [], "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": null, "model": {"type": "BPE", "dropout": null, "unk_token": null,
        "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
        "byte_fallback": true, "ignore_merges": false, "vocab": {"a": 0, "b": 1, "ab": 2},
        "merges": [["a", "b"]]}}"#;

    fn broken_model(dir: &TempDir) -> TokenizerServing {
        std::fs::write(dir.0.join("tokenizer.json"), "not json").expect("write");
        std::fs::write(dir.0.join("tokenizer_config.json"), "{}").expect("write");
        TokenizerServing::new("m", Some(dir.0.clone()), TokenizerOptions::default())
    }

    fn mend(dir: &TempDir) {
        std::fs::write(dir.0.join("tokenizer.json"), TINY_BPE).expect("write");
    }

    #[tokio::test]
    async fn a_failed_build_is_answered_from_memory_until_it_may_be_retried() {
        let dir = TempDir::new("tok-serving-failed");
        let serving = broken_model(&dir).with_retry_after(Duration::from_secs(3600));
        // The compact form parses the document (the whole form serves it as it is).
        assert!(matches!(
            serving.bundle(true).await,
            Err(ServeError::Build(_))
        ));
        assert_eq!(serving.own_digest().await, None);
        mend(&dir);
        // Within the retry time the files are not read again: still the failure.
        match serving.bundle(true).await {
            Err(ServeError::Build(e)) => assert!(e.contains("read again"), "{e}"),
            other => panic!("expected the kept failure, got {other:?}"),
        }
        assert_eq!(serving.own_digest().await, None);
    }

    #[tokio::test]
    async fn mended_files_are_served_once_the_retry_time_has_passed() {
        let dir = TempDir::new("tok-serving-mended");
        let serving = broken_model(&dir).with_retry_after(Duration::ZERO);
        assert!(matches!(
            serving.bundle(true).await,
            Err(ServeError::Build(_))
        ));
        mend(&dir);
        let served = serving
            .bundle(true)
            .await
            .expect("built after the retry time");
        assert!(served.bundle.bpe_tables.is_some(), "the compact form");
        assert!(serving.own_digest().await.is_some());
    }

    #[tokio::test]
    async fn a_model_without_a_directory_is_told_apart_from_a_broken_one() {
        let serving = TokenizerServing::new("m", None, TokenizerOptions::default());
        assert_eq!(
            serving.bundle(false).await.map(|_| ()),
            Err(ServeError::NoModelDir("m".into()))
        );
        assert_eq!(serving.own_digest().await, None);
    }
}
