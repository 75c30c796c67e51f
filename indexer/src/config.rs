//! The indexer's TOML configuration file: models, their replicas, the index budget, scoring
//! weights, scraping, snapshots and the admin token. Every validation error names the offending
//! field (`models[0].replicas[1].http`), so a broken file is fixed in one look.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_core::api::MAX_REPORT_HOLD_MS;
use kvroute_core::hashing::{ExtraKeyStyle, HashAlgo, HashConfig};
use kvroute_core::scoring::ScoringConfig;
use serde::{Deserialize, Serialize};

/// A configuration problem, with the dotted path of the field that caused it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// File path.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
    /// TOML syntax or type error (the message names the key and line).
    #[error("config file {path}: {message}")]
    Parse {
        /// File path.
        path: String,
        /// Parser message.
        message: String,
    },
    /// A field has an invalid value.
    #[error("config field `{field}`: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// The whole file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// HTTP listen address (the `--listen` flag overrides it). Default `127.0.0.1:8190`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Bearer token for `/admin/*`. When neither this nor `admin_token_env` is set the admin API
    /// answers 403.
    #[serde(default)]
    pub admin_token: Option<String>,
    /// Name of an environment variable holding the admin token (preferred over a token in the file).
    #[serde(default)]
    pub admin_token_env: Option<String>,
    /// How often each replica's `/metrics` is scraped, in ms (0 disables scraping).
    #[serde(default = "default_scrape_interval_ms")]
    pub scrape_interval_ms: u64,
    /// A stream that delivered nothing for this long while its engine reports running or waiting
    /// requests is marked stale, in ms.
    #[serde(default = "default_stale_after_ms")]
    pub stale_after_ms: u64,
    /// Largest accepted HTTP request body, in bytes.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Threads of the HTTP API's own runtime (route decisions, completions, metrics), apart from
    /// the event streams' runtime so a decision never waits in a run queue behind event intake.
    /// Default 2; 1 ..= 64.
    #[serde(default = "default_api_threads")]
    pub api_threads: usize,
    /// How the indexer's threads ask the kernel to share the CPU (`[scheduling]`, Linux).
    #[serde(default)]
    pub scheduling: SchedulingSection,
    /// The block index.
    #[serde(default)]
    pub index: IndexSection,
    /// Periodic snapshots of the index.
    #[serde(default)]
    pub snapshot: Option<SnapshotSection>,
    /// Event stream tuning.
    #[serde(default)]
    pub events: EventsSection,
    /// Policies other than `kv`.
    #[serde(default)]
    pub policies: PolicySection,
    /// The cost model's priors, tier rates and latency objectives
    /// (see `kvroute_core::scoring::ScoringConfig`).
    #[serde(default)]
    pub scoring: ScoringConfig,
    /// How replicas' rates are learned from their metrics
    /// (see `kvroute_core::calibration::CalibrationConfig`).
    #[serde(default)]
    pub calibration: kvroute_core::calibration::CalibrationConfig,
    /// How long routed requests count as in flight without a completion (`[inflight]`).
    #[serde(default)]
    pub inflight: InflightConfig,
    /// How recomputation after eviction is recognised (`[reuse]`).
    #[serde(default)]
    pub reuse: crate::reuse::ReuseConfig,
    /// Decisions shared with the other gateways' indexers through Redis (`[peers]`; off when
    /// absent).
    #[serde(default)]
    pub peers: Option<crate::peers::PeersSection>,
    /// Served models, each with its replicas.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
}

fn default_listen() -> String {
    "127.0.0.1:8190".to_string()
}
fn default_scrape_interval_ms() -> u64 {
    1000
}
fn default_stale_after_ms() -> u64 {
    10_000
}
fn default_max_body_bytes() -> usize {
    16 * 1024 * 1024
}
fn default_api_threads() -> usize {
    2
}

/// `[index]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct IndexSection {
    /// Hard memory budget of the index, in bytes (default 1 GiB).
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    /// Lifetime of predicted entries written at decision time, in ms (default 2000).
    #[serde(default = "default_predicted_ttl_ms")]
    pub predicted_ttl_ms: u64,
    /// Index only this KV cache group, read as full attention (what kvroute did before hybrid
    /// models were supported). Unset (default): every group, looked up with vLLM's hybrid hit
    /// rule.
    #[serde(default)]
    pub kv_cache_group: Option<i64>,
}

impl Default for IndexSection {
    fn default() -> Self {
        Self {
            max_bytes: default_max_bytes(),
            predicted_ttl_ms: default_predicted_ttl_ms(),
            kv_cache_group: None,
        }
    }
}
fn default_max_bytes() -> u64 {
    1 << 30
}
fn default_predicted_ttl_ms() -> u64 {
    2000
}

/// `[snapshot]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotSection {
    /// File to write (atomically, via a temporary file and rename) and to load at start.
    pub path: PathBuf,
    /// Interval between snapshots, in ms (default 30000).
    #[serde(default = "default_snapshot_interval_ms")]
    pub interval_ms: u64,
}
fn default_snapshot_interval_ms() -> u64 {
    30_000
}

