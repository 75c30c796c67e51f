//! The engine's `cached_tokens`, read from the final `usage` of a response with bounded memory and
//! without parsing every chunk.
//!
//! * A streamed response (`text/event-stream`) is split into lines as it passes; a line is kept
//!   only when it is a `data:` line holding a `"usage": {` object, replacing the one kept before,
//!   and only the unfinished last line of a chunk is carried to the next. Nothing is parsed until
//!   the end, and then only that one line: the last SSE event carrying `usage`. Memory: two lines
//!   of at most [`SSE_LINE_CAP`] bytes (a longer line is skipped).
//! * A JSON response is kept whole up to `limit` bytes and parsed once at its end.

use std::sync::OnceLock;

use memchr::memmem::Finder;
use serde_json::Value;

/// Longest SSE line kept (vLLM's usage event is a few hundred bytes).
pub const SSE_LINE_CAP: usize = 64 * 1024;

/// The key searched for in SSE lines.
const USAGE_KEY: &[u8] = b"\"usage\"";

/// The searcher of [`USAGE_KEY`], built once.
fn usage_finder() -> &'static Finder<'static> {
    static FINDER: OnceLock<Finder<'static>> = OnceLock::new();
    FINDER.get_or_init(|| Finder::new(USAGE_KEY))
}

