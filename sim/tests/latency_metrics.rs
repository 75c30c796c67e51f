//! vLLM's latency histograms on a real `kvroute-sim` process, and what they imply: the true
//! prefill rate and decode step of the cost model (model seconds, whatever `--time-scale`), and
//! how `--speed` / `POST /admin/speed` change them.

mod common;

use common::{metric, Sim};
use serde_json::{json, Value};

const L: &str = "engine=\"0\",model_name=\"qwen3\"";

/// The simulators here are timed on the wall clock; one at a time keeps them off each other's
/// cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `n` token ids starting with a token unique to `tag`: no two tags share a block.
fn prompt(tag: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|j| 1000 + (tag * 7919 + j * 31) % 20_000)
        .collect()
}

async fn complete(c: &reqwest::Client, s: &Sim, ids: &[u32], max_tokens: usize) -> Value {
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"model": "qwen3", "prompt": ids, "max_tokens": max_tokens}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.expect("json")
}

async fn text(c: &reqwest::Client, s: &Sim, path: &str) -> String {
    c.get(s.url(path))
        .send()
        .await
        .expect("get")
        .text()
        .await
        .expect("body")
}

async fn model(c: &reqwest::Client, s: &Sim) -> Value {
    serde_json::from_str(&text(c, s, "/admin/latency-model").await).expect("model json")
}

