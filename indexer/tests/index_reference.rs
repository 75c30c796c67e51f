//! Differential test of the exact index (`kvroute_indexer::index::KvIndex`) against a clean-room
//! reference written from its documented semantics (docs/index.md, the `KvIndex` doc comments)
//! and from vLLM's own hybrid hit rule, not from the index's code: a map
//! `(replica, KV cache group, router key) -> medium bits`, each replica's KV cache groups as its
//! events described them, a map of the engine hashes that name a live block, and a map of
//! predictions with their expiry. A replica whose only group is full-attention group 0 is looked
//! up by walking the request's keys one by one through the tiers GPU -> predicted -> CPU ->
//! storage; any other layout by vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`, written
//! here as vLLM writes it (a fixed point over the groups: `FullAttentionManager` takes the leading
//! run, `SlidingWindowManager` scans right to left for `ceil((window - 1) / block_size)` contiguous
//! blocks), on GPU blocks, then on GPU or predicted blocks (a prediction stands for every group).
//!
//! Generated cases: each replica gets a layout (one full-attention group, or 1-3 groups of full
//! attention, sliding windows of 1-7 tokens, or an unsupported kind); random event sequences from
//! 4 replicas (two hashing alike, two with their own engine hashes, so the index keeps aliases)
//! over 4 conversations of 8 blocks that share leading blocks with conversation 0 (so prefixes
//! overlap across conversations and replicas): stores from block 0 or chained from a parent
//! (known or not) in any of the replica's groups (or a group outside its layout, or out of
//! range), removals of any blocks (middle ones included, repeated hashes), `AllBlocksCleared`,
//! stream clears (`clear_replica`), `remove_replica`, malformed events, predictions with a TTL on
//! requests with random tails, and a clock that moves on (with `expire_predicted`). After every
//! step, the event's outcome (or error), `lookup` of every conversation and of the case's random
//! requests, `holders` and `group_holders` of every block, every replica's `layout`,
//! `key_of_engine_hash` of every engine hash and the block, entry and prediction counts must equal
//! the reference's.
//!
//! Bounds: these sequences stay far below both bounds (`max_bytes` 1 GiB, `max_predicted`
//! 262,144), so the reference does not model CLOCK eviction; every step asserts that nothing was
//! evicted or dropped, so a case that reached a bound would fail rather than pass vacuously. A
//! second property runs the events (no predictions) under a small budget (the index with one block
//! stored, plus up to 2 KiB) and checks only what eviction documents: the index stays under the
//! budget and only forgets (its holdings are the reference's or fewer, each replica's match no
//! longer than the reference's).
//!
//! Cases: `PROPTEST_CASES` (default below), seed `PROPTEST_RNG_SEED`; failures are shrunk and
//! kept in `index_reference.proptest-regressions`, replayed first.

use std::collections::HashMap;

use std::collections::BTreeMap;

use kvroute_core::events::{BlockRemoved, BlockStored, KvEvent, Medium, WireBlockHash};
use kvroute_core::hashing::{ExtraKeyStyle, RequestExtras};
use kvroute_core::hybrid::GroupKind;
use kvroute_core::router_key::{request_keys, RouterKey};
use kvroute_indexer::index::{
    ApplyOutcome, IndexConfig, IndexError, KvIndex, LearnedGroup, ReplicaMatch, MEDIA_CPU,
    MEDIA_GPU, MEDIA_STORAGE,
};
use proptest::prelude::*;

/// Tokens per block.
const BS: usize = 2;
/// Conversations, blocks per conversation, replicas.
const CONVS: usize = 4;
const BLOCKS: usize = 8;
const REPLICAS: usize = 4;
/// Leading blocks conversation `c` shares with conversation 0.
const SHARED: [usize; CONVS] = [BLOCKS, 3, 5, 0];
/// Engine-hash salt of each replica: 0 and 1 hash alike, 2 and 3 each differently.
const SALT: [u64; REPLICAS] = [0, 0, 0xA11A5, 0xB0B];
/// Every replica hashing alike (the budget test: no aliases, which a full budget may drop).
const UNIFORM: [u64; REPLICAS] = [0; REPLICAS];
/// Group ids a store or removal names: 0-2 pick one of the replica's groups (modulo its layout),
/// 5 is outside every layout, 40 is beyond the group ids the index accepts (32).
const OUTSIDE_GROUP: usize = 5;
const OUT_OF_RANGE_GROUP: usize = 40;

/// A KV cache group as a replica's model has it (what its `BlockStored` events say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Full,
    /// Sliding window of this many tokens.
    Window(u32),
    /// A kind whose hit rule is not modelled: its events are ignored.
    Mamba,
}

/// Each replica's KV cache groups (group id = position).
type Layouts = [Vec<Kind>; REPLICAS];

/// One full-attention group: what every model but a hybrid one has.
fn plain_layouts() -> Layouts {
    std::array::from_fn(|_| vec![Kind::Full])
}

