//! Installs each peer router into its own virtual environment under `<cache>/peers/<name>`, with
//! the versions pinned in issue 7 (the routing benchmark's peers; `cargo xtask setup` installs
//! LiteLLM for the two-layer test). A marker file records what was installed, so a second call is
//! a cheap check; a venv whose marker differs (or whose program is missing) is rebuilt.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd;

/// Written into a venv after a successful install: the install recipe it was built from.
const MARKER: &str = ".kvroute-peer-install";

/// One peer product, as installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Product {
    /// The vLLM project's router (`vllm-router`, Rust).
    VllmRouter,
    /// Shepherd Model Gateway (`smg`, Rust), the SGLang router's successor.
    Smg,
    /// The SGLang router (`sglang-router`, Rust).
    SglangRouter,
    /// LiteLLM's proxy (Python).
    Litellm,
    /// NVIDIA Dynamo's frontend (Rust runtime, Python entry point).
    Dynamo,
}

impl Product {
    /// Every product, in report order.
    pub const ALL: [Product; 5] = [
        Product::VllmRouter,
        Product::Smg,
        Product::SglangRouter,
        Product::Litellm,
        Product::Dynamo,
    ];

    /// Directory name under `<cache>/peers/` and name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Product::VllmRouter => "vllm-router",
            Product::Smg => "smg",
            Product::SglangRouter => "sglang-router",
            Product::Litellm => "litellm",
            Product::Dynamo => "dynamo",
        }
    }

    /// Package and version, for the report.
    pub fn version(self) -> &'static str {
        match self {
            Product::VllmRouter => "vllm-router 0.1.17",
            Product::Smg => "smg 1.13.0",
            Product::SglangRouter => "sglang-router 0.3.2",
            Product::Litellm => "litellm[proxy] 1.108.7",
            Product::Dynamo => "ai-dynamo 1.6.1 (+ ai-dynamo-runtime 1.6.1)",
        }
    }

    /// The `pip install` steps, in order: each is one pip invocation's arguments.
    fn steps(self) -> Vec<Vec<&'static str>> {
        match self {
            Product::VllmRouter => vec![vec!["vllm-router==0.1.17"]],
            Product::Smg => vec![vec!["smg==1.13.0"]],
            // It installs a script named `smg` as well: its own venv keeps it apart from smg's.
            Product::SglangRouter => vec![vec!["sglang-router==0.3.2"]],
            Product::Litellm => vec![vec!["litellm[proxy]==1.108.7"]],
            // `pip install ai-dynamo` fails on `aisimulate`, which downloads from a vendor index.
            // The runtime and ai-dynamo's other requirements (its wheel's Requires-Dist, minus
            // aisimulate and the engine extras) install from PyPI; ai-dynamo itself goes in
            // without resolving its requirements.
            Product::Dynamo => vec![
                vec![
                    "ai-dynamo-runtime==1.6.1",
                    "aiohttp>=3.14.3,<4.0",
                    "certifi>=2026.10.19",
                    "kubernetes>=32.0.1,<33.0.0",
                    "msgspec>=0.19.0",
                    "prometheus-client>=0.23.1,<1.0",
                    "pyzmq>=26.0.0",
                    "redis>=6.2.0,<9.0.0",
                    "tqdm>=4.0.0",
                    "transformers>=4.56.0",
                    "typing-extensions>=4.10.0",
                    "zstandard>=0.23.0,<1.0",
                ],
                vec!["--no-deps", "ai-dynamo==1.6.1"],
            ],
        }
    }

    /// The program the launcher runs, relative to the venv.
    pub fn program(self) -> &'static str {
        match self {
            Product::VllmRouter => "bin/vllm-router",
            Product::Smg => "bin/smg",
            Product::SglangRouter => "bin/sglang-router",
            Product::Litellm => "bin/litellm",
            Product::Dynamo => "bin/python",
        }
    }

    /// A Python import that must work once installed (catches half-installed venvs).
    fn import_check(self) -> &'static str {
        match self {
            Product::VllmRouter => "import vllm_router",
            Product::Smg => "import smg",
            Product::SglangRouter => "import sglang_router",
            Product::Litellm => "import litellm.proxy.proxy_server",
            Product::Dynamo => "import dynamo.frontend.main, dynamo.llm, tokenizers, aiohttp",
        }
    }
}

