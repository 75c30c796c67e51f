//! Shared by the request targets: the real Qwen3 tokenizer, loaded once from
//! `KVROUTE_MODEL_DIR` (`source target/kvroute-env.sh` after `cargo xtask setup`).

use std::sync::LazyLock;

use kvroute_core::request::{ModelFiles, ModelTokenizer, TokenizerOptions};

pub static TOKENIZER: LazyLock<ModelTokenizer> = LazyLock::new(|| {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR").unwrap_or_else(|| {
        panic!(
            "KVROUTE_MODEL_DIR is not set: run `cargo xtask setup`, then \
             `source target/kvroute-env.sh` before `cargo fuzz run`"
        )
    });
    let files = ModelFiles::from_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask setup`)", dir.to_string_lossy()));
    ModelTokenizer::from_files(&files, TokenizerOptions::default()).expect("the tokenizer loads")
});
