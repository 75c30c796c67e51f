//! Differential test of the exact index (`kvroute_indexer::index::KvIndex`) against a clean-room
//! reference written from its documented semantics (docs/index.md, the `KvIndex` doc comments),
//! not from its code: a map `(replica, router key) -> medium bits`, a map of the engine hashes that
//! name a live block, and a map of predictions with their expiry. The lookup walks the request's
//! keys one by one per replica through the tiers GPU -> predicted -> CPU -> storage.
//!
//! Generated cases: random event sequences from 4 replicas (two hashing alike, two with their own
//! engine hashes, so the index keeps aliases) over 4 conversations of 8 blocks that share leading
//! blocks with conversation 0 (so prefixes overlap across conversations and replicas): stores from
//! block 0 or chained from a parent (known or not), removals of any blocks (middle ones included,
//! repeated hashes), `AllBlocksCleared`, stream clears (`clear_replica`), `remove_replica`,
//! events of another KV cache group, malformed events, predictions with a TTL on requests with
//! random tails, and a clock that moves on (with `expire_predicted`). After every step, the
//! event's outcome (or error), `lookup` of every conversation and of the case's random requests,
//! `holders` of every block, `key_of_engine_hash` of every engine hash and the block, entry and
//! prediction counts must equal the reference's.
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