/// The group an event of `r` names and the kind it announces (`None`: no kind, full attention).
fn resolve(layouts: &Layouts, r: usize, group: usize) -> (usize, Option<Kind>) {
    let layout = &layouts[r];
    if group < OUTSIDE_GROUP {
        let g = group % layout.len();
        (g, Some(layout[g]))
    } else {
        (group, None)
    }
}

/// The conversation whose block `b` is the same block as `c`'s (shared prefixes).
fn canonical(c: usize, b: usize) -> usize {
    if b < SHARED[c] {
        0
    } else {
        c
    }
}

fn block_tokens(c: usize, b: usize) -> Vec<u32> {
    let base = (canonical(c, b) * 1000 + b * 10) as u32;
    (0..BS as u32).map(|t| base + t).collect()
}

use kvroute_core::rng::mix as splitmix;

/// The engine hash a replica with `salt` reports for block `b` of conversation `c`: a hash of the
/// whole prefix, so shared blocks have one hash per salt.
fn eh(c: usize, b: usize, salt: u64) -> u64 {
    splitmix(splitmix(((canonical(c, b) as u64) << 32) | b as u64) ^ salt)
}

/// Router keys of every block of conversation `c`, as a request computes them.
fn conv_keys(c: usize) -> Vec<RouterKey> {
    let tokens: Vec<u32> = (0..BLOCKS).flat_map(|b| block_tokens(c, b)).collect();
    keys_of(&tokens)
}

fn keys_of(tokens: &[u32]) -> Vec<RouterKey> {
    request_keys(tokens, BS, &RequestExtras::default(), ExtraKeyStyle::Tagged)
}

fn bit(m: Option<Medium>) -> u8 {
    match m.unwrap_or(Medium::Gpu) {
        Medium::Gpu => MEDIA_GPU,
        Medium::Cpu => MEDIA_CPU,
        Medium::Storage => MEDIA_STORAGE,
    }
}

/// A request: the first `prefix` blocks of `conv`, then blocks of tokens from a tiny alphabet (so
/// two requests' tails can share keys).
#[derive(Debug, Clone)]
struct Request {
    conv: usize,
    prefix: usize,
    tail: Vec<u32>,
}

impl Request {
    fn keys(&self) -> Vec<RouterKey> {
        let mut tokens: Vec<u32> = (0..self.prefix)
            .flat_map(|b| block_tokens(self.conv, b))
            .collect();
        for &t in &self.tail {
            tokens.extend(std::iter::repeat_n(900_000 + t, BS));
        }
        keys_of(&tokens)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// `BlockStored` of blocks `start..start + len` of `conv` (parent: block `start - 1`).
    Store {
        r: usize,
        conv: usize,
        start: usize,
        len: usize,
        medium: Option<Medium>,
        /// KV cache group ([`resolve`]).
        group: usize,
        /// One token short: `InvalidEvent`, nothing changes (only generated with `start == 0`).
        malformed: bool,
    },
    /// `BlockRemoved` of these blocks of `conv`.
    Remove {
        r: usize,
        conv: usize,
        blocks: Vec<usize>,
        medium: Option<Medium>,
        group: usize,
    },
    AllBlocksCleared(usize),
    /// What a subscriber does on an unrecoverable stream gap.
    ClearReplica(usize),
    RemoveReplica(usize),
    Predict {
        r: usize,
        req: Request,
        ttl: u64,
    },
    /// The clock moves on by this many ms; `expire` also calls `expire_predicted`.
    Tick {
        ms: u64,
        expire: bool,
    },
}

fn medium() -> impl Strategy<Value = Option<Medium>> {
    prop_oneof![
        Just(None),
        Just(Some(Medium::Gpu)),
        Just(Some(Medium::Cpu)),
        Just(Some(Medium::Storage)),
    ]
}

fn group() -> impl Strategy<Value = usize> {
    prop_oneof![
        12 => Just(0usize),
        3 => Just(1usize),
        3 => Just(2usize),
        1 => Just(OUTSIDE_GROUP),
        1 => Just(OUT_OF_RANGE_GROUP),
    ]
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        3 => Just(Kind::Full),
        3 => (1u32..=7).prop_map(Kind::Window),
        1 => Just(Kind::Mamba),
    ]
}

/// Per replica: one full-attention group, or a hybrid layout of 1-3 groups.
fn layouts() -> impl Strategy<Value = Layouts> {
    let layout = prop_oneof![
        2 => Just(vec![Kind::Full]),
        3 => prop::collection::vec(kind(), 1..=3),
    ];
    prop::array::uniform4(layout)
}

fn request() -> impl Strategy<Value = Request> {
    (0..CONVS, 0..=BLOCKS, prop::collection::vec(0u32..3, 0..3))
        .prop_map(|(conv, prefix, tail)| Request { conv, prefix, tail })
}

fn store_op() -> impl Strategy<Value = Op> {
    (
        0..REPLICAS,
        0..CONVS,
        prop_oneof![2 => Just(0usize), 3 => 0..BLOCKS],
        1..=BLOCKS,
        medium(),
        group(),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(r, conv, start, len, medium, group, malformed)| Op::Store {
                r,
                conv,
                start,
                len: len.min(BLOCKS - start),
                medium,
                group,
                malformed: malformed && start == 0,
            },
        )
}