async fn set_speed(c: &reqwest::Client, s: &Sim, body: &str) -> (u16, Value) {
    let r = c
        .post(s.url("/admin/speed"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("post");
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

fn sample(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or_else(|| panic!("no sample {series}"))
}

/// `_sum` and `_count` of engine 0's histogram `name`.
fn sum_count(text: &str, name: &str) -> (f64, f64) {
    (
        sample(text, &format!("{name}_sum{{{L}}}")),
        sample(text, &format!("{name}_count{{{L}}}")),
    )
}

/// The `le` values of engine 0's buckets of `name`, in order.
fn bucket_bounds(text: &str, name: &str) -> Vec<String> {
    let prefix = format!("{name}_bucket{{{L},le=\"");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_string)
        .collect()
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter()
        .map(|s| s.to_string())
        .chain(["+Inf".into()])
        .collect()
}

fn near(got: f64, want: f64, rel: f64) -> bool {
    (got - want).abs() <= rel * want.abs()
}

#[tokio::test]
async fn new_histograms_have_vllms_names_buckets_and_labels() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = Sim::start(&[
        "--time-scale",
        "20",
        "--num-gpu-blocks-override",
        "4096",
        "--max-model-len",
        "16384",
    ]);
    let c = reqwest::Client::new();
    for (tag, n) in [(1, 100), (2, 200), (3, 300)] {
        complete(&c, &s, &prompt(tag, n), 4).await;
    }
    let again = complete(&c, &s, &prompt(1, 100), 4).await;
    let hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap_or(-1.0);
    assert_eq!(hit, 96.0, "{again}");
    let m = text(&c, &s, "/metrics").await;

    let latency = strs(&[
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0",
        "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0",
    ]);
    let itl = strs(&[
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0",
        "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0",
    ]);
    let iteration = strs(&[
        "1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0",
        "4096.0", "8192.0", "16384.0",
    ]);
    // build_1_2_5_buckets(max_model_len = 16384).
    let tokens = strs(&[
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
        "5000.0", "10000.0",
    ]);
    let preemptions = strs(&["1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0"]);
    let expected: [(&str, &Vec<String>, f64); 12] = [
        ("vllm:request_queue_time_seconds", &latency, 4.0),
        ("vllm:request_prefill_time_seconds", &latency, 4.0),
        ("vllm:request_decode_time_seconds", &latency, 4.0),
        ("vllm:request_inference_time_seconds", &latency, 4.0),
        ("vllm:e2e_request_latency_seconds", &latency, 4.0),
        ("vllm:inter_token_latency_seconds", &itl, 4.0 * 3.0),
        ("vllm:request_time_per_output_token_seconds", &itl, 4.0),
        ("vllm:iteration_tokens_total", &iteration, -1.0),
        ("vllm:request_prompt_tokens", &tokens, 4.0),
        ("vllm:request_generation_tokens", &tokens, 4.0),
        ("vllm:request_prefill_kv_computed_tokens", &tokens, 4.0),
        ("vllm:request_num_preemptions", &preemptions, 4.0),
    ];
    for (name, bounds, count) in expected {
        assert!(
            m.contains(&format!("\n# TYPE {name} histogram\n")),
            "{name}: no TYPE line"
        );
        assert_eq!(&bucket_bounds(&m, name), bounds, "{name}: buckets");
        let (_, n) = sum_count(&m, name);
        if count >= 0.0 {
            assert_eq!(n, count, "{name}: count");
        }
        // Cumulative: the +Inf bucket holds every observation.
        assert_eq!(sample(&m, &format!("{name}_bucket{{{L},le=\"+Inf\"}}")), n);
    }
    // vLLM 0.33 no longer exports the old per-token TPOT histogram.
    assert!(!m.contains("vllm:time_per_output_token_seconds"));

    // Token accounting: each prompt counted once at its first token, split computed / cached.
    let computed = 100.0 + 200.0 + 300.0 + (100.0 - hit);
    let src = |s: &str| {
        sample(
            &m,
            &format!("vllm:prompt_tokens_by_source_total{{{L},source=\"{s}\"}}"),
        )
    };
    assert_eq!(src("local_compute"), computed);
    assert_eq!(src("local_cache_hit"), hit);
    assert_eq!(src("external_kv_transfer"), 0.0);
    assert_eq!(
        sample(&m, &format!("vllm:prompt_tokens_total{{{L}}}")),
        700.0
    );
    assert_eq!(
        sample(&m, &format!("vllm:prompt_tokens_cached_total{{{L}}}")),
        hit
    );
    assert_eq!(
        sample(
            &m,
            &format!("vllm:prompt_tokens_cached_by_source_total{{{L},source=\"device\"}}")
        ),
        hit
    );
    assert_eq!(
        sum_count(&m, "vllm:request_prefill_kv_computed_tokens").0,
        computed
    );
    assert_eq!(sum_count(&m, "vllm:request_prompt_tokens").0, 700.0);
    assert_eq!(sum_count(&m, "vllm:request_generation_tokens").0, 16.0);
    // Every computed prompt token and every output token lands in exactly one step.
    assert_eq!(
        sum_count(&m, "vllm:iteration_tokens_total").0,
        computed + 16.0
    );
    // Phases add up: queue + prefill = TTFT minus (queued - arrival) >= 0; prefill + decode =
    // inference.
    let (prefill, _) = sum_count(&m, "vllm:request_prefill_time_seconds");
    let (decode, _) = sum_count(&m, "vllm:request_decode_time_seconds");
    let (inference, _) = sum_count(&m, "vllm:request_inference_time_seconds");
    assert!(
        near(prefill + decode, inference, 1e-9),
        "{prefill} + {decode} vs {inference}"
    );
    let (itl_sum, _) = sum_count(&m, "vllm:inter_token_latency_seconds");
    assert!(
        near(itl_sum, decode, 1e-9),
        "itl {itl_sum} vs decode {decode}"
    );
}

#[tokio::test]
async fn prefill_histograms_imply_the_modelled_rate_and_follow_admin_speed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = Sim::start(&["--time-scale", "20", "--num-gpu-blocks-override", "4096"]);
    let c = reqwest::Client::new();
    const N: u32 = 4;
    const P: usize = 8000;
    // Prefill-only requests, one at a time: each prefill is one step of its own.
    let run = |first_tag: u32| {
        let (c, s) = (&c, &s);
        async move {
            for tag in first_tag..first_tag + N {
                complete(c, s, &prompt(tag, P), 1).await;
            }
            let m = text(c, s, "/metrics").await;
            (
                sum_count(&m, "vllm:request_prefill_kv_computed_tokens").0,
                sum_count(&m, "vllm:request_prefill_time_seconds").0,
                sample(
                    &m,
                    &format!("vllm:prompt_tokens_by_source_total{{{L},source=\"local_compute\"}}"),
                ),
            )
        }
    };
    let base = model(&c, &s).await;
    assert_eq!(base["speed"], 1.0);
    let rate = base["prefill_tokens_per_s"].as_f64().unwrap_or(0.0);
    assert_eq!(rate, 30_000.0);
    let (tokens1, time1, local1) = run(10).await;
    assert_eq!(tokens1, f64::from(N) * P as f64);
    assert_eq!(local1, tokens1);
    let implied1 = tokens1 / time1;
    assert!(near(implied1, rate, 0.10), "implied {implied1} vs {rate}");
    // Model seconds, not wall seconds: exactly the cost model's step per request.
    let step_ms = base["decode_step_ms"].as_f64().unwrap_or(0.0)
        + P as f64 * 1000.0 / rate
        + base["decode_ms_per_seq"].as_f64().unwrap_or(0.0);
    assert!(
        near(time1, f64::from(N) * step_ms / 1000.0, 0.01),
        "prefill time {time1} vs {N} x {step_ms} ms"
    );

    let (st, v) = set_speed(&c, &s, r#"{"speed": 0.5}"#).await;
    assert_eq!((st, v["speed"].as_f64()), (200, Some(0.5)), "{v}");
    let slow = model(&c, &s).await;
    assert_eq!(slow["prefill_tokens_per_s"], 15_000.0);
    assert_eq!(
        slow["decode_step_ms"],
        base["decode_step_ms"].as_f64().unwrap_or(0.0) * 2.0
    );
    let (tokens2, time2, _) = run(20).await;
    let implied2 = (tokens2 - tokens1) / (time2 - time1);
    assert!(
        near(implied2, rate / 2.0, 0.10),
        "implied {implied2} vs {}",
        rate / 2.0
    );
    assert!(
        near(implied1 / implied2, 2.0, 0.02),
        "{implied1} / {implied2}"
    );
}

#[tokio::test]
async fn inter_token_latency_is_the_modelled_step_and_speed_flag_doubles_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    // 40 ms model steps (80 at speed 0.5) at time scale 2: 20-40 ms of wall time per step, so
    // timer jitter is small next to a step.
    let s = Sim::start(&[
        "--time-scale",
        "2",
        "--decode-step-ms",
        "40",
        "--speed",
        "0.5",
    ]);
    let c = reqwest::Client::new();
    const P: usize = 32;
    const OUT: usize = 30;
    // One lone decoding request; returns (mean ITL, expected step) in seconds.
    let run = |tag: u32| {
        let (c, s) = (&c, &s);
        async move {
            let before = text(c, s, "/metrics").await;
            let eff = model(c, s).await;
            complete(c, s, &prompt(tag, P), OUT).await;
            let after = text(c, s, "/metrics").await;
            let d = |name: &str| {
                let (s1, n1) = sum_count(&after, name);
                let (s0, n0) = sum_count(&before, name);
                (s1 - s0, n1 - n0)
            };
            let (itl, n) = d("vllm:inter_token_latency_seconds");
            assert_eq!(n, (OUT - 1) as f64);
            let (decode, _) = d("vllm:request_decode_time_seconds");
            let (tpot, _) = d("vllm:request_time_per_output_token_seconds");
            assert!(near(decode, itl, 1e-9), "decode {decode} vs itl {itl}");
            assert!(
                near(tpot, itl / n, 1e-9),
                "tpot {tpot} vs mean itl {}",
                itl / n
            );
            let f = |k: &str| eff[k].as_f64().unwrap_or(f64::NAN);
            let mean_context = (P + OUT / 2) as f64;
            let want_ms = f("decode_step_ms")
                + f("decode_ms_per_seq")
                + mean_context / 1000.0 * f("decode_ms_per_1k_context");
            (itl / n, want_ms / 1000.0)
        }
    };
    let started = model(&c, &s).await;
    assert_eq!(started["speed"], 0.5);
    assert_eq!(started["decode_step_ms"], 80.0);
    assert_eq!(started["time_scale"], 2.0);
    let (slow, want_slow) = run(1).await;
    assert!(near(slow, want_slow, 0.10), "itl {slow} vs {want_slow}");

    let (st, v) = set_speed(&c, &s, r#"{"speed": 1}"#).await;
    assert_eq!((st, v["speed"].as_f64()), (200, Some(1.0)), "{v}");
    let (fast, want_fast) = run(2).await;
    assert!(near(fast, want_fast, 0.10), "itl {fast} vs {want_fast}");
    assert!(near(slow / fast, 2.0, 0.10), "{slow} / {fast}");
}

#[tokio::test]
async fn admin_speed_rejects_bad_input_and_the_flag_is_checked() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = Sim::start(&["--speed", "1.5"]);
    let c = reqwest::Client::new();
    for body in [
        r#"{"speed": 0}"#,
        r#"{"speed": -1}"#,
        r#"{"speed": "fast"}"#,
        r#"{"speed": null}"#,
        r#"{"speed": 1e999}"#,
        r#"{}"#,
        r#"[0.5]"#,
        "0.5",
        "not json",
        "",
    ] {
        let (st, v) = set_speed(&c, &s, body).await;
        assert_eq!(st, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("speed"), "{body}: unclear message {msg:?}");
    }
    let m = model(&c, &s).await;
    assert_eq!(m["speed"], 1.5, "bad requests changed the speed: {m}");
    assert_eq!(m["max_num_batched_tokens"], 8192);
    assert_eq!(m["prefill_tokens_per_s"], 45_000.0);
    let (st, v) = set_speed(&c, &s, r#"{"speed": 0.25}"#).await;
    assert_eq!((st, v), (200, json!({"speed": 0.25})));

    for bad in ["0", "-2", "nan", "inf"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
            .args(["--port", "0", &format!("--speed={bad}"), "--model-dir"])
            .arg(common::model_dir())
            .output()
            .expect("run kvroute-sim");
        assert!(!out.status.success(), "--speed {bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--speed"), "--speed {bad}: {err}");
    }
}
