//! In-flight accounting over the HTTP API (issue #16 item 5): decisions are keyed by the
//! indexer's `decision_id`, never by the caller's `request_id`; a route call can be abandoned by
//! its `callout_id` before or after it is decided.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::*;
use kvroute_indexer::policies::Policy;
use kvroute_indexer::state::AppState;
use serde_json::{json, Value};

async fn fleet() -> (Publisher, Publisher, Arc<AppState>, String) {
    let p0 = Publisher::start(0, 0).await;
    let p1 = Publisher::start(0, 0).await;
    let cfg = config_text(
        &[
            ("r0", free_port(), p0.pub_port, p0.replay_port, false),
            ("r1", free_port(), p1.pub_port, p1.replay_port, false),
        ],
        "",
    );
    let state = start_indexer(&cfg, Policy::RoundRobin);
    wait_connected(&state, "r0").await;
    wait_connected(&state, "r1").await;
    let base = serve_http(state.clone()).await;
    (p0, p1, state, base)
}

fn in_flight(state: &AppState) -> i64 {
    ["r0", "r1"]
        .iter()
        .map(|r| {
            state
                .fleet
                .get(r)
                .unwrap()
                .in_flight
                .load(Ordering::Relaxed)
        })
        .sum()
}

async fn post(c: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = c.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_request_ids_and_abandoned_callouts() {
    let (_p0, _p1, state, base) = fleet().await;
    let c = reqwest::Client::new();
    let route = |callout: &str| {
        json!({"model": "m", "token_ids": (1..=9).collect::<Vec<u32>>(),
               "request_id": "same", "callout_id": callout, "max_tokens": 16})
    };
    // Two requests with the same client id: two decisions, two ids, two slots.
    let (s, a) = post(&c, format!("{base}/v1/route"), route("c-a")).await;
    assert_eq!(s, 200, "{a}");
    let (_, b) = post(&c, format!("{base}/v1/route"), route("c-b")).await;
    assert_ne!(a["decision_id"], b["decision_id"]);
    assert_eq!(a["request_id"], "same");
    assert_eq!(in_flight(&state), 2);
    // Completing A releases A only.
    let (s, _) = post(
        &c,
        format!("{base}/v1/complete"),
        json!({"decision_id": a["decision_id"], "request_id": "same", "cached_tokens": 0}),
    )
    .await;
    assert_eq!(s, 204);
    assert_eq!(in_flight(&state), 1, "B still counts");
    // B's route call is abandoned by its callout id.
    let (s, _) = post(
        &c,
        format!("{base}/v1/complete"),
        json!({"callout_id": "c-b", "abandoned": true}),
    )
    .await;
    assert_eq!(s, 204);
    assert_eq!(in_flight(&state), 0);
    // An abandon that overtakes its route call: the call is answered but never counted.
    let (s, _) = post(
        &c,
        format!("{base}/v1/complete"),
        json!({"callout_id": "c-early", "abandoned": true}),
    )
    .await;
    assert_eq!(s, 204);
    let (s, late) = post(&c, format!("{base}/v1/route"), route("c-early")).await;
    assert_eq!(s, 200, "{late}");
    assert_eq!(in_flight(&state), 0, "the late call was not counted");
    // Ids that are not this process's decisions release nothing; a body without decision_id is
    // refused.
    let (_, d) = post(&c, format!("{base}/v1/route"), route("c-d")).await;
    assert_eq!(in_flight(&state), 1);
    for id in ["0-0", "garbage", ""] {
        let (s, _) = post(
            &c,
            format!("{base}/v1/complete"),
            json!({"decision_id": id}),
        )
        .await;
        assert_eq!(s, 204);
    }
    let (s, e) = post(
        &c,
        format!("{base}/v1/complete"),
        json!({"request_id": "same"}),
    )
    .await;
    assert_eq!(s, 400, "{e}");
    assert!(e["error"].as_str().unwrap().contains("decision_id"), "{e}");
    assert_eq!(in_flight(&state), 1, "d still counts");
    let (s, _) = post(
        &c,
        format!("{base}/v1/complete"),
        json!({"decision_id": d["decision_id"], "abandoned": true}),
    )
    .await;
    assert_eq!(s, 204);
    assert_eq!(in_flight(&state), 0);
    let (s, _) = post(
        &c,
        format!("{base}/v1/route"),
        json!({"model": "m", "token_ids": [1, 2], "callout_id": "x".repeat(129)}),
    )
    .await;
    assert_eq!(s, 400, "an absurd callout id is refused");
    let m = metrics_text(&c, &base).await;
    for line in [
        "kvroute_indexer_decisions_abandoned_total 1",
        "kvroute_indexer_decisions_abandoned_before_route_total 1",
        "kvroute_indexer_completions_unknown_total 3",
        "kvroute_indexer_completions_missing_id_total 1",
        "kvroute_indexer_completions_abandoned_total 3",
        "kvroute_indexer_pending_requests 0",
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_carried_by_a_route_call_are_applied_before_it_is_decided() {
    let (_p0, _p1, state, base) = fleet().await;
    let c = reqwest::Client::new();
    let route = |callout: &str, completed: Value| {
        json!({"model": "m", "token_ids": (1..=9).collect::<Vec<u32>>(),
               "callout_id": callout, "max_tokens": 16, "completed": completed})
    };
    let (s, a) = post(&c, format!("{base}/v1/route"), route("c-a", json!([]))).await;
    assert_eq!(s, 200, "{a}");
    let (_, b) = post(&c, format!("{base}/v1/route"), route("c-b", json!([]))).await;
    assert_eq!(in_flight(&state), 2);
    // C carries A's end: A is released, C counted.
    let (s, cc) = post(
        &c,
        format!("{base}/v1/route"),
        route(
            "c-c",
            json!([{"decision_id": a["decision_id"], "cached_tokens": 0}]),
        ),
    )
    .await;
    assert_eq!(s, 200, "{cc}");
    assert_eq!(in_flight(&state), 2, "A ended, C began");
    // A refused route still applies what it carried: B's end rides on a call for an unknown
    // model.
    let unknown = json!({"model": "nope", "token_ids": [1, 2, 3],
                         "completed": [{"decision_id": b["decision_id"]}]});
    let (s, _) = post(&c, format!("{base}/v1/route"), unknown).await;
    assert_eq!(s, 404);
    assert_eq!(in_flight(&state), 1, "B ended");
    // A batch applies its valid reports and names the refused ones.
    let (s, err) = post(
        &c,
        format!("{base}/v1/complete"),
        json!([{"request_id": "no-id"}, {"decision_id": cc["decision_id"]}]),
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        err["error"].as_str().is_some_and(|e| e.contains("1 of 2")),
        "{err}"
    );
    assert_eq!(in_flight(&state), 0, "C ended despite its neighbour");
    // Too many reports on one call: refused whole.
    let many: Vec<Value> = (0..=kvroute_core::api::MAX_REPORTS_PER_CALL)
        .map(|i| json!({"decision_id": format!("x-{i}")}))
        .collect();
    let (s, err) = post(&c, format!("{base}/v1/route"), route("c-d", json!(many))).await;
    assert_eq!(s, 400, "{err}");
    assert_eq!(in_flight(&state), 0, "nothing decided");
}
