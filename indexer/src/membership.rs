//! The fleet at run time: which replicas exist, their streams (one per data-parallel rank), their
//! load and health. Replicas come from the config file, from the admin API and, for their event
//! endpoints, from `GET {http}/kv_event_sources`.
//!
//! Every stream has its own index id (`u32`), so a DP rank that restarts clears only its own
//! entries; a replica's match is the best of its ranks. Ids are never reused in one process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::config::{parse_tcp_endpoint, ReplicaConfig};

/// Locks a mutex, recovering the data if a panicking thread poisoned it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Membership errors.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// A replica with this name exists.
    #[error("replica {0:?} already exists")]
    Duplicate(String),
    /// No replica with this name.
    #[error("no replica named {0:?}")]
    NotFound(String),
    /// The model is not configured.
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    /// Event source discovery failed.
    #[error("cannot discover event endpoints of {replica} from {url}: {message}")]
    Discovery {
        /// Replica name.
        replica: String,
        /// URL asked.
        url: String,
        /// What went wrong.
        message: String,
    },
}

/// Counters and state of one event stream (one replica, one DP rank).
#[derive(Debug, Default)]
pub struct StreamStats {
    /// Batches applied.
    pub batches: AtomicU64,
    /// Events applied.
    pub events: AtomicU64,
    /// Sequence gaps seen.
    pub gaps: AtomicU64,
    /// Replays performed.
    pub replays: AtomicU64,
    /// Replays that failed (timeout, connect error).
    pub replay_failures: AtomicU64,
    /// Times this stream's entries were dropped (restart, uncoverable gap, AllBlocksCleared excluded).
    pub resets: AtomicU64,
    /// Payloads that failed to decode (skipped).
    pub event_decode_errors: AtomicU64,
    /// Duplicate batches skipped (seen live and in a replay).
    pub duplicates: AtomicU64,
    /// Events the index refused (e.g. unknown parent).
    pub rejected_events: AtomicU64,
    /// New block holdings this stream stored (any medium; re-announced hits excluded).
    pub stored_blocks: AtomicU64,
    /// Of those, blocks another replica already held on GPU (prefill computed twice).
    pub duplicated_blocks: AtomicU64,
    /// Of those, blocks this replica had removed within `reuse.recompute_window_s` (computed
    /// again after an eviction).
    pub recomputed_blocks: AtomicU64,
    /// GPU blocks it stored that its model's [`crate::reuse::FleetCache`] still held (sampled
    /// blocks count for the ones they stand for): prefill a prefix-aware router would have served
    /// from cache.
    pub fleet_repeat_blocks: AtomicU64,
    /// Recomputed blocks the fleet cache followed (each weighted by both samples it stands for).
    pub recompute_checked_blocks: AtomicU64,
    /// Of those, the ones the fleet cache had lost too: recomputation that one copy per block in
    /// the whole fleet's KV would not have avoided (the fleet's memory is too small, not its
    /// routing).
    pub recompute_fleet_lost_blocks: AtomicU64,
    /// Connections made.
    pub connects: AtomicU64,
    /// Hash self-check candidates seen (for sampling).
    pub hash_checks: AtomicU64,
    /// Peers disconnected for announcing a message over `events.max_message_bytes`.
    pub oversized: AtomicU64,
    /// Connections to a bound event socket refused by `events.allowed_peers`.
    pub refused_peers: AtomicU64,
    /// Replays abandoned for exceeding `replay_max_batches` or `replay_max_bytes`.
    pub replays_too_large: AtomicU64,
    /// Peers already logged at warn (bounded; later ones are only counted).
    pub warned_peers: Mutex<std::collections::HashSet<String>>,
}

/// Most distinct peers logged at warn per stream.
const MAX_WARNED_PEERS: usize = 64;

impl StreamStats {
    /// True the first time `peer` is seen here (then log it at warn); false afterwards, and for
    /// every peer once [`MAX_WARNED_PEERS`] were logged.
    pub fn first_warning(&self, peer: &str) -> bool {
        let mut seen = lock(&self.warned_peers);
        if seen.len() >= MAX_WARNED_PEERS || seen.contains(peer) {
            return false;
        }
        seen.insert(peer.to_string())
    }
}

