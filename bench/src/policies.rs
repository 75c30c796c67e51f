//! The routing policies the benchmark compares, how each is started, and the hit-rate ceiling.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::workloads::{BenchRequest, Workload};
use crate::stack::{self, Stack};
use crate::supervisor::Supervisor;

/// Envoy with header session affinity (RING_HASH on `x-session-id`).
const SESSION_TEMPLATE: &str = include_str!("../templates/envoy-session.yaml");

/// A started router: where clients send, and any process the benchmark owns directly.
pub struct Router {
    /// `host:port` of the listener.
    pub addr: String,
    /// Processes started outside [`Stack`] (stopped when dropped).
    _own: Option<Supervisor>,
    /// Process groups of those processes (their CPU and memory count as the router's).
    pub own_groups: Vec<u32>,
}

/// A routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// kvroute: Envoy + filter + indexer `--policy kv`.
    Kv,
    /// Plain Envoy, `lb_policy: ROUND_ROBIN`.
    RoundRobin,
    /// Plain Envoy, `lb_policy: LEAST_REQUEST`.
    LeastRequest,
    /// Envoy + filter + indexer `--policy random`.
    Random,
    /// Plain Envoy, `RING_HASH` on the `x-session-id` header (header session affinity).
    Session,
    /// Envoy + filter + indexer `--policy approx-prefix` (router-side guess, no events used).
    ApproxPrefix,
    /// Envoy's round robin routes; the filter runs in shadow mode against `kvroute-indexer
    /// assess --listen`, whose report (predicted hit rate, verdict, thrash, would-have-saved)
    /// lands in the run's summary (docs/assess.md). Not run unless named.
    Shadow,
}

impl Policy {
    /// The policies run when `--policies` names none (every routing policy; not `shadow`, a
    /// measurement of round robin).
    pub const DEFAULT: [Policy; 6] = [
        Policy::Kv,
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::Random,
        Policy::Session,
        Policy::ApproxPrefix,
    ];

    /// Every policy, in report order: the default ones, then `shadow`.
    pub const ALL: [Policy; 7] = {
        let d = Self::DEFAULT;
        [d[0], d[1], d[2], d[3], d[4], d[5], Policy::Shadow]
    };

    /// Name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::RoundRobin => "round-robin",
            Policy::LeastRequest => "least-request",
            Policy::Random => "random",
            Policy::Session => "session",
            Policy::ApproxPrefix => "approx-prefix",
            Policy::Shadow => "shadow",
        }
    }

    /// How it runs, for the report.
    pub fn how(self) -> &'static str {
        match self {
            Policy::Kv => "Envoy + kvroute filter + indexer `--policy kv` (exact index from KV events, scoring)",
            Policy::RoundRobin => "plain Envoy, `lb_policy: ROUND_ROBIN`",
            Policy::LeastRequest => "plain Envoy, `lb_policy: LEAST_REQUEST`",
            Policy::Random => "Envoy + kvroute filter + indexer `--policy random`",
            Policy::Session => "plain Envoy, `lb_policy: RING_HASH` with a route `hash_policy` on the `x-session-id` header (header session affinity as an Envoy user would set it up; the replicas sit on the ring by name, `envoy.lb` `hash_key`, so a session lands on the same replica in every run; kvroute's own `--policy session`, which the filter reaches by forwarding the header, is not benchmarked)",
            Policy::ApproxPrefix => "Envoy + kvroute filter + indexer `--policy approx-prefix` (router-side prefix guess, no events)",
            Policy::Shadow => "Envoy `ROUND_ROBIN` with the kvroute filter in shadow mode, asking `kvroute-indexer assess --listen` (routes nothing; measures what assess predicts and shadow mode would have saved)",
        }
    }

    /// Whether it cares about load only (the no-sharing control compares kv with the best of these).
    pub fn load_only(self) -> bool {
        matches!(
            self,
            Policy::RoundRobin | Policy::LeastRequest | Policy::Random
        )
    }

    /// Whether it runs the filter and an indexer (or `assess` in its place).
    pub fn uses_indexer(self) -> bool {
        self.indexer_policy().is_some() || self == Policy::Shadow
    }

    /// The indexer's `--policy` value, for policies that go through the filter.
    fn indexer_policy(self) -> Option<&'static str> {
        match self {
            Policy::Kv => Some("kv"),
            Policy::Random => Some("random"),
            Policy::ApproxPrefix => Some("approx-prefix"),
            Policy::RoundRobin | Policy::LeastRequest | Policy::Session | Policy::Shadow => None,
        }
    }

    /// Starts the router for this policy in front of the (running) replicas; `envoy` is the
    /// Envoy binary and `work_dir` takes configs and logs of processes started here (`shadow`:
    /// assess writes its report to [`assess_report_path`]).
    pub fn start(self, stack: &mut Stack, envoy: &Path, work_dir: &Path) -> Result<Router> {
        let router = |addr: String| Router {
            addr,
            _own: None,
            own_groups: Vec::new(),
        };
        match (self, self.indexer_policy()) {
            (Policy::Session, _) => start_session_envoy(stack, envoy, work_dir),
            (Policy::RoundRobin | Policy::LeastRequest, _) => {
                let lb = match self {
                    Policy::RoundRobin => "ROUND_ROBIN",
                    _ => "LEAST_REQUEST",
                };
                stack.start_baseline_envoy(lb)?;
                Ok(router(stack.baseline_addr()))
            }
            // Through kvroute's Envoy: the indexer routes, or (`shadow`) Envoy's round robin
            // routes while assess watches.
            (_, policy) => {
                match policy {
                    Some(policy) => {
                        stack.start_indexer(policy)?;
                        stack.start_kvroute_envoy()?;
                    }
                    None => {
                        stack.start_assess(&assess_report_path(work_dir))?;
                        stack.start_kvroute_envoy_shadow()?;
                    }
                }
                Ok(router(stack.kvroute_addr()))
            }
        }
    }

    /// Stops what [`Policy::start`] started in the stack (drop the [`Router`] for the rest).
    pub fn stop(self, stack: &mut Stack) {
        stack.stop("envoy-");
        stack.stop("indexer");
    }
}

