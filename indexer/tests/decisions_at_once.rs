//! Concurrent decisions see each other: siblings of one new prefix, routed at the same instant
//! from many threads, compute that prefix at most once per replica (the second sibling on a
//! replica finds the first one's predicted blocks there).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};

use common::*;
use kvroute_indexer::policies::Policy;
use kvroute_indexer::route::{route, RouteRequest};

const SIBLINGS: usize = 16;
const ROUNDS: u32 = 25;
/// Blocks (of 4 tokens) in each round's shared prefix.
const PREFIX_BLOCKS: u32 = 32;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_routed_at_once_compute_a_new_prefix_once_per_replica() {
    let pubs = [
        Publisher::start(0, 0).await,
        Publisher::start(0, 0).await,
        Publisher::start(0, 0).await,
    ];
    let names = ["r0", "r1", "r2"];
    let replicas: Vec<_> = names
        .iter()
        .zip(&pubs)
        .map(|(n, p)| (*n, free_port(), p.pub_port, p.replay_port, false))
        .collect();
    let state = start_indexer(&config_text(&replicas, ""), Policy::Kv);
    for n in names {
        wait_connected(&state, n).await;
    }
    for round in 0..ROUNDS {
        let prefix: Vec<u32> = (0..PREFIX_BLOCKS * 4)
            .map(|i| 1_000_000 * (round + 1) + i)
            .collect();
        let barrier = Arc::new(Barrier::new(SIBLINGS));
        let threads: Vec<_> = (0..SIBLINGS)
            .map(|sibling| {
                let (state, barrier) = (state.clone(), barrier.clone());
                let mut tokens = prefix.clone();
                tokens.extend((0..8).map(|i| 900_000_000 + sibling as u32 * 100 + i));
                std::thread::spawn(move || {
                    let req = RouteRequest {
                        model: "m".into(),
                        token_ids: Some(tokens),
                        max_tokens: Some(16),
                        ..Default::default()
                    };
                    barrier.wait();
                    route(&state, &req, None).expect("a decision")
                })
            })
            .collect();
        let mut computed: BTreeMap<String, u32> = BTreeMap::new();
        for t in threads {
            let answer = t.join().expect("sibling thread");
            let m = answer.matched_tokens;
            if m.gpu + m.cpu + m.storage + m.predicted == 0 {
                *computed.entry(answer.replica).or_default() += 1;
            }
        }
        assert!(
            computed.values().all(|&n| n <= 1),
            "round {round}: siblings computing the new prefix, per replica: {computed:?}"
        );
        assert!(!computed.is_empty(), "round {round}: nobody computed it");
    }
}