fn remove_op() -> impl Strategy<Value = Op> {
    (
        0..REPLICAS,
        0..CONVS,
        prop::collection::vec(0..BLOCKS, 1..4),
        medium(),
        group(),
    )
        .prop_map(|(r, conv, blocks, medium, group)| Op::Remove {
            r,
            conv,
            blocks,
            medium,
            group,
        })
}

/// Events and replica clears (no predictions, no clock).
fn event_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => store_op(),
        5 => remove_op(),
        1 => (0..REPLICAS).prop_map(Op::AllBlocksCleared),
        1 => (0..REPLICAS).prop_map(Op::ClearReplica),
        1 => (0..REPLICAS).prop_map(Op::RemoveReplica),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => store_op(),
        5 => remove_op(),
        1 => (0..REPLICAS).prop_map(Op::AllBlocksCleared),
        1 => (0..REPLICAS).prop_map(Op::ClearReplica),
        1 => (0..REPLICAS).prop_map(Op::RemoveReplica),
        3 => (0..REPLICAS, request(), 0u64..3000).prop_map(|(r, req, ttl)| Op::Predict { r, req, ttl }),
        2 => (0u64..2000, any::<bool>()).prop_map(|(ms, expire)| Op::Tick { ms, expire }),
    ]
}

/// The clean-room model.
#[derive(Debug, Default)]
struct Reference {
    /// Engine-hash salt of each replica.
    salts: [u64; REPLICAS],
    /// (replica, KV cache group, block) -> medium bits the group holds the block on (never 0).
    held: HashMap<(usize, usize, RouterKey), u8>,
    /// GPU copies beyond the first of a held block: a chain with a parent naming a block its
    /// group holds on GPU is computed again into a second block (at most 31 counted).
    extra_copies: HashMap<(usize, usize, RouterKey), u32>,
    /// Replica -> its KV cache groups as its accepted `BlockStored` events described them.
    layouts: HashMap<usize, BTreeMap<usize, Kind>>,
    /// Engine hash -> the live block it names: every hash reported for a block since the block
    /// last had no holder (replicas hashing differently add aliases).
    names: HashMap<u64, RouterKey>,
    /// (replica, block) -> expiry (ms) of the prediction that the replica will hold it on GPU
    /// (in every group).
    predicted: HashMap<(usize, RouterKey), u64>,
}

/// The tiers in the order the engine serves them.
const TIERS: [Tier; 4] = [Tier::Gpu, Tier::Predicted, Tier::Cpu, Tier::Storage];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    Gpu,
    Predicted,
    Cpu,
    Storage,
}

/// vLLM's `FullAttentionManager.find_longest_cache_hit`: the leading run of cached blocks below
/// `max_blocks`.
fn full_attention_hit(max_blocks: usize, cached: &dyn Fn(usize) -> bool) -> usize {
    (0..max_blocks).take_while(|&i| cached(i)).count()
}

/// vLLM's `SlidingWindowManager.find_longest_cache_hit` (no EAGLE, equal block sizes): scan
/// from the right for `ceil((window - 1) / block_size)` contiguous cached blocks; the hit ends
/// after them. Without such a run, the leading run of cached blocks is the hit.
fn sliding_window_hit(window: u32, max_blocks: usize, cached: &dyn Fn(usize) -> bool) -> usize {
    let needed = (window as usize - 1).div_ceil(BS);
    let mut contiguous = 0;
    for i in (0..max_blocks).rev() {
        if cached(i) {
            contiguous += 1;
            if contiguous >= needed {
                return i + contiguous;
            }
        } else {
            contiguous = 0;
        }
    }
    contiguous
}

/// vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`: every group lowers the candidate
/// length to its own longest hit below it, until no group lowers it.
fn hybrid_hit(
    groups: &BTreeMap<usize, Kind>,
    max_blocks: usize,
    cached: &dyn Fn(usize, usize) -> bool,
) -> usize {
    let mut hit = max_blocks;
    loop {
        let before = hit;
        for (&g, &kind) in groups {
            let in_group = |i: usize| cached(g, i);
            hit = match kind {
                Kind::Full => full_attention_hit(hit, &in_group),
                Kind::Window(w) => sliding_window_hit(w, hit, &in_group),
                Kind::Mamba => unreachable!("never learned"),
            };
        }
        if hit == before {
            return hit;
        }
    }
}

impl Reference {
    /// Forgets the engine hashes of blocks no replica holds any more.
    fn drop_dead_names(&mut self) {
        let live: Vec<RouterKey> = self.held.keys().map(|&(_, _, k)| k).collect();
        self.names.retain(|_, k| live.contains(k));
    }

