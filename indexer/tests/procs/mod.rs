//! Helpers for tests that run real processes: the `kvroute-indexer serve` binary, vLLM's own
//! publisher (Python), `kvroute-sim`. Paths, processes and metrics come from `kvroute-testkit`.
#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use kvroute_testkit::paths::{env_or, Layout};
pub use kvroute_testkit::paths::{model_dir, newest_mtime, python, target_dir, workspace, TempDir};
pub use kvroute_testkit::ports::{free_port, free_port_run};
pub use kvroute_testkit::process::{proc_status_bytes, Proc};
pub use kvroute_testkit::prom::sum as metric_sum;

/// `fetch_vllm.py`'s cache directory (`KVROUTE_VLLM_WHEEL_DIR`, `KVROUTE_CACHE`/vllm-wheel, or the
/// xtask default).
fn vllm_wheel_dir() -> PathBuf {
    env_or(
        "KVROUTE_VLLM_WHEEL_DIR",
        Layout::for_tests().cache_dir.join("vllm-wheel"),
    )
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
    let mut p = Proc::spawn_piped("kvroute-indexer", cmd, dir.join("indexer.log"), false);
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
