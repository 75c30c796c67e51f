//! What the online token check costs the filter per sampled request, natively (the filter's
//! Wasm runs the same code in V8, typically 1.5-2x slower): asking for the ids (the request body
//! rewritten), reading them from the answer and taking them out again (a whole body, and a
//! stream of 64 chunks), the comparison and the report's JSON.
//!
//! `cargo run --release -p kvroute-filter --example token_check_cost`

use std::hint::black_box;
use std::time::Instant;

use kvroute_core::api::{AgreementReport, TokenCheck, TokenizerDigest};
use kvroute_filter::token_check::{add_return_token_ids, take_from_body, StreamIds};
use serde_json::json;

const OUTPUT_TOKENS: usize = 64;

fn ids(n: usize, seed: u32) -> Vec<u32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 151_000
        })
        .collect()
}

/// Median microseconds of `f` over `runs`.
fn median_us(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn main() {
    println!("prompt tokens | request rewrite us | whole body us | stream (64 chunks) us | compare+report us | bytes added to the answer");
    for prompt_tokens in [1_000usize, 4_000, 8_000] {
        let own = ids(prompt_tokens, 7);
        // ~4 bytes of text per token, the body the client sent.
        let request = json!({"model": "qwen3", "max_tokens": OUTPUT_TOKENS, "messages": [
            {"role": "user", "content": "word ".repeat(prompt_tokens)}]})
        .to_string()
        .into_bytes();
        let answer = json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "qwen3",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x".repeat(256)},
                "finish_reason": "length", "token_ids": ids(OUTPUT_TOKENS, 3)}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": OUTPUT_TOKENS},
            "prompt_token_ids": own})
        .to_string()
        .into_bytes();
        let plain = take_from_body(&answer, true).1.expect("rewritten");
        let mut stream = Vec::new();
        for i in 0..OUTPUT_TOKENS {
            let mut chunk = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": "tok"}, "token_ids": [i]}]});
            if i == 0 {
                chunk["prompt_token_ids"] = json!(own);
            }
            stream.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
        }
        stream.extend_from_slice(b"data: [DONE]\n\n");
        let chunks: Vec<&[u8]> = stream.split_inclusive(|b| *b == b'\n').collect();

        let rewrite = median_us(200, || {
            black_box(add_return_token_ids(black_box(&request)));
        });
        let whole = median_us(200, || {
            black_box(take_from_body(black_box(&answer), true));
        });
        let streamed = median_us(200, || {
            let mut s = StreamIds::new(true, 1 << 20);
            for (i, c) in chunks.iter().enumerate() {
                black_box(s.push(c, i + 1 == chunks.len()));
            }
            black_box(s.prompt_ids());
        });
        let digest = TokenizerDigest {
            tokenizer: "0123456789abcdef".into(),
            template: "0123456789abcdef".into(),
            options: "0123456789abcdef".into(),
        };
        let report = median_us(200, || {
            let check = TokenCheck::compare("chat", black_box(&own), black_box(&own));
            let r = AgreementReport {
                digest: digest.clone(),
                check: Some(check),
            };
            black_box(serde_json::to_vec(&r).ok());
        });
        println!(
            "{prompt_tokens:>13} | {rewrite:>18.1} | {whole:>13.1} | {streamed:>21.1} | {report:>17.1} | {}",
            answer.len() - plain.len()
        );
    }
}