    /// Whether an event of `r` in `group` (announcing `kind`) is ignored: a group id beyond the
    /// index's range or a kind whose hit rule is not modelled.
    fn ignores(group: usize, kind: Option<Kind>) -> bool {
        group >= 32 || kind == Some(Kind::Mamba)
    }

    fn store(
        &mut self,
        keys: &[Vec<RouterKey>],
        layouts: &Layouts,
        op: &Op,
    ) -> Result<ApplyOutcome, IndexError> {
        let Op::Store {
            r,
            conv,
            start,
            len,
            medium,
            group,
            ..
        } = *op
        else {
            unreachable!()
        };
        let (g, kind) = resolve(layouts, r, group);
        let mut out = ApplyOutcome::default();
        if Self::ignores(g, kind) {
            out.ignored = true;
            return Ok(out);
        }
        if start > 0 {
            let parent = eh(conv, start - 1, self.salts[r]);
            if !self.names.contains_key(&parent) {
                return Err(IndexError::ParentUnknown {
                    replica: r as u32,
                    parent,
                    blocks: len,
                });
            }
        }
        self.layouts
            .entry(r)
            .or_default()
            .insert(g, kind.unwrap_or(Kind::Full));
        for (b, &key) in keys[conv].iter().enumerate().skip(start).take(len) {
            // The replica's first GPU copy of a block another replica holds on GPU: prefill
            // computed twice.
            let on_gpu = |holder: &dyn Fn(usize, usize) -> bool| {
                self.held
                    .iter()
                    .any(|(&(hr, hg, k), &m)| k == key && m & MEDIA_GPU != 0 && holder(hr, hg))
            };
            let duplicate = bit(medium) == MEDIA_GPU
                && on_gpu(&|hr, _| hr != r)
                && !on_gpu(&|hr, hg| hr == r && hg != g);
            let media = self.held.entry((r, g, key)).or_insert(0);
            if *media & bit(medium) != 0 {
                out.refreshed += 1;
                if start > 0 && bit(medium) == MEDIA_GPU {
                    let n = self.extra_copies.entry((r, g, key)).or_insert(0);
                    *n = (*n + 1).min(31);
                }
            } else {
                *media |= bit(medium);
                out.stored += 1;
                if duplicate {
                    out.duplicated += 1;
                }
            }
            self.names.insert(eh(conv, b, self.salts[r]), key);
            if self.predicted.remove(&(r, key)).is_some() {
                out.predicted_replaced += 1;
            }
        }
        Ok(out)
    }

    fn remove(&mut self, layouts: &Layouts, op: &Op) -> ApplyOutcome {
        let Op::Remove {
            r,
            conv,
            ref blocks,
            medium,
            group,
        } = *op
        else {
            unreachable!()
        };
        // Removals carry no kind: only the group id decides whether they are indexed.
        let (g, _) = resolve(layouts, r, group);
        let mut out = ApplyOutcome::default();
        if Self::ignores(g, None) {
            out.ignored = true;
            return out;
        }
        for &b in blocks {
            let named = self.names.get(&eh(conv, b, self.salts[r])).copied();
            let copies = named.and_then(|k| self.extra_copies.get_mut(&(r, g, k)));
            if let (Some(n), MEDIA_GPU) = (copies, bit(medium)) {
                if *n > 0 {
                    *n -= 1;
                    out.removed += 1;
                    continue;
                }
            }
            let media = named.and_then(|k| self.held.get_mut(&(r, g, k)));
            match media {
                Some(m) if *m & bit(medium) != 0 => {
                    *m &= !bit(medium);
                    if *m == 0 {
                        self.held.remove(&(r, g, named.expect("named")));
                        self.drop_dead_names();
                    }
                    out.removed += 1;
                }
                _ => out.remove_unknown += 1,
            }
        }
        out
    }

    /// Forgets every block (in every group) and prediction of `r`; returns the
    /// (block, replica, group) entries removed. Its layout stays (the model did not change).
    fn clear(&mut self, r: usize) -> u64 {
        let before = self.held.len();
        self.held.retain(|&(hr, _, _), _| hr != r);
        self.extra_copies.retain(|&(hr, _, _), _| hr != r);
        self.predicted.retain(|&(pr, _), _| pr != r);
        self.drop_dead_names();
        (before - self.held.len()) as u64
    }

    /// Clears `r` and forgets its layout.
    fn remove_replica(&mut self, r: usize) -> u64 {
        self.layouts.remove(&r);
        self.clear(r)
    }

    /// Drops predictions expired at `now` (what the index does on insert and `expire_predicted`).
    fn prune(&mut self, now: u64) {
        self.predicted.retain(|_, &mut exp| exp > now);
    }

    /// Whether every group `r` reported holds `key` on GPU (no groups: no).
    fn on_gpu_everywhere(&self, r: usize, key: RouterKey) -> bool {
        self.layouts.get(&r).is_some_and(|groups| {
            groups.keys().all(|&g| {
                self.held
                    .get(&(r, g, key))
                    .is_some_and(|m| m & MEDIA_GPU != 0)
            })
        })
    }

