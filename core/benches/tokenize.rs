//! Tokenisation of Qwen3 chat requests: cold (segment cache cleared before every request) and
//! warm (a long conversation seen before, extended by a new turn).
//!
//! Needs the Qwen3 tokenizer (`KVROUTE_MODEL_DIR`, default
//! `target/kvroute-cache/models/qwen3`; `cargo xtask setup` fetches it).
//!
//! `cargo bench -p kvroute-core --bench tokenize`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use kvroute_core::request::{Endpoint, ModelFiles, ModelTokenizer, PromptTokens, TokenizerOptions};
use kvroute_testkit::paths::model_dir;
use serde_json::{json, Value};

/// Deterministic English-like text with code and lists, ~`words` words.
fn text(seed: u64, words: usize) -> String {
    const WORDS: [&str; 24] = [
        "routing",
        "cache",
        "prefix",
        "block",
        "replica",
        "token",
        "engine",
        "latency",
        "throughput",
        "scheduler",
        "memory",
        "kernel",
        "attention",
        "layer",
        "request",
        "prompt",
        "decode",
        "prefill",
        "batch",
        "queue",
        "worker",
        "shard",
        "the",
        "of",
    ];
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::new();
    for i in 0..words {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let w = WORDS[(x >> 33) as usize % WORDS.len()];
        out.push_str(w);
        out.push(match i % 97 {
            96 => '\n',
            40 => ',',
            _ => ' ',
        });
        if i % 301 == 300 {
            out.push_str(&format!(
                "\n\n```rust\nfn f_{i}(x: u32) -> u32 {{ x * {i} }}\n```\n\n- item {i}\n"
            ));
        }
    }
    out
}

/// A conversation of `turns` user/assistant turns of `words_per_turn` words each, then a user turn.
fn conversation(turns: usize, words_per_turn: usize, last: &str) -> Value {
    let mut messages = vec![json!({"role": "system", "content": text(1, 200)})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": text(10 + t as u64, words_per_turn)}));
        messages
            .push(json!({"role": "assistant", "content": text(1000 + t as u64, words_per_turn)}));
    }
    messages.push(json!({"role": "user", "content": last}));
    json!({"model": "qwen3", "messages": messages})
}

fn token_count(tk: &ModelTokenizer, body: &Value) -> usize {
    match tk.tokenize_request(Endpoint::ChatCompletions, body) {
        Ok(PromptTokens::Single(ids)) => ids.len(),
        other => panic!("tokenisation failed: {other:?}"),
    }
}

fn bench(c: &mut Criterion) {
    let files = ModelFiles::from_dir(model_dir())
        .expect("Qwen3 tokenizer not found: run `cargo xtask setup` or set KVROUTE_MODEL_DIR");
    let tk = ModelTokenizer::from_files(&files, TokenizerOptions::default()).expect("tokenizer");

    let mut group = c.benchmark_group("tokenize_chat");
    group.sample_size(20);
    // ~1k, ~8k, ~32k tokens: one long user message (cold) split over turns.
    for (label, turns, words) in [("1k", 1, 330), ("8k", 4, 700), ("32k", 16, 700)] {
        let body = conversation(turns, words, "Summarise the conversation.");
        let n = token_count(&tk, &body);
        eprintln!("{label}: {n} tokens");
        group.bench_with_input(BenchmarkId::new("cold", label), &body, |b, body| {
            b.iter(|| {
                tk.clear_cache();
                black_box(tk.tokenize_request(Endpoint::ChatCompletions, body).ok())
            })
        });
        group.bench_with_input(
            BenchmarkId::new("uncached_whole_text", label),
            &body,
            |b, body| {
                let text = tk.render_chat(body).expect("render");
                b.iter(|| black_box(tk.encode_text_uncached(&text, false).ok()))
            },
        );
    }

    // Warm: the previous request (~25k tokens) was seen; the new one adds an assistant reply and
    // a fresh ~2k-token user turn (different every iteration, so it is tokenised cold).
    let seen = conversation(15, 700, &text(77, 60));
    let extend = |seed: u64| {
        let mut next = seen.clone();
        if let Some(messages) = next["messages"].as_array_mut() {
            messages.push(json!({"role": "assistant", "content": text(78, 100)}));
            messages.push(json!({"role": "user", "content": text(seed, 1400)}));
        }
        next
    };
    eprintln!(
        "warm: seen {} tokens, new request {} tokens",
        token_count(&tk, &seen),
        token_count(&tk, &extend(79))
    );
    group.bench_function("warm_conversation/32k", |b| {
        tk.clear_cache();
        let _ = tk.tokenize_request(Endpoint::ChatCompletions, &seen);
        let mut seed = 1_000_000;
        b.iter_batched(
            || {
                seed += 1;
                extend(seed)
            },
            |next| black_box(tk.tokenize_request(Endpoint::ChatCompletions, &next).ok()),
            BatchSize::SmallInput,
        )
    });

    // Warm, one message: a ~30k-token document seen before, now with a fresh question appended
    // in the same message (served by line chunks).
    let doc = text(5, 23_000);
    let seen_doc = json!({"messages": [{"role": "user", "content": doc}]});
    let extend_doc = |seed: u64| json!({"messages": [{"role": "user", "content": format!("{doc}\n{}", text(seed, 1500))}]});
    eprintln!(
        "warm single message: seen {} tokens, new request {} tokens",
        token_count(&tk, &seen_doc),
        token_count(&tk, &extend_doc(6))
    );
    group.bench_function("warm_single_message/32k", |b| {
        tk.clear_cache();
        let _ = tk.tokenize_request(Endpoint::ChatCompletions, &seen_doc);
        let mut seed = 2_000_000;
        b.iter_batched(
            || {
                seed += 1;
                extend_doc(seed)
            },
            |next| black_box(tk.tokenize_request(Endpoint::ChatCompletions, &next).ok()),
            BatchSize::SmallInput,
        )
    });
    let next = extend(79);
    group.bench_function("render_only/32k", |b| {
        b.iter(|| black_box(tk.render_chat(&next).ok()))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
