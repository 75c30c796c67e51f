//! Tokens agree end to end (issue 19), in real Envoy with the real .wasm, kvroute-indexer and
//! kvroute-sim replicas:
//!
//! * a model directory in each layout transformers reads (template in `tokenizer_config.json`,
//!   in `chat_template.jinja`, in `chat_template.json`) routes chats exactly alike, and the online
//!   check finds the engine's prompt tokens equal to the filter's, with the client's response
//!   left as the engine sends it without `return_token_ids`;
//! * a deliberately wrong template given to the filter is caught by the online check on the
//!   sampled requests: the model then fails open as `token_mismatch`, and the indexer's `/readyz`
//!   and metrics name the mismatch.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// The Qwen3 files rearranged into `layout`: `config` (as shipped), `jinja` or `json` (the
/// template moved out of `tokenizer_config.json` into `chat_template.jinja` / `.json`).
fn model_layout(dir: &Path, layout: &str) -> PathBuf {
    let src = model_dir();
    let out = dir.join(format!("model-{layout}"));
    std::fs::create_dir_all(&out).expect("model dir");
    std::fs::copy(src.join("tokenizer.json"), out.join("tokenizer.json")).expect("copy");
    let config: Value = serde_json::from_slice(
        &std::fs::read(src.join("tokenizer_config.json")).expect("tokenizer_config.json"),
    )
    .expect("json");
    let template = config["chat_template"]
        .as_str()
        .expect("Qwen3 ships its template in tokenizer_config.json")
        .to_string();
    let mut without = config.clone();
    if let Some(o) = without.as_object_mut() {
        o.remove("chat_template");
    }
    let write = |name: &str, bytes: Vec<u8>| std::fs::write(out.join(name), bytes).expect(name);
    match layout {
        "config" => write("tokenizer_config.json", config.to_string().into_bytes()),
        "jinja" => {
            write("tokenizer_config.json", without.to_string().into_bytes());
            write("chat_template.jinja", template.into_bytes());
        }
        "json" => {
            write("tokenizer_config.json", without.to_string().into_bytes());
            write(
                "chat_template.json",
                json!({"chat_template": template}).to_string().into_bytes(),
            );
        }
        other => panic!("unknown layout {other}"),
    }
    out
}

struct Stack {
    _dir: PathBuf,
    _sims: Vec<Sim>,
    indexer: Indexer,
    envoy: Envoy,
}

fn stack(name: &str, model_files: Option<&Path>, plugin: Value) -> Stack {
    let dir = scratch(name);
    let files = match model_files {
        Some(p) => p.to_path_buf(),
        None => model_dir(),
    };
    let plans = vec![Sim::plan("r0"), Sim::plan("r1")];
    let mut indexer = Indexer::start_with_model(&plans, &dir, &files, "");
    // The engines always read the model as shipped: they are the judge.
    let sims: Vec<Sim> = plans.iter().map(|p| Sim::start(p, &dir)).collect();
    indexer.wait_ready();
    let opts = EnvoyOptions::new(indexer.port, sims.iter().map(Sim::addr).collect(), plugin);
    let envoy = Envoy::start(name, &opts, &dir);
    envoy.wait_tokenizers(1);
    Stack {
        _dir: dir,
        _sims: sims,
        indexer,
        envoy,
    }
}

fn chat(seed: u64, stream: bool) -> Value {
    json!({"model": "qwen3", "max_tokens": 4, "stream": stream,
           "messages": [{"role": "system", "content": filler(seed, 40)},
                        {"role": "user", "content": format!("question {seed}")}]})
}

fn readyz(ix: &Indexer) -> Value {
    http(ix.port, "GET", "/readyz", &[], b"").json()
}

