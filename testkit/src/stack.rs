//! A local kvroute stack on loopback: `kvroute-sim` replicas, `kvroute-indexer`, and Envoy (with
//! the kvroute filter, or a plain load-balancing baseline), each a supervised child process with
//! its configuration and log under one work directory.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::filter_build::FilterBuild;
use crate::http;
use crate::paths::Layout;
use crate::ports::PortPool;
use crate::supervisor::Supervisor;
use crate::toml_merge;

/// kvroute-sim's default prefill rate (`--prefill-tokens-per-s`), in model-time tokens per second.
const SIM_PREFILL_TOKENS_PER_S: f64 = 30_000.0;
/// The scoring model's prior step time and per-sequence step cost (model seconds).
const SIM_DECODE_STEP_S: f64 = 0.007;
const SIM_DECODE_STEP_PER_SEQ_S: f64 = 0.000_03;
/// The scoring model's default latency objectives (model seconds).
const TTFT_OBJECTIVE_S: f64 = 2.0;
const ITL_OBJECTIVE_S: f64 = 0.05;
/// The process name of `kvroute-indexer assess` in the stack (an `indexer` prefix: stopped with
/// the indexer and counted as the router's cost).
const ASSESS: &str = "indexer-assess";
use crate::prom::CacheCounters;

/// The baseline Envoy configuration (no filter), rendered by [`Stack::start_baseline_envoy`].
pub const BASELINE_TEMPLATE: &str = include_str!("../templates/envoy-baseline.yaml");

/// What to run.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// Number of replicas.
    pub replicas: usize,
    /// Served model name.
    pub model: String,
    /// Directory with tokenizer.json and tokenizer_config.json.
    pub model_dir: PathBuf,
    /// vLLM `--block-size`.
    pub block_size: usize,
    /// vLLM `--num-gpu-blocks-override`: KV capacity per replica, in blocks.
    pub gpu_blocks: usize,
    /// The simulator's `--time-scale`.
    pub time_scale: f64,
    /// vLLM `--prefix-caching-hash-algo`.
    pub hash_algo: String,
    /// Envoy worker threads.
    pub envoy_concurrency: usize,
    /// Extra arguments for every replica (e.g. cost model flags).
    pub sim_args: Vec<String>,
    /// Extra `key = value` lines for the indexer's `[scoring]` table (weights to try).
    pub scoring: Vec<String>,
    /// Extra `key = value` lines for the indexer's `[index]` table.
    pub index: Vec<String>,
    /// Extra fields of the filter's configuration (docs/filter.md), as `(name, value)`.
    pub filter: Vec<(String, serde_json::Value)>,
}

/// The ports of one replica.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaPorts {
    /// OpenAI HTTP server.
    pub http: u16,
    /// ZeroMQ PUB (KV events).
    pub events: u16,
    /// ZeroMQ ROUTER (replay).
    pub replay: u16,
}

/// Every port the stack uses, all on 127.0.0.1.
#[derive(Debug, Clone)]
pub struct Ports {
    /// Per replica.
    pub replicas: Vec<ReplicaPorts>,
    /// The indexer's HTTP API (the first gateway's).
    pub indexer: u16,
    /// Envoy with kvroute: listener and admin (the first gateway's).
    pub kvroute: (u16, u16),
    /// Envoy baseline: listener and admin.
    pub baseline: (u16, u16),
    /// The gateways after the first ([`Stack::set_gateways`]).
    pub more_gateways: Vec<GatewayPorts>,
}

/// The ports of one gateway: its indexer, its Envoy's listener and admin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayPorts {
    /// The indexer's HTTP API.
    pub indexer: u16,
    /// The kvroute Envoy's listener.
    pub listen: u16,
    /// The kvroute Envoy's admin.
    pub admin: u16,
}

/// Where the gateways' indexers share their decisions (`[peers]`, docs/operations.md "Running
/// several gateways"): a Redis server, its password and the fleet's channel.
#[derive(Debug, Clone)]
pub struct PeerRedis {
    /// `host:port`.
    pub addr: String,
    /// Its `requirepass`, handed to each indexer in [`PEERS_PASSWORD_ENV`].
    pub password: String,
    /// The pub/sub channel.
    pub channel: String,
}

/// The environment variable the stack's indexers read the peers' Redis password from.
pub const PEERS_PASSWORD_ENV: &str = "KVROUTE_PEERS_PASSWORD";

impl PeerRedis {
    /// The indexer's `[peers]` table (the password stays out of the file).
    pub fn toml(&self) -> Result<String> {
        let quote = |s: &str| serde_json::to_string(s);
        Ok(format!(
            "\n[peers]\nredis = {}\npassword_env = {}\nchannel = {}\n",
            quote(&self.addr)?,
            quote(PEERS_PASSWORD_ENV)?,
            quote(&self.channel)?
        ))
    }
}

/// Names of gateway `k`'s processes (indexer, Envoy): the first gateway's are the single-gateway
/// stack's (`indexer`, `envoy-kvroute`), the others' carry `-g<k>`.
pub fn gateway_process_names(k: usize) -> (String, String) {
    if k == 0 {
        ("indexer".to_string(), "envoy-kvroute".to_string())
    } else {
        (format!("indexer-g{k}"), format!("envoy-kvroute-g{k}"))
    }
}

impl Ports {
    fn allocate(replicas: usize, pool: &mut PortPool) -> Result<Self> {
        let mut replica_ports = Vec::with_capacity(replicas);
        for _ in 0..replicas {
            replica_ports.push(ReplicaPorts {
                http: pool.take()?,
                events: pool.take()?,
                replay: pool.take()?,
            });
        }
        Ok(Self {
            replicas: replica_ports,
            indexer: pool.take()?,
            kvroute: (pool.take()?, pool.take()?),
            baseline: (pool.take()?, pool.take()?),
            more_gateways: Vec::new(),
        })
    }

    /// Gateway `k`'s ports (0 is the first gateway).
    pub fn gateway(&self, k: usize) -> Option<GatewayPorts> {
        match k {
            0 => Some(GatewayPorts {
                indexer: self.indexer,
                listen: self.kvroute.0,
                admin: self.kvroute.1,
            }),
            _ => self.more_gateways.get(k - 1).copied(),
        }
    }
}

/// The binaries the stack runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `kvroute-sim`.
    pub sim: PathBuf,
    /// `kvroute-indexer`.
    pub indexer: PathBuf,
    /// Envoy.
    pub envoy: PathBuf,
    /// The filter build the kvroute Envoy runs.
    pub filter: FilterBuild,
    /// Its artifact (`kvroute_filter.wasm` or `libkvroute_filter_native.so`).
    pub filter_artifact: PathBuf,
}

