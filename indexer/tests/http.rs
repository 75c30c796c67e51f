//! The HTTP API over real sockets: routing, completion, admin auth, tokenizer files, metrics.

mod common;

use std::time::Duration;

use common::*;
use kvroute_indexer::policies::Policy;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(10);

async fn two_replicas(
    policy: Policy,
    extra: &str,
) -> (
    Publisher,
    Publisher,
    std::sync::Arc<kvroute_indexer::state::AppState>,
    String,
) {
    let p0 = Publisher::start(0, 0).await;
    let p1 = Publisher::start(0, 0).await;
    let cfg = config_text(
        &[
            ("r0", free_port(), p0.pub_port, p0.replay_port, false),
            ("r1", free_port(), p1.pub_port, p1.replay_port, false),
        ],
        extra,
    );
    let state = start_indexer(&cfg, policy);
    wait_connected(&state, "r0").await;
    wait_connected(&state, "r1").await;
    let base = serve_http(state.clone()).await;
    (p0, p1, state, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hit_wins_and_errors_are_clear() {
    let (_p0, mut p1, state, base) = two_replicas(Policy::Kv, "").await;
    let prompt: Vec<u32> = (1..=21).collect(); // 5 usable blocks of 4
    p1.publish(vec![stored(&[1, 2, 3, 4, 5], None, &prompt[..20], 4)])
        .await;
    assert!(wait_until(T, || held(&state, "r1", &prompt) == 5).await);
    let c = reqwest::Client::new();
    let resp = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "token_ids": prompt, "request_id": "req-1"}))
        .send()
        .await
        .unwrap();
    // The decision's own time, for telling it apart from the round trip's.
    let inside = server_timing(resp.headers(), "route")
        .unwrap_or_else(|| panic!("no route Server-Timing: {:?}", resp.headers()));
    assert!(inside < Duration::from_secs(10), "{inside:?}");
    // Its part in the index lookup, within it (a sub-microsecond lookup reads 0.000 ms).
    let in_index = server_timing(resp.headers(), "index")
        .unwrap_or_else(|| panic!("no index Server-Timing: {:?}", resp.headers()));
    assert!(in_index <= inside, "{in_index:?} of {inside:?}");
    let r: Value = resp.json().await.unwrap();
    assert_eq!(r["replica"], "r1", "{r}");
    assert_eq!(r["reason"], "prefix_hit");
    assert_eq!(r["matched_tokens"]["gpu"], 20);
    assert_eq!(r["request_id"], "req-1");
    assert_eq!(
        r["report_hold_ms"], 250,
        "an indexer without peers lets the filter hold reports"
    );
    assert_eq!(
        r["endpoint"],
        state.fleet.get("r1").unwrap().endpoint.as_str()
    );
    // The runner-up, for Envoy's override_host to retry onto.
    assert_eq!(
        r["alternates"],
        json!([state.fleet.get("r0").unwrap().endpoint.as_str()]),
        "{r}"
    );

    let resp = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "nope", "token_ids": [1, 2]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("nope"));
    let resp = c
        .post(format!("{base}/v1/route"))
        .body("{not json")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    // Router keys computed by the caller give the same answer (after the first request ended:
    // with it in flight, credit decay may rightly prefer the idle replica).
    c.post(format!("{base}/v1/complete"))
        .json(&json!({"decision_id": r["decision_id"]}))
        .send()
        .await
        .unwrap();
    let dbg: Value = c
        .post(format!("{base}/debug/lookup"))
        .json(&json!({"model": "m", "token_ids": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let keys = dbg["router_keys"].clone();
    let r2: Value = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "router_keys": keys, "num_tokens": 21, "block_size": 4}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r2["replica"], "r1", "{r2}");
    // The same keys packed, as the filter sends them, match the same blocks.
    let key_list: Vec<u64> = serde_json::from_value(keys).unwrap();
    let packed = kvroute_core::packed_keys::encode(&key_list);
    let r3: Value = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "router_keys": packed, "num_tokens": 21, "block_size": 4}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r3["replica"], "r1", "{r3}");
    assert_eq!(r3["matched_tokens"], r2["matched_tokens"], "{r3}");
    let resp = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "router_keys": "AQID", "num_tokens": 21, "block_size": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "3 bytes are not a key");
    let text = resp.text().await.unwrap();
    assert!(text.contains("not a whole number of 8-byte keys"), "{text}");
    let resp = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "router_keys": [1], "block_size": 16}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "block size mismatch is refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_releases_in_flight_and_compares_hits() {
    let (_p0, mut p1, state, base) = two_replicas(Policy::Kv, "").await;
    let prompt: Vec<u32> = (1..=9).collect();
    p1.publish(vec![stored(&[1, 2], None, &prompt[..8], 4)])
        .await;
    assert!(wait_until(T, || held(&state, "r1", &prompt) == 2).await);
    let c = reqwest::Client::new();
    let r: Value = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "token_ids": prompt, "request_id": "a"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["replica"], "r1");
    let r1 = state.fleet.get("r1").unwrap();
    assert_eq!(r1.in_flight.load(std::sync::atomic::Ordering::Relaxed), 1);
    let resp = c
        .post(format!("{base}/v1/complete"))
        .json(&json!({"decision_id": r["decision_id"], "request_id": "a", "endpoint": r["endpoint"], "cached_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    assert_eq!(r1.in_flight.load(std::sync::atomic::Ordering::Relaxed), 0);
    let resp = c
        .post(format!("{base}/v1/complete"))
        .json(&json!({"decision_id": "0-1", "cached_tokens": null}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    // A completion without decision_id (a filter older than the indexer) is refused and counted.
    let resp = c
        .post(format!("{base}/v1/complete"))
        .json(&json!({"request_id": "a", "cached_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let metrics = metrics_text(&c, &base).await;
    assert!(
        metrics.contains("kvroute_indexer_hit_prediction_exact_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_indexer_reported_hit_tokens_total 8"));
    assert!(metrics.contains("kvroute_indexer_completions_unknown_total 1"));
    assert!(metrics.contains("kvroute_indexer_completions_missing_id_total 1"));
    assert!(
        metrics.contains("kvroute_indexer_decisions_total{reason=\"prefix_hit\",policy=\"kv\"} 1")
    );
    assert!(metrics.contains("kvroute_indexer_index_entries "));
    // Every route decision is timed: the histogram's count is its +Inf bucket, and not zero.
    let value = |series: &str| {
        kvroute_testkit::prom::series_value(&metrics, series)
            .unwrap_or_else(|| panic!("{series} missing:\n{metrics}"))
    };
    let count = value("kvroute_indexer_route_duration_seconds_count");
    assert!(count >= 1.0, "{count}");
    assert_eq!(
        value("kvroute_indexer_route_duration_seconds_bucket{le=\"+Inf\"}"),
        count
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_prompts_spread_by_load() {
    let (_p0, _p1, _state, base) = two_replicas(Policy::Kv, "").await;
    let c = reqwest::Client::new();
    let mut counts = std::collections::HashMap::new();
    for i in 0..20u32 {
        let prompt: Vec<u32> = (i * 100..i * 100 + 33).collect();
        let r: Value = c
            .post(format!("{base}/v1/route"))
            .json(&json!({"model": "m", "token_ids": prompt}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        *counts
            .entry(r["replica"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    // Requests never complete here, so in-flight load alternates them.
    assert_eq!(counts.get("r0"), Some(&10), "{counts:?}");
    assert_eq!(counts.get("r1"), Some(&10), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_needs_the_token() {
    let (_p0, _p1, state, base) = two_replicas(Policy::Kv, "").await;
    let c = reqwest::Client::new();
    let p2 = Publisher::start(0, 0).await;
    let body = json!({"model": "m", "name": "r2", "http": format!("127.0.0.1:{}", free_port()),
        "events": [format!("tcp://127.0.0.1:{}", p2.pub_port)], "replay": [format!("tcp://127.0.0.1:{}", p2.replay_port)], "topic": "kv-events"});
    let resp = c
        .post(format!("{base}/admin/replicas"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = c
        .post(format!("{base}/admin/replicas"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = c
        .post(format!("{base}/admin/replicas"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    wait_connected(&state, "r2").await;
    let resp = c
        .post(format!("{base}/admin/replicas"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409, "duplicate");
    let mut bad = body.clone();
    bad["name"] = json!("r3");
    bad["http"] = json!("not-an-address");
    let resp = c
        .post(format!("{base}/admin/replicas"))
        .bearer_auth("sekret")
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.text().await.unwrap().contains("replica.http"));
    // Drain r0 and r1: everything goes to r2.
    for r in ["r0", "r1"] {
        let resp = c
            .post(format!("{base}/admin/replicas/{r}/drain"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
        let resp = c
            .post(format!("{base}/admin/replicas/{r}/drain"))
            .bearer_auth("sekret")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 204);
    }
    let r: Value = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "token_ids": [1, 2, 3]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["replica"], "r2");
    let resp = c
        .delete(format!("{base}/admin/replicas/r2"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    let resp = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "token_ids": [1, 2, 3]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503, "all remaining replicas drain");
    let resp = c
        .delete(format!("{base}/admin/replicas/r2"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_files_are_served() {
    let dir = std::env::temp_dir().join(format!("kvroute-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": {}}").unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"chat_template\": \"x\"}",
    )
    .unwrap();
    let cfg = format!(
        "scrape_interval_ms = 0\n[[models]]\nname = \"m\"\nmodel_dir = \"{}\"\nblock_size = 16\n",
        dir.display()
    );
    let state = start_indexer(&cfg, Policy::Kv);
    let base = serve_http(state).await;
    let c = reqwest::Client::new();
    let v: Value = c
        .get(format!("{base}/v1/models/m/tokenizer"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["tokenizer_json"], "{\"model\": {}}");
    assert_eq!(v["tokenizer_config_json"], "{\"chat_template\": \"x\"}");
    assert_eq!(v["block_size"], 16);
    assert_eq!(
        c.get(format!("{base}/v1/models/zzz/tokenizer"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    let models: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["models"][0]["name"], "m");
    // No replica at all: not ready.
    assert_eq!(
        c.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    assert_eq!(
        c.get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokenizer_is_served_compact_when_asked() {
    use kvroute_core::api::TokenizerBundle;
    let dir = std::env::temp_dir().join(format!("kvroute-tok-compact-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
                  "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    let cfg = format!(
        "scrape_interval_ms = 0\n[[models]]\nname = \"m\"\nmodel_dir = \"{}\"\nblock_size = 16\n",
        dir.display()
    );
    let base = serve_http(start_indexer(&cfg, Policy::Kv)).await;
    let c = reqwest::Client::new();
    let get = |query: &'static str| {
        let c = c.clone();
        let url = format!("{base}/v1/models/m/tokenizer{query}");
        async move { c.get(url).send().await.unwrap() }
    };
    let whole: TokenizerBundle = get("").await.json().await.unwrap();
    assert_eq!(whole.bpe_tables, None, "not asked: the whole document");
    assert_eq!(whole.tokenizer_json, tokenizer.to_string());
    let compact: TokenizerBundle = get("?form=compact").await.json().await.unwrap();
    let tables = compact.bpe_tables.expect("the tables");
    assert_eq!(tables.vocab, ["a", "b", "ab"]);
    assert_eq!(tables.merges, [[0, 1]]);
    let doc: Value = serde_json::from_str(&compact.tokenizer_json).unwrap();
    assert_eq!(doc["model"]["vocab"], json!({}));
    assert_eq!(doc["model"]["byte_fallback"], true, "options kept");
    assert_eq!(compact.block_size, Some(16));
    // Built once per form: served from memory even after the files are gone.
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let again: TokenizerBundle = get("?form=compact").await.json().await.unwrap();
    assert_eq!(again.bpe_tables, Some(tables));
    assert_eq!(again.tokenizer_json, compact.tokenizer_json);
    let again_whole: TokenizerBundle = get("").await.json().await.unwrap();
    assert_eq!(again_whole.tokenizer_json, whole.tokenizer_json);
    let bad = get("?form=postcard").await;
    assert_eq!(bad.status(), 400);
    let _ = std::fs::remove_dir_all(&dir);
}

/// An indexer and a model with a tokenizer directory, LoRA adapter `adapter` and the given
/// `[models.hash]` table.
async fn indexer_with_model(hash: &str) -> String {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-contract-{}-{}",
        std::process::id(),
        hash.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": {}}").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    let cfg = format!(
        "scrape_interval_ms = 0\n[[models]]\nname = \"m\"\nmodel_dir = \"{}\"\nblock_size = 4\n\
         [models.hash]\n{hash}\n[models.loras]\nadapter = \"/loras/adapter\"\n",
        dir.display()
    );
    serve_http(start_indexer(&cfg, Policy::Kv)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_keys_lora_requests_as_the_indexer_does_for_old_engines() {
    use kvroute_core::api::TokenizerBundle;
    use kvroute_core::hashing::{ExtraKeyStyle, LoraRef, RequestExtras};
    let c = reqwest::Client::new();
    let tokens: Vec<u32> = (1..=17).collect();
    for (hash, style) in [
        (
            "algo = \"sha256\"\nengine_version = \"0.25.0\"",
            ExtraKeyStyle::Plain,
        ),
        ("algo = \"sha256\"", ExtraKeyStyle::Tagged),
    ] {
        let base = indexer_with_model(hash).await;
        let resp = c
            .get(format!("{base}/v1/models/m/tokenizer"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.headers()
                .get(kvroute_core::api::CONTRACT_HEADER)
                .and_then(|v| v.to_str().ok()),
            Some(kvroute_core::api::CONTRACT_VERSION_STR)
        );
        let bundle: TokenizerBundle = resp.json().await.unwrap();
        assert_eq!(bundle.extra_key_style, Some(style), "{hash}");
        // What the filter computes: the bundle's style (tagged when it announces none).
        let extras = RequestExtras {
            lora: Some(LoraRef {
                name: "adapter".into(),
                path: "/loras/adapter".into(),
            }),
            ..RequestExtras::default()
        };
        let filter_keys: Vec<u64> = kvroute_core::router_key::request_keys(
            &tokens,
            4,
            &extras,
            bundle.extra_key_style.unwrap_or_default(),
        )
        .iter()
        .map(|k| k.0)
        .collect();
        // What the indexer computes for the same request.
        let v: Value = c
            .post(format!("{base}/debug/lookup"))
            .json(&json!({"model": "m", "token_ids": tokens, "lora": "adapter"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let indexer_keys: Vec<u64> = serde_json::from_value(v["router_keys"].clone()).unwrap();
        assert_eq!(filter_keys, indexer_keys, "{hash}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_contract_version_is_refused_by_name() {
    let base = indexer_with_model("algo = \"sha256\"").await;
    let c = reqwest::Client::new();
    let resp = c
        .post(format!("{base}/v1/route"))
        .header(kvroute_core::api::CONTRACT_HEADER, "999")
        .json(&json!({"model": "m", "token_ids": [1, 2, 3, 4, 5]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    let text = resp.text().await.unwrap();
    assert!(
        text.contains("\\\"999\\\"")
            && text.contains(&format!("speaks {}", kvroute_core::api::CONTRACT_VERSION)),
        "{text}"
    );
    // The same request in this version is not refused for its version.
    let resp = c
        .post(format!("{base}/v1/route"))
        .header(
            kvroute_core::api::CONTRACT_HEADER,
            kvroute_core::api::CONTRACT_VERSION_STR,
        )
        .json(&json!({"model": "m", "token_ids": [1, 2, 3, 4, 5]}))
        .send()
        .await
        .unwrap();
    assert_ne!(resp.status(), 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_gives_every_candidate_in_seconds_and_completions_grade_the_prediction() {
    let (_p0, mut p1, state, base) = two_replicas(Policy::Kv, "").await;
    let prompt: Vec<u32> = (1..=21).collect();
    p1.publish(vec![stored(&[1, 2, 3, 4, 5], None, &prompt[..20], 4)])
        .await;
    assert!(wait_until(T, || held(&state, "r1", &prompt) == 5).await);
    let c = reqwest::Client::new();
    let r: Value = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "token_ids": prompt, "explain": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["replica"], "r1", "{r}");
    let explain = r["explain"].as_array().expect("explain asked for");
    assert_eq!(explain.len(), 2, "{r}");
    let by_name = |n: &str| {
        explain
            .iter()
            .find(|e| e["replica"] == n)
            .unwrap_or_else(|| panic!("{n} in {r}"))
    };
    let (hit, cold) = (by_name("r1"), by_name("r0"));
    assert_eq!(hit["chosen"], true);
    assert_eq!(cold["chosen"], false);
    assert_eq!(hit["matched_tokens"]["gpu"], 20);
    assert_eq!(hit["terms"]["uncached_tokens"], 1);
    assert_eq!(cold["terms"]["uncached_tokens"], 21);
    let ttft = |e: &Value| e["terms"]["ttft_s"].as_f64().expect("ttft_s");
    assert!(ttft(hit) < ttft(cold), "{r}");
    assert!(hit["rates"]["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    let predicted_ms = r["predicted_ttft_ms"].as_f64().unwrap();
    assert!((predicted_ms - ttft(hit) * 1000.0).abs() < 1e-6, "{r}");
    // Without the flag there is no explanation.
    let plain: Value = c
        .post(format!("{base}/v1/route"))
        .json(&json!({"model": "m", "token_ids": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(plain.get("explain").is_none(), "{plain}");

    // The proxy's TTFT, reported with the completion, is graded against the prediction.
    let observed_us = (predicted_ms * 3.0 * 1000.0) as u64;
    let resp = c
        .post(format!("{base}/v1/complete"))
        .json(&json!({"decision_id": r["decision_id"], "ttft_us": observed_us}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    let metrics = metrics_text(&c, &base).await;
    let line = |prefix: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix} in\n{metrics}"))
            .to_string()
    };
    // A ratio of 3 lands above 2.0 and at or below 4.0.
    assert!(
        line("kvroute_indexer_ttft_observed_over_predicted_bucket{replica=\"r1\",le=\"2\"}")
            .ends_with(" 0")
    );
    assert!(
        line("kvroute_indexer_ttft_observed_over_predicted_bucket{replica=\"r1\",le=\"4\"}")
            .ends_with(" 1")
    );
    line("kvroute_indexer_replica_prefill_tokens_per_second{replica=\"r0\"");
    line("kvroute_indexer_replica_decode_step_seconds{replica=\"r1\"");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_s_turns_are_learned_as_successors_and_priced_where_prefill_was_recent() {
    let (_p0, _p1, _state, base) = two_replicas(Policy::Kv, "").await;
    let c = reqwest::Client::new();
    let route = |prompt: Vec<u32>| {
        let c = c.clone();
        let base = base.clone();
        async move {
            c.post(format!("{base}/v1/route"))
                .json(&json!({"model": "m", "token_ids": prompt, "explain": true}))
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let successors = |r: &Value, replica: &str| -> f64 {
        r["explain"]
            .as_array()
            .and_then(|e| e.iter().find(|c| c["replica"] == replica))
            .and_then(|c| c["terms"]["successors_s"].as_f64())
            .unwrap_or_else(|| panic!("{replica}'s successors_s in {r}"))
    };
    // One session of four turns, each prompt extending the last: the first goes anywhere, the
    // rest follow its predicted blocks. Three continuations of one start.
    let mut prompt: Vec<u32> = (1..=400).collect();
    let first = route(prompt.clone()).await;
    let home = first["replica"].as_str().unwrap().to_string();
    let other = if home == "r0" { "r1" } else { "r0" };
    assert_eq!(
        successors(&first, &home),
        0.0,
        "nothing learned yet: {first}"
    );
    for turn in 1..4u32 {
        prompt.extend(turn * 1_000..turn * 1_000 + 200);
        let r = route(prompt.clone()).await;
        assert_eq!(r["replica"], home.as_str(), "turn {turn}: {r}");
    }
    // Once the session's prompts are old enough to be judged (four of its gaps, milliseconds
    // here), 3 of 4 were continued: a new session's first turn expects successors (3 / 5 over
    // 1 - 3 / 5), which would queue behind the prefill recently routed to the session's
    // replica, and behind nothing at the other.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let start = route((50_000..50_400).collect()).await;
    assert!(successors(&start, &home) > 0.0, "{start}");
    assert_eq!(successors(&start, other), 0.0, "{start}");
    assert_eq!(start["replica"], other, "{start}");
}
