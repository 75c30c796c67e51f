//! Routing end to end: real Envoy + the real .wasm + kvroute-indexer + kvroute-sim replicas on
//! loopback. Which replica served a request is read from the replicas' own counters
//! (`vllm:prefix_cache_queries_total` moves only on the replica that ran it), and cache hits from
//! `vllm:prefix_cache_hits_total` and the response's `usage.prompt_tokens_details.cached_tokens`.

mod common;

use std::thread;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

struct Fleet {
    _dir: std::path::PathBuf,
    sims: Vec<Sim>,
    indexer: Indexer,
    envoy: Envoy,
}

fn fleet(name: &str, n: usize) -> Fleet {
    fleet_with(name, n, "")
}

fn fleet_with(name: &str, n: usize, indexer_toml: &str) -> Fleet {
    let dir = scratch(name);
    let plans: Vec<SimPlan> = (0..n).map(|i| Sim::plan(&format!("r{i}"))).collect();
    let mut indexer = Indexer::start_with(&plans, &dir, indexer_toml);
    let sims: Vec<Sim> = plans.iter().map(|p| Sim::start(p, &dir)).collect();
    indexer.wait_ready();
    let opts = EnvoyOptions::new(
        indexer.port,
        sims.iter().map(Sim::addr).collect(),
        // Generous route timeout: two shared cores also run the sims and the indexer.
        json!({"route_timeout_ms": 2000, "debug_headers": true,
               "inject_kv_cache_report_mode": true, "models": {"qwen3": {}}}),
    );
    let envoy = Envoy::start(name, &opts, &dir);
    envoy.wait_tokenizers(1);
    Fleet {
        _dir: dir,
        sims,
        indexer,
        envoy,
    }
}

/// What one request did on the fleet.
#[derive(Debug)]
struct Outcome {
    replica: usize,
    hits: u64,
    cached_tokens: u64,
    prompt_tokens: u64,
    response: Response,
}

fn usage_of(r: &Response, streaming: bool) -> Value {
    if streaming {
        assert!(
            r.header("content-type")
                .is_some_and(|c| c.contains("text/event-stream")),
            "not SSE: {:?}",
            r.headers
        );
        r.text()
            .lines()
            .rev()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
            .expect("a final usage chunk")
    } else {
        r.json()["usage"].clone()
    }
}

impl Fleet {
    fn counters(&self) -> Vec<(u64, u64)> {
        self.sims.iter().map(Sim::cache_counters).collect()
    }

    /// Sends one request (alone on the fleet) and finds the replica that ran it.
    fn send(&self, path: &str, body: &Value) -> Outcome {
        let streaming = body["stream"].as_bool().unwrap_or(false);
        let before = self.counters();
        let response = post_json(self.envoy.port, path, body, &[]);
        assert_eq!(response.status, 200, "{}", response.text());
        assert!(
            response.header("x-kvroute-fail-open").is_none(),
            "failed open: {:?}",
            response.headers
        );
        let usage = usage_of(&response, streaming);
        let after = self.counters();
        let ran: Vec<usize> = (0..self.sims.len())
            .filter(|&i| after[i].0 > before[i].0)
            .collect();
        assert_eq!(
            ran.len(),
            1,
            "exactly one replica ran it: {before:?} -> {after:?}"
        );
        let replica = ran[0];
        Outcome {
            replica,
            hits: after[replica].1 - before[replica].1,
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
            prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
            response,
        }
    }

    /// Lets KV events reach the indexer.
    fn settle(&self) {
        thread::sleep(Duration::from_millis(300));
    }
}

fn chat(system: &str, user: &str, stream: bool) -> Value {
    json!({"model": "qwen3", "max_tokens": 4, "stream": stream,
           "stream_options": {"include_usage": true},
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
}

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"model": "qwen3", "max_tokens": 4, "stream": stream,
           "stream_options": {"include_usage": true}, "prompt": prompt})
}