impl Binaries {
    /// The builds of `profile_dir` (`release` or `debug`) in `layout`'s target directory, the
    /// release `.wasm`, and the venv's Envoy.
    pub fn new(layout: &Layout, profile_dir: &str) -> Self {
        Self {
            sim: layout.target_dir.join(profile_dir).join("kvroute-sim"),
            indexer: layout.target_dir.join(profile_dir).join("kvroute-indexer"),
            envoy: layout.envoy_bin(),
            filter: FilterBuild::Wasm,
            filter_artifact: FilterBuild::Wasm.artifact(layout),
        }
    }

    /// The same with the kvroute Envoy running `filter` (its release artifact).
    pub fn with_filter(self, layout: &Layout, filter: FilterBuild) -> Self {
        Self {
            filter,
            filter_artifact: filter.artifact(layout),
            ..self
        }
    }

    fn check(&self) -> Result<()> {
        for path in [&self.sim, &self.indexer, &self.envoy, &self.filter_artifact] {
            if !path.is_file() {
                bail!(
                    "{} is missing (build or setup step skipped?)",
                    path.display()
                );
            }
        }
        Ok(())
    }
}

/// A running (or stopped) local stack.
pub struct Stack {
    cfg: StackConfig,
    bins: Binaries,
    /// The kvroute Envoy template: `envoy/envoy.yaml`, or `envoy/envoy-native.yaml` for the
    /// native build.
    envoy_template: PathBuf,
    /// Configuration files and logs go here.
    work_dir: PathBuf,
    /// Every port in use.
    pub ports: Ports,
    sup: Supervisor,
    generation: u32,
    /// Where the indexer keeps its snapshot (`[snapshot] path`); none when `None`.
    pub indexer_snapshot: Option<PathBuf>,
    /// Extra arguments of single replicas (after the shared `sim_args`), by index.
    replica_args: Vec<Vec<String>>,
    /// Baseline Envoys health-check the replicas (a replica may be down: scale-out).
    health_checks: bool,
    /// The kvroute Envoys send routed requests through `override_host` ([`with_override_host`])
    /// instead of the ORIGINAL_DST cluster.
    override_host: bool,
    /// Ports handed out so far (more gateways take theirs from it).
    port_pool: PortPool,
    /// Envoy + indexer pairs in front of the replicas (1 unless [`Stack::set_gateways`]).
    gateways: usize,
    /// The gateways' `[peers]`, when they share decisions.
    peers: Option<PeerRedis>,
}

impl Stack {
    /// Prepares a stack (nothing runs yet); `work_dir` is created and holds configs and logs.
    pub fn new(
        layout: &Layout,
        cfg: StackConfig,
        bins: Binaries,
        work_dir: PathBuf,
        die_with_parent: bool,
    ) -> Result<Self> {
        bins.check()?;
        fs::create_dir_all(work_dir.join("logs"))
            .with_context(|| format!("creating {}", work_dir.display()))?;
        let mut port_pool = PortPool::default();
        Ok(Self {
            ports: Ports::allocate(cfg.replicas, &mut port_pool)?,
            envoy_template: layout.root.join("envoy").join(envoy_template(bins.filter)),
            cfg,
            bins,
            work_dir,
            sup: Supervisor::new(die_with_parent),
            generation: 0,
            indexer_snapshot: None,
            replica_args: Vec::new(),
            health_checks: false,
            override_host: false,
            port_pool,
            gateways: 1,
            peers: None,
        })
    }

    /// Runs `n` gateways (Envoy + filter + indexer pairs, each indexer following every replica)
    /// from the next [`Stack::start_indexer`] / [`Stack::start_kvroute_envoy`] on; with `peers`
    /// their indexers share decisions through that Redis (`[peers]`), without it each routes on
    /// its own decisions. One gateway and no peers is the default.
    pub fn set_gateways(&mut self, n: usize, peers: Option<PeerRedis>) -> Result<()> {
        if n == 0 {
            bail!("a stack needs at least one gateway");
        }
        while self.ports.more_gateways.len() + 1 < n {
            self.ports.more_gateways.push(GatewayPorts {
                indexer: self.port_pool.take()?,
                listen: self.port_pool.take()?,
                admin: self.port_pool.take()?,
            });
        }
        self.gateways = n;
        self.peers = peers;
        Ok(())
    }

    /// Gateways in front of the replicas.
    pub fn gateways(&self) -> usize {
        self.gateways
    }

    /// `host:port` of every gateway's kvroute Envoy listener (the first is [`Stack::kvroute_addr`]).
    pub fn kvroute_addrs(&self) -> Vec<String> {
        (0..self.gateways)
            .filter_map(|k| self.ports.gateway(k))
            .map(|g| format!("127.0.0.1:{}", g.listen))
            .collect()
    }

    /// `host:port` of gateway `k`'s indexer (0 is [`Stack::indexer_addr`]).
    pub fn gateway_indexer_addr(&self, k: usize) -> Option<String> {
        self.ports
            .gateway(k)
            .map(|g| format!("127.0.0.1:{}", g.indexer))
    }

    fn gateway_ports(&self, k: usize) -> Result<GatewayPorts> {
        self.ports
            .gateway(k)
            .with_context(|| format!("no gateway {k} (set_gateways first)"))
    }

    /// Stops gateway `k`'s Envoy and indexer (SIGTERM, then SIGKILL): the gateway dies.
    pub fn stop_gateway(&mut self, k: usize) {
        let (indexer, envoy) = gateway_process_names(k);
        self.sup.stop_named(&envoy);
        self.sup.stop_named(&indexer);
    }

    /// Starts gateway `k` again (its indexer with `policy`, then its Envoy, on its ports) after
    /// [`Stack::stop_gateway`], and waits as [`Stack::start_indexer`] and
    /// [`Stack::start_kvroute_envoy`] do.
    pub fn start_gateway(&mut self, k: usize, policy: &str) -> Result<()> {
        self.start_gateway_indexer(k, policy)?;
        self.start_gateway_envoy(k)
    }

    /// Starts gateway `k`'s kvroute Envoy (its indexer runs or comes next) and waits until the
    /// filter has loaded the tokenizer.
    pub fn start_gateway_envoy(&mut self, k: usize) -> Result<()> {
        self.start_envoy_of_gateway(k, false)
    }

    /// `host:port` of every replica's HTTP server.
    pub fn replica_addrs(&self) -> Vec<String> {
        self.ports
            .replicas
            .iter()
            .map(|p| format!("127.0.0.1:{}", p.http))
            .collect()
    }

    /// `host:port` of the indexer's HTTP API.
    pub fn indexer_addr(&self) -> String {
        format!("127.0.0.1:{}", self.ports.indexer)
    }