fn layout_routes_like_the_config(layout: &str) {
    let name = format!("tokens-layout-{layout}");
    let scratch_dir = scratch(&format!("{name}-files"));
    let files = model_layout(&scratch_dir, layout);
    let s = stack(
        &name,
        Some(&files),
        json!({"route_timeout_ms": 2000, "debug_headers": true, "models": {"qwen3": {}}}),
    );
    for (i, stream) in [false, true, false].into_iter().enumerate() {
        let r = post_json(
            s.envoy.port,
            "/v1/chat/completions",
            &chat(i as u64, stream),
            &[],
        );
        assert_eq!(r.status, 200, "{layout}: {}", r.text());
        assert_eq!(
            r.header("x-kvroute-fail-open"),
            None,
            "{layout}: the chat was not routed"
        );
        assert!(r.header("x-kvroute-replica").is_some(), "{layout}: routed");
        let text = r.text();
        if stream {
            assert!(
                !text.contains("token_ids"),
                "{layout}: ids left in the stream"
            );
            assert!(text.contains("data: [DONE]"), "{layout}: stream intact");
        } else {
            let v = r.json();
            assert!(v["prompt_token_ids"].is_null(), "{layout}: {v}");
            assert!(v["choices"][0]["token_ids"].is_null(), "{layout}: {v}");
            assert!(v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 40);
        }
    }
    // Every request was one of the model's first (sampled): the engine agreed each time.
    wait_for("the online checks", Duration::from_secs(30), || {
        s.envoy.kv("token_check.agreed") >= 3
    });
    assert_eq!(s.envoy.kv("token_check.disagreed"), 0);
    wait_for("the agreement reports", Duration::from_secs(30), || {
        s.indexer.metric("kvroute_indexer_token_checks_total") >= 3.0
    });
    // A replica that was busy at the indexer's last scrape and has sent no event since reads
    // as stale until the next scrape sees it idle (seconds on a loaded machine): read /readyz
    // until it settles, then judge it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ready = readyz(&s.indexer);
    while ready["status"] != "ready" && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
        ready = readyz(&s.indexer);
    }
    assert_eq!(ready["status"], "ready", "{layout}: {ready}");
    assert_eq!(
        s.indexer
            .metric("kvroute_indexer_tokenizer_digest_mismatch"),
        0.0,
        "{layout}: the filter loaded what the indexer loads"
    );
}

#[test]
fn a_template_in_chat_template_jinja_routes_chats() {
    layout_routes_like_the_config("jinja");
}

#[test]
fn a_template_in_chat_template_json_routes_chats() {
    layout_routes_like_the_config("json");
}

#[test]
fn a_template_in_tokenizer_config_routes_chats() {
    layout_routes_like_the_config("config");
}

#[test]
fn a_wrong_template_is_caught_online_and_the_model_fails_open() {
    // Renders every message without Qwen3's <|im_start|> markers: plausible, and wrong.
    let wrong = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\
                 {% if add_generation_prompt %}assistant: {% endif %}";
    let s = stack(
        "tokens-wrong-template",
        None,
        json!({"route_timeout_ms": 2000, "debug_headers": true,
               "token_check": {"sample_one_in": 1000, "first_requests": 2},
               "models": {"qwen3": {"tokenizer_options": {"chat_template": wrong}}}}),
    );
    let first = post_json(s.envoy.port, "/v1/chat/completions", &chat(1, false), &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(
        first.json()["prompt_token_ids"].is_null(),
        "the ids the filter asked for are taken out"
    );
    wait_for("the disagreement", Duration::from_secs(30), || {
        s.envoy.kv("token_check.disagreed") >= 1
    });
    // The model is no longer routed by prefix: its requests fail open, with their own reason.
    let next = post_json(s.envoy.port, "/v1/chat/completions", &chat(2, false), &[]);
    assert_eq!(next.status, 200, "served unrouted: {}", next.text());
    assert_eq!(next.header("x-kvroute-fail-open"), Some("token_mismatch"));
    assert!(s.envoy.kv("fail_open.token_mismatch") >= 1);
    // The indexer names it: /readyz, metrics.
    wait_for("the indexer to hear of it", Duration::from_secs(30), || {
        s.indexer.metric("kvroute_indexer_token_mismatch") == 1.0
    });
    let ready = readyz(&s.indexer);
    let problems = ready["problems"].to_string();
    assert_eq!(ready["status"], "degraded", "{ready}");
    assert!(
        problems.contains("token mismatch with the engine"),
        "{problems}"
    );
    assert!(
        problems.contains("the filter's tokenizer differs from the indexer's (template)"),
        "{problems}"
    );
    assert!(!problems.contains("question"), "no prompt text in /readyz");
}
