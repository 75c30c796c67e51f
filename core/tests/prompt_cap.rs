//! The prompt token cap on the real Qwen3 tokenizer: prompts within it get exactly the uncapped
//! ids; longer ones are refused (`PromptTooLong`), before tokenising when their size says so and
//! otherwise while tokenising, with a working set that follows the cap and not the prompt. Peak
//! heap is measured with a counting allocator (run with `--nocapture` to see the figures).

use std::sync::Mutex;

use kvroute_core::request::{
    Endpoint, ModelFiles, ModelTokenizer, PromptTokens, RequestError, TokenizerOptions,
    MAX_PROMPT_BYTES_PER_TOKEN,
};
use kvroute_testkit::counting_alloc::CountingAllocator;
use serde_json::{json, Value};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

/// Serialises the tests: the peak counter is process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

/// Heap bytes allocated at the peak of `f`, above what was live before it.
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    HEAP.peak_during(f)
}

fn tokenizer() -> ModelTokenizer {
    let dir = kvroute_testkit::paths::model_dir();
    let read = |f: &str| {
        std::fs::read(dir.join(f)).unwrap_or_else(|e| {
            panic!(
                "{} missing ({e}): run `cargo xtask setup`",
                dir.join(f).display()
            )
        })
    };
    let files = ModelFiles {
        tokenizer_json: read("tokenizer.json"),
        tokenizer_config_json: read("tokenizer_config.json"),
    };
    ModelTokenizer::from_files(&files, TokenizerOptions::default()).expect("Qwen3 loads")
}

fn chat(content: &str) -> Value {
    json!({"model": "qwen3", "messages": [{"role": "user", "content": content}]})
}

fn single(t: PromptTokens) -> Vec<u32> {
    match t {
        PromptTokens::Single(ids) => ids,
        other => panic!("expected one prompt, got {other:?}"),
    }
}

fn too_long(r: &Result<PromptTokens, RequestError>, cap: usize) -> bool {
    matches!(r, Err(RequestError::PromptTooLong { limit }) if *limit == cap)
}

#[test]
fn qwen3_announces_its_context() {
    assert_eq!(tokenizer().model_max_length(), Some(131_072));
}

