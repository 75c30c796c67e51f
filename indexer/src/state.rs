//! The state shared by every task of a running indexer: configuration, fleet, index, load,
//! policies and counters.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::hashing::{ExtraKeyStyle, HashConfig};

use crate::config::{hash_config, Config};
use crate::index::{IndexConfig, SharedIndex};
use crate::load::LoadTracker;
use crate::membership::{lock, Fleet};
use crate::policy_state::{Policy, PolicyState};

/// Per-model settings used at run time.
#[derive(Debug)]
pub struct ModelRuntime {
    /// Served model name.
    pub name: String,
    /// Tokens per block; 0 until configured or learned from an event.
    pub block_size: AtomicU32,
    /// Whether `block_size` came from the configuration (then events never change it).
    pub block_size_configured: bool,
    /// LoRA name -> path.
    pub loras: BTreeMap<String, String>,
    /// Engine hash settings, when the self-check is configured.
    pub hash: Option<HashConfig>,
    /// Extra-key shape of the engines.
    pub style: ExtraKeyStyle,
    /// Its recent arrival rate (route decisions per second).
    pub arrivals: Mutex<crate::load::RateMeter>,
    /// Recent prompts, to learn how many later requests continue one.
    pub continuations: Mutex<crate::successors::Continuations>,
    /// Its tokenizer directory and the bundles and digest built from it.
    pub tokenizers: crate::tokenizer_serving::TokenizerServing,
    /// The model's fleet seen as one cache, fed with every replica's stores (assess's
    /// prediction of a prefix-aware router's hit rate).
    pub fleet_cache: Mutex<crate::reuse::FleetCache>,
    /// Recent GPU removals of every replica of the model, to tell recomputation after eviction
    /// from new work.
    pub removals: Mutex<crate::reuse::RecentRemovals>,
    /// Whether the filter and the engines agree with the indexer on this model's tokens.
    pub agreement: Mutex<crate::agreement::Agreement>,
    /// The calibration windows of all its replicas, summed at every scrape: the prior of each
    /// replica's rates.
    pub rates: Mutex<kvroute_core::calibration::RatePool>,
    /// Held by one decision at a time, from reading the fleet to recording the choice: two
    /// siblings of a new prefix decided at once would each miss the other's predicted blocks.
    pub deciding: Mutex<()>,
}

impl ModelRuntime {
    /// Block size, or `None` while unknown.
    pub fn block_size(&self) -> Option<u32> {
        match self.block_size.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }
}

/// Global counters exported on `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Route requests answered with a replica.
    pub routed: AtomicU64,
    /// Route requests refused, by HTTP status.
    pub route_errors: Mutex<BTreeMap<u16, u64>>,
    /// Decisions by reason.
    pub decisions: Mutex<BTreeMap<String, u64>>,
    /// Sum of matched tokens at decision time, for requests later completed with `cached_tokens`.
    pub predicted_hit_tokens: AtomicU64,
    /// Sum of `cached_tokens` reported at completion.
    pub reported_hit_tokens: AtomicU64,
    /// Completions whose report equals / exceeds / falls short of the prediction.
    pub hit_exact: AtomicU64,
    /// Reported > predicted.
    pub hit_under_predicted: AtomicU64,
    /// Reported < predicted.
    pub hit_over_predicted: AtomicU64,
    /// Completions of decisions made on a partial prompt (not compared).
    pub hit_prediction_partial: AtomicU64,
    /// Decisions made on a partial prompt (a chat with media, keyed up to its first placeholder).
    pub partial_predictions: AtomicU64,
    /// `/v1/complete` calls.
    pub completions: AtomicU64,
    /// `/v1/complete` calls for an unknown (ended, expired or foreign) decision id.
    pub completions_unknown: AtomicU64,
    /// `/v1/complete` calls reporting an abandoned request (by decision or callout id).
    pub completions_abandoned: AtomicU64,
    /// `/v1/complete` calls refused for lacking `decision_id` (filters older than the indexer).
    pub completions_missing_id: AtomicU64,
    /// Hash self-checks run.
    pub hash_checks: AtomicU64,
    /// Hash self-check mismatches.
    pub hash_mismatches: AtomicU64,
    /// Engine restarts detected through `process_start_time_seconds`.
    pub restarts_detected: AtomicU64,
    /// Snapshots written.
    pub snapshots_written: AtomicU64,
    /// Snapshot write failures.
    pub snapshot_failures: AtomicU64,
    /// How long the last snapshot held the index lock (routing waits meanwhile), microseconds.
    pub snapshot_lock_us: AtomicU64,
    /// Scrape failures.
    pub scrape_failures: AtomicU64,
    /// Observed / predicted time to first token, per replica name.
    pub ttft_accuracy: Mutex<BTreeMap<String, TtftAccuracy>>,
    /// How long `/v1/route` took, from its received body to its decision.
    pub route_duration: DurationHistogram,
}