/// Where the `shadow` line's `assess` writes its JSON report.
pub fn assess_report_path(work_dir: &Path) -> std::path::PathBuf {
    work_dir.join("assess-shadow.json")
}

/// Envoy with RING_HASH on `x-session-id`, on the stack's baseline ports.
fn start_session_envoy(stack: &Stack, envoy: &Path, work_dir: &Path) -> Result<Router> {
    let (listen, admin) = stack.ports.baseline;
    let mut yaml = stack::render(
        SESSION_TEMPLATE,
        &[
            ("LISTEN_PORT", listen.to_string()),
            ("ADMIN_PORT", admin.to_string()),
            ("LB_ENDPOINTS", stack.lb_endpoints_hash_keyed()),
        ],
    )?;
    if stack.health_checks() {
        yaml = stack::with_health_checks(&yaml)?;
    }
    let config = work_dir.join("envoy-session.yaml");
    fs::write(&config, yaml).with_context(|| format!("writing {}", config.display()))?;
    let mut cmd = Command::new(envoy);
    cmd.arg("-c").arg(&config).args([
        "--disable-hot-restart",
        "--log-level",
        "warn",
        "--concurrency",
        "2",
    ]);
    let mut sup = Supervisor::new(true);
    let pid = sup.spawn(
        "envoy-session",
        cmd,
        &work_dir.join("logs").join("envoy-session.log"),
    )?;
    sup.wait_http_ok(
        "envoy-session",
        &format!("127.0.0.1:{admin}"),
        "/ready",
        Duration::from_secs(60),
    )?;
    Ok(Router {
        addr: format!("127.0.0.1:{listen}"),
        _own: Some(sup),
        own_groups: vec![pid],
    })
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match Policy::ALL.iter().find(|p| p.name() == s) {
            Some(p) => Ok(*p),
            None => bail!(
                "unknown policy {s:?} (one of: {})",
                Policy::ALL.map(Policy::name).join(", ")
            ),
        }
    }
}

/// The single-replica, infinite-cache hit-rate bound: the fraction of prompt tokens in blocks an
/// earlier request already had, counted as vLLM counts hits (whole blocks, a chain from the first
/// block, at most `(n - 1) / block_size` blocks so one token is always computed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceiling {
    /// Prompt tokens.
    pub queried: u64,
    /// Tokens that would hit.
    pub hit: u64,
}

impl Ceiling {
    /// hit / queried.
    pub fn hit_rate(&self) -> f64 {
        if self.queried == 0 {
            0.0
        } else {
            self.hit as f64 / self.queried as f64
        }
    }
}

/// Computes [`Ceiling`] for `workload` in arrival order with `block_size`-token blocks.
#[cfg(test)]
pub fn ceiling(workload: &Workload, block_size: usize) -> Ceiling {
    ceiling_of(workload, &ceiling_hits(workload, block_size))
}

/// [`Ceiling`] from the per-request hits of [`ceiling_hits`].
pub fn ceiling_of(workload: &Workload, hits: &[u64]) -> Ceiling {
    Ceiling {
        queried: workload
            .requests
            .iter()
            .map(|r| r.num_tokens() as u64)
            .sum(),
        hit: hits.iter().sum(),
    }
}