    fn predict(&mut self, r: usize, keys: &[RouterKey], now: u64, ttl: u64) -> usize {
        self.prune(now);
        let mut n = 0;
        for &key in keys {
            if !self.on_gpu_everywhere(r, key) {
                let exp = self.predicted.entry((r, key)).or_insert(0);
                *exp = (*exp).max(now + ttl);
                n += 1;
            }
        }
        self.prune(now);
        n
    }

    fn media(&self, r: usize, g: usize, key: RouterKey) -> u8 {
        self.held.get(&(r, g, key)).copied().unwrap_or(0)
    }

    fn is_predicted(&self, r: usize, key: RouterKey, now: u64) -> bool {
        self.predicted.get(&(r, key)).is_some_and(|&exp| exp > now)
    }

    /// Whether block `key` of replica `r` (group 0) is served from `tier`. A block already on GPU
    /// after a predicted one counts as predicted: it is GPU-to-be, reachable once the predicted
    /// blocks before it are computed.
    fn serves(&self, tier: Tier, r: usize, key: RouterKey, now: u64) -> bool {
        let media = self.media(r, 0, key);
        match tier {
            Tier::Gpu => media & MEDIA_GPU != 0,
            Tier::Predicted => self.is_predicted(r, key, now) || media & MEDIA_GPU != 0,
            Tier::Cpu => media & MEDIA_CPU != 0,
            Tier::Storage => media & MEDIA_STORAGE != 0,
        }
    }

    /// The layout of `r` when it is hybrid: anything but a lone full-attention group 0.
    fn hybrid_layout(&self, r: usize) -> Option<&BTreeMap<usize, Kind>> {
        self.layouts
            .get(&r)
            .filter(|l| !(l.len() == 1 && l.get(&0) == Some(&Kind::Full)))
    }

    /// The tier walk of a replica with one full-attention group.
    fn walk(&self, r: usize, keys: &[RouterKey], now: u64) -> ReplicaMatch {
        let mut m = ReplicaMatch {
            replica: r as u32,
            ..ReplicaMatch::default()
        };
        let mut tier = Tier::Gpu;
        for &key in keys {
            // Tiers only go down: the first tier from the current one that serves the block.
            let Some(t) = TIERS
                .into_iter()
                .filter(|&t| t >= tier)
                .find(|&t| self.serves(t, r, key, now))
            else {
                break;
            };
            tier = t;
            match t {
                Tier::Gpu => m.gpu += 1,
                Tier::Predicted => m.predicted += 1,
                Tier::Cpu => m.cpu += 1,
                Tier::Storage => m.storage += 1,
            }
        }
        m
    }

    /// vLLM's hybrid hit on GPU blocks, then on GPU or predicted blocks (the predicted tier).
    /// Offloaded tiers are not modelled for hybrid layouts.
    fn hybrid(
        &self,
        r: usize,
        groups: &BTreeMap<usize, Kind>,
        keys: &[RouterKey],
        now: u64,
    ) -> ReplicaMatch {
        let gpu = |g: usize, i: usize| self.media(r, g, keys[i]) & MEDIA_GPU != 0;
        let on_gpu = hybrid_hit(groups, keys.len(), &gpu);
        let with_predicted = hybrid_hit(groups, keys.len(), &|g, i| {
            gpu(g, i) || self.is_predicted(r, keys[i], now)
        });
        ReplicaMatch {
            replica: r as u32,
            gpu: on_gpu as u32,
            predicted: (with_predicted - on_gpu) as u32,
            ..ReplicaMatch::default()
        }
    }

    fn lookup(&self, keys: &[RouterKey], now: u64) -> Vec<ReplicaMatch> {
        (0..REPLICAS)
            .map(|r| match self.hybrid_layout(r) {
                Some(groups) => self.hybrid(r, groups, keys, now),
                None => self.walk(r, keys, now),
            })
            .filter(|m| m.total() > 0)
            .collect()
    }

    fn group_holders(&self, key: RouterKey) -> Vec<(u32, u8, u8)> {
        let mut v: Vec<(u32, u8, u8)> = self
            .held
            .iter()
            .filter(|(&(_, _, k), _)| k == key)
            .map(|(&(r, g, _), &m)| (r as u32, g as u8, m))
            .collect();
        v.sort_unstable();
        v
    }

    /// Per replica: the media of all its groups.
    fn holders(&self, key: RouterKey) -> Vec<(u32, u8)> {
        let mut per: BTreeMap<u32, u8> = BTreeMap::new();
        for (r, _, m) in self.group_holders(key) {
            *per.entry(r).or_default() |= m;
        }
        per.into_iter().collect()
    }

    /// `r`'s layout as the index reports it (index = group id).
    fn layout(&self, r: usize) -> Vec<Option<LearnedGroup>> {
        let Some(groups) = self.layouts.get(&r) else {
            return Vec::new();
        };
        let mut v = vec![None; groups.keys().max().map_or(0, |&g| g + 1)];
        for (&g, &kind) in groups {
            v[g] = Some(LearnedGroup {
                kind: match kind {
                    Kind::Full => GroupKind::FullAttention,
                    Kind::Window(window) => GroupKind::SlidingWindow { window },
                    Kind::Mamba => unreachable!("never learned"),
                },
                block_size: BS as u32,
            });
        }
        v
    }
}

