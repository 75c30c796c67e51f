//! The Rust target the filter is built for. `rust-toolchain.toml` names `wasm32-wasip1`, but
//! rustup (1.28 and later) adds a listed target only when it installs the toolchain itself: a
//! machine whose toolchain was already there has no wasm32 standard library. This installs it,
//! through rustup, for the toolchain the workspace resolves to.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd;

/// The target of the Envoy filter.
pub const WASM_TARGET: &str = "wasm32-wasip1";

/// Makes sure the workspace's toolchain has the wasm32-wasip1 standard library, installing it with
/// `rustup target add` when missing. Returns what it found or did, for progress lines.
pub fn ensure_wasm_target(root: &Path) -> Result<String> {
    if wasm_target_installed(root)? {
        return Ok(format!("{WASM_TARGET} installed"));
    }
    let mut add = Command::new("rustup");
    add.args(["target", "add", WASM_TARGET]).current_dir(root);
    cmd::run(&mut add).with_context(|| {
        format!(
            "the {WASM_TARGET} target is missing and rustup could not add it; install it for the \
             toolchain in rust-toolchain.toml (`rustup target add {WASM_TARGET}`)"
        )
    })?;
    if !wasm_target_installed(root)? {
        bail!("`rustup target add {WASM_TARGET}` succeeded but rustc still has no {WASM_TARGET} library");
    }
    Ok(format!("{WASM_TARGET} added with rustup"))
}

/// Whether rustc (as resolved in `root`, so by its `rust-toolchain.toml`) has the target's library.
fn wasm_target_installed(root: &Path) -> Result<bool> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut print = Command::new(rustc);
    print
        .args(["--print", "target-libdir", "--target", WASM_TARGET])
        .current_dir(root);
    let libdir = cmd::stdout_of(&mut print)?;
    let libdir = Path::new(&libdir);
    Ok(libdir.is_dir()
        && std::fs::read_dir(libdir)
            .map(|mut entries| entries.next().is_some())
            .unwrap_or(false))
}