/// Upper bounds of the route duration buckets, seconds.
pub const ROUTE_DURATION_BUCKETS: [f64; 12] = [
    50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 250e-3,
];

/// A latency histogram with lock-free counters ([`ROUTE_DURATION_BUCKETS`]).
#[derive(Debug, Default)]
pub struct DurationHistogram {
    /// Per bucket (not cumulative), then the overflow.
    counts: [AtomicU64; ROUTE_DURATION_BUCKETS.len() + 1],
    /// Sum of the observations, nanoseconds.
    sum_ns: AtomicU64,
}

impl DurationHistogram {
    /// Records one observation.
    pub fn observe(&self, d: std::time::Duration) {
        let s = d.as_secs_f64();
        let i = ROUTE_DURATION_BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(ROUTE_DURATION_BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket bound (the last is `+Inf`), and the sum in seconds.
    pub fn cumulative(&self) -> (Vec<u64>, f64) {
        let mut total = 0;
        let counts = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect();
        (counts, self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// Upper bounds of the observed / predicted TTFT ratio buckets.
pub const TTFT_RATIO_BUCKETS: [f64; 11] =
    [0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0];

/// Most replicas the TTFT accuracy is kept for (names come from the configuration and admin API).
const MAX_TTFT_ACCURACY_REPLICAS: usize = 4096;

/// How the predicted time to first token compared with what the proxy saw, for one replica.
#[derive(Debug, Clone, Default)]
pub struct TtftAccuracy {
    /// Per bucket of [`TTFT_RATIO_BUCKETS`] (not cumulative), then the overflow.
    pub counts: [u64; TTFT_RATIO_BUCKETS.len() + 1],
    /// Sum of observed TTFTs, seconds.
    pub observed_s: f64,
    /// Sum of predicted TTFTs, seconds.
    pub predicted_s: f64,
}

impl TtftAccuracy {
    /// Observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

impl Metrics {
    /// Counts one decision.
    pub fn count_decision(&self, reason: &str) {
        *lock(&self.decisions).entry(reason.to_string()).or_default() += 1;
    }

    /// Records one completion's observed TTFT against its prediction (both seconds).
    pub fn record_ttft(&self, replica: &str, observed_s: f64, predicted_s: f64) {
        if !(observed_s.is_finite() && predicted_s.is_finite() && predicted_s > 0.0) {
            return;
        }
        let mut all = lock(&self.ttft_accuracy);
        if !all.contains_key(replica) && all.len() >= MAX_TTFT_ACCURACY_REPLICAS {
            return;
        }
        let a = all.entry(replica.to_string()).or_default();
        let ratio = observed_s / predicted_s;
        let i = TTFT_RATIO_BUCKETS
            .iter()
            .position(|b| ratio <= *b)
            .unwrap_or(TTFT_RATIO_BUCKETS.len());
        a.counts[i] += 1;
        a.observed_s += observed_s;
        a.predicted_s += predicted_s;
    }

    /// Counts one refused route request.
    pub fn count_route_error(&self, status: u16) {
        *lock(&self.route_errors).entry(status).or_default() += 1;
    }
}

/// Everything a running indexer shares.
pub struct AppState {
    /// The configuration as loaded.
    pub config: Config,
    /// Models by name.
    pub models: HashMap<String, Arc<ModelRuntime>>,
    /// Replicas.
    pub fleet: Fleet,
    /// The exact block index (all models; entries are per stream index id).
    pub index: SharedIndex,
    /// In-flight requests.
    pub load: LoadTracker,
    /// Shadow decisions (requests the filter does not send where it was told).
    pub shadow: crate::shadow::ShadowBook,
    /// Refuse route requests that are not shadow (`assess --listen`: nothing is routed).
    pub shadow_only: std::sync::atomic::AtomicBool,
    /// The prompt audit, set only by `assess --audit` (it keeps prompt tokens).
    pub audit: std::sync::OnceLock<Mutex<crate::assess::audit::PromptAudit>>,
    /// The routing policy.
    pub policy: Policy,
    /// State of the non-kv policies.
    pub policy_state: PolicyState,
    /// Counters.
    pub metrics: Metrics,
    /// HTTP client for scraping and discovery.
    pub http: reqwest::Client,
    /// Process start.
    pub started: Instant,
    /// Reuse (blocks computed twice, recomputed) is counted for batches the engines stamped at or
    /// after this unix time, in ms: history replayed on connect is not this window's traffic.
    pub reuse_counted_from_ms: std::sync::atomic::AtomicU64,
    /// Admin bearer token.
    pub admin_token: Option<String>,
    /// The decisions shared with peer gateways (`[peers]`).
    pub peers: Option<crate::peers::PeerLink>,
    /// Where event streams run: the streams' own runtime when `serve` made one
    /// (`scheduling.event_coalesce_ms`), else the runtime the state was built on (`None` outside
    /// one). A replica added through the API gets its subscribers there, not on the API's runtime.
    pub background: Option<tokio::runtime::Handle>,
}

/// Wall-clock unix time in ms (0 before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl AppState {
    /// The KV blocks of every replica of `model`, as their metrics report them (0: unknown).
    pub fn fleet_kv_capacity_blocks(&self, model: &str) -> u64 {
        self.fleet
            .of_model(model)
            .iter()
            .filter_map(|r| lock(&r.scraped).totals.kv_capacity_blocks)
            .map(u64::from)
            .sum()
    }

    /// Builds the state from a validated config (no replicas added yet); event streams will run
    /// on `streams`, or on the current runtime.
    pub fn new(
        config: Config,
        policy: Policy,
        streams: Option<tokio::runtime::Handle>,
    ) -> anyhow::Result<Arc<AppState>> {
        let mut models = HashMap::new();
        for m in &config.models {
            let hash = match &m.hash {
                Some(h) => Some(hash_config(h).map_err(|(f, msg)| {
                    anyhow::anyhow!("config field `models.{}.hash.{f}`: {msg}", m.name)
                })?),
                None => None,
            };
            let style = match &m.hash {
                Some(h) => ExtraKeyStyle::for_engine_version(&h.engine_version),
                None => ExtraKeyStyle::Tagged,
            };
            models.insert(
                m.name.clone(),
                Arc::new(ModelRuntime {
                    name: m.name.clone(),
                    block_size: AtomicU32::new(m.block_size.unwrap_or(0)),
                    block_size_configured: m.block_size.is_some(),
                    loras: m.loras.clone(),
                    hash,
                    style,
                    arrivals: Mutex::new(crate::load::RateMeter::default()),
                    continuations: Mutex::new(crate::successors::Continuations::new(
                        config.inflight.max_tracked_prompts,
                        config.inflight.recent_work_window_s,
                    )),
                    tokenizers: crate::tokenizer_serving::TokenizerServing::new(
                        &m.name,
                        m.model_dir.clone(),
                        m.tokenizer_options.clone().unwrap_or_default(),
                    ),
                    fleet_cache: Mutex::new(crate::reuse::FleetCache::default()),
                    removals: Mutex::new(crate::reuse::RecentRemovals::default()),
                    rates: Mutex::default(),
                    agreement: Mutex::new(crate::agreement::Agreement::default()),
                    deciding: Mutex::new(()),
                }),
            );
        }
        let index = SharedIndex::new(IndexConfig {
            max_bytes: config.index.max_bytes as usize,
            group_idx: config.index.kv_cache_group,
            ..Default::default()
        });
        let policy_state = PolicyState::new(&config.policies);
        let load = LoadTracker::new(config.inflight.clone());
        let shadow =
            crate::shadow::ShadowBook::new(config.inflight.max_pending, config.reuse.clone());
        let admin_token = config.admin_token();
        let peers = config.peers.clone().map(crate::peers::PeerLink::new);
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()?;
        Ok(Arc::new(AppState {
            config,
            models,
            fleet: Fleet::new(),
            index,
            load,
            shadow,
            shadow_only: std::sync::atomic::AtomicBool::new(false),
            audit: std::sync::OnceLock::new(),
            policy,
            policy_state,
            metrics: Metrics::default(),
            http,
            started: Instant::now(),
            reuse_counted_from_ms: std::sync::atomic::AtomicU64::new(unix_ms()),
            admin_token,
            peers,
            background: streams.or_else(|| tokio::runtime::Handle::try_current().ok()),
        }))
    }

    /// How long a silent stream of a busy engine stays fresh.
    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.config.stale_after_ms)
    }

    /// Drops every index entry of one stream.
    pub fn clear_stream(&self, index_id: u32) {
        self.index.clear_stream(index_id, || ());
    }
}
