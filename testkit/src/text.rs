//! Deterministic filler text for prompts.

/// Deterministic filler text of roughly `words` words (about 1.3 tokens per word).
pub fn filler(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 24] = [
        "cache", "replica", "prefix", "token", "router", "block", "engine", "latency", "memory",
        "policy", "stream", "event", "index", "request", "model", "batch", "queue", "warm", "cold",
        "hit", "miss", "score", "load", "fleet",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
        out.push(if i % 17 == 16 { '.' } else { ' ' });
        if i % 17 == 16 {
            out.push(' ');
        }
    }
    out
}

/// About `tokens` tokens of Qwen3 chat (the filter benchmark's prompts): a system prompt, then
/// user/assistant turns of ~500 tokens each, then a last user turn made from `last_turn_seed`
/// (same `seed`, new `last_turn_seed`: the same earlier turns with a new last one).
pub fn chat_conversation(seed: u64, tokens: usize, last_turn_seed: u64) -> serde_json::Value {
    use serde_json::json;
    let words_per_1k = 760; // filler() gives ~1.3 tokens per word
    let turns = (tokens / 1000).max(1);
    let mut messages = vec![json!({"role": "system", "content": filler(seed, words_per_1k / 2)})];
    for t in 0..turns.saturating_sub(1) {
        messages.push(
            json!({"role": "user", "content": filler(seed * 1000 + t as u64, words_per_1k / 2)}),
        );
        messages.push(
            json!({"role": "assistant", "content": filler(seed * 2000 + t as u64, words_per_1k / 2)}),
        );
    }
    messages.push(json!({"role": "user", "content": filler(last_turn_seed, words_per_1k / 2)}));
    json!({"model": "qwen3", "max_tokens": 1, "messages": messages})
}