/// The venv of `product` under `cache`.
pub fn venv_dir(cache: &Path, product: Product) -> PathBuf {
    cache.join("peers").join(product.name())
}

/// What [`ensure`] found or did.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The venv.
    pub venv: PathBuf,
    /// Seconds spent installing (0 when it was already there).
    pub install_s: f64,
    /// Size of the venv on disk, MB.
    pub size_mb: f64,
}

/// Makes sure `product` is installed in its venv; installs it (a few minutes the first time)
/// otherwise. Fails with pip's own output when it cannot.
pub fn ensure(cache: &Path, product: Product) -> Result<Installed> {
    let venv = venv_dir(cache, product);
    let recipe = recipe(product);
    let marker = venv.join(MARKER);
    let program = venv.join(product.program());
    let current = fs::read_to_string(&marker).is_ok_and(|m| m == recipe) && program.is_file();
    if current {
        return Ok(Installed {
            size_mb: dir_size_mb(&venv),
            venv,
            install_s: 0.0,
        });
    }
    let started = Instant::now();
    println!(
        "==> peers: installing {} into {}",
        product.version(),
        venv.display()
    );
    let python = venv.join("bin").join("python");
    if !python.is_file() {
        fs::create_dir_all(venv.parent().unwrap_or(cache))
            .with_context(|| format!("creating {}", cache.display()))?;
        cmd::output(Command::new("python3").args(["-m", "venv"]).arg(&venv)).with_context(
            || {
                format!(
                    "creating the venv {} (Debian: `apt-get install python3-venv`)",
                    venv.display()
                )
            },
        )?;
    }
    let _ = fs::remove_file(&marker);
    for step in product.steps() {
        cmd::output(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "--quiet",
                ])
                .args(&step),
        )
        .with_context(|| format!("installing {}", product.version()))?;
    }
    // LiteLLM fetches a price list from the internet on import unless told not to.
    cmd::output(
        Command::new(&python)
            .args(["-c", product.import_check()])
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
    )
    .with_context(|| format!("{} does not import after installing", product.version()))?;
    if !program.is_file() {
        bail!(
            "{} installed but {} is missing",
            product.version(),
            program.display()
        );
    }
    fs::write(&marker, &recipe).with_context(|| format!("writing {}", marker.display()))?;
    let installed = Installed {
        size_mb: dir_size_mb(&venv),
        venv,
        install_s: started.elapsed().as_secs_f64(),
    };
    println!(
        "==> peers: {} installed in {:.0} s ({:.0} MB)",
        product.version(),
        installed.install_s,
        installed.size_mb
    );
    Ok(installed)
}

/// The marker's content: every pip step, one line each.
fn recipe(product: Product) -> String {
    product
        .steps()
        .iter()
        .map(|s| s.join(" "))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// Bytes under `dir` (not following symlinks), in MB.
fn dir_size_mb(dir: &Path) -> f64 {
    fn walk(dir: &Path) -> u64 {
        let Ok(entries) = fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                _ => 0,
            })
            .sum()
    }
    walk(dir) as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_product_pins_its_version_and_has_its_own_venv() {
        let cache = Path::new("/c");
        let mut dirs: Vec<PathBuf> = Product::ALL.iter().map(|&p| venv_dir(cache, p)).collect();
        dirs.dedup();
        assert_eq!(dirs.len(), Product::ALL.len());
        for p in Product::ALL {
            let r = recipe(p);
            assert!(r.contains("=="), "{r}");
            let pinned = p.version().split_whitespace().nth(1).expect("version");
            assert!(r.contains(pinned), "{} not in {r}", pinned);
        }
        // Dynamo's install never resolves ai-dynamo's own requirements (aisimulate).
        assert!(recipe(Product::Dynamo).contains("--no-deps ai-dynamo==1.6.1"));
        assert!(!recipe(Product::Dynamo).contains("aisimulate"));
    }
}