    /// `host:port` of the kvroute Envoy listener.
    pub fn kvroute_addr(&self) -> String {
        format!("127.0.0.1:{}", self.ports.kvroute.0)
    }

    /// `host:port` of the baseline Envoy listener.
    pub fn baseline_addr(&self) -> String {
        format!("127.0.0.1:{}", self.ports.baseline.0)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.work_dir
            .join("logs")
            .join(format!("{name}.{}.log", self.generation))
    }

    /// Starts every replica (cold) and waits until each answers `/health`.
    pub fn start_replicas(&mut self) -> Result<()> {
        self.start_replicas_except(&[])
    }

    /// Starts every replica but those in `later` (cold), and waits until each answers
    /// `/health`; the others stay configured in the indexer and Envoy, down until
    /// [`Stack::start_replica`].
    pub fn start_replicas_except(&mut self, later: &[usize]) -> Result<()> {
        self.generation += 1;
        let now: Vec<usize> = (0..self.ports.replicas.len())
            .filter(|i| !later.contains(i))
            .collect();
        for &index in &now {
            self.spawn_replica(index)?;
        }
        for &index in &now {
            self.wait_replica(index)?;
        }
        Ok(())
    }

    /// Gives replica `index` extra `kvroute-sim` arguments from its next start on (e.g.
    /// `--speed 0.5`).
    pub fn set_replica_args(&mut self, index: usize, args: Vec<String>) {
        if self.replica_args.len() <= index {
            self.replica_args.resize(index + 1, Vec::new());
        }
        self.replica_args[index] = args;
    }

    /// Makes the baseline Envoys health-check the replicas (`GET /health`), so a replica that is
    /// down gets no traffic until it answers; Envoy's default otherwise (none).
    pub fn set_health_checks(&mut self, on: bool) {
        self.health_checks = on;
    }

    /// Makes the kvroute Envoys started from now on route through `override_host` on
    /// `x-kvroute-destinations`, with retries onto the runner-up ([`with_override_host`]).
    pub fn set_override_host(&mut self, on: bool) {
        self.override_host = on;
    }

    /// Whether baseline Envoys health-check the replicas.
    pub fn health_checks(&self) -> bool {
        self.health_checks
    }

    /// Starts replica `index` again (cold, on its ports) after it was stopped or died, and
    /// waits until it answers `/health`.
    pub fn start_replica(&mut self, index: usize) -> Result<()> {
        self.spawn_replica(index)?;
        self.wait_replica(index)
    }