/// The ceiling's hit tokens of every request (workload order): what an infinite cache that saw
/// every earlier request would serve; the rest of each prompt must be computed.
pub fn ceiling_hits(workload: &Workload, block_size: usize) -> Vec<u64> {
    let bs = block_size.max(1);
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::with_capacity(workload.requests.len());
    for request in &workload.requests {
        let tokens = request.tokens();
        let n = tokens.len();
        let usable = n.saturating_sub(1) / bs;
        let mut parent = 0x6b76_726f_7574_6521u64;
        let mut hits_here = 0usize;
        let mut chain_intact = true;
        for (index, block) in tokens.chunks_exact(bs).enumerate() {
            parent = chain_key(parent, block);
            let fresh = seen.insert(parent);
            if chain_intact && !fresh && index < usable {
                hits_here += 1;
            } else {
                chain_intact = false;
            }
        }
        out.push((hits_here * bs) as u64);
    }
    out
}

/// Like [`ceiling_hits`], with the cache the fleet really has: one LRU of `capacity_blocks`
/// blocks (every replica's KV as one cache, no block held twice), every block of every request
/// touched in arrival order (a hit refreshes it). Optimistic for any router (running requests'
/// blocks and decode blocks take no room here), so the bound it gives is one no router beats.
pub fn fleet_cache_hits(
    workload: &Workload,
    block_size: usize,
    capacity_blocks: usize,
) -> Vec<u64> {
    let bs = block_size.max(1);
    let mut cache = LruBlocks::new(capacity_blocks);
    workload
        .requests
        .iter()
        .map(|request| {
            let keys = block_keys(&request.tokens(), bs);
            let hits = cache.cached_prefix(&keys, usable_blocks(request, bs));
            cache.touch_all(&keys);
            (hits * bs) as u64
        })
        .collect()
}

/// The chained keys of a prompt's full blocks of `block_size` tokens.
pub fn block_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = 0x6b76_726f_7574_6521u64;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            parent = chain_key(parent, block);
            parent
        })
        .collect()
}

/// Blocks of `request` an engine may serve from its cache (the last prompt token is always
/// computed).
pub fn usable_blocks(request: &BenchRequest, block_size: usize) -> usize {
    request.num_tokens().saturating_sub(1) / block_size.max(1)
}

/// A cache of block keys evicted least recently used first, holding at most `capacity` keys.
#[derive(Debug, Clone)]
pub struct LruBlocks {
    capacity: usize,
    last_use: HashMap<u64, u64>,
    /// (use, key) in use order; an entry whose key was used again later is stale and skipped.
    order: VecDeque<(u64, u64)>,
    clock: u64,
}

impl LruBlocks {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        LruBlocks {
            capacity,
            last_use: HashMap::new(),
            order: VecDeque::new(),
            clock: 0,
        }
    }

    /// How many of the first `usable` keys are held, counted from the first until one is not.
    pub fn cached_prefix(&self, keys: &[u64], usable: usize) -> usize {
        keys.iter()
            .take(usable)
            .take_while(|k| self.last_use.contains_key(k))
            .count()
    }

    /// Uses every key in order (a held one becomes the most recent, a new one is added), then
    /// evicts the least recently used keys beyond the capacity.
    pub fn touch_all(&mut self, keys: &[u64]) {
        for &key in keys {
            self.clock += 1;
            self.last_use.insert(key, self.clock);
            self.order.push_back((self.clock, key));
        }
        while self.last_use.len() > self.capacity {
            let Some((used, key)) = self.order.pop_front() else {
                break;
            };
            if self.last_use.get(&key) == Some(&used) {
                self.last_use.remove(&key);
            }
        }
    }
}