/// `[scheduling]`: per-thread requests to the kernel that put a route decision ahead of event
/// intake on a busy host (`crate::scheduling`). Both are open to an unprivileged process; a
/// kernel that refuses them leaves its defaults (one warning in the log).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulingSection {
    /// The time slice the HTTP API's threads ask for, in microseconds: a shorter slice than the
    /// kernel's default (0.7 ms x (1 + log2 CPUs)) wakes ahead of CPU-bound threads (Linux 6.12+;
    /// older kernels ignore it); one longer than a decision (p99 ~0.3 ms at 100 replicas) lets a
    /// decision finish in one slice. 0 keeps the kernel's default; otherwise 100 ..= 100000.
    /// Default 400.
    #[serde(default = "default_api_slice_us")]
    pub api_slice_us: u64,
    /// Event intake, scrapes and snapshots run `SCHED_BATCH`: their wake-ups do not preempt
    /// other threads (default true).
    #[serde(default = "default_true")]
    pub background_batch: bool,
    /// An event thread that has run this long since it last woke, in microseconds, yields its
    /// CPU to the kernel after the batch at hand, so a route handler queued behind a burst of
    /// event intake on the same CPU runs before the rest of the burst; short bursts (the common
    /// case) never pay the system call. 0: never yields. Default 100.
    #[serde(default = "default_event_yield_after_us")]
    pub event_yield_after_us: u64,
    /// The replicas' event streams run on one thread of their own that, each time it runs out of
    /// work, sleeps this long, in milliseconds, before it waits for its sockets again: what every
    /// stream sent meanwhile is read in one wake-up instead of one each. Events reach the index up
    /// to this much later (a decision's own blocks are predicted at once, not waited for). 0:
    /// the streams share the background runtime and each batch wakes a thread. At most 1000.
    /// Default 50.
    #[serde(default = "default_event_coalesce_ms")]
    pub event_coalesce_ms: u64,
}

fn default_event_coalesce_ms() -> u64 {
    50
}

fn default_event_yield_after_us() -> u64 {
    100
}

fn default_api_slice_us() -> u64 {
    400
}
fn default_true() -> bool {
    true
}

impl Default for SchedulingSection {
    fn default() -> Self {
        Self {
            api_slice_us: default_api_slice_us(),
            background_batch: true,
            event_yield_after_us: default_event_yield_after_us(),
            event_coalesce_ms: default_event_coalesce_ms(),
        }
    }
}

impl SchedulingSection {
    /// What the HTTP API's threads ask for (`None`: nothing).
    pub fn api_class(&self) -> Option<crate::scheduling::ThreadClass> {
        (self.api_slice_us > 0).then(|| {
            crate::scheduling::ThreadClass::Latency(std::time::Duration::from_micros(
                self.api_slice_us,
            ))
        })
    }

    /// What the event runtime's threads ask for (`None`: nothing).
    pub fn background_class(&self) -> Option<crate::scheduling::ThreadClass> {
        self.background_batch
            .then_some(crate::scheduling::ThreadClass::Batch)
    }

    /// How long an event thread runs before it yields after a batch (`None`: never).
    pub fn event_yield_after(&self) -> Option<std::time::Duration> {
        (self.event_yield_after_us > 0)
            .then(|| std::time::Duration::from_micros(self.event_yield_after_us))
    }

    /// How long the event streams' thread sleeps before it waits for its sockets (`None`: the
    /// streams run on the background runtime, without a pause).
    pub fn event_coalesce(&self) -> Option<std::time::Duration> {
        (self.event_coalesce_ms > 0)
            .then(|| std::time::Duration::from_millis(self.event_coalesce_ms))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.event_coalesce_ms > 1_000 {
            return Err(invalid(
                "scheduling.event_coalesce_ms",
                "must be 0 (no pause) ..= 1000",
            ));
        }
        if self.event_yield_after_us > 1_000_000 {
            return Err(invalid(
                "scheduling.event_yield_after_us",
                "must be 0 (never) ..= 1000000",
            ));
        }
        if self.api_slice_us != 0 && !crate::scheduling::SLICE_RANGE_US.contains(&self.api_slice_us)
        {
            return Err(invalid(
                "scheduling.api_slice_us",
                "must be 0 (the kernel's default) or 100 ..= 100000",
            ));
        }
        Ok(())
    }
}

/// `[events]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EventsSection {
    /// Timeout of one connect attempt, in ms (default 250).
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Upper bound of the reconnect backoff, in ms (default 2000).
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    /// Timeout of every read while replaying, in ms (default 2000).
    #[serde(default = "default_replay_read_timeout_ms")]
    pub replay_read_timeout_ms: u64,
    /// Most batches accepted from one replay (default 200000).
    #[serde(default = "default_replay_max_batches")]
    pub replay_max_batches: usize,
    /// Most payload bytes buffered from one replay before it is abandoned (default 64 MiB).
    #[serde(default = "default_replay_max_bytes")]
    pub replay_max_bytes: usize,
    /// Largest ZeroMQ message (all frames) or command frame accepted on any event socket, live
    /// or replay; a peer announcing more is disconnected before anything is allocated for it
    /// (default 64 MiB; vLLM's largest batches are a few MB).
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// IP address bound for engines that connect out (bind mode found by discovery), in place
    /// of all interfaces (default `127.0.0.1`).
    #[serde(default = "default_bind_address")]
    pub bind_address: String,
    /// Peers (`IP` or `IP/prefix`) admitted by bound event sockets. Empty (the default): the
    /// replica's own configured hosts plus loopback.
    #[serde(default)]
    pub allowed_peers: Vec<String>,
}