/// `group_idx` as vLLM sends it (group 0 as `None`, as older vLLM does) and the kind fields.
fn group_fields(g: usize, kind: Option<Kind>) -> (Option<i64>, Option<String>, Option<i64>) {
    let (name, window) = match kind {
        None => (None, None),
        Some(Kind::Full) => (Some("full_attention"), None),
        Some(Kind::Window(w)) => (Some("sliding_window"), Some(i64::from(w))),
        Some(Kind::Mamba) => (Some("mamba"), None),
    };
    ((g != 0).then_some(g as i64), name.map(Into::into), window)
}

fn stored_event(op: &Op, salts: &[u64; REPLICAS], layouts: &Layouts) -> KvEvent {
    let Op::Store {
        r,
        conv,
        start,
        len,
        medium,
        group,
        malformed,
    } = *op
    else {
        unreachable!()
    };
    let blocks = start..start + len;
    let mut token_ids: Vec<u32> = blocks.clone().flat_map(|b| block_tokens(conv, b)).collect();
    if malformed {
        token_ids.pop();
    }
    let (g, kind) = resolve(layouts, r, group);
    let (group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window) = group_fields(g, kind);
    KvEvent::BlockStored(BlockStored {
        block_hashes: blocks
            .map(|b| WireBlockHash::Int(eh(conv, b, salts[r])))
            .collect(),
        parent_block_hash: (start > 0).then(|| WireBlockHash::Int(eh(conv, start - 1, salts[r]))),
        token_ids,
        block_size: BS as u32,
        medium,
        group_idx,
        kv_cache_spec_kind,
        kv_cache_spec_sliding_window,
        ..BlockStored::default()
    })
}

fn removed_event(op: &Op, salts: &[u64; REPLICAS], layouts: &Layouts) -> KvEvent {
    let Op::Remove {
        r,
        conv,
        ref blocks,
        medium,
        group,
    } = *op
    else {
        unreachable!()
    };
    let (g, _) = resolve(layouts, r, group);
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: blocks
            .iter()
            .map(|&b| WireBlockHash::Int(eh(conv, b, salts[r])))
            .collect(),
        medium,
        group_idx: group_fields(g, None).0,
        ..BlockRemoved::default()
    })
}

/// Applies `ops` to a fresh index and reference, comparing them after every step.
fn check(ops: &[Op], requests: &[Request], layouts: &Layouts) -> Result<(), TestCaseError> {
    let keys: Vec<Vec<RouterKey>> = (0..CONVS).map(conv_keys).collect();
    let request_keys: Vec<Vec<RouterKey>> = requests.iter().map(Request::keys).collect();
    let mut ix = KvIndex::default();
    let mut re = Reference {
        salts: SALT,
        ..Reference::default()
    };
    let mut now = 1_000u64;
    for (step, op) in ops.iter().enumerate() {
        match op {
            &Op::Store {
                r,
                group,
                malformed: true,
                ..
            } if {
                let (g, kind) = resolve(layouts, r, group);
                !Reference::ignores(g, kind)
            } =>
            {
                let got = ix.apply(op_replica(op), &stored_event(op, &SALT, layouts));
                prop_assert!(
                    matches!(got, Err(IndexError::InvalidEvent { .. })),
                    "step {step} {op:?}: {got:?}"
                );
            }
            Op::Store { .. } => {
                let got = ix.apply(op_replica(op), &stored_event(op, &SALT, layouts));
                prop_assert_eq!(got, re.store(&keys, layouts, op), "step {} {:?}", step, op);
            }
            Op::Remove { .. } => {
                let got = ix.apply(op_replica(op), &removed_event(op, &SALT, layouts));
                prop_assert_eq!(got, Ok(re.remove(layouts, op)), "step {} {:?}", step, op);
            }
            &Op::AllBlocksCleared(r) => {
                let got = ix.apply(r as u32, &KvEvent::AllBlocksCleared);
                let want = ApplyOutcome {
                    cleared: re.clear(r),
                    ..ApplyOutcome::default()
                };
                prop_assert_eq!(got, Ok(want), "step {} {:?}", step, op);
            }
            &Op::ClearReplica(r) => {
                prop_assert_eq!(ix.clear_replica(r as u32), re.clear(r), "step {}", step);
            }
            &Op::RemoveReplica(r) => {
                prop_assert_eq!(
                    ix.remove_replica(r as u32),
                    re.remove_replica(r),
                    "step {}",
                    step
                );
            }
            Op::Predict { r, req, ttl } => {
                let k = req.keys();
                let got = ix.insert_predicted(*r as u32, &k, now, *ttl);
                prop_assert_eq!(got, Ok(re.predict(*r, &k, now, *ttl)), "step {}", step);
            }
            &Op::Tick { ms, expire } => {
                now += ms;
                if expire {
                    ix.expire_predicted(now);
                    re.prune(now);
                }
            }
        }
        compare(&ix, &re, &keys, &request_keys, now, step)?;
    }
    Ok(())
}