#[test]
fn prompts_within_the_cap_keep_their_exact_ids() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let tok = tokenizer();
    let turn = "KV-cache aware routing sends a request to the replica holding its prefix.\n";
    let body = json!({"model": "qwen3", "messages": [
        {"role": "system", "content": turn.repeat(40)},
        {"role": "user", "content": "Explain it <think>briefly</think>."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": turn.repeat(10)}]});
    let exact = single(
        tok.tokenize_request(Endpoint::ChatCompletions, &body)
            .expect("ok"),
    );
    let n = exact.len();
    let capped = tok.tokenize_request_capped(Endpoint::ChatCompletions, &body, n);
    assert_eq!(single(capped.expect("fits exactly")), exact);
    tok.clear_cache();
    let r = tok.tokenize_request_capped(Endpoint::ChatCompletions, &body, n - 1);
    assert!(too_long(&r, n - 1), "{r:?}");

    // One line longer than a counting chunk (64 KiB), within the cap: counted, then exact.
    let line = "the quick brown fox jumps over the lazy dog ".repeat(2_500);
    assert!(line.len() > 64 * 1024);
    let exact = single(
        tok.tokenize_request(Endpoint::ChatCompletions, &chat(&line))
            .expect("ok"),
    );
    tok.clear_cache();
    let capped = tok.tokenize_request_capped(Endpoint::ChatCompletions, &chat(&line), 30_000);
    assert_eq!(single(capped.expect("fits")), exact);

    // Completions: text, ids and batches are capped per prompt.
    let ids: Vec<u32> = (0..100).collect();
    let r = tok.tokenize_request_capped(Endpoint::Completions, &json!({"prompt": ids}), 99);
    assert!(too_long(&r, 99), "{r:?}");
    let r = tok.tokenize_request_capped(
        Endpoint::Completions,
        &json!({"prompt": ["short", "word ".repeat(200)]}),
        100,
    );
    assert!(too_long(&r, 100), "{r:?}");
    let ok = tok.tokenize_request_capped(
        Endpoint::Completions,
        &json!({"prompt": "hello world"}),
        100,
    );
    assert!(ok.is_ok());
}

#[test]
fn the_digit_bomb_is_refused_with_a_bounded_working_set() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let tok = tokenizer();
    let cap = 131_072;

    // Working set of the tokenizer per token (Qwen3 splits every digit: one token per byte).
    let n = 200_000;
    let digits = "7".repeat(n);
    let (ids, peak) = peak_of(|| tok.encode_text_uncached(&digits, false).expect("ok"));
    assert_eq!(ids.len(), n);
    let per_token = peak / n;
    println!("tokenizer working set: {peak} bytes for {n} tokens = {per_token} B/token");
    drop(ids);

    // The request: 3.9 MB of digits. Refused from its size: the tokenizer never runs.
    let bomb = chat(&"7".repeat(3_900_000));
    let (r, peak) = peak_of(|| tok.tokenize_request_capped(Endpoint::ChatCompletions, &bomb, cap));
    assert!(too_long(&r, cap), "{r:?}");
    println!("3.9 MB digits, cap {cap}: refused before tokenising, peak {peak} bytes");
    assert!(
        peak < 3_900_000 * 8,
        "only copies of the text, no tokenizer working set: {peak}"
    );

    // Under the size bound (1.5 MB < 131072 x 16 bytes) but 1.5 M tokens: stopped while counting.
    let text = "7".repeat(1_500_000);
    assert!(text.len() < cap * MAX_PROMPT_BYTES_PER_TOKEN);
    let body = chat(&text);
    let (r, peak) = peak_of(|| tok.tokenize_request_capped(Endpoint::ChatCompletions, &body, cap));
    assert!(too_long(&r, cap), "{r:?}");
    println!(
        "1.5 MB digits, cap {cap}: refused while tokenising, peak {peak} bytes (uncapped would need ~{} bytes)",
        per_token * 1_500_000
    );
    // Uncapped, the tokenizer alone would hold ~1.5 M x per_token (>100 MB).
    assert!(
        peak < 1_500_000 * 8 + 64 * 1024 * per_token * 2,
        "working set follows the chunk, not the prompt: {peak}"
    );

    // Digits split by newlines (pieces of ~2 KiB each): stopped by the running count.
    let lines = "7777777777\n".repeat(140_000);
    let body = chat(&lines);
    let (r, peak) = peak_of(|| tok.tokenize_request_capped(Endpoint::ChatCompletions, &body, cap));
    assert!(too_long(&r, cap), "{r:?}");
    println!("1.5 MB of digit lines, cap {cap}: refused, peak {peak} bytes");
    assert!(peak < lines.len() * 8 + cap * per_token * 2, "{peak}");
}

#[test]
fn real_text_is_far_below_the_bytes_per_token_bound() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let tok = tokenizer();
    let samples = [
        ("english", "Routing a request to the replica that already holds its prompt prefix in the KV cache saves the prefill of that prefix: the time to first token drops, and the fleet serves more requests with the same GPUs. "),
        ("chinese", "键值缓存感知路由把请求发送到已经缓存了其提示前缀的副本上，从而省去这部分前缀的预填充计算，首个令牌的延迟随之下降，整个集群可以用同样的显卡服务更多的请求。"),
        ("japanese", "キー・バリューキャッシュを考慮したルーティングは、プロンプトの接頭辞をすでに保持しているレプリカへリクエストを送り、その部分の事前計算を省きます。"),
        ("code", "fn main() {\n    let mut total = 0u64;\n    for (i, line) in std::io::stdin().lines().enumerate() {\n        total += line.map(|l| l.len() as u64).unwrap_or(0) * i as u64;\n    }\n    println!(\"{total}\");\n}\n"),
        ("indented", &format!("{}\n", "                                if x { y(); }\n".repeat(20))),
    ];
    for (name, text) in samples {
        let n = tok.encode_text_uncached(text, false).expect("ok").len();
        let ratio = text.len() as f64 / n as f64;
        println!(
            "{name}: {} bytes / {n} tokens = {ratio:.2} bytes/token",
            text.len()
        );
        assert!(
            ratio * 2.0 < MAX_PROMPT_BYTES_PER_TOKEN as f64,
            "{name}: {ratio:.2} bytes/token leaves no margin under the bound"
        );
    }
}