/// Mutable state of one stream, guarded by a mutex.
#[derive(Debug, Default, Clone)]
pub struct StreamState {
    /// Last applied sequence number.
    pub last_seq: Option<u64>,
    /// Fingerprint of the last applied payload.
    pub last_fingerprint: Option<u64>,
    /// Connected right now.
    pub connected: bool,
    /// When the last message (live or replayed) arrived.
    pub last_message: Option<Instant>,
    /// Engine timestamp of the last batch (seconds since the epoch).
    pub last_batch_ts: Option<f64>,
    /// Lag of the last batch: our receive time minus the engine's timestamp, in seconds.
    pub lag_seconds: Option<f64>,
    /// The endpoint in use.
    pub endpoint: String,
    /// Replay endpoint, if any.
    pub replay: Option<String>,
}

/// One event stream.
#[derive(Debug)]
pub struct Stream {
    /// DP rank.
    pub rank: u32,
    /// Id of this stream's entries in the index.
    pub index_id: u32,
    /// Counters.
    pub stats: StreamStats,
    /// State.
    pub state: Mutex<StreamState>,
    /// Set by restart detection outside the stream task: resynchronise from seq 0.
    pub resync: AtomicBool,
}

/// Load as scraped from the replica's `/metrics`.
#[derive(Debug, Default, Clone)]
pub struct ScrapedLoad {
    /// `vllm:num_requests_waiting` (summed over engines).
    pub waiting: f64,
    /// `vllm:num_requests_running` (summed over engines).
    pub running: f64,
    /// `vllm:kv_cache_usage_perc` (max over engines, 0..1).
    pub kv_usage: f64,
    /// `process_start_time_seconds`.
    pub process_start: Option<f64>,
    /// Last successful scrape.
    pub last_ok: Option<Instant>,
    /// The calibration inputs of the last successful scrape.
    pub totals: kvroute_core::calibration::EngineTotals,
    /// Consecutive failures.
    pub failures: u32,
    /// Running + waiting requests per engine (DP rank), from the `engine` label.
    pub busy_by_engine: std::collections::BTreeMap<u32, f64>,
    /// The engine's reuse counters of the last successful scrape.
    pub reuse: EngineReuse,
}

/// A replica of one model.
#[derive(Debug)]
pub struct Replica {
    /// Unique name.
    pub name: String,
    /// Model served.
    pub model: String,
    /// Its configuration (after discovery, `events`/`replay` are filled in).
    pub config: RwLock<ReplicaConfig>,
    /// Routing target `IP:port`.
    pub endpoint: String,
    /// One stream per DP rank (ranks found by discovery are appended; see [`Replica::streams`]).
    streams: RwLock<Vec<Arc<Stream>>>,
    /// Accepts no new requests.
    pub draining: AtomicBool,
    /// Requests routed here and not yet completed.
    pub in_flight: AtomicI64,
    /// Uncached prompt blocks routed here whose prefill is estimated not to be done yet.
    pub pending_prefill_blocks: AtomicI64,
    /// How many routed requests those blocks belong to.
    pub pending_prefill_requests: AtomicI64,
    /// Output tokens the requests routed here are still expected to generate.
    pub remaining_output_tokens: AtomicI64,
    /// Uncached prompt blocks of kvroute's requests in flight here (prefill done or not).
    pub in_flight_uncached_blocks: AtomicI64,
    /// Blocks the index holds for it (all its streams), as of the last refresh
    /// ([`crate::server`] refreshes it with the KV release curves).
    pub held_blocks: AtomicU64,
    /// The prefill kvroute recently routed here ([`crate::successors::RecentWork`]).
    pub recent_work: Mutex<crate::successors::RecentWork>,
    /// Its rates learned from its metrics (`None` until the first scrape: the priors apply).
    pub calibration: Mutex<Option<kvroute_core::calibration::ReplicaCalibration>>,
    /// Scraped load.
    pub scraped: Mutex<ScrapedLoad>,
    /// Background tasks (subscribers), aborted on removal.
    pub tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Hash self-check found a mismatch (its likely cause).
    pub hash_mismatch: Mutex<Option<String>>,
}

/// Scrape failures after which a replica counts as unhealthy.
pub const UNHEALTHY_AFTER_FAILURES: u32 = 3;

impl Replica {
    /// The streams, one per DP rank, rank order. Discovery may add ranks while the replica runs.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Counts `prefill` just routed here (by this gateway or a peer) in its recent work, faded
    /// over `window_s`.
    pub fn count_routed_prefill(&self, window_s: f64, prefill: std::time::Duration) {
        lock(&self.recent_work).add(std::time::Instant::now(), window_s, prefill.as_secs_f64());
    }