fn op_replica(op: &Op) -> u32 {
    match op {
        Op::Store { r, .. } | Op::Remove { r, .. } => *r as u32,
        _ => unreachable!(),
    }
}

fn compare(
    ix: &KvIndex,
    re: &Reference,
    keys: &[Vec<RouterKey>],
    requests: &[Vec<RouterKey>],
    now: u64,
    step: usize,
) -> Result<(), TestCaseError> {
    for r in 0..REPLICAS {
        prop_assert_eq!(
            ix.layout(r as u32).to_vec(),
            re.layout(r),
            "step {}: layout of replica {}",
            step,
            r
        );
    }
    for (c, k) in keys.iter().enumerate() {
        prop_assert_eq!(
            ix.lookup(k, now),
            re.lookup(k, now),
            "step {}: conversation {}",
            step,
            c
        );
        for (b, &key) in k.iter().enumerate() {
            prop_assert_eq!(
                ix.group_holders(key),
                re.group_holders(key),
                "step {}: group holders of block {} of {}",
                step,
                b,
                c
            );
            prop_assert_eq!(
                ix.holders(key),
                re.holders(key),
                "step {}: holders of block {} of {}",
                step,
                b,
                c
            );
            for salt in SALT {
                let h = eh(c, b, salt);
                prop_assert_eq!(
                    ix.key_of_engine_hash(h),
                    re.names.get(&h).copied(),
                    "step {}: engine hash of block {} of {} (salt {:#x})",
                    step,
                    b,
                    c,
                    salt
                );
            }
        }
    }
    for (i, k) in requests.iter().enumerate() {
        prop_assert_eq!(
            ix.lookup(k, now),
            re.lookup(k, now),
            "step {}: request {}",
            step,
            i
        );
    }
    let s = ix.stats();
    let mut blocks: Vec<RouterKey> = re.held.keys().map(|&(_, _, k)| k).collect();
    blocks.sort_unstable();
    blocks.dedup();
    prop_assert_eq!(
        (s.blocks, s.entries, s.predicted_entries),
        (
            blocks.len() as u64,
            re.held.len() as u64,
            re.predicted.len() as u64
        ),
        "step {}: blocks, entries, predictions",
        step
    );
    // The sequences stay under the bounds: the reference models no eviction.
    prop_assert_eq!(
        (
            s.evicted_for_budget,
            s.dropped_for_budget,
            s.predicted_evicted
        ),
        (0, 0, 0)
    );
    Ok(())
}

/// Registers every replica and every (replica, KV cache group) the case's events can name (so the
/// replica tables and layouts, which the budget does not bound, are full-size before the budget
/// is measured): one block stored in each group and removed again, on the index and the
/// reference alike.
fn register(ix: &mut KvIndex, re: &mut Reference, layouts: &Layouts) {
    let keys: Vec<Vec<RouterKey>> = (0..CONVS).map(conv_keys).collect();
    for r in 0..REPLICAS {
        ix.insert_predicted(r as u32, &[], 0, 0).expect("registers");
        for group in [0, 1, 2, OUTSIDE_GROUP] {
            let store = Op::Store {
                r,
                conv: CONVS - 1,
                start: 0,
                len: 1,
                medium: None,
                group,
                malformed: false,
            };
            let remove = Op::Remove {
                r,
                conv: CONVS - 1,
                blocks: vec![0],
                medium: None,
                group,
            };
            // Under a small budget the index may refuse a new group's bookkeeping: the
            // reference then does not learn that group either.
            if ix
                .apply(r as u32, &stored_event(&store, &re.salts, layouts))
                .is_ok()
            {
                let _ = re.store(&keys, layouts, &store);
            }
            let _ = ix.apply(r as u32, &removed_event(&remove, &re.salts, layouts));
            re.remove(layouts, &remove);
        }
    }
}

/// What the index allocates with every replica registered and one block stored, plus `slack`
/// bytes: room for a few dozen blocks (the tables stop doubling), far fewer than the key space.
fn small_budget(slack: usize, layouts: &Layouts) -> usize {
    let mut ix = KvIndex::default();
    let mut re = Reference {
        salts: UNIFORM,
        ..Reference::default()
    };
    register(&mut ix, &mut re, layouts);
    let one = Op::Store {
        r: 0,
        conv: 0,
        start: 0,
        len: 1,
        medium: None,
        group: 0,
        malformed: false,
    };
    ix.apply(0, &stored_event(&one, &UNIFORM, layouts))
        .expect("stores");
    ix.stats().bytes_estimate as usize + slack
}