impl Default for EventsSection {
    fn default() -> Self {
        Self {
            connect_timeout_ms: default_connect_timeout_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            replay_read_timeout_ms: default_replay_read_timeout_ms(),
            replay_max_batches: default_replay_max_batches(),
            replay_max_bytes: default_replay_max_bytes(),
            max_message_bytes: default_max_message_bytes(),
            bind_address: default_bind_address(),
            allowed_peers: Vec::new(),
        }
    }
}

impl EventsSection {
    /// The networks a bound event socket of `replica` admits: `allowed_peers` when set, else the
    /// replica's own hosts (`http`, `endpoint`, event and replay hosts given as IPs) and loopback.
    pub fn allowed_peer_nets(&self, replica: &ReplicaConfig) -> Vec<IpNet> {
        if !self.allowed_peers.is_empty() {
            return self
                .allowed_peers
                .iter()
                .filter_map(|p| p.parse().ok())
                .collect();
        }
        let mut nets = vec![IpNet::LOOPBACK_V4, IpNet::LOOPBACK_V6];
        let hosts = [replica.http.as_str()]
            .into_iter()
            .chain(replica.endpoint.as_deref())
            .filter_map(|a| a.parse::<SocketAddr>().ok().map(|a| a.ip()))
            .chain(
                replica
                    .events
                    .iter()
                    .chain(&replica.replay)
                    .filter_map(|ep| parse_tcp_endpoint(ep).ok())
                    .filter_map(|(h, _)| h.trim_matches(['[', ']']).parse::<IpAddr>().ok()),
            );
        for ip in hosts {
            let net = IpNet::host(ip);
            if !ip.is_unspecified() && !nets.iter().any(|n| n.contains(ip)) {
                nets.push(net);
            }
        }
        nets
    }
}

/// An IP network (`10.0.0.0/8`, `fd00::/8`; a bare address is a single host). IPv4-mapped IPv6
/// peers (`::ffff:10.0.0.1`) match IPv4 networks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// `127.0.0.0/8`.
    pub const LOOPBACK_V4: IpNet = IpNet {
        addr: IpAddr::V4(Ipv4Addr::new(127, 0, 0, 0)),
        prefix: 8,
    };
    /// `::1/128`.
    pub const LOOPBACK_V6: IpNet = IpNet {
        addr: IpAddr::V6(Ipv6Addr::LOCALHOST),
        prefix: 128,
    };

    /// The network of exactly one address.
    pub fn host(ip: IpAddr) -> IpNet {
        let ip = ip.to_canonical();
        IpNet {
            addr: ip,
            prefix: if ip.is_ipv4() { 32 } else { 128 },
        }
    }

    /// Whether `ip` is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |prefix: u8, width: u32| -> u128 {
            if prefix == 0 {
                0
            } else {
                (u128::MAX << (width - u32::from(prefix))) & (u128::MAX >> (128 - width))
            }
        };
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let m = bits(self.prefix, 32);
                u128::from(u32::from(net)) & m == u128::from(u32::from(ip)) & m
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let m = bits(self.prefix, 128);
                u128::from(net) & m == u128::from(ip) & m
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for IpNet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or IP/prefix"))?;
        let addr = addr.to_canonical();
        let width = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => width,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= width)
                .ok_or_else(|| format!("{s:?} has an invalid prefix length (0..={width})"))?,
        };
        Ok(IpNet { addr, prefix })
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}
fn default_connect_timeout_ms() -> u64 {
    250
}
fn default_max_backoff_ms() -> u64 {
    2000
}
fn default_replay_read_timeout_ms() -> u64 {
    2000
}
fn default_replay_max_batches() -> usize {
    200_000
}
fn default_replay_max_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_max_message_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_bind_address() -> String {
    "127.0.0.1".to_string()
}

/// `[policies]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySection {
    /// Request header carrying the session key for `--policy session` (default `x-session-id`);
    /// a `"session"` field in the route body wins over it.
    #[serde(default = "default_session_header")]
    pub session_header: String,
    /// Session affinity lifetime, in ms (default 600000).
    #[serde(default = "default_session_ttl_ms")]
    pub session_ttl_ms: u64,
    /// Most sessions remembered (default 100000).
    #[serde(default = "default_session_max_entries")]
    pub session_max_entries: usize,
    /// Lifetime of a remembered (key, replica) pair for `--policy approx-prefix`, in ms (default 120000).
    #[serde(default = "default_approx_ttl_ms")]
    pub approx_ttl_ms: u64,
    /// Most (key, replica) pairs remembered for `--policy approx-prefix` (default 2000000).
    #[serde(default = "default_approx_max_entries")]
    pub approx_max_entries: usize,
}