    /// Index ids of all ranks.
    pub fn index_ids(&self) -> Vec<u32> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|s| s.index_id)
            .collect()
    }

    /// Routable: not draining and its metrics endpoint answers (unknown counts as healthy).
    pub fn healthy(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
            && lock(&self.scraped).failures < UNHEALTHY_AFTER_FAILURES
    }

    /// The index may be out of date for this replica: a stream is disconnected, or silent for
    /// `stale_after` while its engine reports work. With data parallelism each rank's stream is
    /// judged by its own engine's load (vLLM's `engine="<rank>"` label), so an idle rank next to a
    /// busy one is not stale; without per-engine metrics the replica's total counts.
    pub fn stale(&self, stale_after: Duration) -> bool {
        let streams = self.streams();
        // Each rank's engine busy or not, read at once (not a copy of the per-engine map).
        let busy: Vec<bool> = {
            let s = lock(&self.scraped);
            let total = s.running + s.waiting;
            streams
                .iter()
                .map(|st| s.busy_by_engine.get(&st.rank).copied().unwrap_or(total) > 0.0)
                .collect()
        };
        streams.iter().zip(busy).any(|(st, busy)| {
            let s = lock(&st.state);
            if !s.connected {
                return true;
            }
            busy && s
                .last_message
                .map(|t| t.elapsed() > stale_after)
                .unwrap_or(true)
        })
    }
}

/// All replicas.
#[derive(Debug, Default)]
pub struct Fleet {
    replicas: RwLock<Vec<Arc<Replica>>>,
    next_index_id: AtomicU64,
    /// Index ids reserved by a loaded snapshot: (replica name, rank) -> id.
    reserved: Mutex<HashMap<(String, u32), u32>>,
}

impl Fleet {
    /// An empty fleet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `(replica, rank)` get `id` when it is added (snapshot restore); later ids start above.
    pub fn reserve_id(&self, replica: &str, rank: u32, id: u32) {
        lock(&self.reserved).insert((replica.to_string(), rank), id);
        self.next_index_id
            .fetch_max(u64::from(id) + 1, Ordering::Relaxed);
    }

    fn alloc_id(&self, replica: &str, rank: u32) -> u32 {
        if let Some(id) = lock(&self.reserved).remove(&(replica.to_string(), rank)) {
            return id;
        }
        let id = self.next_index_id.fetch_add(1, Ordering::Relaxed);
        u32::try_from(id).unwrap_or(u32::MAX)
    }

    /// Adds a replica; its streams get index ids (the caller starts the subscribers).
    pub fn add(&self, model: &str, cfg: ReplicaConfig) -> Result<Arc<Replica>, MembershipError> {
        let mut reps = self.replicas.write().unwrap_or_else(|p| p.into_inner());
        if reps.iter().any(|r| r.name == cfg.name) {
            return Err(MembershipError::Duplicate(cfg.name));
        }
        let events = cfg.event_endpoints();
        let replays = cfg.replay_endpoints();
        let streams = (0..cfg.data_parallel_size)
            .map(|rank| self.new_stream(&cfg.name, rank, &events, &replays))
            .collect();
        let replica = Arc::new(Replica {
            name: cfg.name.clone(),
            model: model.to_string(),
            endpoint: cfg.route_endpoint().to_string(),
            config: RwLock::new(cfg),
            streams: RwLock::new(streams),
            draining: AtomicBool::new(false),
            in_flight: AtomicI64::new(0),
            pending_prefill_blocks: AtomicI64::new(0),
            pending_prefill_requests: AtomicI64::new(0),
            remaining_output_tokens: AtomicI64::new(0),
            in_flight_uncached_blocks: AtomicI64::new(0),
            held_blocks: AtomicU64::new(0),
            recent_work: Mutex::new(crate::successors::RecentWork::since(
                std::time::Instant::now(),
            )),
            calibration: Mutex::new(None),
            scraped: Mutex::new(ScrapedLoad::default()),
            tasks: Mutex::new(Vec::new()),
            hash_mismatch: Mutex::new(None),
        });
        reps.push(replica.clone());
        Ok(replica)
    }

    fn new_stream(
        &self,
        replica: &str,
        rank: u32,
        events: &[String],
        replays: &[Option<String>],
    ) -> Arc<Stream> {
        Arc::new(Stream {
            rank,
            index_id: self.alloc_id(replica, rank),
            stats: StreamStats::default(),
            state: Mutex::new(StreamState {
                endpoint: events.get(rank as usize).cloned().unwrap_or_default(),
                replay: replays.get(rank as usize).cloned().flatten(),
                ..Default::default()
            }),
            resync: AtomicBool::new(false),
        })
    }

