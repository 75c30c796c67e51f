//! Helpers for tests that run the real `kvroute-sim` binary on 127.0.0.1.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}

/// The Qwen3 model dir (KVROUTE_MODEL_DIR, else the xtask cache). Fails when missing.
pub fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/kvroute-cache/models/qwen3"));
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file(),
        "model dir {} has no tokenizer.json/tokenizer_config.json: run `cargo xtask setup`",
        dir.display()
    );
    dir
}

/// The venv python (KVROUTE_PYTHON, else the xtask cache). Fails when missing.
pub fn python() -> PathBuf {
    let py = std::env::var_os("KVROUTE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/kvroute-cache/venv/bin/python"));
    assert!(
        py.exists(),
        "python {} not found: run `cargo xtask setup`",
        py.display()
    );
    py
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// `n` consecutive free ports (for data-parallel +rank endpoints).
pub fn free_port_run(n: u16) -> u16 {
    for _ in 0..200 {
        let base = free_port();
        if base > 65000 {
            continue;
        }
        let all_free = (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no run of {n} free ports");
}

/// A running simulator process, killed on drop.
pub struct Sim {
    pub child: Child,
    pub base: String,
}

impl Sim {
    /// Starts `kvroute-sim --port 0 --model-dir <qwen3> --served-model-name qwen3 <args>` and
    /// waits for its "listening on" line.
    pub fn start(args: &[&str]) -> Sim {
        Self::start_env(args, &[])
    }

    /// As [`Sim::start`] with extra environment variables.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Sim {
        let model = model_dir();
        // KVROUTE_SIM_TASKSET=0 pins the simulator (only) to CPU 0, for benchmarks.
        let mut cmd = match std::env::var("KVROUTE_SIM_TASKSET") {
            Ok(cpus) if !cpus.is_empty() => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpus]).arg(env!("CARGO_BIN_EXE_kvroute-sim"));
                c
            }
            _ => Command::new(env!("CARGO_BIN_EXE_kvroute-sim")),
        };
        cmd.args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--served-model-name",
            "qwen3",
        ])
        .arg("--model-dir")
        .arg(&model)
        .args(args)
        .env_remove("PYTHONHASHSEED")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn kvroute-sim");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(Ok(line)) = lines.next() {
                if let Some(url) = line.strip_prefix("kvroute-sim listening on ") {
                    let _ = tx.send(url.to_string());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("kvroute-sim did not start within 60 s");
        Sim { child, base }
    }

    /// `base + path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads one metric sample value from Prometheus text.
pub fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The kv-events-config JSON for PUB/replay ports.
pub fn events_config(pub_port: u16, replay_port: u16, extra: &str) -> String {
    format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{pub_port}","replay_endpoint":"tcp://*:{replay_port}","topic":"kv-events"{extra}}}"#
    )
}