impl Default for PolicySection {
    fn default() -> Self {
        Self {
            session_header: default_session_header(),
            session_ttl_ms: default_session_ttl_ms(),
            session_max_entries: default_session_max_entries(),
            approx_ttl_ms: default_approx_ttl_ms(),
            approx_max_entries: default_approx_max_entries(),
        }
    }
}
fn default_session_header() -> String {
    "x-session-id".to_string()
}
fn default_session_ttl_ms() -> u64 {
    600_000
}
fn default_session_max_entries() -> usize {
    100_000
}
fn default_approx_ttl_ms() -> u64 {
    120_000
}
fn default_approx_max_entries() -> usize {
    2_000_000
}

/// `[[models]]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Served model name (the `model` field of requests).
    pub name: String,
    /// The model's directory: `tokenizer.json`, and any of `tokenizer_config.json`,
    /// `chat_template.jinja`, `chat_template.json`, `special_tokens_map.json` (served to the
    /// filter, merged as transformers reads them).
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// The engines' chat-template flags (`--chat-template`, `--chat-template-content-format`,
    /// ...), as the filter's `models.<name>.tokenizer_options`: the indexer's tokenizer digest is
    /// computed with them, so a filter configured otherwise shows as a digest mismatch.
    #[serde(default)]
    pub tokenizer_options: Option<kvroute_core::request::TokenizerOptions>,
    /// Tokens per KV block; learned from the first BlockStored when not given.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// The engines' context length (`--max-model-len`), announced to the filter with the
    /// tokenizer: it tokenises no longer prompts (they fail open as `prompt_too_long`).
    #[serde(default)]
    pub max_model_len: Option<u32>,
    /// The engines' prefix-cache hash settings, for the online hash self-check.
    #[serde(default)]
    pub hash: Option<HashSection>,
    /// LoRA adapter name -> path as loaded by the engines (the path is part of vLLM's hash).
    #[serde(default)]
    pub loras: BTreeMap<String, String>,
    /// The replicas serving this model.
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
}

/// `[models.hash]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HashSection {
    /// `--prefix-caching-hash-algo` of the engines: sha256, sha256_cbor, xxhash, xxhash_cbor.
    pub algo: String,
    /// The engines' `PYTHONHASHSEED`, when set.
    #[serde(default)]
    pub seed: Option<String>,
    /// vLLM version of the engines (selects the extra-key shape), default "0.33.0".
    #[serde(default = "default_engine_version")]
    pub engine_version: String,
}
fn default_engine_version() -> String {
    "0.33.0".to_string()
}

/// `[[models.replicas]]`, also the body of `POST /admin/replicas`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Unique replica name.
    pub name: String,
    /// The replica's HTTP address `IP:port` (metrics, event source discovery).
    pub http: String,
    /// Where requests are routed, `IP:port` (default: `http`).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// ZeroMQ event endpoints: one per DP rank, or one for rank 0 (rank r then uses port + r).
    /// Discovered from `GET {http}/kv_event_sources` when empty.
    #[serde(default)]
    pub events: Vec<String>,
    /// ZeroMQ replay (ROUTER) endpoints, same rules as `events`.
    #[serde(default)]
    pub replay: Vec<String>,
    /// Number of data-parallel ranks behind this address.
    #[serde(default = "default_dp")]
    pub data_parallel_size: u32,
    /// Bind the event endpoints instead of connecting (for engines whose publisher connects out).
    #[serde(default)]
    pub bind: bool,
    /// Topic to subscribe to ("" = all).
    #[serde(default)]
    pub topic: String,
}
fn default_dp() -> u32 {
    1
}