use kvroute_core::events::{BlockRemoved, BlockStored, KvEvent, Medium, WireBlockHash};
use kvroute_core::hashing::{ExtraKeyStyle, RequestExtras};
use kvroute_core::router_key::{request_keys, RouterKey};
use kvroute_indexer::index::{
    ApplyOutcome, IndexConfig, IndexError, KvIndex, ReplicaMatch, MEDIA_CPU, MEDIA_GPU,
    MEDIA_STORAGE,
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
        other_group: bool,
        /// One token short: `InvalidEvent`, nothing changes (only generated with `start == 0`).
        malformed: bool,
    },
    /// `BlockRemoved` of these blocks of `conv`.
    Remove {
        r: usize,
        conv: usize,
        blocks: Vec<usize>,
        medium: Option<Medium>,
        other_group: bool,
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
        prop::bool::weighted(0.05),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(r, conv, start, len, medium, other_group, malformed)| Op::Store {
                r,
                conv,
                start,
                len: len.min(BLOCKS - start),
                medium,
                other_group,
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
        prop::bool::weighted(0.05),
    )
        .prop_map(|(r, conv, blocks, medium, other_group)| Op::Remove {
            r,
            conv,
            blocks,
            medium,
            other_group,
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
    /// (replica, block) -> medium bits the replica holds the block on (never 0).
    held: HashMap<(usize, RouterKey), u8>,
    /// Engine hash -> the live block it names: every hash reported for a block since the block
    /// last had no holder (replicas hashing differently add aliases).
    names: HashMap<u64, RouterKey>,
    /// (replica, block) -> expiry (ms) of the prediction that the replica will hold it on GPU.
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

impl Reference {
    /// Forgets the engine hashes of blocks no replica holds any more.
    fn drop_dead_names(&mut self) {
        let live: Vec<RouterKey> = self.held.keys().map(|&(_, k)| k).collect();
        self.names.retain(|_, k| live.contains(k));
    }

    fn store(&mut self, keys: &[Vec<RouterKey>], op: &Op) -> Result<ApplyOutcome, IndexError> {
        let Op::Store {
            r,
            conv,
            start,
            len,
            medium,
            other_group,
            ..
        } = *op
        else {
            unreachable!()
        };
        let mut out = ApplyOutcome::default();
        if other_group {
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
        for (b, &key) in keys[conv].iter().enumerate().skip(start).take(len) {
            // A new GPU copy of a block another replica holds on GPU: prefill computed twice.
            let held_elsewhere = bit(medium) == MEDIA_GPU
                && (0..REPLICAS).any(|o| {
                    o != r && self.held.get(&(o, key)).is_some_and(|m| m & MEDIA_GPU != 0)
                });
            let media = self.held.entry((r, key)).or_insert(0);
            if *media & bit(medium) != 0 {
                out.refreshed += 1;
            } else {
                *media |= bit(medium);
                out.stored += 1;
                if held_elsewhere {
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

    fn remove(&mut self, op: &Op) -> ApplyOutcome {
        let Op::Remove {
            r,
            conv,
            ref blocks,
            medium,
            other_group,
        } = *op
        else {
            unreachable!()
        };
        let mut out = ApplyOutcome::default();
        if other_group {
            out.ignored = true;
            return out;
        }
        for &b in blocks {
            let named = self.names.get(&eh(conv, b, self.salts[r])).copied();
            let media = named.and_then(|k| self.held.get_mut(&(r, k)));
            match media {
                Some(m) if *m & bit(medium) != 0 => {
                    *m &= !bit(medium);
                    if *m == 0 {
                        self.held.remove(&(r, named.expect("named")));
                        self.drop_dead_names();
                    }
                    out.removed += 1;
                }
                _ => out.remove_unknown += 1,
            }
        }
        out
    }

    /// Forgets every block and prediction of `r`; returns the (block, replica) entries removed.
    fn clear(&mut self, r: usize) -> u64 {
        let before = self.held.len();
        self.held.retain(|&(hr, _), _| hr != r);
        self.predicted.retain(|&(pr, _), _| pr != r);
        self.drop_dead_names();
        (before - self.held.len()) as u64
    }

    /// Drops predictions expired at `now` (what the index does on insert and `expire_predicted`).
    fn prune(&mut self, now: u64) {
        self.predicted.retain(|_, &mut exp| exp > now);
    }

    fn predict(&mut self, r: usize, keys: &[RouterKey], now: u64, ttl: u64) -> usize {
        self.prune(now);
        let mut n = 0;
        for &key in keys {
            let on_gpu = self.held.get(&(r, key)).is_some_and(|m| m & MEDIA_GPU != 0);
            if !on_gpu {
                let exp = self.predicted.entry((r, key)).or_insert(0);
                *exp = (*exp).max(now + ttl);
                n += 1;
            }
        }
        self.prune(now);
        n
    }

    /// Whether block `key` of replica `r` is served from `tier`. A block already on GPU after a
    /// predicted one counts as predicted: it is GPU-to-be, reachable once the predicted blocks
    /// before it are computed.
    fn serves(&self, tier: Tier, r: usize, key: RouterKey, now: u64) -> bool {
        let media = self.held.get(&(r, key)).copied().unwrap_or(0);
        let predicted = self.predicted.get(&(r, key)).is_some_and(|&exp| exp > now);
        match tier {
            Tier::Gpu => media & MEDIA_GPU != 0,
            Tier::Predicted => predicted || media & MEDIA_GPU != 0,
            Tier::Cpu => media & MEDIA_CPU != 0,
            Tier::Storage => media & MEDIA_STORAGE != 0,
        }
    }

    fn lookup(&self, keys: &[RouterKey], now: u64) -> Vec<ReplicaMatch> {
        let mut out = Vec::new();
        for r in 0..REPLICAS {
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
            if m.total() > 0 {
                out.push(m);
            }
        }
        out
    }

    fn holders(&self, key: RouterKey) -> Vec<(u32, u8)> {
        let mut v: Vec<(u32, u8)> = self
            .held
            .iter()
            .filter(|(&(_, k), _)| k == key)
            .map(|(&(r, _), &m)| (r as u32, m))
            .collect();
        v.sort_unstable();
        v
    }
}

fn stored_event(op: &Op, salts: &[u64; REPLICAS]) -> KvEvent {
    let Op::Store {
        r,
        conv,
        start,
        len,
        medium,
        other_group,
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
    KvEvent::BlockStored(BlockStored {
        block_hashes: blocks
            .map(|b| WireBlockHash::Int(eh(conv, b, salts[r])))
            .collect(),
        parent_block_hash: (start > 0).then(|| WireBlockHash::Int(eh(conv, start - 1, salts[r]))),
        token_ids,
        block_size: BS as u32,
        medium,
        group_idx: other_group.then_some(1),
        ..BlockStored::default()
    })
}

fn removed_event(op: &Op, salts: &[u64; REPLICAS]) -> KvEvent {
    let Op::Remove {
        r,
        conv,
        ref blocks,
        medium,
        other_group,
    } = *op
    else {
        unreachable!()
    };
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: blocks
            .iter()
            .map(|&b| WireBlockHash::Int(eh(conv, b, salts[r])))
            .collect(),
        medium,
        group_idx: other_group.then_some(1),
        ..BlockRemoved::default()
    })
}

/// Applies `ops` to a fresh index and reference, comparing them after every step.
fn check(ops: &[Op], requests: &[Request]) -> Result<(), TestCaseError> {
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
            Op::Store {
                malformed: true,
                other_group: false,
                ..
            } => {
                let got = ix.apply(op_replica(op), &stored_event(op, &SALT));
                prop_assert!(
                    matches!(got, Err(IndexError::InvalidEvent { .. })),
                    "step {step} {op:?}: {got:?}"
                );
            }
            Op::Store { .. } => {
                let got = ix.apply(op_replica(op), &stored_event(op, &SALT));
                prop_assert_eq!(got, re.store(&keys, op), "step {} {:?}", step, op);
            }
            Op::Remove { .. } => {
                let got = ix.apply(op_replica(op), &removed_event(op, &SALT));
                prop_assert_eq!(got, Ok(re.remove(op)), "step {} {:?}", step, op);
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
                prop_assert_eq!(ix.remove_replica(r as u32), re.clear(r), "step {}", step);
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
    let mut blocks: Vec<RouterKey> = re.held.keys().map(|&(_, k)| k).collect();
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

/// Registers every replica (so the replica tables, which the budget does not bound, are full-size
/// before the budget is measured).
fn register(ix: &mut KvIndex) {
    for r in 0..REPLICAS {
        ix.insert_predicted(r as u32, &[], 0, 0).expect("registers");
    }
}

/// What the index allocates with every replica registered and one block stored, plus `slack`
/// bytes: room for a few dozen blocks (the tables stop doubling), far fewer than the key space.
fn small_budget(slack: usize) -> usize {
    let mut ix = KvIndex::default();
    register(&mut ix);
    let one = Op::Store {
        r: 0,
        conv: 0,
        start: 0,
        len: 1,
        medium: None,
        other_group: false,
        malformed: false,
    };
    ix.apply(0, &stored_event(&one, &UNIFORM)).expect("stores");
    ix.stats().bytes_estimate as usize + slack
}

/// Under a budget the index evicts whole blocks (CLOCK, not modelled): it may only forget. After
/// every step it stays under the budget, every holding it reports is one the reference has,
/// every replica's match is no longer than the reference's, and its counters agree with itself.
fn check_bounded(ops: &[Op], requests: &[Request], slack: usize) -> Result<u64, TestCaseError> {
    let keys: Vec<Vec<RouterKey>> = (0..CONVS).map(conv_keys).collect();
    let mut lookups: Vec<Vec<RouterKey>> = requests.iter().map(Request::keys).collect();
    lookups.extend(keys.iter().cloned());
    let max_bytes = small_budget(slack);
    let mut ix = KvIndex::new(IndexConfig {
        max_bytes,
        ..IndexConfig::default()
    });
    register(&mut ix);
    let mut re = Reference {
        salts: UNIFORM,
        ..Reference::default()
    };
    for (step, op) in ops.iter().enumerate() {
        match op {
            &Op::Store {
                r,
                malformed,
                other_group,
                ..
            } => {
                // Results differ once the index has evicted a parent: not compared.
                let _ = ix.apply(r as u32, &stored_event(op, &UNIFORM));
                if !malformed || other_group {
                    let _ = re.store(&keys, op);
                }
            }
            &Op::Remove { r, .. } => {
                let _ = ix.apply(r as u32, &removed_event(op, &UNIFORM));
                re.remove(op);
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
                re.clear(r);
            }
            Op::Predict { .. } | Op::Tick { .. } => unreachable!("event_op() makes neither"),
        }
        let s = ix.stats();
        prop_assert!(s.bytes_estimate <= max_bytes as u64, "step {step}: {s:?}");
        let (mut blocks, mut entries) = (0u64, 0u64);
        for (c, k) in keys.iter().enumerate() {
            for (b, &key) in k.iter().enumerate() {
                let held = ix.holders(key);
                for &(r, media) in &held {
                    let want = re.held.get(&(r as usize, key)).copied().unwrap_or(0);
                    prop_assert!(
                        media & !want == 0,
                        "step {step}: replica {r} holds block {b} of {c} on {media:#b}, the reference on {want:#b}"
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
    ) {
        check(&ops, &requests)?;
    }

    /// Under a small budget, eviction only ever forgets.
    #[test]
    fn a_bounded_index_only_forgets(
        ops in prop::collection::vec(event_op(), 1..120),
        requests in prop::collection::vec(request(), 1..6),
        slack in 0usize..2048,
    ) {
        check_bounded(&ops, &requests, slack)?;
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
                other_group: false,
                malformed: false,
            })
        })
        .collect();
    let evicted = check_bounded(&ops, &[], 0).expect("bounded checks hold");
    assert!(evicted > 0, "nothing evicted: the budget does not bind");
}