    fn spawn_replica(&mut self, index: usize) -> Result<()> {
        let ports = *self
            .ports
            .replicas
            .get(index)
            .with_context(|| format!("no replica r{index}"))?;
        let events = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{}", ports.events),
            "replay_endpoint": format!("tcp://*:{}", ports.replay),
            "topic": "kv-events",
        });
        let mut cmd = Command::new(&self.bins.sim);
        cmd.arg("--port")
            .arg(ports.http.to_string())
            .args(["--served-model-name", &self.cfg.model, "--model-dir"])
            .arg(&self.cfg.model_dir)
            .args(["--block-size", &self.cfg.block_size.to_string()])
            .args([
                "--num-gpu-blocks-override",
                &self.cfg.gpu_blocks.to_string(),
            ])
            .args(["--prefix-caching-hash-algo", &self.cfg.hash_algo])
            .args(["--kv-events-config", &events.to_string()])
            .args(["--time-scale", &self.cfg.time_scale.to_string()])
            .args(&self.cfg.sim_args)
            .args(self.replica_args.get(index).into_iter().flatten())
            .env("RUST_LOG", "warn");
        let name = format!("replica-r{index}");
        let log = self.log(&name);
        self.sup.spawn(&name, cmd, &log)?;
        Ok(())
    }

    fn wait_replica(&mut self, index: usize) -> Result<()> {
        let addr = self.replica_addrs()[index].clone();
        self.sup.wait_http_ok(
            &format!("replica r{index}"),
            &addr,
            "/health",
            Duration::from_secs(60),
        )
    }

    /// Pids (each its process group) of the live processes whose names start with `prefix`
    /// (`indexer`, `envoy-kvroute`, `replica-r1`).
    pub fn pids(&self, prefix: &str) -> Vec<u32> {
        self.sup.pids_matching(prefix)
    }

    /// Process groups of the router: every Envoy and the indexer (not the replicas). Their CPU
    /// time and memory are what routing costs.
    pub fn router_process_groups(&self) -> Vec<u32> {
        let mut groups = self.sup.pids_matching("envoy");
        groups.extend(self.sup.pids_matching("indexer"));
        groups
    }

    /// Stops every replica.
    pub fn stop_replicas(&mut self) {
        self.sup.stop_matching("replica-");
    }

    /// Writes the indexer's configuration, starts it with `policy` and waits for `/readyz`; with
    /// several gateways ([`Stack::set_gateways`]), one indexer per gateway, each also waiting
    /// until it is connected to its peers when they share.
    pub fn start_indexer(&mut self, policy: &str) -> Result<()> {
        for k in 0..self.gateways {
            self.start_gateway_indexer(k, policy)?;
        }
        Ok(())
    }

    /// Starts gateway `k`'s indexer with `policy` and waits for its `/readyz` (and its peers'
    /// Redis, when the gateways share).
    pub fn start_gateway_indexer(&mut self, k: usize, policy: &str) -> Result<()> {
        let ports = self.gateway_ports(k)?;
        let (name, _) = gateway_process_names(k);
        let config = self.work_dir.join(format!("{name}.toml"));
        fs::write(&config, self.indexer_toml(k)?)
            .with_context(|| format!("writing {}", config.display()))?;
        let listen = format!("127.0.0.1:{}", ports.indexer);
        let mut cmd = Command::new(&self.bins.indexer);
        cmd.args(["serve", "--config"])
            .arg(&config)
            .args(["--listen", &listen, "--policy", policy])
            .env("RUST_LOG", indexer_log_filter());
        if let Some(peers) = &self.peers {
            cmd.env(PEERS_PASSWORD_ENV, &peers.password);
        }
        let log = self.log(&name);
        self.sup.spawn(&name, cmd, &log)?;
        self.sup
            .wait_http_ok(&name, &listen, "/readyz", Duration::from_secs(60))?;
        if self.peers.is_some() {
            self.wait_peers_connected(&name, &listen, Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// Waits until the indexer at `addr` reports `kvroute_indexer_peers_connected 1`.
    fn wait_peers_connected(&mut self, name: &str, addr: &str, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.sup.check_alive()?;
            let connected = http::get(addr, "/metrics", Duration::from_secs(2))
                .ok()
                .filter(|(status, _)| *status == 200)
                .and_then(|(_, text)| crate::prom::sum(&text, "kvroute_indexer_peers_connected"))
                .is_some_and(|v| v >= 1.0);
            if connected {
                return Ok(());
            }
            if crate::supervisor::interrupted() {
                bail!("interrupted");
            }
            if std::time::Instant::now() >= deadline {
                bail!(
                    "{name} did not connect to its peers' Redis within {}s; see {}",
                    timeout.as_secs(),
                    self.log(name).display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts `kvroute-indexer assess` in the indexer's place (same configuration and port,
    /// `--listen` for filters in shadow mode), writing its report to `json` when it ends, and
    /// waits until its window has begun. End it with [`Stack::finish_assess`]. (One gateway.)
    pub fn start_assess(&mut self, json: &Path) -> Result<()> {
        let config = self.work_dir.join("indexer.toml");
        fs::write(&config, self.indexer_toml(0)?)
            .with_context(|| format!("writing {}", config.display()))?;
        let listen = format!("127.0.0.1:{}", self.ports.indexer);
        let _ = fs::remove_file(json);
        let mut cmd = Command::new(&self.bins.indexer);
        cmd.args(["assess", "--config"])
            .arg(&config)
            .args(["--listen", &listen, "--duration", "24h", "--json"])
            .arg(json)
            .env("RUST_LOG", indexer_log_filter());
        let log = self.log(ASSESS);
        self.sup.spawn(ASSESS, cmd, &log)?;
        self.sup
            .wait_http_ok("assess", &listen, "/readyz", Duration::from_secs(60))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("assess: watching")
        {
            self.sup.check_alive()?;
            if std::time::Instant::now() >= deadline {
                bail!(
                    "assess did not start its window within 60 s; see {}",
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Ends the `assess` window (SIGINT, as Ctrl-C) and waits for it to write its report.
    pub fn finish_assess(&mut self) -> Result<()> {
        self.sup.interrupt_and_wait(ASSESS, Duration::from_secs(60))
    }

    /// Gateway `k`'s indexer configuration for this stack (its prefill rate is the replicas'
    /// time-scaled; `[peers]` when the gateways share).
    fn indexer_toml(&self, k: usize) -> Result<String> {
        let ports = self.gateway_ports(k)?;
        let quote = |s: &str| serde_json::to_string(s);
        let scale = self.cfg.time_scale.max(f64::MIN_POSITIVE);
        let mut toml = format!(
            "listen = {}\nscrape_interval_ms = 500\n\n\
             [scoring]\nprefill_tokens_per_s = {:.1}\ndecode_step_s = {:.8}\n\
             decode_step_per_seq_s = {:.10}\nttft_objective_s = {:.6}\nitl_objective_s = {:.8}\n\n\
             [calibration]\nengine_time_scale = {}\n\n\
             [inflight]\nrecent_work_window_s = {:.3}\n\n\
             [[models]]\nname = {}\nmodel_dir = {}\nblock_size = {}\nhash = {{ algo = {} }}\n",
            quote(&format!("127.0.0.1:{}", ports.indexer))?,
            SIM_PREFILL_TOKENS_PER_S * scale,
            SIM_DECODE_STEP_S / scale,
            SIM_DECODE_STEP_PER_SEQ_S / scale,
            TTFT_OBJECTIVE_S / scale,
            ITL_OBJECTIVE_S / scale,
            scale,
            // The default window (60 s) in model time, as the replicas' sessions live in it.
            60.0 / scale,
            quote(&self.cfg.model)?,
            quote(&self.cfg.model_dir.to_string_lossy())?,
            self.cfg.block_size,
            quote(&self.cfg.hash_algo)?,
        );
        if let Some(snapshot) = &self.indexer_snapshot {
            // Each gateway's indexer keeps its own.
            let mut path = snapshot.clone().into_os_string();
            if k > 0 {
                path.push(format!(".g{k}"));
            }
            toml.push_str(&format!(
                "\n[snapshot]\npath = {}\ninterval_ms = 10000\n",
                quote(&PathBuf::from(path).to_string_lossy())?
            ));
        }
        if let Some(peers) = &self.peers {
            toml.push_str(&peers.toml()?);
        }
        for (index, ports) in self.ports.replicas.iter().enumerate() {
            toml.push_str(&format!(
                "\n[[models.replicas]]\nname = \"r{index}\"\nhttp = \"127.0.0.1:{}\"\n\
                 events = [\"tcp://127.0.0.1:{}\"]\nreplay = [\"tcp://127.0.0.1:{}\"]\n",
                ports.http, ports.events, ports.replay
            ));
        }
        // What the caller asks for replaces what the stack writes, key by key.
        let mut doc: toml::Table = toml
            .parse()
            .context("the local stack's own indexer configuration")?;
        toml_merge::merge(
            &mut doc,
            toml_merge::table_of_lines("scoring", &self.cfg.scoring)?,
        );
        toml_merge::merge(
            &mut doc,
            toml_merge::table_of_lines("index", &self.cfg.index)?,
        );
        toml_merge::merge(&mut doc, indexer_extra_toml()?);
        Ok(format!(
            "# Written by cargo xtask for a local stack. The simulated replicas run --time-scale\n\
             # times faster than the wall: the scoring priors are the defaults (30k tokens/s,\n\
             # 7 ms steps) in wall time, and their metrics report model time.\n{}",
            toml::to_string(&doc).context("writing the indexer configuration")?
        ))
    }

    /// Every replica as an Envoy `lb_endpoints` list (JSON).
    pub fn lb_endpoints(&self) -> String {
        loopback_endpoints(&self.http_ports(), false)
    }

    /// [`Stack::lb_endpoints`] with each replica's name (`r0`, `r1`, ...) as its place on a
    /// hash ring (`envoy.lb` `hash_key`): a ring hash then maps a session to the same replica in
    /// every run, whatever ports the replicas got (by default Envoy hashes the address).
    pub fn lb_endpoints_hash_keyed(&self) -> String {
        loopback_endpoints(&self.http_ports(), true)
    }

    fn http_ports(&self) -> Vec<u16> {
        self.ports.replicas.iter().map(|p| p.http).collect()
    }

    /// Renders the kvroute Envoy template of the filter build, starts Envoy with the filter and
    /// waits until the filter has loaded the tokenizer (in every worker's VM for the Wasm build,
    /// once for the native one).
    pub fn start_kvroute_envoy(&mut self) -> Result<()> {
        self.start_kvroute_envoy_in(false)
    }

    /// [`Stack::start_kvroute_envoy`] with the filter in shadow mode (`"mode": "shadow"`) and the
    /// fallback cluster on `ROUND_ROBIN`: Envoy's round robin routes every request while the
    /// filter asks the indexer and reports what it would have chosen (docs/assess.md).
    pub fn start_kvroute_envoy_shadow(&mut self) -> Result<()> {
        self.start_kvroute_envoy_in(true)
    }

    fn start_kvroute_envoy_in(&mut self, shadow: bool) -> Result<()> {
        if shadow {
            return self.start_envoy_of_gateway(0, true);
        }
        // Every gateway's Envoy first, then their tokenizer loads (which take the time) together.
        for k in 0..self.gateways {
            self.spawn_envoy_of_gateway(k, false)?;
        }
        for k in 0..self.gateways {
            self.wait_tokenizers_of_gateway(k)?;
        }
        Ok(())
    }

    fn start_envoy_of_gateway(&mut self, k: usize, shadow: bool) -> Result<()> {
        self.spawn_envoy_of_gateway(k, shadow)?;
        self.wait_tokenizers_of_gateway(k)
    }

    /// Renders gateway `k`'s kvroute Envoy configuration, starts it and waits for its `/ready`.
    fn spawn_envoy_of_gateway(&mut self, k: usize, shadow: bool) -> Result<()> {
        let ports = self.gateway_ports(k)?;
        let (_, name) = gateway_process_names(k);
        let template = fs::read_to_string(&self.envoy_template)
            .with_context(|| format!("reading {}", self.envoy_template.display()))?;
        let mut plugin = json!({"models": {self.cfg.model.as_str(): {}}});
        for (name, value) in &self.cfg.filter {
            plugin[name.as_str()] = value.clone();
        }
        if shadow {
            plugin["mode"] = json!("shadow");
        }
        let plugin_config = plugin.to_string();
        let values = kvroute_template_values(
            ports.listen,
            ports.admin,
            (
                self.bins.filter,
                &self.bins.filter_artifact.to_string_lossy(),
            ),
            ports.indexer,
            &self.lb_endpoints(),
            &plugin_config,
        )?;
        let mut yaml = render(&template, &values)?;
        if shadow {
            yaml = with_round_robin_fallback(&yaml)?;
        }
        if self.override_host {
            yaml = with_override_host(&yaml)?;
        }
        self.start_envoy(&name, &yaml, ports.admin)
    }

    fn wait_tokenizers_of_gateway(&mut self, k: usize) -> Result<()> {
        let ports = self.gateway_ports(k)?;
        let (_, name) = gateway_process_names(k);
        self.wait_tokenizers_loaded(&name, ports.admin, Duration::from_secs(90))
    }

    /// Starts the plain Envoy (no filter) balancing over the replicas with `lb_policy`
    /// (ROUND_ROBIN, LEAST_REQUEST, RANDOM).
    pub fn start_baseline_envoy(&mut self, lb_policy: &str) -> Result<()> {
        let (listen, admin) = self.ports.baseline;
        let mut yaml = render(
            BASELINE_TEMPLATE,
            &[
                ("LISTEN_PORT", listen.to_string()),
                ("ADMIN_PORT", admin.to_string()),
                ("LB_POLICY", lb_policy.to_string()),
                ("LB_ENDPOINTS", self.lb_endpoints()),
            ],
        )?;
        if self.health_checks {
            yaml = with_health_checks(&yaml)?;
        }
        self.start_envoy("envoy-baseline", &yaml, admin)
    }

    fn start_envoy(&mut self, name: &str, yaml: &str, admin: u16) -> Result<()> {
        let config = self.work_dir.join(format!("{name}.yaml"));
        fs::write(&config, yaml).with_context(|| format!("writing {}", config.display()))?;
        let mut cmd = Command::new(&self.bins.envoy);
        cmd.arg("-c")
            .arg(&config)
            .args(["--disable-hot-restart", "--log-level", "warn"])
            .args(["--concurrency", &self.cfg.envoy_concurrency.to_string()]);
        let log = self.log(name);
        self.sup.spawn(name, cmd, &log)?;
        self.sup.wait_http_ok(
            name,
            &format!("127.0.0.1:{admin}"),
            "/ready",
            Duration::from_secs(60),
        )
    }

    /// Stops the processes whose names start with `prefix` (`envoy-baseline`, `indexer`, ...).
    pub fn stop(&mut self, prefix: &str) {
        self.sup.stop_matching(prefix);
    }

    /// Fails if a process of the stack has died.
    pub fn check_alive(&mut self) -> Result<()> {
        self.sup.check_alive()
    }

    /// Leaves every process running; returns (pid, name) of each.
    pub fn detach(&mut self) -> Vec<(u32, String)> {
        self.sup.detach()
    }

    /// Fails unless every port of the stack that something listens on is bound to loopback
    /// only: the replicas' event and replay sockets carry prompt token ids, their HTTP servers
    /// `/reset_prefix_cache`, the indexer `/debug/lookup`, Envoy's admin `/quitquitquit`.
    pub fn check_loopback_only(&self) -> Result<()> {
        let mut ports = vec![
            ("indexer HTTP".to_string(), self.ports.indexer),
            ("kvroute Envoy listener".to_string(), self.ports.kvroute.0),
            ("kvroute Envoy admin".to_string(), self.ports.kvroute.1),
            ("baseline Envoy listener".to_string(), self.ports.baseline.0),
            ("baseline Envoy admin".to_string(), self.ports.baseline.1),
        ];
        for (i, g) in self.ports.more_gateways.iter().enumerate() {
            let k = i + 1;
            ports.push((format!("gateway {k} indexer HTTP"), g.indexer));
            ports.push((format!("gateway {k} Envoy listener"), g.listen));
            ports.push((format!("gateway {k} Envoy admin"), g.admin));
        }
        for (i, p) in self.ports.replicas.iter().enumerate() {
            ports.push((format!("replica r{i} HTTP"), p.http));
            ports.push((format!("replica r{i} events (PUB)"), p.events));
            ports.push((format!("replica r{i} replay (ROUTER)"), p.replay));
        }
        let listening = listening_sockets()?;
        for (what, port) in ports {
            if let Some((addr, _)) = listening
                .iter()
                .find(|(addr, p)| *p == port && !addr.is_loopback())
            {
                bail!("{what} (port {port}) listens on {addr}, not on loopback only");
            }
        }
        Ok(())
    }

    /// The replicas' prefix-cache counters, summed.
    pub fn cache_counters(&self) -> Result<CacheCounters> {
        let all = self
            .replica_addrs()
            .iter()
            .map(|addr| CacheCounters::scrape(addr))
            .collect::<Result<Vec<_>>>()?;
        Ok(CacheCounters::sum(&all))
    }

    /// The kvroute filter's counters from Envoy's admin `/stats` (names without `wasmcustom.` or
    /// the native build's `dynamicmodulescustom.`).
    pub fn filter_counters(&self) -> Result<BTreeMap<String, u64>> {
        filter_counters_at(self.ports.kvroute.1)
    }

    fn wait_tokenizers_loaded(&mut self, name: &str, admin: u16, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        let want = match self.bins.filter {
            FilterBuild::Wasm => self.cfg.envoy_concurrency as u64,
            FilterBuild::Native => 1,
        };
        loop {
            self.sup.check_alive()?;
            let counters = filter_counters_at(admin).unwrap_or_default();
            let loaded = counters
                .get("kvroute.tokenizer_loaded")
                .copied()
                .unwrap_or(0);
            if loaded >= want {
                return Ok(());
            }
            if crate::supervisor::interrupted() {
                bail!("interrupted");
            }
            if std::time::Instant::now() >= deadline {
                let failed = counters
                    .get("kvroute.tokenizer_load_failed")
                    .copied()
                    .unwrap_or(0);
                bail!(
                    "the kvroute filter loaded the tokenizer in {loaded} of {want} Envoy VMs \
                     within {}s ({failed} failed loads); see {}",
                    timeout.as_secs(),
                    self.log(name).display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Envoy's counters and gauges whose names contain `filter` (`/stats?filter=`), from the admin
/// at `admin` (`host:port`), by name.
pub fn envoy_stats(admin: &str, filter: &str) -> Result<Vec<(String, u64)>> {
    let (status, text) = http::get(
        admin,
        &format!("/stats?filter={filter}"),
        Duration::from_secs(5),
    )?;
    if status != 200 {
        bail!("Envoy admin /stats answered HTTP {status}");
    }
    Ok(text
        .lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            Some((name.trim().to_string(), value.trim().parse::<u64>().ok()?))
        })
        .collect())
}

/// The kvroute filter's counters from the admin `/stats` of the Envoy whose admin listens on
/// `admin` (names without `wasmcustom.` or the native build's `dynamicmodulescustom.`).
fn filter_counters_at(admin: u16) -> Result<BTreeMap<String, u64>> {
    Ok(envoy_stats(&format!("127.0.0.1:{admin}"), "kvroute")?
        .into_iter()
        .map(|(name, value)| {
            let name = name
                .strip_prefix("wasmcustom.")
                .or_else(|| name.strip_prefix("dynamicmodulescustom."))
                .map(str::to_string)
                .unwrap_or(name);
            (name, value)
        })
        .collect())
}

/// Local (address, port) of every listening TCP socket on this host (Linux `/proc/net/tcp` and
/// `tcp6`; empty elsewhere).
fn listening_sockets() -> Result<Vec<(std::net::IpAddr, u16)>> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        out.extend(parse_listening(&text));
    }
    Ok(out)
}

/// The LISTEN (`0A`) rows of a `/proc/net/tcp{,6}` table.
fn parse_listening(table: &str) -> Vec<(std::net::IpAddr, u16)> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.get(3) != Some(&"0A") {
                return None;
            }
            let (addr, port) = cols.get(1)?.split_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let ip = match addr.len() {
                8 => std::net::IpAddr::from(
                    u32::from_str_radix(addr, 16)
                        .ok()?
                        .swap_bytes()
                        .to_be_bytes(),
                ),
                32 => {
                    // Four 32-bit words, each in host (little-endian) byte order.
                    let mut bytes = [0u8; 16];
                    for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                        let word = u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16).ok()?;
                        chunk.copy_from_slice(&word.swap_bytes().to_be_bytes());
                    }
                    let v6 = std::net::Ipv6Addr::from(bytes);
                    v6.to_ipv4_mapped()
                        .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4)
                }
                _ => return None,
            };
            Some((ip, port))
        })
        .collect()
}

/// The kvroute Envoy template of a filter build, in `envoy/`.
fn envoy_template(filter: FilterBuild) -> &'static str {
    match filter {
        FilterBuild::Wasm => "envoy.yaml",
        FilterBuild::Native => "envoy-native.yaml",
    }
}

/// The values of the kvroute Envoy template's placeholders (documented at the top of each file):
/// `filter` is the build and its artifact's path.
fn kvroute_template_values(
    listen: u16,
    admin: u16,
    filter: (FilterBuild, &str),
    indexer: u16,
    lb_endpoints: &str,
    plugin_config: &str,
) -> Result<Vec<(&'static str, String)>> {
    let mut values = vec![
        ("LISTEN_PORT", listen.to_string()),
        ("ADMIN_PORT", admin.to_string()),
        ("INDEXER_PORT", indexer.to_string()),
        ("FALLBACK_LB_ENDPOINTS", lb_endpoints.to_string()),
        // JSON string literals: Envoy reads them as the StringValue of the configuration.
        ("PLUGIN_CONFIG", serde_json::to_string(plugin_config)?),
    ];
    match filter {
        (FilterBuild::Wasm, path) => {
            values.push(("WASM_PATH", path.to_string()));
            values.push(("VM_CONFIG", serde_json::to_string("")?));
        }
        (FilterBuild::Native, path) => values.push(("MODULE_PATH", path.to_string())),
    }
    Ok(values)
}

/// The active health check of `envoy/envoy.yaml`'s fallback cluster (`GET /health` every 5 s, out
/// after 3 failures, in after 1 success; a host is out until its first check passes).
const HEALTH_CHECKS: &str = "    health_checks:
    - timeout: 2s
      interval: 5s
      no_traffic_interval: 5s
      unhealthy_threshold: 3
      healthy_threshold: 1
      http_health_check: { path: /health }
";

/// The kvroute Envoy config with its fallback cluster (`kvroute_replicas_fallback`) balancing
/// by `ROUND_ROBIN` instead of `LEAST_REQUEST`.
pub fn with_round_robin_fallback(yaml: &str) -> Result<String> {
    let anchor =
        "  - name: kvroute_replicas_fallback\n    type: STATIC\n    lb_policy: LEAST_REQUEST\n";
    if yaml.matches(anchor).count() != 1 {
        bail!("envoy.yaml has no single LEAST_REQUEST fallback cluster to switch to round robin");
    }
    Ok(yaml.replacen(anchor, &anchor.replace("LEAST_REQUEST", "ROUND_ROBIN"), 1))
}

/// The kvroute Envoy template's route to the indexer's choice (ORIGINAL_DST), and the same
/// route to the replicas' cluster with retries.
const ROUTE_TO_CHOICE: &str = "                  cluster: kvroute_replicas_dst\n";
const ROUTE_WITH_RETRIES: &str = "                  cluster: kvroute_replicas_fallback\n                  retry_policy: { retry_on: \"connect-failure,reset\", num_retries: 2 }\n";

/// The replicas' cluster balancing by least request, and the same under `override_host` on
/// `x-kvroute-destinations` with least request as its fallback (docs/filter.md "Retrying onto the
/// runner-up").
const LEAST_REQUEST: &str = "    lb_policy: LEAST_REQUEST\n";
const OVERRIDE_HOST: &str = r#"    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-kvroute-destinations
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest
"#;

/// The text edits that turn a kvroute Envoy template (either build, rendered or not) into its
/// `override_host` form: routed requests go to the replicas' cluster, which tries the filter's
/// `x-kvroute-destinations` in order on retries and balances by least request without it.
pub fn override_host_edits() -> [(&'static str, &'static str); 2] {
    [
        (ROUTE_TO_CHOICE, ROUTE_WITH_RETRIES),
        (LEAST_REQUEST, OVERRIDE_HOST),
    ]
}

/// A kvroute Envoy config in its `override_host` form ([`override_host_edits`]).
pub fn with_override_host(yaml: &str) -> Result<String> {
    let mut out = yaml.to_string();
    for (from, to) in override_host_edits() {
        if out.matches(from).count() != 1 {
            bail!("the kvroute Envoy config has no single {from:?} to turn into override_host");
        }
        out = out.replacen(from, to, 1);
    }
    Ok(out)
}

/// A rendered single-cluster Envoy config (the baseline and session templates) with
/// [`HEALTH_CHECKS`] added to its cluster (after its `connect_timeout`).
pub fn with_health_checks(yaml: &str) -> Result<String> {
    let anchor = "    connect_timeout: 1s\n";
    if yaml.matches(anchor).count() != 1 || yaml.contains("health_checks:") {
        bail!("the Envoy config has no single cluster to add health checks to");
    }
    Ok(yaml.replacen(anchor, &format!("{anchor}{HEALTH_CHECKS}"), 1))
}

/// Loopback replicas on `ports` as an Envoy `lb_endpoints` list (JSON); with `hash_keyed`, replica
/// `i` is placed on a hash ring by its name `r{i}` (`envoy.lb` `hash_key`), not by its address.
pub fn loopback_endpoints(ports: &[u16], hash_keyed: bool) -> String {
    let endpoints: Vec<_> = ports
        .iter()
        .enumerate()
        .map(|(index, port)| {
            let mut e = json!({"endpoint": {"address": {"socket_address":
                {"address": "127.0.0.1", "port_value": port}}}});
            if hash_keyed {
                e["metadata"] =
                    json!({"filter_metadata": {"envoy.lb": {"hash_key": format!("r{index}")}}});
            }
            e
        })
        .collect();
    serde_json::Value::Array(endpoints).to_string()
}

/// Replaces every `{{NAME}}` of `template`; fails if a non-comment line still holds a `{{...}}`.
pub fn render(template: &str, values: &[(&str, String)]) -> Result<String> {
    // One pass over the template: a value is inserted as it is and never scanned again (a chat
    // template inside a plugin configuration has `{{` of its own).
    let mut out = String::with_capacity(template.len());
    let mut leftovers = Vec::new();
    for line in template.split_inclusive('\n') {
        let comment = line.trim_start().starts_with('#');
        let mut rest = line;
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let name = after.find("}}").map(|end| &after[..end]).filter(|n| {
                !n.is_empty()
                    && n.bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            });
            match name.and_then(|n| values.iter().find(|(k, _)| *k == n).map(|(_, v)| (n, v))) {
                Some((n, value)) => {
                    out.push_str(value);
                    rest = &after[n.len() + 2..];
                }
                None => {
                    if !comment {
                        leftovers.push(line.trim_end().to_string());
                    }
                    out.push_str("{{");
                    rest = after;
                }
            }
        }
        out.push_str(rest);
    }
    if !leftovers.is_empty() {
        bail!(
            "template placeholders left unfilled (the template has new ones xtask does not know): {}",
            leftovers.join(" | ")
        );
    }
    Ok(out)
}

/// The indexer's log filter in a local stack: `warn`, or `KVROUTE_STACK_INDEXER_LOG` (e.g.
/// `warn,kvroute_indexer::route=debug` to log every decision and every prefix given away).
fn indexer_log_filter() -> String {
    std::env::var("KVROUTE_STACK_INDEXER_LOG").unwrap_or_else(|_| "warn".to_string())
}

/// Settings laid over a local stack's indexer configuration (`KVROUTE_STACK_INDEXER_TOML`, `\n`
/// for a line break, e.g. `[inflight]\nreport_hold_ms = 0` to try a setting in the benchmark; a
/// key the stack writes too is replaced; nothing when unset).
fn indexer_extra_toml() -> Result<toml::Table> {
    let Ok(extra) = std::env::var("KVROUTE_STACK_INDEXER_TOML") else {
        return Ok(toml::Table::new());
    };
    extra
        .replace("\\n", "\n")
        .parse()
        .context("KVROUTE_STACK_INDEXER_TOML is not TOML")
}

#[cfg(test)]
mod tests {
    use super::render;
    use crate::filter_build::FilterBuild;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn baseline_yaml() -> String {
        render(
            super::BASELINE_TEMPLATE,
            &[
                ("LISTEN_PORT", "10000".into()),
                ("ADMIN_PORT", "9901".into()),
                ("LB_POLICY", "ROUND_ROBIN".into()),
                (
                    "LB_ENDPOINTS",
                    r#"[{"endpoint":{"address":{"socket_address":{"address":"127.0.0.1","port_value":8001}}}}]"#
                        .into(),
                ),
            ],
        )
        .expect("render")
    }

    #[test]
    fn baseline_config_is_valid_for_the_real_envoy() {
        let envoy = std::env::var_os("KVROUTE_ENVOY")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
            .expect("KVROUTE_ENVOY is not set to the Envoy binary: run `cargo xtask setup` (or `cargo xtask test`)");
        let dir = std::env::temp_dir().join(format!("xtask-envoy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = dir.join("baseline.yaml");
        std::fs::write(&config, baseline_yaml()).expect("write config");
        let out = Command::new(envoy)
            .args(["--mode", "validate", "--disable-hot-restart", "-c"])
            .arg(&config)
            .output()
            .expect("run envoy");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "envoy rejected the baseline config:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn xtask_fills_every_placeholder_of_the_kvroute_envoy_templates() {
        for (build, path) in [
            (FilterBuild::Wasm, "/x.wasm"),
            (FilterBuild::Native, "/x.so"),
        ] {
            let name = super::envoy_template(build);
            let template = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../envoy")
                .join(name);
            let text = std::fs::read_to_string(&template).expect("the envoy template");
            let values =
                super::kvroute_template_values(1, 2, (build, path), 3, "[]", "{}").expect("values");
            let yaml = render(&text, &values)
                .unwrap_or_else(|e| panic!("stack.rs must know every placeholder of {name}: {e}"));
            assert!(yaml.contains(path), "{name} names the filter artifact");
        }
    }

    #[test]
    fn the_override_host_form_routes_through_the_replicas_cluster_with_retries() {
        for template in ["envoy.yaml", "envoy-native.yaml"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../envoy")
                .join(template);
            let yaml = std::fs::read_to_string(&path).expect("template");
            let edited = super::with_override_host(&yaml).expect("override_host form");
            assert!(
                !edited.contains("cluster: kvroute_replicas_dst\n"),
                "{template}"
            );
            assert!(edited.contains("retry_policy:"), "{template}");
            assert!(
                edited.contains("envoy.load_balancing_policies.override_host"),
                "{template}"
            );
            assert!(!edited.contains("lb_policy: LEAST_REQUEST"), "{template}");
            assert!(super::with_override_host(&edited).is_err(), "only once");
        }
    }

    #[test]
    fn the_shadow_stack_switches_only_the_fallback_cluster_to_round_robin() {
        let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/envoy.yaml");
        let text = std::fs::read_to_string(&template).expect("envoy/envoy.yaml");
        let values =
            super::kvroute_template_values(1, 2, (FilterBuild::Wasm, "/x.wasm"), 3, "[]", "{}")
                .expect("values");
        let yaml = render(&text, &values).expect("render");
        let rr = super::with_round_robin_fallback(&yaml).expect("round robin");
        assert_eq!(
            rr.matches("LEAST_REQUEST").count() + 1,
            yaml.matches("LEAST_REQUEST").count()
        );
        assert!(rr.contains(
            "- name: kvroute_replicas_fallback\n    type: STATIC\n    lb_policy: ROUND_ROBIN\n"
        ));
        assert!(super::with_round_robin_fallback(&rr).is_err(), "only once");
    }

    #[test]
    fn listening_sockets_are_parsed_with_their_addresses() {
        let v4 = "  sl  local_address rem_address   st\n\
             0: 00000000:15B5 00000000:0000 0A 0\n\
             1: 0100007F:15B6 00000000:0000 0A 0\n\
             2: 0100007F:15B7 0100007F:9C40 01 0\n";
        let got = super::parse_listening(v4);
        assert_eq!(
            got,
            vec![
                ("0.0.0.0".parse().unwrap(), 5557),
                ("127.0.0.1".parse().unwrap(), 5558)
            ]
        );
        assert!(!got[0].0.is_loopback() && got[1].0.is_loopback());
        let v6 = "  sl  local_address\n\
             0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 0\n\
             1: 00000000000000000000000000000000:1F91 00000000000000000000000000000000:0000 0A 0\n";
        let got = super::parse_listening(v6);
        assert_eq!(got[0], ("::1".parse().unwrap(), 8080));
        assert!(got[0].0.is_loopback() && !got[1].0.is_loopback());
    }

    #[test]
    fn render_fills_placeholders_and_rejects_unknown_ones() {
        let t = "# {{A}} in a comment is fine\nport: {{A}}\nlist: {{B}}\n";
        let out = render(t, &[("A", "10".into()), ("B", "[1]".into())]).expect("render");
        assert_eq!(out, "# 10 in a comment is fine\nport: 10\nlist: [1]\n");
        assert!(render("x: {{C}}\n", &[("A", "1".into())]).is_err());
        assert!(render("# only {{C}} in a comment\n", &[]).is_ok());
        // A value with braces of its own (a chat template in a plugin configuration) is inserted
        // as it is, not read as a placeholder.
        let jinja = "{{- messages[0].content }}{{X}}".to_string();
        let out = render("value: {{V}}\n", &[("V", jinja.clone())]).expect("render");
        assert_eq!(out, format!("value: {jinja}\n"));
    }

    #[test]
    fn health_checked_baseline_is_valid_for_the_real_envoy() {
        let yaml = super::with_health_checks(&baseline_yaml()).expect("health checks");
        assert!(yaml.contains("http_health_check: { path: /health }"));
        assert!(super::with_health_checks(&yaml).is_err(), "only once");
        let Some(envoy) = std::env::var_os("KVROUTE_ENVOY")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
        else {
            return;
        };
        let dir = std::env::temp_dir().join(format!("xtask-envoy-hc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = dir.join("baseline-hc.yaml");
        std::fs::write(&config, &yaml).expect("write config");
        let out = Command::new(envoy)
            .args(["--mode", "validate", "--disable-hot-restart", "-c"])
            .arg(&config)
            .output()
            .expect("run envoy");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn peers_table_names_the_redis_and_keeps_the_password_out_of_the_file() {
        let peers = super::PeerRedis {
            addr: "127.0.0.1:6380".into(),
            password: "secret-pw".into(),
            channel: "kvroute:bench".into(),
        };
        let toml = peers.toml().expect("toml");
        assert_eq!(
            toml,
            "\n[peers]\nredis = \"127.0.0.1:6380\"\npassword_env = \"KVROUTE_PEERS_PASSWORD\"\nchannel = \"kvroute:bench\"\n"
        );
        assert!(!toml.contains("secret-pw"));
    }

    #[test]
    fn gateways_after_the_first_get_their_own_ports_and_names() {
        let mut pool = crate::ports::PortPool::default();
        let mut ports = super::Ports::allocate(2, &mut pool).expect("ports");
        let first = ports.gateway(0).expect("first gateway");
        assert_eq!(
            (first.indexer, first.listen, first.admin),
            (ports.indexer, ports.kvroute.0, ports.kvroute.1)
        );
        assert!(ports.gateway(1).is_none());
        ports.more_gateways.push(super::GatewayPorts {
            indexer: pool.take().expect("port"),
            listen: pool.take().expect("port"),
            admin: pool.take().expect("port"),
        });
        let second = ports.gateway(1).expect("second gateway");
        assert_ne!(second, first);
        assert_eq!(
            super::gateway_process_names(0),
            ("indexer".to_string(), "envoy-kvroute".to_string())
        );
        assert_eq!(
            super::gateway_process_names(2),
            ("indexer-g2".to_string(), "envoy-kvroute-g2".to_string())
        );
    }

    #[test]
    fn baseline_template_renders_completely() {
        let out = render(
            super::BASELINE_TEMPLATE,
            &[
                ("LISTEN_PORT", "1".into()),
                ("ADMIN_PORT", "2".into()),
                ("LB_POLICY", "ROUND_ROBIN".into()),
                ("LB_ENDPOINTS", "[]".into()),
            ],
        )
        .expect("render");
        assert!(out.contains("lb_policy: ROUND_ROBIN"));
    }
}
