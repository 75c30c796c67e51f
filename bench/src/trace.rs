//! `--trace FILE`: any Mooncake-format JSONL trace (`timestamp` ms, `input_length`,
//! `output_length`, `hash_ids`, optional `session`) replayed as a workload, through the same
//! parser and expansion as the shipped traces. User files get no checksum.

use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::workloads::{self, MooncakeWindow, RecordSource, Workload};

/// How to cut and pace a user trace.
#[derive(Debug, Clone, Copy)]
pub struct TraceOptions {
    /// Tokens per hash id (Mooncake's traces: 512).
    pub block_tokens: u32,
    /// Arrival compression: timestamps are divided by this.
    pub rate: f64,
    /// First record replayed (0-based).
    pub start: usize,
    /// Records replayed at most (`None`: to the end).
    pub count: Option<usize>,
    /// Records with input + output above this are dropped (and reported).
    pub max_model_len: u32,
    /// Output tokens are capped at this.
    pub max_output_tokens: u32,
}

/// The workload name of a trace file: its stem, lower-cased, runs of anything but `[a-z0-9]`
/// turned into one `-` (`toolagent_trace.jsonl` -> `toolagent-trace`); `taken` names (the
/// built-in workloads) get a `trace-` prefix.
pub fn workload_name(path: &Path, taken: &[&str]) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let mut name = String::new();
    for c in stem.chars() {
        if c.is_ascii_alphanumeric() {
            name.push(c);
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    let name = name.trim_end_matches('-').to_string();
    if name.is_empty() {
        "trace".to_string()
    } else if taken.contains(&name.as_str()) {
        format!("trace-{name}")
    } else {
        name
    }
}

/// Reads `path` and builds its workload named `name`.
pub fn load(path: &Path, name: &str, opts: TraceOptions) -> Result<Workload> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let records =
        workloads::parse_mooncake(&text).with_context(|| format!("parsing {}", path.display()))?;
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    build(&file, name, &records, opts)
}

