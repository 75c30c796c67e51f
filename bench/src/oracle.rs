//! The greedy oracle of a workload: the TTFTs a router would reach that knew every replica's
//! cache and prefill queue exactly and sent each request, in arrival order, to the replica where
//! its own first token comes soonest. A reference for what routing can do on the fleet's
//! separate caches, not a bound: a router that keeps capacity back for later arrivals may beat
//! it, and it prices no decode.
//!
//! Each replica is one LRU cache of its KV blocks (a request's blocks are touched there when it
//! is placed; running requests take no room) and one prefill server taking requests first come,
//! first served: a request starts when it arrives or when the replica's previous prefill ends,
//! and takes [`SimLatency::idle_ttft_ms`] for what that replica has not cached, divided by the
//! replica's speed. Ties go to the longer hit, then to the lower index.

use serde::Serialize;

use super::ideal::{IdealBound, SimLatency};
use super::policies::{block_keys, usable_blocks, LruBlocks};
use super::workloads::Workload;

/// What the greedy oracle reached on a workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GreedyOracle {
    /// Its TTFT percentiles.
    pub ttft: IdealBound,
    /// Each replica's share of the prompt tokens computed (the prefill work it placed there).
    pub prefill_shares: Vec<f64>,
}

/// One replica of the oracle's fleet.
struct Replica {
    cache: LruBlocks,
    speed: f64,
    /// When its last placed prefill ends, model ms.
    free_at_ms: f64,
    /// Prompt tokens it computed.
    computed: u64,
}

/// The oracle's TTFTs and prefill shares for `workload` on `speeds.len()` replicas of `blocks`
/// KV blocks of `block_size` tokens each (`speeds` in the simulator's `--speed` sense); `None`
/// without requests or replicas.
pub fn greedy_oracle(
    workload: &Workload,
    block_size: usize,
    blocks: usize,
    speeds: &[f64],
    model: &SimLatency,
) -> Option<GreedyOracle> {
    let mut fleet: Vec<Replica> = speeds
        .iter()
        .map(|&speed| Replica {
            cache: LruBlocks::new(blocks),
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
            free_at_ms: f64::NEG_INFINITY,
            computed: 0,
        })
        .collect();
    if fleet.is_empty() {
        return None;
    }
    let bs = block_size.max(1);
    let mut ttfts = Vec::with_capacity(workload.requests.len());
    for request in &workload.requests {
        let keys = block_keys(&request.tokens(), bs);
        let usable = usable_blocks(request, bs);
        let prompt = request.num_tokens() as u64;
        // (ttft, hit blocks, index, uncached tokens) of the best replica so far.
        let mut best: Option<(f64, usize, usize, u64)> = None;
        for (index, replica) in fleet.iter().enumerate() {
            let hit = replica.cache.cached_prefix(&keys, usable);
            let uncached = prompt.saturating_sub((hit * bs) as u64);
            let wait = (replica.free_at_ms - request.at_ms).max(0.0);
            let ttft = wait + model.idle_ttft_ms(uncached) / replica.speed;
            let better = best.is_none_or(|(t, h, _, _)| {
                ttft.total_cmp(&t).then(h.cmp(&hit)) == std::cmp::Ordering::Less
            });
            if better {
                best = Some((ttft, hit, index, uncached));
            }
        }
        let (ttft, _, index, uncached) = best?;
        let replica = &mut fleet[index];
        replica.free_at_ms = request.at_ms + ttft;
        replica.computed += uncached;
        replica.cache.touch_all(&keys);
        ttfts.push(ttft);
    }
    let computed: u64 = fleet.iter().map(|r| r.computed).sum();
    Some(GreedyOracle {
        ttft: IdealBound::of(ttfts, model)?,
        prefill_shares: fleet
            .iter()
            .map(|r| r.computed as f64 / computed.max(1) as f64)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::workloads::{workload_of, Segment};
    use super::*;

    /// `idle_ttft(x) = 5 * ceil(x / 100) + x` ms.
    fn model() -> SimLatency {
        SimLatency::round_numbers()
    }

    /// A = 96 tokens (6 blocks) at 0 ms; A + 32 at 10 ms; A + another 32 at 20 ms.
    fn workload() -> Workload {
        let a = Segment::new("a", 0, 96);
        let mut w = workload_of(vec![
            vec![a],
            vec![a, Segment::new("b", 0, 32)],
            vec![a, Segment::new("c", 0, 32)],
        ]);
        for (r, at) in w.requests.iter_mut().zip([0.0, 10.0, 20.0]) {
            r.at_ms = at;
        }
        w
    }

    fn p50_p90(b: &IdealBound) -> (f64, f64) {
        (b.p50_ms, b.p90_ms)
    }

    #[test]
    fn each_request_goes_where_its_first_token_comes_soonest() {
        // r0 takes A (101 ms, free at 101). The second finds A's 6 blocks there: wait 91 +
        // 37 = 128 against 138 cold on r1, so r0 (free at 138). The third would wait 118 + 37 on
        // r0 and takes r1 cold: 138. TTFTs 101, 128, 138.
        let o = greedy_oracle(&workload(), 16, 1_000, &[1.0, 1.0], &model()).expect("oracle");
        let b = &o.ttft;
        assert_eq!(b.p50_ms, 128.0);
        assert!((b.p90_ms - (0.2 * 128.0 + 0.8 * 138.0)).abs() < 1e-9);
        // r0 computed 96 + 32 tokens, r1 all 128 of the third.
        assert_eq!(o.prefill_shares, [0.5, 0.5]);
    }

    #[test]
    fn a_slow_replica_prefills_at_its_speed() {
        // r1 at half speed: the third request's cold 138 ms become 276, so it waits on r0 (155).
        let o = greedy_oracle(&workload(), 16, 1_000, &[1.0, 0.5], &model()).expect("oracle");
        let b = &o.ttft;
        assert_eq!(p50_p90(b).0, 128.0);
        // Everything on r0: 96 + 32 + 32 tokens.
        assert_eq!(o.prefill_shares, [1.0, 0.0]);
        assert!((b.p99_ms - (0.02 * 128.0 + 0.98 * 155.0)).abs() < 1e-9);
    }

    #[test]
    fn each_replica_keeps_only_its_own_blocks() {
        // Four blocks per replica: r0 keeps A's last four, so A's first block is gone and the
        // second request is cold everywhere: r1 at once (138 ms, free at 148); the third is cold
        // everywhere too: 81 + 138 on r0 against 128 + 138 on r1, so 219. TTFTs 101, 138, 219.
        let o = greedy_oracle(&workload(), 16, 4, &[1.0, 1.0], &model()).expect("oracle");
        assert_eq!(p50_p90(&o.ttft), (138.0, 0.2 * 138.0 + 0.8 * 219.0));
        assert!(greedy_oracle(&workload(), 16, 4, &[], &model()).is_none());
    }
}
