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