/// A 64-bit chained key of a block (collisions are irrelevant at benchmark sizes).
fn chain_key(parent: u64, block: &[u32]) -> u64 {
    let mut h = parent ^ 0x9E37_79B9_7F4A_7C15;
    for &t in block {
        h = (h ^ u64::from(t)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 29;
    }
    h.wrapping_mul(0x94D0_49BB_1331_11EB) ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::super::workloads::{workload_of as workload, Segment, SharedPrefix};
    use super::*;

    #[test]
    fn policies_parse_and_print() {
        for p in Policy::ALL {
            assert_eq!(p.name().parse::<Policy>().expect("parse"), p);
        }
        assert!("nope".parse::<Policy>().is_err());
        assert!(Policy::RoundRobin.load_only() && !Policy::Kv.load_only());
    }

    #[test]
    fn session_template_renders_to_a_ring_hash_on_the_session_header() {
        let yaml = stack::render(
            SESSION_TEMPLATE,
            &[
                ("LISTEN_PORT", "1".into()),
                ("ADMIN_PORT", "2".into()),
                (
                    "LB_ENDPOINTS",
                    stack::loopback_endpoints(&[8001, 8002], true),
                ),
            ],
        )
        .expect("render");
        assert!(yaml.contains("lb_policy: RING_HASH"));
        assert!(yaml.contains("header_name: x-session-id"));
        // Replicas sit on the ring by name, not by their (per-run) ports.
        assert!(yaml.contains(r#""envoy.lb":{"hash_key":"r1"}"#), "{yaml}");
        // A scale-out health-checks the replicas; that config must be valid too.
        let checked = stack::with_health_checks(&yaml).expect("health checks");
        // The real Envoy accepts it, when setup installed one.
        if let Some(envoy) = std::env::var_os("KVROUTE_ENVOY").filter(|p| Path::new(p).is_file()) {
            let dir = std::env::temp_dir().join(format!("xtask-session-{}", std::process::id()));
            fs::create_dir_all(&dir).expect("dir");
            for (name, text) in [("s.yaml", &yaml), ("s-hc.yaml", &checked)] {
                let config = dir.join(name);
                fs::write(&config, text).expect("write");
                let out = Command::new(&envoy)
                    .args(["--mode", "validate", "--disable-hot-restart", "-c"])
                    .arg(&config)
                    .output()
                    .expect("envoy");
                assert!(
                    out.status.success(),
                    "{name}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let _ = fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn ceiling_counts_whole_shared_blocks_and_keeps_one_token() {
        let a = Segment::new("a", 0, 40);
        let b = Segment::new("b", 0, 8);
        let c = Segment::new("c", 0, 8);
        // 48 tokens: blocks 0,1 (32 tokens) of the 40 shared ones hit; block 2 mixes a and b.
        let w = workload(vec![vec![a, b], vec![a, c], vec![a, b]]);
        let ceil = ceiling(&w, 16);
        assert_eq!(ceil.queried, 144);
        // Second: 32 hit. Third: identical to the first, 3 blocks, but (48-1)/16 = 2 usable.
        assert_eq!(ceil.hit, 64);
        // Exactly one block long: never a hit ((16 - 1) / 16 = 0).
        let one = Segment::new("one", 0, 16);
        assert_eq!(ceiling(&workload(vec![vec![one], vec![one]]), 16).hit, 0);
    }

    #[test]
    fn the_fleet_cache_forgets_what_it_has_no_room_for() {
        // A and B: 3 blocks each (48 tokens) plus a 16-token tail; asked A, B, A.
        let a = Segment::new("a", 0, 48);
        let b = Segment::new("b", 0, 48);
        let t = Segment::new("t", 0, 16);
        let w = workload(vec![vec![a, t], vec![b, t], vec![a, t]]);
        // Room for everything: the ceiling's hits (A's 3 blocks the third time).
        assert_eq!(fleet_cache_hits(&w, 16, 1_000), ceiling_hits(&w, 16));
        assert_eq!(fleet_cache_hits(&w, 16, 1_000), [0, 0, 48]);
        // Room for 5 blocks: B's 4 evicted A's first block, so the third request misses at once.
        assert_eq!(fleet_cache_hits(&w, 16, 5), [0, 0, 0]);
        // Room for 8: both fit, A hits again.
        assert_eq!(fleet_cache_hits(&w, 16, 8), [0, 0, 48]);
        // A hit refreshes: A, B, A, C (4 blocks) with room for 8 evicts B, not A, so A hits again.
        let c = Segment::new("c", 0, 48);
        let w = workload(vec![
            vec![a, t],
            vec![b, t],
            vec![a, t],
            vec![c, t],
            vec![a, t],
            vec![b, t],
        ]);
        assert_eq!(fleet_cache_hits(&w, 16, 8), [0, 0, 48, 0, 48, 0]);
    }

    #[test]
    fn ceiling_stops_at_the_first_miss() {
        let a = Segment::new("a", 0, 16);
        let b = Segment::new("b", 0, 16);
        let x = Segment::new("x", 0, 16);
        let tail = Segment::new("t", 0, 16);
        // Request 2 shares block a, misses x, then b at position 2 is a different chain anyway.
        let w = workload(vec![vec![a, b, tail], vec![a, x, b, tail]]);
        assert_eq!(ceiling(&w, 16).hit, 16);
    }

    #[test]
    fn shared_prefix_ceiling_is_the_closed_form() {
        let sp = SharedPrefix {
            groups: 10,
            prompts_per_group: 5,
            system_tokens: 6_000,
            question_tokens: 1_200,
            output_tokens: 1,
            seed: 1,
        };
        let w = sp.at_rate(1.0).expect("workload");
        // 4 of 5 prompts per group hit the system prompt's whole blocks (6000 / 16 = 375).
        let expected = (10 * 4 * 375 * 16) as f64 / (50 * 7_200) as f64;
        assert!((ceiling(&w, 16).hit_rate() - expected).abs() < 1e-12);
    }
}