/// The first request of a prefix goes anywhere; its siblings must follow it and hit its cache.
fn shared_prefix_follows(f: &Fleet, what: &str, make: &dyn Fn(usize) -> (String, Value)) {
    let (path, body) = make(0);
    let first = f.send(&path, &body);
    assert!(first.prompt_tokens > 1000, "{what}: a long prompt");
    f.settle();
    for i in 1..5 {
        let (path, body) = make(i);
        let o = f.send(&path, &body);
        assert_eq!(
            o.replica, first.replica,
            "{what} #{i}: lands on the replica holding the prefix"
        );
        // The shared part is > 1000 tokens; the engine's own counters and usage both show it.
        assert!(
            o.hits >= 1000,
            "{what} #{i}: prefix_cache_hits_total grew by {}",
            o.hits
        );
        assert_eq!(
            o.cached_tokens, o.hits,
            "{what} #{i}: usage agrees with the counters"
        );
        assert_eq!(
            o.response
                .header("x-kvroute-reason")
                .map(|r| r.contains("prefix") || r.contains("hit")),
            Some(true),
            "{what} #{i}: decision reason {:?}",
            o.response.header("x-kvroute-reason")
        );
    }
}

#[test]
fn shared_prefixes_land_on_the_replica_holding_them() {
    let f = fleet("routing-prefix", 3);
    for (k, stream) in [false, true].into_iter().enumerate() {
        let system = filler(100 + k as u64, 1400);
        shared_prefix_follows(&f, &format!("chat stream={stream}"), &|i| {
            (
                "/v1/chat/completions".to_string(),
                chat(
                    &system,
                    &format!("question {i}: {}", filler(1000 + i as u64, 20)),
                    stream,
                ),
            )
        });
        let doc = filler(200 + k as u64, 1400);
        shared_prefix_follows(&f, &format!("completions stream={stream}"), &|i| {
            (
                "/v1/completions".to_string(),
                completion(
                    &format!("{doc}\nQ{i}: {}", filler(2000 + i as u64, 20)),
                    stream,
                ),
            )
        });
    }

    // Multi-turn: each turn extends the conversation and lands where the previous turns are.
    let mut messages = vec![json!({"role": "system", "content": filler(300, 700)})];
    let mut home = None;
    let mut last_cached = 0;
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": filler(400 + turn, 120)}));
        let body = json!({"model": "qwen3", "max_tokens": 8, "messages": messages});
        let o = f.send("/v1/chat/completions", &body);
        let reply = o.response.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        messages.push(json!({"role": "assistant", "content": reply}));
        match home {
            None => home = Some(o.replica),
            Some(h) => {
                assert_eq!(o.replica, h, "turn {turn} stays with its conversation");
                assert!(
                    o.cached_tokens > last_cached,
                    "turn {turn}: more of the conversation is cached"
                );
            }
        }
        last_cached = o.cached_tokens;
        f.settle();
    }

    // The filter reported every request's end, with the engine's cached tokens.
    wait_for("completion reports", Duration::from_secs(5), || {
        f.envoy.kv("complete_sent") >= f.envoy.kv("routed")
    });
    assert_eq!(f.envoy.kv("body_rewritten"), f.envoy.kv("routed"));
}

#[test]
fn sibling_bursts_compute_their_prefix_once_per_replica_and_unique_prompts_spread() {
    // On an idle fleet a full prefill on an idle replica is faster than waiting for a sibling's
    // (one step less), so the model may spread a burst; what it must not do is compute the same
    // new prefix twice on one replica: after the first sibling on a replica, the others find it
    // there (predicted, then cached).
    let f = fleet_with("routing-burst", 3, "");
    // 8 siblings with a new shared prefix, all at once (before any KV event can arrive).
    let prefix = filler(500, 1400);
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let body = completion(
                &format!("{prefix}\nvariant {i}: {}", filler(600 + i, 10)),
                false,
            );
            let port = f.envoy.port;
            thread::spawn(move || post_json(port, "/v1/completions", &body, &[]))
        })
        .collect();
    let decisions: Vec<(String, String)> = handles
        .into_iter()
        .map(|h| {
            let r = h.join().expect("request thread");
            assert_eq!(r.status, 200, "{}", r.text());
            (
                r.header("x-kvroute-replica").unwrap_or("none").to_string(),
                r.header("x-kvroute-reason").unwrap_or("none").to_string(),
            )
        })
        .collect();
    let used: std::collections::BTreeSet<&str> =
        decisions.iter().map(|(r, _)| r.as_str()).collect();
    let cold = decisions
        .iter()
        .filter(|(_, why)| why != "prefix_hit")
        .count();
    assert!(!used.contains("none"), "{decisions:?}");
    assert_eq!(
        cold,
        used.len(),
        "one sibling per replica computes the prefix, the others hit it: {decisions:?}"
    );
    assert!(used.len() < decisions.len(), "{decisions:?}");

    // Unique prompts (nothing shared) go by load: concurrent rounds use every replica.
    let before = f.counters();
    for round in 0..4u64 {
        let handles: Vec<_> = (0..3u64)
            .map(|i| {
                let body = json!({"model": "qwen3", "max_tokens": 32,
                                  "prompt": format!("{} {}", round * 10 + i, filler(9000 + round * 10 + i, 200))});
                let port = f.envoy.port;
                thread::spawn(move || post_json(port, "/v1/completions", &body, &[]))
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().expect("thread").status, 200);
        }
    }
    let after = f.counters();
    for i in 0..3 {
        assert!(
            after[i].0 > before[i].0,
            "replica r{i} got no unique prompt: {before:?} -> {after:?}"
        );
    }
}

