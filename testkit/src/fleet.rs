//! A real fleet for end-to-end tests: `kvroute-sim` replicas and `kvroute-indexer serve`, each a
//! [`Proc`] on loopback ports, started and waited for healthy (every wait bounded).

use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::http::{http, post_json, try_http};
use crate::paths::{bin, model_dir};
use crate::ports::free_port;
use crate::process::Proc;
use crate::prom;

pub const ADMIN_TOKEN: &str = "e2e-admin-token";

/// The ports of one kvroute-sim replica.
#[derive(Debug, Clone)]
pub struct SimPlan {
    pub name: String,
    pub port: u16,
    pub events: u16,
    pub replay: u16,
}

impl SimPlan {
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The indexer's replica entry. As in vLLM, a publisher endpoint with a concrete address
    /// connects out, so the indexer binds it (`bind = true`): everything stays on loopback.
    pub fn replica_config(&self) -> Value {
        serde_json::json!({"name": self.name, "http": self.addr(),
            "events": [format!("tcp://127.0.0.1:{}", self.events)],
            "replay": [format!("tcp://127.0.0.1:{}", self.replay)],
            "bind": true})
    }
}

/// One kvroute-sim replica.
pub struct Sim {
    pub name: String,
    pub port: u16,
    pub events: u16,
    pub replay: u16,
    pub proc: Proc,
}

impl Sim {
    /// Ports for a replica that is not started yet (so the indexer can bind its event endpoint
    /// first: a publisher with a concrete address connects out, as in vLLM).
    pub fn plan(name: &str) -> SimPlan {
        SimPlan {
            name: name.to_string(),
            port: free_port(),
            events: free_port(),
            replay: free_port(),
        }
    }

    pub fn start(plan: &SimPlan, dir: &Path) -> Sim {
        Self::spawn(plan, dir, true)
    }

    /// A replica without a KV event publisher (for tests with no real indexer).
    pub fn start_without_events(name: &str, dir: &Path) -> Sim {
        Self::spawn(&Self::plan(name), dir, false)
    }

    fn spawn(plan: &SimPlan, dir: &Path, with_events: bool) -> Sim {
        let SimPlan {
            name,
            port,
            events,
            replay,
        } = plan.clone();
        let kv = serde_json::json!({
            "enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://127.0.0.1:{events}"),
            "replay_endpoint": format!("tcp://127.0.0.1:{replay}"),
            "topic": "kv-events"});
        let mut cmd = Command::new(bin("kvroute-sim"));
        cmd.arg("--port")
            .arg(port.to_string())
            .args(["--block-size", "16", "--served-model-name", "qwen3"])
            // Names the fail-open tests use for models the indexer does not know.
            .args(if with_events {
                &[][..]
            } else {
                &["other", "unlisted"][..]
            })
            .arg("--model-dir")
            .arg(model_dir())
            .args(["--num-gpu-blocks-override", "4096", "--time-scale", "20"]);
        if with_events {
            cmd.arg("--kv-events-config").arg(kv.to_string());
        }
        let proc = Proc::spawn(&name, &mut cmd, dir);
        let mut sim = Sim {
            name: name.clone(),
            port,
            events,
            replay,
            proc,
        };
        let start = Instant::now();
        loop {
            sim.proc.assert_running();
            if try_http(port, "GET", "/health", &[], b"", Duration::from_secs(2))
                .is_ok_and(|r| r.status == 200)
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{name} not healthy"
            );
            thread::sleep(Duration::from_millis(100));
        }
        sim
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Sum of a Prometheus counter over its label sets.
    pub fn metric(&self, name: &str) -> f64 {
        metric_of(self.port, name)
    }

    /// (prefix_cache_queries_total, prefix_cache_hits_total), in tokens.
    pub fn cache_counters(&self) -> (u64, u64) {
        (
            self.metric("vllm:prefix_cache_queries_total") as u64,
            self.metric("vllm:prefix_cache_hits_total") as u64,
        )
    }
}

fn toml_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