/// Builds the workload of parsed `records` (`file` names them in the description).
pub fn build(
    file: &str,
    name: &str,
    records: &[workloads::MooncakeRecord],
    opts: TraceOptions,
) -> Result<Workload> {
    if !(opts.rate.is_finite() && opts.rate > 0.0) {
        bail!("--trace-rate must be > 0, got {}", opts.rate);
    }
    if opts.block_tokens == 0 {
        bail!("--trace-block-tokens must be > 0");
    }
    if opts.count == Some(0) {
        bail!("--trace-count must be > 0");
    }
    let ns = format!("trace-{name}");
    let source = RecordSource {
        name,
        file,
        ns: &ns,
        block_tokens: opts.block_tokens,
        sessions_from_trace: true,
    };
    let window = MooncakeWindow {
        start: opts.start,
        count: opts.count.unwrap_or(usize::MAX),
        rate_multiplier: opts.rate,
        max_model_len: opts.max_model_len,
        max_output_tokens: opts.max_output_tokens,
    };
    let mut w = workloads::records_workload(&source, records, window)?;
    let sessions = records
        .iter()
        .skip(opts.start)
        .take(window.count)
        .filter(|r| r.session_id().is_some())
        .count();
    w.description = format!(
        "trace {file} (Mooncake format, {} tokens per hash id): {}; {}",
        opts.block_tokens,
        w.description
            .strip_prefix(&format!("Mooncake {file} "))
            .unwrap_or(&w.description),
        if sessions > 0 {
            format!("{sessions} records carry a session id (sent as x-session-id)")
        } else {
            "no session ids (every record its own session)".to_string()
        }
    );
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workloads::{parse_mooncake, BenchRequest};

    fn opts() -> TraceOptions {
        TraceOptions {
            block_tokens: 16,
            rate: 1.0,
            start: 0,
            count: None,
            max_model_len: 10_000,
            max_output_tokens: 2_000,
        }
    }

    /// The workload of `recs` as the test file `t.jsonl`, with `opts` changed by `edit`.
    fn built(
        recs: &[workloads::MooncakeRecord],
        edit: impl FnOnce(&mut TraceOptions),
    ) -> Result<Workload> {
        let mut o = opts();
        edit(&mut o);
        build("t.jsonl", "t", recs, o)
    }

    const WITH_SESSIONS: &str = r#"{"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3], "session": "a"}
{"timestamp": 1500, "input_length": 20, "output_length": 5, "hash_ids": [7, 8], "session": 42}
{"timestamp": 1200, "input_length": 56, "output_length": 5, "hash_ids": [1, 2, 3, 4], "session": "a"}
{"timestamp": 3000, "input_length": 16, "output_length": 5, "hash_ids": [9]}
{"timestamp": 5000, "input_length": 20000, "output_length": 5, "hash_ids": [5], "session": "b"}"#;

    #[test]
    fn names_come_from_the_file() {
        let taken = ["shared-prefix"];
        let name = |p: &str| workload_name(Path::new(p), &taken);
        assert_eq!(name("/x/toolagent_trace.jsonl"), "toolagent-trace");
        assert_eq!(name("My Trace (v2).jsonl"), "my-trace-v2");
        assert_eq!(name("shared_prefix.jsonl"), "trace-shared-prefix");
        assert_eq!(name("__.jsonl"), "trace");
    }

    #[test]
    fn sessions_are_read_when_present_and_records_over_the_limit_dropped() {
        let recs = parse_mooncake(WITH_SESSIONS).expect("parse");
        assert_eq!(recs[0].session_id().as_deref(), Some("a"));
        assert_eq!(recs[1].session_id().as_deref(), Some("42"));
        assert_eq!(recs[3].session_id(), None);
        let w = built(&recs, |_| {}).expect("workload");
        assert_eq!(w.requests.len(), 4, "the 20k-token record is dropped");
        assert!(w.notes.iter().any(|n| n.contains("1 of 5 records dropped")));
        let sessions: Vec<&str> = w.requests.iter().map(|r| r.session.as_str()).collect();
        assert_eq!(sessions, ["a", "a", "42", "mc-3"]);
        let at: Vec<f64> = w.requests.iter().map(|r| r.at_ms).collect();
        assert_eq!(at, [0.0, 200.0, 500.0, 2000.0]);
        // 16 tokens per hash id: the two "a" records share hash ids 1..3 (48 tokens, 40 used
        // by the first, whose last block is cut).
        let (a0, a1) = (w.requests[0].tokens(), w.requests[1].tokens());
        assert_eq!(a1.len(), 56);
        assert_eq!(a0[..32], a1[..32]);
        assert!(w.description.contains("4 records carry a session id"));
    }

    #[test]
    fn traces_without_sessions_parse_as_the_shipped_ones() {
        let text = "{\"timestamp\":0,\"input_length\":512,\"output_length\":1,\"hash_ids\":[0]}\n\
                    {\"timestamp\":10,\"input_length\":600,\"output_length\":1,\"hash_ids\":[0,1]}";
        let recs = parse_mooncake(text).expect("parse");
        let w = built(&recs, |o| o.block_tokens = 512).expect("workload");
        let sessions: Vec<&str> = w.requests.iter().map(|r| r.session.as_str()).collect();
        assert_eq!(sessions, ["mc-0", "mc-1"]);
        assert_eq!(w.requests[1].tokens()[..512], w.requests[0].tokens()[..]);
        assert!(w.description.contains("no session ids"));
    }

    #[test]
    fn rate_compression_keeps_each_sessions_order() {
        let recs = parse_mooncake(WITH_SESSIONS).expect("parse");
        let w = built(&recs, |o| o.rate = 4.0).expect("w");
        let at: Vec<f64> = w.requests.iter().map(|r| r.at_ms).collect();
        assert_eq!(at, [0.0, 50.0, 125.0, 500.0]);
        assert!((w.offered_rate() - 4.0 / 0.5).abs() < 1e-9);
        // A session whose later record is stamped earlier still arrives in file order.
        let text = r#"{"timestamp": 100, "input_length": 16, "output_length": 1, "hash_ids": [1], "session": "s"}
{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [2], "session": "t"}
{"timestamp": 50, "input_length": 32, "output_length": 1, "hash_ids": [1, 3], "session": "s"}"#;
        let recs = parse_mooncake(text).expect("parse");
        let w = built(&recs, |o| o.rate = 2.0).expect("w");
        let s: Vec<&BenchRequest> = w.requests.iter().filter(|r| r.session == "s").collect();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].num_tokens(), 16, "file order within the session");
        assert_eq!(s[1].num_tokens(), 32);
        assert!(s[0].at_ms <= s[1].at_ms);
        assert!(w.requests.windows(2).all(|p| p[0].at_ms <= p[1].at_ms));
        assert!(built(&recs, |o| o.rate = 0.0).is_err());
    }

    #[test]
    fn windows_pick_records_and_start_their_clock() {
        let recs = parse_mooncake(WITH_SESSIONS).expect("parse");
        let w = built(&recs, |o| {
            o.start = 1;
            o.count = Some(2);
        })
        .expect("workload");
        assert_eq!(w.requests.len(), 2);
        // Records 1 (t=1500) and 2 (t=1200; session a's first in the window): the clock starts
        // at the earliest.
        let at: Vec<f64> = w.requests.iter().map(|r| r.at_ms).collect();
        assert_eq!(at, [0.0, 300.0]);
        assert_eq!(w.requests[0].session, "a");
        assert!(w.description.contains("records 1..3"));
        assert!(built(&recs, |o| o.start = 9).is_err());
        assert!(built(&recs, |o| o.count = Some(0)).is_err());
    }
}