/// Under a budget the index evicts whole blocks (CLOCK, not modelled): it may only forget. After
/// every step it stays under the budget, every holding it reports is one the reference has,
/// every replica's match is no longer than the reference's (vLLM's hit only shrinks as blocks
/// go), and its counters agree with itself.
fn check_bounded(
    ops: &[Op],
    requests: &[Request],
    slack: usize,
    layouts: &Layouts,
) -> Result<u64, TestCaseError> {
    let keys: Vec<Vec<RouterKey>> = (0..CONVS).map(conv_keys).collect();
    let mut lookups: Vec<Vec<RouterKey>> = requests.iter().map(Request::keys).collect();
    lookups.extend(keys.iter().cloned());
    let max_bytes = small_budget(slack, layouts);
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes,
        ..IndexConfig::default()
    });
    let mut re = Reference {
        salts: UNIFORM,
        ..Reference::default()
    };
    register(&mut ix, &mut re, layouts);
    for (step, op) in ops.iter().enumerate() {
        match op {
            &Op::Store { r, malformed, .. } => {
                // Results differ once the index has evicted a parent: not compared, and an event
                // the index rejected (its parent evicted) is not applied to the reference either
                // (it would learn a KV cache group the index did not).
                let got = ix.apply(r as u32, &stored_event(op, &UNIFORM, layouts));
                if !malformed && got.is_ok() {
                    let _ = re.store(&keys, layouts, op);
                }
            }
            &Op::Remove { r, .. } => {
                let _ = ix.apply(r as u32, &removed_event(op, &UNIFORM, layouts));
                re.remove(layouts, op);
            }
            &Op::AllBlocksCleared(r) => {
                let _ = ix.apply(r as u32, &KvEvent::AllBlocksCleared);
                re.clear(r);
            }
            &Op::ClearReplica(r) => {
                ix.clear_replica(r as u32);
                re.clear(r);
            }
            &Op::RemoveReplica(r) => {
                ix.remove_replica(r as u32);
                re.remove_replica(r);
            }
            Op::Predict { .. } | Op::Tick { .. } => unreachable!("event_op() makes neither"),
        }
        let s = ix.stats();
        prop_assert!(s.bytes_estimate <= max_bytes as u64, "step {step}: {s:?}");
        let (mut blocks, mut entries) = (0u64, 0u64);
        for (c, k) in keys.iter().enumerate() {
            for (b, &key) in k.iter().enumerate() {
                let held = ix.group_holders(key);
                for &(r, g, media) in &held {
                    let want = re.media(r as usize, usize::from(g), key);
                    prop_assert!(
                        media & !want == 0,
                        "step {step}: replica {r} holds block {b} of {c} in group {g} on {media:#b}, the reference on {want:#b}"
                    );
                }
                // Shared blocks appear under several conversations: count each once.
                if canonical(c, b) == c {
                    blocks += u64::from(!held.is_empty());
                    entries += held.len() as u64;
                }
            }
        }
        prop_assert_eq!((s.blocks, s.entries), (blocks, entries), "step {}", step);
        let per_replica: u64 = ix.replicas().iter().map(|&(_, n)| n).sum();
        prop_assert_eq!(per_replica, s.entries, "step {}", step);
        for k in &lookups {
            let want = re.lookup(k, 0);
            for m in ix.lookup(k, 0) {
                let most = want
                    .iter()
                    .find(|w| w.replica == m.replica)
                    .map_or(0, ReplicaMatch::total);
                prop_assert!(
                    m.total() <= most,
                    "step {step}: index {m:?}, reference {want:?}"
                );
            }
        }
    }
    Ok(ix.stats().evicted_for_budget)
}

fn config() -> proptest::test_runner::Config {
    kvroute_testkit::cases::config(256, None)
}

proptest! {
    #![proptest_config(config())]

    /// Every step of a random event sequence leaves the index and the reference agreeing.
    #[test]
    fn index_agrees_with_a_clean_room_reference(
        ops in prop::collection::vec(op(), 1..80),
        requests in prop::collection::vec(request(), 1..6),
        layouts in layouts(),
    ) {
        check(&ops, &requests, &layouts)?;
    }

    /// Under a small budget, eviction only ever forgets.
    #[test]
    fn a_bounded_index_only_forgets(
        ops in prop::collection::vec(event_op(), 1..120),
        requests in prop::collection::vec(request(), 1..6),
        slack in 0usize..2048,
        layouts in layouts(),
    ) {
        check_bounded(&ops, &requests, slack, &layouts)?;
    }
}

/// The budget of `a_bounded_index_only_forgets` binds: storing every conversation on every
/// replica evicts, and the checks hold through it.
#[test]
fn the_small_budget_evicts() {
    let ops: Vec<Op> = (0..REPLICAS)
        .flat_map(|r| {
            (0..CONVS).map(move |conv| Op::Store {
                r,
                conv,
                start: 0,
                len: BLOCKS,
                medium: None,
                group: 0,
                malformed: false,
            })
        })
        .collect();
    let evicted = check_bounded(&ops, &[], 0, &plain_layouts()).expect("bounded checks hold");
    assert!(evicted > 0, "nothing evicted: the budget does not bind");
}