    /// Records what `GET /kv_event_sources` reported for a replica configured without event
    /// endpoints: its config gets the endpoints and DP size, and ranks beyond its current streams
    /// get new streams (index ids of their own, endpoints filled in). Returns the new streams; the
    /// caller starts their subscribers. Idempotent.
    pub fn apply_discovery(
        &self,
        replica: &Replica,
        discovered: &ReplicaConfig,
    ) -> Vec<Arc<Stream>> {
        if let Ok(mut cfg) = replica.config.write() {
            if cfg.events.is_empty() {
                cfg.events = discovered.events.clone();
                cfg.replay = discovered.replay.clone();
                cfg.bind = discovered.bind;
                cfg.data_parallel_size = cfg.data_parallel_size.max(discovered.data_parallel_size);
            }
        }
        let events = discovered.event_endpoints();
        let replays = discovered.replay_endpoints();
        let mut streams = replica.streams.write().unwrap_or_else(|p| p.into_inner());
        let mut added = Vec::new();
        for rank in streams.len() as u32..discovered.data_parallel_size {
            let s = self.new_stream(&replica.name, rank, &events, &replays);
            streams.push(s.clone());
            added.push(s);
        }
        added
    }

    /// Removes a replica and stops its tasks; returns it so the caller can drop its index entries.
    pub fn remove(&self, name: &str) -> Result<Arc<Replica>, MembershipError> {
        let mut reps = self.replicas.write().unwrap_or_else(|p| p.into_inner());
        let pos = reps
            .iter()
            .position(|r| r.name == name)
            .ok_or_else(|| MembershipError::NotFound(name.to_string()))?;
        let r = reps.remove(pos);
        for t in lock(&r.tasks).drain(..) {
            t.abort();
        }
        Ok(r)
    }

    /// Looks a replica up by name.
    pub fn get(&self, name: &str) -> Option<Arc<Replica>> {
        self.all().into_iter().find(|r| r.name == name)
    }

