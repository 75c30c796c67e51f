//! Helpers for tests that run real processes: the `kvroute-indexer serve` binary, vLLM's own
//! publisher (Python), `kvroute-sim`. Every wait is bounded; children are killed on drop.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("indexer/ has a parent")
        .to_path_buf()
}

/// The Cargo target directory (`CARGO_TARGET_DIR` or `<workspace>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let p = PathBuf::from(d);
            if p.is_absolute() {
                p
            } else {
                workspace().join(p)
            }
        }
        None => workspace().join("target"),
    }
}

/// `KVROUTE_PYTHON`, else the venv `cargo xtask setup` makes; panics with the setup hint.
pub fn python() -> PathBuf {
    let p = std::env::var_os("KVROUTE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/kvroute-cache/venv/bin/python"));
    assert!(
        p.is_file(),
        "Python with msgspec and pyzmq not found at {} (KVROUTE_PYTHON): run `cargo xtask setup`",
        p.display()
    );
    p
}

/// `fetch_vllm.py`'s cache directory (`KVROUTE_VLLM_WHEEL_DIR`, `KVROUTE_CACHE`/vllm-wheel, or the
/// xtask default).
fn vllm_wheel_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVROUTE_VLLM_WHEEL_DIR") {
        PathBuf::from(d)
    } else if let Some(c) = std::env::var_os("KVROUTE_CACHE") {
        PathBuf::from(c).join("vllm-wheel")
    } else {
        workspace().join("target/kvroute-cache/vllm-wheel")
    }
}

/// The extracted vLLM 0.33.0 tree (`fetch_vllm.py`'s cache rules); panics with the setup hint.
pub fn vllm_pkg() -> PathBuf {
    let pkg = vllm_wheel_dir().join("pkg");
    assert!(
        pkg.join("READY").is_file() && pkg.join("vllm/distributed/kv_events.py").is_file(),
        "vLLM 0.33.0's kv_events.py is not extracted in {}: run `cargo xtask setup`",
        pkg.display()
    );
    pkg
}

/// The importable tree of a legacy vLLM release's verbatim `kv_events.py` (`fetch_vllm.py`'s
/// `legacy/<version>`); panics with the setup hint.
pub fn vllm_legacy_pkg(version: &str) -> PathBuf {
    let pkg = vllm_wheel_dir().join("legacy").join(version);
    let ready = std::fs::read_to_string(pkg.join("READY")).unwrap_or_default();
    assert!(
        ready.starts_with(&format!("{version}\n"))
            && pkg.join("vllm/distributed/kv_events.py").is_file(),
        "vLLM {version}'s kv_events.py is not extracted in {}: run `cargo xtask setup`",
        pkg.display()
    );
    pkg
}

/// The Qwen3 tokenizer directory (`KVROUTE_MODEL_DIR` or the xtask cache); panics with the hint.
pub fn model_dir() -> PathBuf {
    let d = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/kvroute-cache/models/qwen3"));
    assert!(
        d.join("tokenizer.json").is_file() && d.join("tokenizer_config.json").is_file(),
        "tokenizer files not found in {} (KVROUTE_MODEL_DIR): run `cargo xtask setup`",
        d.display()
    );
    d
}

/// A fresh directory under the system temp dir, removed on drop (only what this test created).
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates `kvroute-<tag>-<pid>-<nanos>`.
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("kvroute-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process whose stdout lines arrive on a channel; killed (and reaped) on drop.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    lines: Receiver<String>,
    stdin: Option<ChildStdin>,
    log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` with stdout piped, stderr to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf, keep_stdin: bool) -> Proc {
        let err = std::fs::File::create(&log).expect("create log");
        cmd.stdout(Stdio::piped()).stderr(err);
        cmd.stdin(if keep_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            name: name.to_string(),
            child: Some(child),
            lines: rx,
            stdin,
            log,
        }
    }

    /// The next stdout line that satisfies `f`, within `timeout`; panics with the log otherwise.
    pub fn wait_line(&mut self, timeout: Duration, mut f: impl FnMut(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if f(&l) => return l,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{}: no expected stdout line within {timeout:?}; stderr:\n{}",
                    self.name,
                    self.log_tail()
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "{}: exited before the expected line; stderr:\n{}",
                    self.name,
                    self.log_tail()
                ),
            }
        }
    }

    /// The next stdout line within `timeout`, if any.
    pub fn try_line(&mut self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// Whether the child has exited.
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// Writes one line to the child's stdin.
    pub fn send_line(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin kept");
        writeln!(s, "{line}").expect("write to child stdin");
        s.flush().expect("flush child stdin");
    }

    /// The last 4 KB of the child's stderr.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(4096);
        let start = (start..text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(text.len());
        text[start..].to_string()
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stdin = None;
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `kvroute-indexer serve --config <path> --listen 127.0.0.1:0`; returns it and its base URL.
pub fn start_indexer(config: &Path, dir: &Path, extra_args: &[&str]) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-indexer"));
    cmd.args(["serve", "--config"])
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .args(extra_args)
        .env("NO_COLOR", "1")
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        );
    let mut p = Proc::spawn("kvroute-indexer", cmd, dir.join("indexer.log"), false);
    let line = p.wait_line(Duration::from_secs(30), |l| l.starts_with("listening on "));
    let addr = line.trim_start_matches("listening on ").trim().to_string();
    (p, format!("http://{addr}"))
}

/// A short-timeout HTTP client.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client")
}

/// GET a JSON document.
pub async fn get_json(c: &reqwest::Client, url: &str) -> Value {
    let r = c
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = r.status();
    let text = r.text().await.unwrap_or_default();
    assert!(status.is_success(), "GET {url}: {status} {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("GET {url}: not JSON ({e}): {text}"))
}

/// POST JSON; returns status and JSON body (`Null` when not JSON).
pub async fn post_json(c: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = c
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// GET text.
pub async fn get_text(c: &reqwest::Client, url: &str) -> String {
    c.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap_or_default()
}

/// Polls the async predicate every 50 ms until it is true or `timeout` passes; returns the last
/// result.
pub async fn poll<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sum of every sample of a Prometheus series (all label sets); `None` if absent.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
        *found.get_or_insert(0.0) += v;
    }
    found
}

/// The stream JSON objects of a replica in `/debug/replicas`.
pub fn streams_of<'a>(replicas: &'a Value, name: &str) -> Vec<&'a Value> {
    replicas["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["name"] == name)
        .flat_map(|r| r["streams"].as_array().into_iter().flatten())
        .collect()
}

/// The replica JSON object in `/debug/replicas`.
pub fn replica_of<'a>(replicas: &'a Value, name: &str) -> Option<&'a Value> {
    replicas["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["name"] == name)
}

/// A field of `/proc/<pid>/status` given in kB (`VmRSS`, `VmHWM`), in bytes; `None` off Linux or
/// once the process is gone.
pub fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(&format!("{field}:")))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
