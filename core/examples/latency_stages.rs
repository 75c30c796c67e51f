//! Where the filter's time goes on one request, natively and without Envoy: the cold path of an
//! ~8k- and a ~32k-token chat (the filter benchmark's prompts, `kvroute_testkit::text::
//! chat_conversation`) split into JSON parse, chat template, added-token split + normaliser,
//! pre-tokenisation, BPE and router keys; and the warm path (earlier turns in the segment cache,
//! a new last turn); and a `/v1/completions` body whose prompt is 8k or 48k token ids, through
//! the `Value` parse and through `RequestBody`'s fast path. A measurement, not a test: it prints
//! the minimum and median over rounds.
//!
//! `cargo run --release -p kvroute-core --example latency_stages [rounds] [warm]` (`warm`: only
//! the warm path, e.g. under `perf record`).
//!
//! Needs the Qwen3 tokenizer (`cargo xtask setup`; `KVROUTE_MODEL_DIR` overrides).

use std::hint::black_box;
use std::time::Instant;

use kvroute_core::hashing::ExtraKeyStyle;
use kvroute_core::request::{
    parse_body, request_extras, Endpoint, ModelFiles, ModelTokenizer, PromptTokens, RequestBody,
    TokenizerOptions,
};
use kvroute_core::router_key::request_keys;
use kvroute_testkit::paths::model_dir;
use kvroute_testkit::text::chat_conversation;
use tokenizers::{Model, OffsetType, PreTokenizer, Tokenizer};

/// Block size of the keys (vLLM's default).
const BLOCK_SIZE: usize = 16;

/// Milliseconds taken by `f`, and its result.
fn timed<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let t = Instant::now();
    let out = f();
    (t.elapsed().as_secs_f64() * 1e3, out)
}

/// Minimum and median of a sample.
fn min_median(mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[0], xs[xs.len() / 2])
}

fn tokens_of(result: PromptTokens) -> Vec<u32> {
    match result {
        PromptTokens::Single(ids) => ids,
        PromptTokens::Batch(_) | PromptTokens::Partial(_) => {
            panic!("a text-only chat is one whole prompt")
        }
    }
}

/// One cold request's stages, ms, in the order of [`STAGES`].
const STAGES: [&str; 9] = [
    "json parse",
    "chat template",
    "tokenizers crate: added tokens + normaliser",
    "tokenizers crate: pre-tokenisation",
    "tokenizers crate: BPE",
    "tokenizers crate: whole (encode_fast)",
    "kvroute: segments, piece encoder",
    "router keys",
    "whole cold path (parse..keys)",
];

fn cold_stages(
    tk: &ModelTokenizer,
    nocache: &ModelTokenizer,
    raw_tk: &Tokenizer,
    bytes: &[u8],
) -> ([f64; 9], usize) {
    let (parse, body) = timed(|| parse_body(bytes).expect("JSON"));
    let (render, text) = timed(|| tk.render_chat(&body).expect("render"));
    let (split, mut pretok) = timed(|| {
        raw_tk
            .get_added_vocabulary()
            .extract_and_normalize(raw_tk.get_normalizer(), &text)
    });
    let pre_tokenizer = raw_tk.get_pre_tokenizer().expect("a pre-tokenizer");
    let (pre, ()) = timed(|| {
        pre_tokenizer
            .pre_tokenize(&mut pretok)
            .expect("pre-tokenize")
    });
    let model = raw_tk.get_model();
    let (bpe, ()) = timed(|| pretok.tokenize(|n| model.tokenize(n.get())).expect("BPE"));
    let staged = pretok
        .into_encoding(None, 0, OffsetType::Char)
        .expect("encoding");
    let (whole_tokenizer, enc) =
        timed(|| raw_tk.encode_fast(text.as_str(), false).expect("encode"));
    assert_eq!(
        staged.get_ids(),
        enc.get_ids(),
        "staged tokenisation differs"
    );
    let (segmented, ids) = timed(|| nocache.encode_text(&text, false).expect("encode"));
    assert_eq!(ids, enc.get_ids(), "the piece encoder differs");

    let extras = request_extras(&body, &|_| None);
    let (keys, _) = timed(|| {
        black_box(request_keys(
            enc.get_ids(),
            BLOCK_SIZE,
            &extras,
            ExtraKeyStyle::default(),
        ))
    });
    tk.clear_cache();
    let (whole, n) = timed(|| {
        let body = parse_body(bytes).expect("JSON");
        let ids = tokens_of(
            tk.tokenize_request(Endpoint::ChatCompletions, &body)
                .expect("tokenize"),
        );
        black_box(request_keys(
            &ids,
            BLOCK_SIZE,
            &request_extras(&body, &|_| None),
            ExtraKeyStyle::default(),
        ));
        ids.len()
    });
    (
        [
            parse,
            render,
            split,
            pre,
            bpe,
            whole_tokenizer,
            segmented,
            keys,
            whole,
        ],
        n,
    )
}