    /// Every replica.
    pub fn all(&self) -> Vec<Arc<Replica>> {
        self.replicas
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replicas of one model.
    pub fn of_model(&self, model: &str) -> Vec<Arc<Replica>> {
        self.all()
            .into_iter()
            .filter(|r| r.model == model)
            .collect()
    }

    /// The replica that owns an index id, with the rank.
    pub fn by_index_id(&self, id: u32) -> Option<(Arc<Replica>, u32)> {
        self.all().into_iter().find_map(|r| {
            r.streams()
                .iter()
                .find(|s| s.index_id == id)
                .map(|s| (r.clone(), s.rank))
        })
    }
}

/// `GET {http}/kv_event_sources` (vLLM >= 0.33): fills in `events`/`replay` and
/// `data_parallel_size` of a replica that did not configure them. vLLM answers an object keyed by
/// DP rank (`{"0": KVEventsConfig, "1": ...}`, `{}` when events are off); a JSON list (one entry
/// per rank) or an object with such a list under `sources` is accepted too. Each entry has
/// `endpoint` and optionally `replay_endpoint`. Wildcard hosts (`*`, `0.0.0.0`, `::`) are
/// replaced by the replica's HTTP host; an engine that connects out gets a bound endpoint on
/// `bind_host` (`events.bind_address`).
pub async fn discover_event_sources(
    client: &reqwest::Client,
    cfg: &mut ReplicaConfig,
    bind_host: &str,
) -> Result<(), MembershipError> {
    let url = format!("http://{}/kv_event_sources", cfg.http);
    let err = |message: String| MembershipError::Discovery {
        replica: cfg.name.clone(),
        url: url.clone(),
        message,
    };
    let resp = client
        .get(&url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map_err(|e| err(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(err(format!("HTTP {}", resp.status())));
    }
    let body: serde_json::Value = resp.json().await.map_err(|e| err(e.to_string()))?;
    let host = cfg
        .http
        .rsplit_once(':')
        .map(|(h, _)| h.to_string())
        .unwrap_or_default();
    let EventSources {
        events,
        replay,
        bind,
        published_to,
    } = parse_event_sources(&body, &host, bind_host).map_err(err)?;
    let bind_is_loopback = bind_host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback());
    for target in &published_to {
        let remote = parse_tcp_endpoint(target)
            .ok()
            .and_then(|(h, _)| h.trim_matches(['[', ']']).parse::<std::net::IpAddr>().ok())
            .is_none_or(|ip| !ip.is_loopback());
        if bind_is_loopback && remote {
            tracing::warn!(replica = %cfg.name, engine_publishes_to = %target, bind_address = bind_host, "the engine connects out to a non-loopback address but events.bind_address is loopback: set events.bind_address to the interface it connects to");
        }
    }
    cfg.data_parallel_size = u32::try_from(events.len()).unwrap_or(1).max(1);
    cfg.events = events;
    cfg.bind = bind;
    cfg.replay = if replay.iter().all(Option::is_some) {
        replay.into_iter().flatten().collect()
    } else {
        Vec::new()
    };
    Ok(())
}

/// Event endpoints of a replica as its `/kv_event_sources` reports them, from the indexer's side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSources {
    /// Per DP rank: where the indexer connects (engine binds) or binds (engine connects out).
    pub events: Vec<String>,
    /// Per DP rank: the engine's replay (ROUTER) endpoint, if it has one.
    pub replay: Vec<Option<String>>,
    /// The engine connects out to `events` (vLLM does so for a tcp endpoint with neither `*` nor
    /// `::` in it), so the indexer must bind them: on the bind host, at the listed port.
    pub bind: bool,
    /// The engine's own endpoints, for ranks that connect out.
    pub published_to: Vec<String>,
}

/// Whether vLLM's publisher binds `endpoint` (it connects out otherwise): vLLM binds when the
/// endpoint contains `*` or `::`, or is `ipc://` / `inproc://`.
pub fn engine_binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Parses a `/kv_event_sources` answer into per-rank event and replay endpoints; ranks that
/// connect out get `tcp://{bind_host}:{port}` to bind.
pub fn parse_event_sources(
    body: &serde_json::Value,
    host: &str,
    bind_host: &str,
) -> Result<EventSources, String> {
    let list = match body {
        serde_json::Value::Array(a) => a.clone(),
        serde_json::Value::Object(o) => match o.get("sources").or_else(|| o.get("data")) {
            Some(serde_json::Value::Array(a)) => a.clone(),
            _ if o.contains_key("endpoint") => vec![body.clone()],
            // vLLM: {"<rank>": KVEventsConfig, ...}; ranks must be 0..n.
            _ => {
                let mut ranked = Vec::with_capacity(o.len());
                for (k, v) in o {
                    let rank: usize = k
                        .parse()
                        .map_err(|_| format!("key {k:?} is not a data-parallel rank"))?;
                    ranked.push((rank, v.clone()));
                }
                ranked.sort_by_key(|(r, _)| *r);
                if let Some((i, (r, _))) = ranked.iter().enumerate().find(|(i, (r, _))| i != r) {
                    return Err(format!("rank {i} missing (next listed rank is {r})"));
                }
                ranked.into_iter().map(|(_, v)| v).collect()
            }
        },
        _ => return Err("expected a JSON list or object".into()),
    };
    let mut events = Vec::new();
    let mut replay = Vec::new();
    let mut connect_out = Vec::new();
    let mut published_to = Vec::new();
    let bind_host = if bind_host.contains(':') && !bind_host.starts_with('[') {
        format!("[{bind_host}]")
    } else {
        bind_host.to_string()
    };
    for entry in &list {
        let disabled = entry.get("enable_kv_cache_events") == Some(&serde_json::Value::Bool(false))
            || entry.get("publisher").and_then(|p| p.as_str()) == Some("null");
        if disabled {
            return Err("KV events are disabled on this engine (enable --kv-events-config)".into());
        }
        let ep = entry
            .get("endpoint")
            .and_then(|v| v.as_str())
            .ok_or("an entry has no \"endpoint\"")?;
        if engine_binds(ep) {
            events.push(resolve_wildcard(ep, host));
            connect_out.push(false);
        } else {
            let port = ep
                .strip_prefix("tcp://")
                .and_then(|rest| rest.rsplit_once(':'))
                .map(|(_, port)| port)
                .filter(|port| port.parse::<u16>().is_ok())
                .ok_or_else(|| {
                    format!(
                        "the engine publishes to {ep:?}, which is not a tcp://HOST:PORT endpoint"
                    )
                })?;
            events.push(format!("tcp://{bind_host}:{port}"));
            published_to.push(ep.to_string());
            connect_out.push(true);
        }
        replay.push(
            entry
                .get("replay_endpoint")
                .and_then(|v| v.as_str())
                .filter(|r| !r.is_empty())
                .map(|r| resolve_wildcard(r, host)),
        );
    }
    if events.is_empty() {
        return Err("no event sources listed (are KV events enabled?)".into());
    }
    let bind = connect_out.iter().all(|&c| c);
    if !bind && connect_out.iter().any(|&c| c) {
        return Err(
            "some ranks bind their event endpoint and others connect out; configure them alike"
                .into(),
        );
    }
    Ok(EventSources {
        events,
        replay,
        bind,
        published_to,
    })
}

fn resolve_wildcard(ep: &str, host: &str) -> String {
    for wild in ["tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::"] {
        if let Some(port) = ep.strip_prefix(wild) {
            return format!("tcp://{host}:{port}");
        }
    }
    ep.to_string()
}

/// The engine's own reuse counters (totals since it started), read by `assess`.
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct EngineReuse {
    /// `vllm:prefix_cache_hits_total`: prompt tokens served from the prefix cache.
    pub cache_hit_tokens: f64,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up in it.
    pub cache_query_tokens: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_sources_resolve_wildcards() {
        let body = serde_json::json!([
            {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
            {"endpoint": "tcp://*:5558"}
        ]);
        let s = parse_event_sources(&body, "10.0.0.7", "127.0.0.1").unwrap();
        assert_eq!(s.events, ["tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"]);
        assert_eq!(s.replay, [Some("tcp://10.0.0.7:5558".to_string()), None]);
        assert!(!s.bind);
    }

    #[test]
    fn event_sources_in_vllms_rank_keyed_shape() {
        // What vLLM 0.33.0's GET /kv_event_sources returns: dict[int, KVEventsConfig].
        let body = serde_json::json!({
            "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558",
                  "replay_endpoint": "tcp://*:5568", "buffer_steps": 10000, "hwm": 100000,
                  "max_queue_size": 100000, "topic": "kv-events"},
            "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5567", "buffer_steps": 10000, "hwm": 100000,
                  "max_queue_size": 100000, "topic": "kv-events"}
        });
        let s = parse_event_sources(&body, "127.0.0.1", "127.0.0.1").unwrap();
        assert_eq!(s.events, ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]);
        assert!(!s.bind);
        assert_eq!(
            s.replay,
            [
                Some("tcp://127.0.0.1:5567".to_string()),
                Some("tcp://127.0.0.1:5568".to_string())
            ]
        );
        // An endpoint without `*` or `::`: the engine connects out to it, the indexer binds.
        let one = serde_json::json!({"0": {"endpoint": "tcp://10.1.2.3:5557", "replay_endpoint": "tcp://*:5567"}});
        let s = parse_event_sources(&one, "127.0.0.1", "127.0.0.1").unwrap();
        // Bound on `events.bind_address` (loopback by default), never on all interfaces.
        assert_eq!(s.events, ["tcp://127.0.0.1:5557"]);
        assert_eq!(s.published_to, ["tcp://10.1.2.3:5557"]);
        let s = parse_event_sources(&one, "127.0.0.1", "10.1.2.3").unwrap();
        assert_eq!(s.events, ["tcp://10.1.2.3:5557"]);
        let s = parse_event_sources(&one, "127.0.0.1", "fd00::7").unwrap();
        assert_eq!(s.events, ["tcp://[fd00::7]:5557"]);
        assert_eq!(s.replay, [Some("tcp://127.0.0.1:5567".to_string())]);
        assert!(s.bind);
        let ipv6 = serde_json::json!({"0": {"endpoint": "tcp://[::]:5557"}});
        assert!(!parse_event_sources(&ipv6, "h", "127.0.0.1").unwrap().bind);
    }

    #[test]
    fn event_sources_errors_are_explicit() {
        let err = |v: serde_json::Value| parse_event_sources(&v, "h", "127.0.0.1").unwrap_err();
        assert!(err(serde_json::json!({})).contains("no event sources"));
        assert!(err(
            serde_json::json!({"0": {"endpoint": "tcp://*:1"}, "2": {"endpoint": "tcp://*:3"}})
        )
        .contains("rank 1 missing"));
        assert!(err(serde_json::json!({"x": {}})).contains("not a data-parallel rank"));
        assert!(err(
            serde_json::json!({"0": {"endpoint": "tcp://*:1"}, "1": {"endpoint": "tcp://10.0.0.1:2"}})
        )
        .contains("configure them alike"));
        assert!(err(serde_json::json!({"0": {"endpoint": "tcp://indexer"}}))
            .contains("not a tcp://HOST:PORT"));
        assert!(err(serde_json::json!({"0": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5557"}}))
            .contains("disabled"));
    }
}
