//! CPU of the filter's response path for one streamed response: feed a synthetic vLLM SSE stream
//! (one event per chunk, the usage event last) through the response scanner and read
//! `cached_tokens`. Run alone under callgrind for an instruction count that does not depend on
//! the machine's load (docs/performance.md):
//!
//! ```text
//! CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
//!   cargo build -p kvroute-filter --release --example response_scan
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!   target/release/examples/response_scan 100 2000
//! ```
//!
//! Arguments: responses (default 100), output tokens per response (default 2000). Prints the
//! wall time per response as well (noisy on a shared machine; callgrind's `Ir` / responses is the
//! number to compare).

use std::time::Instant;

use kvroute_filter::usage::UsageScanner;

fn stream(tokens: usize) -> Vec<Vec<u8>> {
    let mut chunks = Vec::with_capacity(tokens + 2);
    for i in 0..tokens {
        chunks.push(
            format!(
                "data: {{\"id\":\"chatcmpl-5f1c9a7e2b\",\"object\":\"chat.completion.chunk\",\
                 \"created\":1767225600,\"model\":\"qwen3\",\"choices\":[{{\"index\":0,\
                 \"delta\":{{\"content\":\" word{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
            )
            .into_bytes(),
        );
    }
    chunks.push(
        b"data: {\"id\":\"chatcmpl-5f1c9a7e2b\",\"object\":\"chat.completion.chunk\",\"created\":1767225600,\
          \"model\":\"qwen3\",\"choices\":[],\"usage\":{\"prompt_tokens\":7012,\"total_tokens\":9012,\
          \"completion_tokens\":2000,\"prompt_tokens_details\":{\"cached_tokens\":6992}}}\n\n"
            .to_vec(),
    );
    chunks.push(b"data: [DONE]\n\n".to_vec());
    chunks
}

fn main() {
    let mut args = std::env::args().skip(1);
    let responses: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(100);
    let tokens: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let chunks = stream(tokens);
    let bytes: usize = chunks.iter().map(Vec::len).sum();
    let started = Instant::now();
    let mut found = 0u64;
    for _ in 0..responses {
        let mut scanner = UsageScanner::new(1 << 20, true);
        for c in &chunks {
            scanner.push(std::hint::black_box(c));
        }
        found += scanner.cached_tokens().unwrap_or(0);
    }
    let per = started.elapsed().as_secs_f64() / responses as f64;
    assert_eq!(
        found,
        6992 * responses as u64,
        "the usage event was not found"
    );
    println!(
        "{responses} responses of {} chunks ({bytes} bytes): {:.1} us per response",
        chunks.len(),
        per * 1e6
    );
}