fn replica_toml(r: &Value) -> String {
    let list = |k: &str| {
        r[k].as_array()
            .map(|a| {
                a.iter()
                    .map(|v| toml_str(v.as_str().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    format!(
        "[[models.replicas]]\nname = {}\nhttp = {}\nevents = [{}]\nreplay = [{}]\nbind = true\n\n",
        toml_str(r["name"].as_str().unwrap_or("")),
        toml_str(r["http"].as_str().unwrap_or("")),
        list("events"),
        list("replay")
    )
}

/// kvroute-indexer serve.
pub struct Indexer {
    pub port: u16,
    pub proc: Proc,
}

impl Indexer {
    /// Starts the indexer for replicas that are not running yet (it binds their event
    /// endpoints); call [`Indexer::wait_ready`] once they run.
    pub fn start(sims: &[SimPlan], dir: &Path) -> Indexer {
        Self::start_with(sims, dir, "")
    }

    /// Like [`Indexer::start`], with extra TOML tables (e.g. `[scoring]`) appended.
    pub fn start_with(sims: &[SimPlan], dir: &Path, extra_toml: &str) -> Indexer {
        Self::start_with_model(sims, dir, &model_dir(), extra_toml)
    }

    /// Like [`Indexer::start_with`], serving the model's files from `model_files`.
    pub fn start_with_model(
        sims: &[SimPlan],
        dir: &Path,
        model_files: &Path,
        extra_toml: &str,
    ) -> Indexer {
        Self::start_on(sims, dir, model_files, extra_toml, free_port(), &[])
    }

    /// Like [`Indexer::start_with_model`], listening on `port` (a restart where Envoy expects it)
    /// with extra `serve` arguments (e.g. `--policy session`).
    pub fn start_on(
        sims: &[SimPlan],
        dir: &Path,
        model_files: &Path,
        extra_toml: &str,
        port: u16,
        args: &[&str],
    ) -> Indexer {
        let mut cfg = format!(
            "listen = {}\nadmin_token = {}\n\n[[models]]\nname = \"qwen3\"\nmodel_dir = {}\nblock_size = 16\n\n[models.hash]\nalgo = \"sha256\"\n\n",
            toml_str(&format!("127.0.0.1:{port}")),
            toml_str(ADMIN_TOKEN),
            toml_str(&model_files.display().to_string()),
        );
        for s in sims {
            cfg.push_str(&replica_toml(&s.replica_config()));
        }
        cfg.push_str(extra_toml);
        let path = dir.join("indexer.toml");
        std::fs::write(&path, cfg).expect("write indexer config");
        let proc = Proc::spawn(
            "indexer",
            Command::new(bin("kvroute-indexer"))
                .arg("serve")
                .arg("--config")
                .arg(&path)
                .args(args)
                .env("RUST_LOG", test_indexer_log_filter()),
            dir,
        );
        let mut ix = Indexer { port, proc };
        let start = Instant::now();
        loop {
            ix.proc.assert_running();
            if try_http(port, "GET", "/healthz", &[], b"", Duration::from_secs(2))
                .is_ok_and(|r| r.status == 200)
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "indexer not up; log:\n{}",
                ix.proc.log_tail()
            );
            thread::sleep(Duration::from_millis(100));
        }
        ix
    }

    /// Waits until the indexer answers `/readyz` with 200, ready or degraded (e.g. event streams
    /// that have said nothing since it started): enough for policies that do not read the index.
    pub fn wait_serving(&mut self) {
        self.wait_readyz("serving", |_| true);
    }

    /// Waits until every replica is healthy and its event stream connected (`/readyz` says
    /// "ready", not "degraded").
    pub fn wait_ready(&mut self) {
        self.wait_readyz("ready", |status| status == "ready");
    }

    /// Polls `/readyz` for up to 60 s until it answers 200 with a `status` that `accept` takes.
    fn wait_readyz(&mut self, what: &str, accept: impl Fn(&Value) -> bool) {
        let start = Instant::now();
        loop {
            self.proc.assert_running();
            let r = try_http(
                self.port,
                "GET",
                "/readyz",
                &[],
                b"",
                Duration::from_secs(2),
            );
            if r.as_ref()
                .is_ok_and(|r| r.status == 200 && accept(&r.json()["status"]))
            {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "indexer not {what}: {:?}",
                r.map(|r| r.text())
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Adds a replica at run time through the admin API.
    pub fn add_replica(&self, sim: &SimPlan) {
        let mut body = sim.replica_config();
        body["model"] = Value::from("qwen3");
        let auth = format!("Bearer {ADMIN_TOKEN}");
        let r = post_json(
            self.port,
            "/admin/replicas",
            &body,
            &[("authorization", &auth)],
        );
        assert_eq!(r.status, 201, "add replica: {}", r.text());
    }

    /// The indexer's Prometheus metric (sum over labels).
    pub fn metric(&self, name: &str) -> f64 {
        metric_of(self.port, name)
    }
}

/// Sum over label sets of metric `name` on `127.0.0.1:port/metrics` (0 when absent).
fn metric_of(port: u16, name: &str) -> f64 {
    let r = http(port, "GET", "/metrics", &[], b"");
    prom::sum(&r.text(), name).unwrap_or(0.0)
}

/// The log filter of the indexers tests start: `info`, or `KVROUTE_TEST_INDEXER_LOG` (e.g.
/// `info,kvroute_indexer::route=debug` to see every decision of a failing e2e test).
fn test_indexer_log_filter() -> String {
    std::env::var("KVROUTE_TEST_INDEXER_LOG").unwrap_or_else(|_| "info".to_string())
}
