//! Helpers for tests that run the real `kvroute-sim` binary on 127.0.0.1.
#![allow(dead_code, unused_imports)]

use std::process::Command;
use std::time::Duration;

pub use kvroute_testkit::paths::{model_dir, python, workspace, TempDir};
pub use kvroute_testkit::ports::{free_port, free_port_run};
use kvroute_testkit::process::Proc;

/// A running simulator process, killed on drop.
pub struct Sim {
    pub proc: Proc,
    pub base: String,
    /// Holds the stderr log.
    _dir: TempDir,
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
        .env("RUST_LOG", "warn");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let dir = TempDir::new("sim");
        let mut proc = Proc::spawn_piped("kvroute-sim", cmd, dir.0.join("sim.log"), false);
        let line = proc.wait_line(Duration::from_secs(60), |l| {
            l.starts_with("kvroute-sim listening on ")
        });
        let base = line["kvroute-sim listening on ".len()..].to_string();
        Sim {
            proc,
            base,
            _dir: dir,
        }
    }

    /// `base + path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        self.proc.terminate(timeout)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

/// Reads one metric sample value from Prometheus text.
pub fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    kvroute_testkit::prom::series_value(text, name_and_labels)
}

/// The kv-events-config JSON for PUB/replay ports.
pub fn events_config(pub_port: u16, replay_port: u16, extra: &str) -> String {
    format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{pub_port}","replay_endpoint":"tcp://*:{replay_port}","topic":"kv-events"{extra}}}"#
    )
}