/// One warm request (earlier turns cached): the whole path, the new turn's text tokenised alone,
/// and the same request again with every segment cached.
fn warm_stages(
    tk: &ModelTokenizer,
    nocache: &ModelTokenizer,
    seed: u64,
    tokens: usize,
    last: u64,
) -> [f64; 5] {
    let bytes = chat_conversation(seed, tokens, last)
        .to_string()
        .into_bytes();
    let path = |bytes: &[u8]| {
        let body = parse_body(bytes).expect("JSON");
        let ids = tokens_of(
            tk.tokenize_request(Endpoint::ChatCompletions, &body)
                .expect("tokenize"),
        );
        black_box(request_keys(
            &ids,
            BLOCK_SIZE,
            &request_extras(&body, &|_| None),
            ExtraKeyStyle::default(),
        ));
    };
    let (warm, ()) = timed(|| path(&bytes));
    let (all_cached, ()) = timed(|| path(&bytes));
    let body = parse_body(&bytes).expect("JSON");
    let last_turn = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .expect("a last turn")
        .to_owned();
    let (new_turn, _) = timed(|| nocache.encode_text(&last_turn, false).expect("encode"));
    let (parse, _) = timed(|| black_box(parse_body(&bytes).expect("JSON")));
    let (render, _) = timed(|| black_box(tk.render_chat(&body).expect("render")));
    [warm, new_turn, all_cached, parse, render]
}

/// A `/v1/completions` body of `n` token ids (varied widths, as a real vocabulary gives).
fn id_prompt_body(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let ids: Vec<u32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % 151_000) as u32
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({"model": "qwen3", "prompt": ids, "max_tokens": 64}))
        .expect("json")
}

/// Body to router keys for a token-id prompt: the `Value` path and the `RequestBody` path.
fn id_prompt_stages(tk: &ModelTokenizer, bytes: &[u8]) -> [f64; 2] {
    let keys = |ids: &[u32]| {
        black_box(request_keys(
            ids,
            BLOCK_SIZE,
            &request_extras(&serde_json::Value::Null, &|_| None),
            ExtraKeyStyle::default(),
        ));
    };
    let (value, ()) = timed(|| {
        let body = parse_body(bytes).expect("JSON");
        let ids = tokens_of(
            tk.tokenize_request_capped(Endpoint::Completions, &body, 1 << 20)
                .expect("ids"),
        );
        keys(&ids);
    });
    let (fast, ()) = timed(|| {
        let body = RequestBody::parse(bytes, Endpoint::Completions).expect("JSON");
        let ids = tokens_of(
            tk.tokenize_body_capped(Endpoint::Completions, &body, 1 << 20)
                .expect("ids"),
        );
        keys(&ids);
    });
    [value, fast]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("rounds: a number"))
        .unwrap_or(7);
    let files = ModelFiles::from_dir(model_dir())
        .expect("Qwen3 tokenizer not found: run `cargo xtask setup` or set KVROUTE_MODEL_DIR");
    let tk = ModelTokenizer::from_files(&files, TokenizerOptions::default()).expect("tokenizer");
    let nocache = ModelTokenizer::from_files(
        &files,
        TokenizerOptions {
            segment_cache_max_bytes: 0,
            segment_cache_max_entries: 0,
            ..TokenizerOptions::default()
        },
    )
    .expect("tokenizer");
    let raw_tk = Tokenizer::from_bytes(&files.tokenizer_json).expect("tokenizer.json");
    println!(
        "load average: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!("{rounds} rounds; ms, min / median\n");
    let warm_only = std::env::args().nth(2).as_deref() == Some("warm");

    for tokens in [8000usize, 32000].into_iter().filter(|_| !warm_only) {
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); STAGES.len()];
        let mut n_tokens = 0;
        for round in 0..rounds as u64 {
            // New text every round: nothing in the segment cache nor in the BPE's word cache
            // beyond what the filler's small vocabulary puts there.
            let body = chat_conversation(tokens as u64 * 100 + round, tokens, 800_000 + round);
            let (stages, n) = cold_stages(&tk, &nocache, &raw_tk, body.to_string().as_bytes());
            n_tokens = n;
            for (s, v) in samples.iter_mut().zip(stages) {
                s.push(v);
            }
        }
        println!("cold ~{}k chat ({n_tokens} tokens)", tokens / 1000);
        for (name, s) in STAGES.iter().zip(samples) {
            let (min, med) = min_median(s);
            println!("  {name:<44} {min:>8.3} / {med:>8.3}");
        }
    }

    for tokens in [8000usize, 48000] {
        let names = ["Value parse + ids + keys", "RequestBody + ids + keys"];
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        for round in 0..rounds.max(3) as u64 * 3 {
            let stages = id_prompt_stages(&tk, &id_prompt_body(tokens, round));
            for (s, v) in samples.iter_mut().zip(stages) {
                s.push(v);
            }
        }
        println!("~{}k token-id completion prompt", tokens / 1000);
        for (name, s) in names.iter().zip(samples) {
            let (min, med) = min_median(s);
            println!("  {name:<44} {min:>8.3} / {med:>8.3}");
        }
    }

    for tokens in [8000usize, 32000] {
        let seed = tokens as u64 * 7 + 1;
        tk.clear_cache();
        let _ = tk.tokenize_request(
            Endpoint::ChatCompletions,
            &chat_conversation(seed, tokens, 900_000),
        );
        let names = [
            "whole warm path (parse..keys)",
            "new last turn tokenised alone",
            "same request, all cached",
            "json parse alone",
            "chat template alone",
        ];
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        for round in 0..rounds.max(3) as u64 * 3 {
            let stages = warm_stages(&tk, &nocache, seed, tokens, 900_001 + round);
            for (s, v) in samples.iter_mut().zip(stages) {
                s.push(v);
            }
        }
        println!(
            "warm ~{}k chat (earlier turns seen, new last turn)",
            tokens / 1000
        );
        for (name, s) in names.iter().zip(samples) {
            let (min, med) = min_median(s);
            println!("  {name:<44} {min:>8.3} / {med:>8.3}");
        }
    }
}