impl Config {
    /// How long filters may hold completion reports for a route call to carry (ms), as every
    /// route answer tells them: 0 with `[peers]` (other gateways learn of an end only when its
    /// report arrives), else `[inflight] report_hold_ms`.
    pub fn report_hold_ms(&self) -> u64 {
        if self.peers.is_some() {
            0
        } else {
            self.inflight.report_hold_ms
        }
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates config text; `origin` names the source in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every field; errors name the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen
            .parse::<SocketAddr>()
            .map_err(|e| invalid("listen", format!("{:?} is not IP:port ({e})", self.listen)))?;
        if !(1..=64).contains(&self.api_threads) {
            return Err(invalid("api_threads", "must be 1 ..= 64"));
        }
        self.scheduling.validate()?;
        if self.index.max_bytes < 1024 * 1024 {
            return Err(invalid(
                "index.max_bytes",
                "must be at least 1048576 (1 MiB)",
            ));
        }
        if let Some(s) = &self.snapshot {
            if s.interval_ms == 0 {
                return Err(invalid("snapshot.interval_ms", "must be > 0"));
            }
            if s.path.as_os_str().is_empty() {
                return Err(invalid("snapshot.path", "must not be empty"));
            }
        }
        self.inflight
            .validate()
            .map_err(|(f, msg)| invalid(format!("inflight.{f}"), msg))?;
        self.reuse
            .validate()
            .map_err(|(f, msg)| invalid(format!("reuse.{f}"), msg))?;
        if let Some(p) = &self.peers {
            p.validate()
                .map_err(|(f, msg)| invalid(format!("peers.{f}"), msg))?;
        }
        self.scoring
            .validate()
            .map_err(|(f, msg)| invalid(format!("scoring.{f}"), msg))?;
        self.calibration
            .validate()
            .map_err(|(f, msg)| invalid(format!("calibration.{f}"), msg))?;
        if self.events.connect_timeout_ms == 0 {
            return Err(invalid("events.connect_timeout_ms", "must be > 0"));
        }
        if self.events.replay_read_timeout_ms == 0 {
            return Err(invalid("events.replay_read_timeout_ms", "must be > 0"));
        }
        if self.events.replay_max_bytes == 0 {
            return Err(invalid("events.replay_max_bytes", "must be > 0"));
        }
        if self.events.max_message_bytes < 64 * 1024 {
            return Err(invalid(
                "events.max_message_bytes",
                "must be at least 65536 (64 KiB)",
            ));
        }
        self.events.bind_address.parse::<IpAddr>().map_err(|_| {
            invalid(
                "events.bind_address",
                format!("{:?} is not an IP address", self.events.bind_address),
            )
        })?;
        for (i, p) in self.events.allowed_peers.iter().enumerate() {
            p.parse::<IpNet>()
                .map_err(|m| invalid(format!("events.allowed_peers[{i}]"), m))?;
        }
        if let Some(var) = &self.admin_token_env {
            if std::env::var(var).map(|v| v.is_empty()).unwrap_or(true) {
                return Err(invalid(
                    "admin_token_env",
                    format!("environment variable {var} is not set or empty"),
                ));
            }
        }
        if self.admin_token.as_deref() == Some("") {
            return Err(invalid("admin_token", "must not be empty"));
        }
        if self.models.is_empty() {
            return Err(invalid(
                "models",
                "at least one [[models]] entry is required",
            ));
        }
        let mut model_names = std::collections::HashSet::new();
        let mut replica_names = std::collections::HashSet::new();
        for (mi, m) in self.models.iter().enumerate() {
            let mf = format!("models[{mi}]");
            if m.name.is_empty() {
                return Err(invalid(format!("{mf}.name"), "must not be empty"));
            }
            if !model_names.insert(m.name.clone()) {
                return Err(invalid(
                    format!("{mf}.name"),
                    format!("duplicate model {:?}", m.name),
                ));
            }
            if let Some(dir) = &m.model_dir {
                for f in ["tokenizer.json", "tokenizer_config.json"] {
                    if !dir.join(f).is_file() {
                        return Err(invalid(
                            format!("{mf}.model_dir"),
                            format!("{} has no {f}", dir.display()),
                        ));
                    }
                }
            }
            if let Some(bs) = m.block_size {
                if bs == 0 || bs > 1 << 20 {
                    return Err(invalid(
                        format!("{mf}.block_size"),
                        "must be between 1 and 1048576",
                    ));
                }
            }
            if let Some(h) = &m.hash {
                hash_config(h)
                    .map_err(|(field, msg)| invalid(format!("{mf}.hash.{field}"), msg))?;
            }
            for (name, path) in &m.loras {
                if path.is_empty() {
                    return Err(invalid(
                        format!("{mf}.loras.{name}"),
                        "path must not be empty",
                    ));
                }
            }
            for (ri, r) in m.replicas.iter().enumerate() {
                let rf = format!("{mf}.replicas[{ri}]");
                r.validate(&rf)?;
                if !replica_names.insert(r.name.clone()) {
                    return Err(invalid(
                        format!("{rf}.name"),
                        format!("duplicate replica name {:?} (names are global)", r.name),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The admin token, from `admin_token_env` or `admin_token`.
    pub fn admin_token(&self) -> Option<String> {
        if let Some(var) = &self.admin_token_env {
            if let Ok(v) = std::env::var(var) {
                if !v.is_empty() {
                    return Some(v);
                }
            }
        }
        self.admin_token.clone()
    }
}

/// Builds the hash configuration of a `[models.hash]` section; errors carry the sub-field name.
pub fn hash_config(h: &HashSection) -> Result<HashConfig, (&'static str, String)> {
    let algo: HashAlgo = h.algo.parse().map_err(|_| {
        (
            "algo",
            format!(
                "unknown algorithm {:?} (sha256, sha256_cbor, xxhash, xxhash_cbor)",
                h.algo
            ),
        )
    })?;
    if !h
        .engine_version
        .split('.')
        .take(2)
        .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
    {
        return Err((
            "engine_version",
            format!("{:?} is not a version like 0.33.0", h.engine_version),
        ));
    }
    let cfg = HashConfig {
        algo,
        seed: h.seed.clone(),
        style: ExtraKeyStyle::for_engine_version(&h.engine_version),
    };
    kvroute_core::hashing::BlockHasher::new(&cfg).map_err(|e| ("seed", e.to_string()))?;
    Ok(cfg)
}

impl ReplicaConfig {
    /// Checks this replica; `field` is its path in the file (or in the admin request).
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(invalid(
                format!("{field}.name"),
                format!("{:?} must be non-empty [A-Za-z0-9._-]", self.name),
            ));
        }
        self.http.parse::<SocketAddr>().map_err(|e| {
            invalid(
                format!("{field}.http"),
                format!("{:?} is not IP:port ({e})", self.http),
            )
        })?;
        if let Some(ep) = &self.endpoint {
            ep.parse::<SocketAddr>().map_err(|e| {
                invalid(
                    format!("{field}.endpoint"),
                    format!("{ep:?} is not IP:port ({e})"),
                )
            })?;
        }
        if self.data_parallel_size == 0 || self.data_parallel_size > 1024 {
            return Err(invalid(
                format!("{field}.data_parallel_size"),
                "must be between 1 and 1024",
            ));
        }
        for (name, list) in [("events", &self.events), ("replay", &self.replay)] {
            if list.len() > 1 && list.len() != self.data_parallel_size as usize {
                return Err(invalid(
                    format!("{field}.{name}"),
                    format!(
                        "has {} entries; give one (rank 0, others at port + rank) or data_parallel_size = {}",
                        list.len(),
                        self.data_parallel_size
                    ),
                ));
            }
            for (i, ep) in list.iter().enumerate() {
                parse_tcp_endpoint(ep).map_err(|m| invalid(format!("{field}.{name}[{i}]"), m))?;
            }
        }
        if self.bind && self.events.is_empty() {
            return Err(invalid(
                format!("{field}.events"),
                "bind = true needs explicit event endpoints",
            ));
        }
        Ok(())
    }

    /// Routing target `IP:port`.
    pub fn route_endpoint(&self) -> &str {
        self.endpoint.as_deref().unwrap_or(&self.http)
    }

    /// Event endpoint of every DP rank (empty when discovery is needed).
    pub fn event_endpoints(&self) -> Vec<String> {
        expand_ranks(&self.events, self.data_parallel_size)
    }

    /// Replay endpoint of every DP rank (`None` where replay is not configured).
    pub fn replay_endpoints(&self) -> Vec<Option<String>> {
        let v = expand_ranks(&self.replay, self.data_parallel_size);
        (0..self.data_parallel_size as usize)
            .map(|r| v.get(r).cloned())
            .collect()
    }
}

/// Splits `tcp://HOST:PORT` into host and port.
pub fn parse_tcp_endpoint(ep: &str) -> Result<(String, u16), String> {
    let rest = ep
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{ep:?} must start with tcp://"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{ep:?} has no :port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{ep:?} has an invalid port"))?;
    if host.is_empty() {
        return Err(format!("{ep:?} has no host"));
    }
    Ok((host.to_string(), port))
}

/// One endpoint per rank: a full list is used as is; a single endpoint gives rank r port + r
/// (vLLM's data-parallel rule).
pub fn expand_ranks(list: &[String], dp: u32) -> Vec<String> {
    if list.len() != 1 || dp <= 1 {
        return list.to_vec();
    }
    let Ok((host, port)) = parse_tcp_endpoint(&list[0]) else {
        return list.to_vec();
    };
    (0..dp)
        .filter_map(|r| {
            port.checked_add(r as u16)
                .map(|p| format!("tcp://{host}:{p}"))
        })
        .collect()
}

/// `[inflight]`: how long a routed request counts as in flight without a completion.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InflightConfig {
    /// Shortest lifetime of a decision without a completion, in ms (default 30000).
    #[serde(default = "default_expiry_floor_ms")]
    pub expiry_floor_ms: u64,
    /// Longest lifetime of a decision without a completion, in ms (default 600000).
    #[serde(default = "default_expiry_cap_ms")]
    pub expiry_cap_ms: u64,
    /// Decode rate of one request assumed for the deadline, tokens/s (default 20; keep it low:
    /// a request that outlives its deadline stops counting as load).
    #[serde(default = "default_decode_tokens_per_s")]
    pub decode_tokens_per_s: f64,
    /// Output length assumed when the route request has no `max_tokens` (default 2048).
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u64,
    /// Most decisions (and early abandons) remembered (default 200000).
    #[serde(default = "default_max_pending")]
    pub max_pending: usize,
    /// How long a filter may hold its completion reports for its next route call to carry, ms
    /// (default 250; at most 10000): told to the filter with every route answer. One exchange
    /// then serves a report and a decision, which saves the filter's Envoy 0.1-0.2 ms of CPU per
    /// request. With `[peers]` the answer says 0 whatever this is: the other gateways would
    /// count a finished request as running until its report arrives.
    #[serde(default = "default_report_hold_ms")]
    pub report_hold_ms: u64,
    /// Seconds over which a replica's recent prefill work and how often requests continue an
    /// earlier one are averaged (default 60): long enough to span several returns of the
    /// sessions resident on a replica, whose turns are what that work predicts.
    #[serde(default = "default_recent_work_window_s")]
    pub recent_work_window_s: f64,
    /// Prompts remembered per model to recognise a request continuing one (default 65,536:
    /// about 7 MiB, ~110 bytes each with their map slot and queue entries).
    #[serde(default = "default_max_tracked_prompts")]
    pub max_tracked_prompts: usize,
}

impl Default for InflightConfig {
    fn default() -> Self {
        Self {
            expiry_floor_ms: default_expiry_floor_ms(),
            expiry_cap_ms: default_expiry_cap_ms(),
            decode_tokens_per_s: default_decode_tokens_per_s(),
            default_max_tokens: default_max_tokens(),
            max_pending: default_max_pending(),
            report_hold_ms: default_report_hold_ms(),
            recent_work_window_s: default_recent_work_window_s(),
            max_tracked_prompts: default_max_tracked_prompts(),
        }
    }
}
fn default_recent_work_window_s() -> f64 {
    60.0
}
fn default_max_tracked_prompts() -> usize {
    65_536
}
fn default_report_hold_ms() -> u64 {
    250
}
fn default_expiry_floor_ms() -> u64 {
    30_000
}
fn default_expiry_cap_ms() -> u64 {
    600_000
}
fn default_decode_tokens_per_s() -> f64 {
    20.0
}
fn default_max_tokens() -> u64 {
    2048
}
fn default_max_pending() -> usize {
    200_000
}

impl InflightConfig {
    /// Checks the fields; the error is (field, message).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.expiry_floor_ms == 0 {
            return Err(("expiry_floor_ms", "must be > 0".into()));
        }
        if self.expiry_cap_ms < self.expiry_floor_ms {
            return Err(("expiry_cap_ms", "must be >= expiry_floor_ms".into()));
        }
        if !(self.decode_tokens_per_s.is_finite() && self.decode_tokens_per_s > 0.0) {
            return Err(("decode_tokens_per_s", "must be a number > 0".into()));
        }
        if self.max_pending == 0 {
            return Err(("max_pending", "must be > 0".into()));
        }
        if self.report_hold_ms > MAX_REPORT_HOLD_MS {
            return Err(("report_hold_ms", format!("must be <= {MAX_REPORT_HOLD_MS}")));
        }
        if !(self.recent_work_window_s.is_finite() && self.recent_work_window_s > 0.0) {
            return Err(("recent_work_window_s", "must be a number > 0".into()));
        }
        if self.max_tracked_prompts == 0 {
            return Err(("max_tracked_prompts", "must be > 0".into()));
        }
        Ok(())
    }

    /// The shortest lifetime.
    pub fn floor(&self) -> Duration {
        Duration::from_millis(self.expiry_floor_ms)
    }

    /// The longest lifetime.
    pub fn cap(&self) -> Duration {
        Duration::from_millis(self.expiry_cap_ms.max(self.expiry_floor_ms))
    }

    /// Estimated decode time of `max_tokens` (the default when `None`), at most the cap.
    pub fn decode_time(&self, max_tokens: Option<u64>) -> Duration {
        let tokens = max_tokens.unwrap_or(self.default_max_tokens) as f64;
        Duration::try_from_secs_f64(tokens / self.decode_tokens_per_s)
            .unwrap_or(self.cap())
            .min(self.cap())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[[models]]
name = "qwen3"
[[models.replicas]]
name = "r0"
http = "127.0.0.1:8001"
events = ["tcp://127.0.0.1:5557"]
"#;

    #[test]
    fn minimal_config_parses_with_defaults() {
        let cfg = Config::parse(MINIMAL, "t").expect("valid");
        assert_eq!(cfg.listen, "127.0.0.1:8190");
        assert_eq!(cfg.models[0].replicas[0].route_endpoint(), "127.0.0.1:8001");
        assert_eq!(cfg.index.max_bytes, 1 << 30);
    }

    #[test]
    fn filters_may_hold_reports_unless_other_gateways_share_the_decisions() {
        let alone = Config::parse(MINIMAL, "t").expect("valid");
        assert_eq!(alone.report_hold_ms(), 250);
        let set = Config::parse(&format!("{MINIMAL}[inflight]\nreport_hold_ms = 40\n"), "t")
            .expect("valid");
        assert_eq!(set.report_hold_ms(), 40);
        let shared = Config::parse(
            &format!(
                "{MINIMAL}[inflight]\nreport_hold_ms = 40\n[peers]\nredis = \"127.0.0.1:6379\"\n"
            ),
            "t",
        )
        .expect("valid");
        assert_eq!(
            shared.report_hold_ms(),
            0,
            "a gateway of a fleet never asks to hold"
        );
        let too_long = format!("{MINIMAL}[inflight]\nreport_hold_ms = 10001\n");
        let err = Config::parse(&too_long, "t").expect_err("over the bound");
        assert!(err.to_string().contains("report_hold_ms"), "{err}");
    }

    #[test]
    fn scheduling_defaults_and_bounds() {
        let cfg = Config::parse(MINIMAL, "t").expect("valid");
        assert_eq!(cfg.scheduling.api_slice_us, 400);
        assert!(cfg.scheduling.background_batch);
        assert_eq!(
            cfg.scheduling.event_yield_after(),
            Some(std::time::Duration::from_micros(100))
        );
        assert_eq!(
            cfg.scheduling.event_coalesce(),
            Some(std::time::Duration::from_millis(50))
        );
        let out_of_range = [
            ("event_yield_after_us", 1_000_001),
            ("event_coalesce_ms", 1001),
            ("api_slice_us", 1),
            ("api_slice_us", 99),
            ("api_slice_us", 100_001),
        ];
        for (key, value) in out_of_range {
            let text = format!("{MINIMAL}\n[scheduling]\n{key} = {value}\n");
            let err = Config::parse(&text, "t")
                .expect_err("out of range")
                .to_string();
            assert!(err.contains(&format!("scheduling.{key}")), "{err}");
        }
        let text = format!(
            "{MINIMAL}\n[scheduling]\napi_slice_us = 0\nbackground_batch = false\nevent_yield_after_us = 0\nevent_coalesce_ms = 0\n"
        );
        let cfg = Config::parse(&text, "t").expect("valid");
        assert_eq!(cfg.scheduling.event_yield_after(), None);
        assert_eq!(cfg.scheduling.event_coalesce(), None);
        assert_eq!(cfg.scheduling.api_class(), None);
        assert_eq!(cfg.scheduling.background_class(), None);
    }

    #[test]
    fn api_threads_out_of_range_is_refused() {
        for n in ["0", "65"] {
            let text = format!("api_threads = {n}\n{MINIMAL}");
            let err = Config::parse(&text, "t").unwrap_err().to_string();
            assert!(err.contains("api_threads"), "{err}");
        }
        let cfg = Config::parse(&format!("api_threads = 1\n{MINIMAL}"), "t").expect("valid");
        assert_eq!(cfg.api_threads, 1);
    }

    #[test]
    fn bad_http_names_the_field() {
        let text = MINIMAL.replace("127.0.0.1:8001", "localhost");
        let err = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(err.contains("models[0].replicas[0].http"), "{err}");
    }

    #[test]
    fn unknown_key_is_rejected_with_its_name() {
        let text = MINIMAL.replace("name = \"r0\"", "name = \"r0\"\nhttpp = \"x\"");
        let err = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(err.contains("httpp"), "{err}");
    }

    #[test]
    fn example_config_is_valid() {
        // model_dir must exist on the machine that runs it; the example's does not exist here.
        let text: String = include_str!("../examples/indexer.toml")
            .lines()
            .filter(|l| !l.starts_with("model_dir"))
            .map(|l| format!("{l}\n"))
            .collect();
        let cfg = Config::parse(&text, "examples/indexer.toml").expect("example parses");
        assert_eq!(cfg.models[0].replicas.len(), 2);
        assert_eq!(cfg.models[0].replicas[1].data_parallel_size, 2);
    }

    #[test]
    fn event_socket_bounds_have_safe_defaults_and_are_validated() {
        let cfg = Config::parse(MINIMAL, "t").expect("valid");
        assert_eq!(cfg.events.max_message_bytes, 64 << 20);
        assert_eq!(cfg.events.replay_max_bytes, 64 << 20);
        assert_eq!(cfg.events.bind_address, "127.0.0.1");
        for (bad, field) in [
            ("bind_address = \"0.0.0.0:1\"", "events.bind_address"),
            (
                "allowed_peers = [\"10.0.0.0/33\"]",
                "events.allowed_peers[0]",
            ),
            ("allowed_peers = [\"eth0\"]", "events.allowed_peers[0]"),
            ("max_message_bytes = 10", "events.max_message_bytes"),
            ("replay_max_bytes = 0", "events.replay_max_bytes"),
        ] {
            let text = format!("[events]\n{bad}\n{MINIMAL}");
            let err = Config::parse(&text, "t").unwrap_err().to_string();
            assert!(err.contains(field), "{bad}: {err}");
        }
    }

    #[test]
    fn ip_networks_match_as_cidr() {
        let net: IpNet = "10.0.0.0/8".parse().unwrap();
        assert!(net.contains("10.200.1.2".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.1.1".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let host: IpNet = "192.168.1.7".parse().unwrap();
        assert!(host.contains("192.168.1.7".parse().unwrap()));
        assert!(!host.contains("192.168.1.8".parse().unwrap()));
        let v6: IpNet = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        let all: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        assert!("10.0.0.0/x".parse::<IpNet>().is_err());
    }

    #[test]
    fn default_allowed_peers_are_the_replicas_hosts_and_loopback() {
        let cfg = Config::parse(MINIMAL, "t").expect("valid");
        let mut r = cfg.models[0].replicas[0].clone();
        r.http = "10.0.0.5:8000".into();
        r.replay = vec!["tcp://10.0.0.6:5558".into()];
        let nets = cfg.events.allowed_peer_nets(&r);
        let ok = |ip: &str| nets.iter().any(|n| n.contains(ip.parse().unwrap()));
        assert!(ok("10.0.0.5") && ok("10.0.0.6") && ok("127.0.0.1") && ok("::1"));
        assert!(!ok("10.0.0.7"));
        let mut events = cfg.events.clone();
        events.allowed_peers = vec!["10.0.0.0/8".into()];
        let nets = events.allowed_peer_nets(&r);
        assert!(nets.iter().any(|n| n.contains("10.9.9.9".parse().unwrap())));
        assert!(!nets
            .iter()
            .any(|n| n.contains("127.0.0.1".parse().unwrap())));
    }

    #[test]
    fn dp_ranks_get_consecutive_ports() {
        let v = expand_ranks(&["tcp://10.0.0.1:5557".to_string()], 3);
        assert_eq!(
            v,
            [
                "tcp://10.0.0.1:5557",
                "tcp://10.0.0.1:5558",
                "tcp://10.0.0.1:5559"
            ]
        );
    }
}
