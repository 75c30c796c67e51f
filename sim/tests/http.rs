//! The OpenAI HTTP surface of a real `kvroute-sim` process.

mod common;

use std::time::Duration;

use common::{metric, Sim};
use serde_json::{json, Value};

const BS: u64 = 16;

fn long_prompt(tag: &str) -> String {
    format!(
        "{tag}: the quick brown fox jumps over the lazy dog while routers count tokens, \
         blocks and hashes so that every cache hit is found again on the next request. {}",
        "Repeat the facts about prefix caching and KV blocks. ".repeat(8)
    )
}

async fn post(c: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = c.post(url).json(body).send().await.expect("request");
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    (status, v)
}

fn sim() -> Sim {
    Sim::start(&["--time-scale", "20", "--num-gpu-blocks-override", "2000"])
}

#[tokio::test]
async fn completions_repeat_reports_cached_blocks() {
    let s = sim();
    let c = reqwest::Client::new();
    let body = json!({"model": "qwen3", "prompt": long_prompt("a"), "max_tokens": 7});
    let (st, first) = post(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(st, 200, "{first}");
    let n = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(n > 3 * BS, "prompt too short: {n}");
    assert_eq!(first["usage"]["completion_tokens"], 7);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let (_, second) = post(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        (n - 1) / BS * BS
    );
    // Deterministic outputs for the same prompt.
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty());
    // The warm request's simulated TTFT is shorter.
    let t1 = first["kvroute_sim"]["ttft_s"].as_f64().unwrap();
    let t2 = second["kvroute_sim"]["ttft_s"].as_f64().unwrap();
    assert!(t2 <= t1, "warm {t2} cold {t1}");
    // token-id prompts work too, and a batch gives one choice per prompt.
    let (st, v) = post(
        &c,
        &s.url("/v1/completions"),
        &json!({"model": "qwen3", "prompt": [[1, 2, 3], [4, 5, 6, 7]], "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["prompt_tokens"], 7);
}

#[tokio::test]
async fn chat_non_streaming_and_streaming() {
    let s = sim();
    let c = reqwest::Client::new();
    let msgs = json!([{"role": "system", "content": long_prompt("sys")},
                      {"role": "user", "content": "hello"}]);
    let (st, v) = post(
        &c,
        &s.url("/v1/chat/completions"),
        &json!({"model": "qwen3", "messages": msgs, "max_tokens": 5}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let n = v["usage"]["prompt_tokens"].as_u64().unwrap();
    // The render endpoint gives the same token count.
    let (st, r) = post(
        &c,
        &s.url("/v1/chat/completions/render"),
        &json!({"model": "qwen3", "messages": msgs}),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["token_ids"].as_array().unwrap().len() as u64, n);

    let resp = c
        .post(s.url("/v1/chat/completions"))
        .json(
            &json!({"model": "qwen3", "messages": msgs, "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert!(resp
        .headers()
        .get("content-type")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let text = resp.text().await.unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 4);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        (n - 1) / BS * BS
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .collect();
    assert_eq!(finish.len(), 1);

    // Without include_usage no usage chunk is sent.
    let text = c
        .post(s.url("/v1/completions"))
        .json(&json!({"model": "qwen3", "prompt": "hi there", "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("\"usage\""));
    assert_eq!(text.matches("\"text_completion\"").count(), 4);
}

#[tokio::test]
async fn metrics_counters_move() {
    let s = sim();
    let c = reqwest::Client::new();
    let get_metrics = || async {
        c.get(s.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let before = get_metrics().await;
    let l = "{engine=\"0\",model_name=\"qwen3\"}";
    assert_eq!(
        metric(&before, &format!("vllm:prefix_cache_queries_total{l}")),
        Some(0.0)
    );
    assert!(metric(&before, "process_start_time_seconds").unwrap() > 1.0e9);
    let body = json!({"model": "qwen3", "prompt": long_prompt("m"), "max_tokens": 3});
    let (_, a) = post(&c, &s.url("/v1/completions"), &body).await;
    let (_, b) = post(&c, &s.url("/v1/completions"), &body).await;
    let n = a["usage"]["prompt_tokens"].as_f64().unwrap();
    let hit = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap();
    assert!(hit > 0.0);
    let after = get_metrics().await;
    assert_eq!(
        metric(&after, &format!("vllm:prefix_cache_queries_total{l}")),
        Some(2.0 * n)
    );
    assert_eq!(
        metric(&after, &format!("vllm:prefix_cache_hits_total{l}")),
        Some(hit)
    );
    assert_eq!(
        metric(
            &after,
            &format!("vllm:time_to_first_token_seconds_count{l}")
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &after,
            &format!("vllm:e2e_request_latency_seconds_count{l}")
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(&after, &format!("vllm:num_requests_running{l}")),
        Some(0.0)
    );
    assert_eq!(
        metric(&after, &format!("vllm:num_preemptions_total{l}")),
        Some(0.0)
    );
    // Freed blocks stay cached but count as free: usage back to 0.
    assert_eq!(
        metric(&after, &format!("vllm:kv_cache_usage_perc{l}")),
        Some(0.0)
    );
}

#[tokio::test]
async fn errors_are_vllm_shaped() {
    let s = sim();
    let c = reqwest::Client::new();
    let r = c
        .post(s.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{\"model\": \"qwen3\", \"messages\": [")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 400);
    assert!(v["error"]["message"].is_string());

    let (st, v) = post(
        &c,
        &s.url("/v1/completions"),
        &json!({"model": "gpt-4", "prompt": "x"}),
    )
    .await;
    assert_eq!(st, 404);
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["param"], "model");

    for bad in [
        json!({"model": "qwen3", "prompt": "x", "max_tokens": "many"}),
        json!({"model": "qwen3", "prompt": "x", "max_tokens": 0}),
        json!({"model": "qwen3"}),
        json!({"model": "qwen3", "messages": "not a list"}),
        json!({"model": "qwen3", "prompt": "x", "max_tokens": 1_000_000}),
        json!([1, 2, 3]),
    ] {
        let url = if bad.get("messages").is_some() {
            s.url("/v1/chat/completions")
        } else {
            s.url("/v1/completions")
        };
        let (st, v) = post(&c, &url, &bad).await;
        assert_eq!(st, 400, "{bad} -> {v}");
        assert_eq!(v["error"]["code"], 400, "{v}");
    }
    // The server still works afterwards.
    let (st, _) = post(
        &c,
        &s.url("/v1/completions"),
        &json!({"model": "qwen3", "prompt": "ok", "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn info_endpoints_and_reset() {
    let s = Sim::start(&[
        "--time-scale",
        "20",
        "--lora-modules",
        "sql-lora=/models/loras/sql",
    ]);
    let c = reqwest::Client::new();
    let models: Value = c
        .get(s.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data[0]["id"], "qwen3");
    assert_eq!(data[0]["owned_by"], "vllm");
    assert_eq!(data[1]["id"], "sql-lora");
    let v: Value = c
        .get(s.url("/version"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["version"], "0.33.0");
    assert_eq!(
        c.get(s.url("/health"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
    let src: Value = c
        .get(s.url("/kv_event_sources"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(src, json!({}));

    let body = json!({"model": "qwen3", "prompt": long_prompt("r"), "max_tokens": 2});
    post(&c, &s.url("/v1/completions"), &body).await;
    let (st, v) = post(&c, &s.url("/reset_prefix_cache"), &json!({})).await;
    assert_eq!(st, 200);
    assert_eq!(v["success"], true);
    let (_, again) = post(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // A LoRA request and a salted request do not hit the base model's blocks.
    let (_, base) = post(&c, &s.url("/v1/completions"), &body).await;
    assert!(
        base["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let mut lora = body.clone();
    lora["model"] = json!("sql-lora");
    let (st, l) = post(&c, &s.url("/v1/completions"), &lora).await;
    assert_eq!(st, 200, "{l}");
    assert_eq!(l["model"], "sql-lora");
    assert_eq!(l["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut salted = body.clone();
    salted["cache_salt"] = json!("tenant-1");
    let (_, sa) = post(&c, &s.url("/v1/completions"), &salted).await;
    assert_eq!(sa["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn sigterm_stops_cleanly() {
    let mut s = sim();
    let c = reqwest::Client::new();
    let (st, _) = post(
        &c,
        &s.url("/v1/completions"),
        &json!({"model": "qwen3", "prompt": "bye", "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 200);
    let status = s
        .terminate(Duration::from_secs(10))
        .expect("did not exit after SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn streamed_deltas_add_up_to_the_whole_text() {
    // Output ids are drawn from the whole byte-level vocabulary, so characters split across
    // tokens: the incremental detokenizer must hold them back and still lose nothing.
    let s = sim();
    let c = reqwest::Client::new();
    let body = json!({"model": "qwen3", "prompt": "tell me a long story", "max_tokens": 400});
    let (st, v) = post(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(st, 200, "{v}");
    let whole = v["choices"][0]["text"].as_str().unwrap().to_string();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = c
        .post(s.url("/v1/completions"))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let deltas: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert!(whole.chars().count() > 100, "{whole:?}");
    assert_eq!(deltas, whole.trim_end_matches('\u{FFFD}'));
}

/// Peak resident memory of a process, MiB (`VmHWM`).
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .expect("VmHWM")
        / 1024.0
}

#[tokio::test]
async fn a_prompt_over_the_context_is_refused_without_tokenising_all_of_it() {
    let s = Sim::start(&["--time-scale", "20", "--max-model-len", "4096"]);
    let c = reqwest::Client::new();
    // 3.9 M digits: each its own Qwen3 token. Tokenised whole this took ~1.3 GB.
    let bomb = json!({"model": "qwen3", "max_tokens": 1,
                      "messages": [{"role": "user", "content": "7".repeat(3_900_000)}]});
    let (st, v) = post(&c, &s.url("/v1/chat/completions"), &bomb).await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v.to_string()
            .contains("maximum context length is 4096 tokens"),
        "{v}"
    );
    let peak = peak_rss_mib(s.pid());
    assert!(peak < 600.0, "the simulator peaked at {peak:.0} MiB");
    let ok = json!({"model": "qwen3", "prompt": "hello", "max_tokens": 2});
    assert_eq!(post(&c, &s.url("/v1/completions"), &ok).await.0, 200);
}