#[test]
fn a_replica_added_at_run_time_receives_work_and_warms_up() {
    let mut f = fleet("routing-scale", 2);
    let dir = scratch("routing-scale-new");
    let plan = Sim::plan("r2");
    f.indexer.add_replica(&plan);
    f.sims.push(Sim::start(&plan, &dir));
    f.indexer.wait_ready();
    thread::sleep(Duration::from_millis(500));
    // Unique prompts, several at a time: the empty replica must win some (it is not even in
    // Envoy's fallback cluster: only the filter's routing can reach it).
    let mut hit_new = None;
    let mut decisions = Vec::new();
    for round in 0..20u64 {
        let prompts: Vec<String> = (0..3u64)
            .map(|i| format!("{} {}", round, filler(7000 + round * 10 + i, 1400)))
            .collect();
        let before = f.counters();
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let body = completion(p, false);
                let port = f.envoy.port;
                thread::spawn(move || post_json(port, "/v1/completions", &body, &[]))
            })
            .collect();
        let replies: Vec<Response> = handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
        for r in &replies {
            assert_eq!(r.status, 200, "{}", r.text());
        }
        decisions.extend(replies.iter().map(|r| {
            format!(
                "{}/{}",
                r.header("x-kvroute-replica").unwrap_or("none"),
                r.header("x-kvroute-reason").unwrap_or("none")
            )
        }));
        let after = f.counters();
        if after[2].0 > before[2].0 {
            let i = replies
                .iter()
                .position(|r| r.header("x-kvroute-replica") == Some("r2"))
                .expect("a reply routed to r2");
            hit_new = Some(prompts[i].clone());
            break;
        }
    }
    let warmed = hit_new.unwrap_or_else(|| {
        panic!(
            "the new replica never received work: {decisions:?}; indexer: {}",
            http(f.indexer.port, "GET", "/debug/replicas", &[], b"").text()
        )
    });
    f.settle();
    // It warmed up: a sibling of what it served goes there and hits.
    let o = f.send(
        "/v1/completions",
        &completion(&format!("{warmed} and then"), false),
    );
    assert_eq!(o.replica, 2, "the sibling follows the new replica's cache");
    assert!(
        o.cached_tokens >= 1000,
        "hit on the new replica: {}",
        o.cached_tokens
    );
}

#[test]
fn a_chat_with_an_image_routes_by_its_text_before_the_image_and_counts_as_partial() {
    let f = fleet("routing-media", 3);
    let system = filler(900, 1400);
    let first = f.send(
        "/v1/chat/completions",
        &chat(&system, "describe my garden", false),
    );
    f.settle();
    // The same conversation with a photo: its tokens are known up to the image's placeholder,
    // which covers the shared system prompt.
    let mut body = chat(&system, "", false);
    body["messages"][1]["content"] = json!([
        {"type": "text", "text": "and this photo?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    ]);
    let r = post_json(f.envoy.port, "/v1/chat/completions", &body, &[]);
    // The simulated model is text-only and refuses the image, as vLLM does; the routing
    // happened before that.
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.header("x-kvroute-fail-open").is_none(), "{:?}", r.headers);
    assert_eq!(
        r.header("x-kvroute-replica"),
        Some(format!("r{}", first.replica).as_str()),
        "{:?}",
        r.headers
    );
    assert_eq!(
        r.header("x-kvroute-reason"),
        Some("prefix_hit"),
        "{:?}",
        r.headers
    );
    assert_eq!(
        f.indexer
            .metric("kvroute_indexer_partial_predictions_total"),
        1.0
    );
    // Text chats are whole predictions.
    assert_eq!(f.envoy.kv("routed"), 2);
}
