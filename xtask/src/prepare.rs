//! What `cargo xtask demo` and `cargo xtask chaos` do before they start a local stack: setup,
//! then the builds of the simulator, the indexer and the filter's `.wasm`.

use anyhow::Result;
use clap::Args;

use crate::filter_build::{self, FilterBuild};
use crate::paths::Layout;
use crate::setup;

/// The options of commands that run a local stack.
#[derive(Debug, Clone, Args)]
pub struct PrepareOptions {
    /// Do not run setup first.
    #[arg(long)]
    pub no_setup: bool,
    /// Do not build; use the binaries and .wasm already in the target directory.
    #[arg(long)]
    pub no_build: bool,
    /// Run debug binaries (what `cargo xtask test` builds) instead of release ones: faster to
    /// build, slower to run. The filter is always the release build.
    #[arg(long)]
    pub debug: bool,
}

impl PrepareOptions {
    /// Runs setup and the builds, unless told not to.
    pub fn run(&self, layout: &Layout) -> Result<()> {
        if !self.no_setup {
            setup::run(layout)?;
        }
        if !self.no_build {
            filter_build::build_stack(layout, self.debug, &[FilterBuild::Wasm])?;
        }
        Ok(())
    }

    /// The target directory's profile folder of the binaries: `debug` or `release`.
    pub fn profile(&self) -> &'static str {
        if self.debug {
            "debug"
        } else {
            "release"
        }
    }
}
