//! The two builds of the kvroute filter (docs/filter.md): the proxy-wasm `.wasm` and the native
//! Envoy dynamic module (`.so`), with the cargo command that builds each and where it lands; and
//! the one build of a local stack's processes that `cargo xtask demo`, `chaos` and the benchmark
//! share.

use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::str::FromStr;

use anyhow::{bail, Result};

use crate::paths::{cargo_bin, Layout};
use crate::{cmd, toolchain};

/// Which build of the filter Envoy runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum FilterBuild {
    /// `kvroute_filter.wasm` in Envoy's Wasm filter (`envoy/envoy.yaml`), one VM per worker.
    #[default]
    Wasm,
    /// `libkvroute_filter_native.so` as an Envoy dynamic module (`envoy/envoy-native.yaml`), one
    /// plugin per process.
    Native,
}

impl FilterBuild {
    /// Both builds.
    pub const ALL: [FilterBuild; 2] = [FilterBuild::Wasm, FilterBuild::Native];

    /// `wasm` or `native` (as `--filter-build` and `KVROUTE_FILTER_BUILD` spell it).
    pub fn name(self) -> &'static str {
        match self {
            FilterBuild::Wasm => "wasm",
            FilterBuild::Native => "native",
        }
    }

    /// `KVROUTE_FILTER_BUILD` (`wasm` when unset or empty).
    pub fn from_env() -> Result<Self> {
        match std::env::var("KVROUTE_FILTER_BUILD") {
            Err(_) => Ok(FilterBuild::Wasm),
            Ok(v) if v.is_empty() => Ok(FilterBuild::Wasm),
            Ok(v) => v.parse(),
        }
    }

    /// The `cargo` arguments that build it (release). The native module is built alone: in a
    /// workspace build cargo unifies the filter crate's `wasm-host` feature into it and Envoy
    /// refuses the resulting `.so` (docs/filter.md, "Native build").
    pub fn cargo_args(self) -> &'static [&'static str] {
        match self {
            FilterBuild::Wasm => &[
                "build",
                "--release",
                "-p",
                "kvroute-filter",
                "--target",
                toolchain::WASM_TARGET,
            ],
            FilterBuild::Native => &["build", "--release", "-p", "kvroute-filter-native"],
        }
    }

    /// Where [`Self::cargo_args`] puts it.
    pub fn artifact(self, layout: &Layout) -> PathBuf {
        match self {
            FilterBuild::Wasm => layout.filter_wasm(),
            FilterBuild::Native => layout.filter_native(),
        }
    }

    /// Builds it in `layout`'s workspace (adding the wasm32 target first when needed).
    pub fn build(self, layout: &Layout) -> Result<()> {
        if self == FilterBuild::Wasm {
            toolchain::ensure_wasm_target(&layout.root)?;
        }
        let mut cargo = Command::new(cargo_bin());
        cargo.args(self.cargo_args()).current_dir(&layout.root);
        cmd::run(&mut cargo)
    }
}

impl fmt::Display for FilterBuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FilterBuild {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "wasm" => Ok(FilterBuild::Wasm),
            "native" => Ok(FilterBuild::Native),
            other => bail!("unknown filter build {other:?}: expected wasm or native"),
        }
    }
}

/// Builds what a local stack runs: `kvroute-sim` and `kvroute-indexer` (release, or debug when
/// `debug`) and the filter in each of `filters` (always release).
pub fn build_stack(layout: &Layout, debug: bool, filters: &[FilterBuild]) -> Result<()> {
    let names: Vec<&str> = filters.iter().map(|f| f.name()).collect();
    println!(
        "==> building ({}): kvroute-sim, kvroute-indexer; the filter ({}, release)",
        if debug { "debug" } else { "release" },
        names.join(", ")
    );
    let mut bins = Command::new(cargo_bin());
    bins.args([
        "build",
        "-p",
        "kvroute-sim",
        "-p",
        "kvroute-indexer",
        "--bins",
    ]);
    if !debug {
        bins.arg("--release");
    }
    bins.current_dir(&layout.root);
    cmd::run(&mut bins)?;
    for filter in filters {
        filter.build(layout)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::FilterBuild;

    #[test]
    fn builds_are_named_and_parsed_alike() {
        for build in FilterBuild::ALL {
            assert_eq!(build.name().parse::<FilterBuild>().ok(), Some(build));
        }
        let err = "wasm32".parse::<FilterBuild>().expect_err("not a build");
        assert!(err.to_string().contains("expected wasm or native"), "{err}");
    }

    #[test]
    fn the_native_build_is_built_alone_in_release() {
        let args = FilterBuild::Native.cargo_args();
        assert_eq!(args.iter().filter(|a| **a == "-p").count(), 1, "{args:?}");
        assert!(args.contains(&"--release"));
        assert!(FilterBuild::Wasm.cargo_args().contains(&"--release"));
    }
}