/// `usage.prompt_tokens_details.cached_tokens` of one response object.
pub fn cached_tokens_of(v: &Value) -> Option<u64> {
    v.get("usage")?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

/// `cached_tokens` of a complete non-streaming JSON response.
pub fn cached_tokens_from_json(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    cached_tokens_of(&v)
}

/// `cached_tokens` of one SSE `data:` line.
fn cached_tokens_from_data_line(line: &[u8]) -> Option<u64> {
    let data = line.strip_prefix(b"data:")?;
    cached_tokens_from_json(data)
}

/// True when `line` is a `data:` line with a `"usage"` key whose value is an object (not the
/// `"usage": null` some engines put in every chunk). Quotes inside JSON strings are escaped, so
/// the key cannot match text of the response.
fn holds_usage_object(line: &[u8]) -> bool {
    if !line.starts_with(b"data:") {
        return false;
    }
    usage_finder().find_iter(line).any(|at| {
        let mut rest = line[at + USAGE_KEY.len()..]
            .iter()
            .skip_while(|b| b.is_ascii_whitespace());
        rest.next() == Some(&b':') && rest.find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
    })
}

/// Collects what is needed to read `cached_tokens` at the end of a response.
#[derive(Debug)]
pub struct UsageScanner {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// A JSON body, kept whole while at most `limit` bytes (`None` once over).
    Json {
        limit: usize,
        whole: Option<Vec<u8>>,
    },
    /// A server-sent event stream.
    Sse(SseLines),
}

#[derive(Debug)]
struct SseLines {
    /// The unfinished line at the end of the last chunk.
    partial: Vec<u8>,
    /// The unfinished line outgrew [`SSE_LINE_CAP`]: skipped up to its end.
    skipping: bool,
    /// The last complete `data:` line holding a usage object.
    last_usage: Vec<u8>,
}

impl SseLines {
    fn new() -> Self {
        Self {
            partial: Vec::new(),
            skipping: false,
            last_usage: Vec::new(),
        }
    }

    fn push(&mut self, chunk: &[u8]) {
        // Most chunks are token events: nothing carried over and no usage key anywhere in the
        // chunk, so none of its complete lines can be kept; only its unfinished end is carried.
        // One search over the chunk instead of one per line.
        if self.partial.is_empty() && !self.skipping && usage_finder().find(chunk).is_none() {
            let unfinished = memchr::memrchr(b'\n', chunk).map_or(chunk, |nl| &chunk[nl + 1..]);
            self.extend_partial(unfinished);
            return;
        }
        let mut rest = chunk;
        while let Some(nl) = memchr::memchr(b'\n', rest) {
            let piece = &rest[..nl];
            if self.partial.is_empty() && !self.skipping {
                // The common case: a whole line inside the chunk, looked at in place.
                self.line_ended(piece);
            } else {
                self.extend_partial(piece);
                let line = std::mem::take(&mut self.partial);
                if !self.skipping {
                    self.line_ended(&line);
                }
                self.partial = line;
                self.partial.clear();
                self.skipping = false;
            }
            rest = &rest[nl + 1..];
        }
        self.extend_partial(rest);
    }

    fn extend_partial(&mut self, piece: &[u8]) {
        if self.skipping || piece.is_empty() {
            return;
        }
        if self.partial.len() + piece.len() > SSE_LINE_CAP {
            self.skipping = true;
            self.partial.clear();
        } else {
            self.partial.extend_from_slice(piece);
        }
    }

    fn line_ended(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.len() <= SSE_LINE_CAP && holds_usage_object(line) {
            self.last_usage.clear();
            self.last_usage.extend_from_slice(line);
        }
    }

    fn cached_tokens(&self) -> Option<u64> {
        // A stream that ended without a final newline: its last line counts too.
        if !self.skipping && holds_usage_object(&self.partial) {
            if let Some(t) = cached_tokens_from_data_line(&self.partial) {
                return Some(t);
            }
        }
        cached_tokens_from_data_line(&self.last_usage)
    }

    fn held_bytes(&self) -> usize {
        self.partial.capacity() + self.last_usage.capacity()
    }
}

impl UsageScanner {
    /// `limit`: bytes of a JSON body kept whole; `streaming`: a `text/event-stream` response.
    pub fn new(limit: usize, streaming: bool) -> Self {
        let kind = if streaming {
            Kind::Sse(SseLines::new())
        } else {
            Kind::Json {
                limit,
                whole: Some(Vec::new()),
            }
        };
        Self { kind }
    }

    /// Whether the response is a `text/event-stream`.
    pub fn streaming(&self) -> bool {
        matches!(self.kind, Kind::Sse(_))
    }

    /// Feeds one body chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        match &mut self.kind {
            Kind::Sse(lines) => lines.push(chunk),
            Kind::Json { limit, whole } => {
                if let Some(w) = whole {
                    if w.len() + chunk.len() > *limit {
                        *whole = None;
                    } else {
                        w.extend_from_slice(chunk);
                    }
                }
            }
        }
    }

    /// `cached_tokens` of what was fed, if the response carried it.
    pub fn cached_tokens(&self) -> Option<u64> {
        match &self.kind {
            Kind::Sse(lines) => lines.cached_tokens(),
            Kind::Json { whole, .. } => whole.as_deref().and_then(cached_tokens_from_json),
        }
    }

    /// Bytes this scanner holds (for tests of its bound).
    pub fn held_bytes(&self) -> usize {
        match &self.kind {
            Kind::Sse(lines) => lines.held_bytes(),
            Kind::Json { whole, .. } => whole.as_ref().map_or(0, Vec::capacity),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: &[u8] = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";

    fn token_event(i: usize) -> Vec<u8> {
        format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"w{i}\"}}}}],\"usage\":null}}\n\n")
            .into_bytes()
    }

    fn sse(chunks: &[&[u8]]) -> UsageScanner {
        let mut s = UsageScanner::new(0, true);
        for c in chunks {
            s.push(c);
        }
        s
    }

    #[test]
    fn the_last_usage_event_of_a_stream_is_read() {
        let first = token_event(1);
        assert_eq!(
            sse(&[&first, USAGE, b"data: [DONE]\n\n"]).cached_tokens(),
            Some(32)
        );
        let earlier = b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\n";
        assert_eq!(
            sse(&[earlier, &first, USAGE]).cached_tokens(),
            Some(32),
            "the last one wins"
        );
        assert_eq!(
            sse(&[USAGE, &first, b"data: [DONE]\n\n"]).cached_tokens(),
            Some(32),
            "usage: null later does not hide it"
        );
    }

    #[test]
    fn usage_split_across_chunks_at_every_byte_is_read() {
        let mut stream = token_event(7);
        stream.extend_from_slice(USAGE);
        stream.extend_from_slice(b"data: [DONE]\n\n");
        for cut in 0..=stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(sse(&[a, b]).cached_tokens(), Some(32), "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(sse(&bytes).cached_tokens(), Some(32), "one byte per chunk");
    }

    /// A token event as vLLM streams it: no `usage` key at all until the final event.
    fn vllm_token_event(i: usize) -> Vec<u8> {
        format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"w{i}\"}}}}]}}\n\n").into_bytes()
    }

    #[test]
    fn token_events_without_a_usage_key_are_passed_over_at_every_cut() {
        // Chunks of whole token events take the one-search path; the usage event then starts in
        // one chunk and ends in the next, wherever the cut falls.
        let mut stream: Vec<u8> = (0..3).flat_map(vllm_token_event).collect();
        stream.extend_from_slice(USAGE);
        stream.extend_from_slice(b"data: [DONE]\n\n");
        for cut in 0..=stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(sse(&[a, b]).cached_tokens(), Some(32), "cut at {cut}");
        }
        let events: Vec<Vec<u8>> = (0..50).map(vllm_token_event).collect();
        let refs: Vec<&[u8]> = events.iter().map(Vec::as_slice).collect();
        let scanner = sse(&refs);
        assert_eq!(scanner.cached_tokens(), None);
        assert_eq!(
            scanner.held_bytes(),
            0,
            "nothing is carried between whole events"
        );
    }

    #[test]
    fn a_stream_without_usage_has_none() {
        let events: Vec<Vec<u8>> = (0..50).map(token_event).collect();
        let refs: Vec<&[u8]> = events.iter().map(Vec::as_slice).collect();
        assert_eq!(sse(&refs).cached_tokens(), None);
        assert_eq!(sse(&[b"data: [DONE]\n\n"]).cached_tokens(), None);
        assert_eq!(
            sse(&[b": comment \"usage\": {\n", b"event: x\n"]).cached_tokens(),
            None,
            "only data lines count"
        );
        assert_eq!(
            sse(&[b"data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\": {\"}}]}\n"])
                .cached_tokens(),
            None,
            "the key inside generated text is escaped"
        );
    }

    #[test]
    fn crlf_lines_and_an_unterminated_last_line_are_read() {
        let crlf = b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":5}}}\r\n\r\n";
        assert_eq!(sse(&[crlf]).cached_tokens(), Some(5));
        let open = b"data: {\"usage\" : {\"prompt_tokens_details\":{\"cached_tokens\":6}}}";
        assert_eq!(sse(&[open]).cached_tokens(), Some(6));
    }

    #[test]
    fn huge_streams_stay_bounded() {
        let mut s = UsageScanner::new(0, true);
        let event = token_event(3);
        for _ in 0..100_000 {
            s.push(&event);
        }
        // A line longer than the cap, in pieces and in one chunk: skipped, not held.
        let giant = vec![b'x'; 3 * SSE_LINE_CAP];
        for piece in giant.chunks(1000) {
            s.push(piece);
        }
        s.push(b"\n");
        s.push(&giant);
        s.push(b"\n");
        s.push(USAGE);
        assert!(s.held_bytes() <= 2 * SSE_LINE_CAP, "{}", s.held_bytes());
        assert_eq!(s.cached_tokens(), Some(32));
        let mut huge_usage =
            b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":9}},\"x\":\"".to_vec();
        huge_usage.extend(std::iter::repeat_n(b'y', SSE_LINE_CAP));
        huge_usage.extend_from_slice(b"\"}\n");
        s.push(&huge_usage);
        assert_eq!(
            s.cached_tokens(),
            Some(32),
            "a usage line over the cap is not kept"
        );
        assert!(s.held_bytes() <= 2 * SSE_LINE_CAP, "{}", s.held_bytes());
    }

    #[test]
    fn json_bodies_are_read_whole_within_the_limit() {
        let body = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let mut s = UsageScanner::new(1024, false);
        for piece in body.chunks(10) {
            s.push(piece);
        }
        assert!(!s.streaming());
        assert_eq!(s.cached_tokens(), Some(32));
        let mut s = UsageScanner::new(16, false);
        s.push(&body[..10]);
        s.push(&body[10..]);
        assert_eq!(s.cached_tokens(), None, "over the limit: gives up");
        assert_eq!(s.held_bytes(), 0);
        assert_eq!(
            cached_tokens_from_json(br#"{"usage":{"prompt_tokens":4}}"#),
            None
        );
    }
}
