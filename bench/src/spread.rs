//! Which gateway the benchmark's client sends each request to, as a Kubernetes Service in front
//! of several gateways would: round robin without session affinity, or every request of a
//! session to one gateway (a hash of its session header) when the workload has sessions.

use clap::ValueEnum;

use super::workloads::Workload;

/// How the client spreads requests over several gateways (`--gateway-spread`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum GatewaySpread {
    /// By session when the workload has sessions (a Service with session affinity), else round
    /// robin.
    #[default]
    Auto,
    /// Round robin whatever the sessions: a session's turns reach different gateways (a
    /// Service without affinity).
    RoundRobin,
}

/// The gateways' listeners and how requests are spread over them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Targets {
    addrs: Vec<String>,
    by_session: bool,
}

impl Targets {
    /// One listener: every request goes there.
    pub fn one(addr: String) -> Self {
        Self {
            addrs: vec![addr],
            by_session: false,
        }
    }

    /// Several listeners for `workload`: with [`GatewaySpread::Auto`], by session when some
    /// session of it has more than one request, round robin otherwise (callers pass at least one
    /// listener).
    pub fn spread(addrs: Vec<String>, workload: &Workload, how: GatewaySpread) -> Self {
        let by_session = addrs.len() > 1 && how == GatewaySpread::Auto && has_sessions(workload);
        Self { addrs, by_session }
    }

    /// How requests are spread, for the report (`round robin`, `by session`; empty for one).
    pub fn mode(&self) -> &'static str {
        match (self.addrs.len(), self.by_session) {
            (0 | 1, _) => "",
            (_, true) => "by session",
            (_, false) => "round robin",
        }
    }

    /// The listener of request `index` of session `session`.
    pub fn pick(&self, index: usize, session: &str) -> &str {
        let n = self.addrs.len();
        if n <= 1 {
            return self.addrs.first().map_or("", String::as_str);
        }
        let slot = if self.by_session {
            (fnv1a(session.as_bytes()) % n as u64) as usize
        } else {
            index % n
        };
        &self.addrs[slot]
    }
}

/// Whether some session of `workload` has more than one request (multi-turn chats, agents,
/// traces with sessions); llm-d's shared prefix and the no-sharing control give every request a
/// session of its own.
pub fn has_sessions(workload: &Workload) -> bool {
    let mut seen = std::collections::HashSet::new();
    workload
        .requests
        .iter()
        .any(|r| !r.session.is_empty() && !seen.insert(r.session.as_str()))
}

/// 64-bit FNV-1a: stable across runs and platforms (a session keeps its gateway).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workloads::{BenchRequest, Segment};

    fn workload(sessions: &[&str]) -> Workload {
        Workload {
            name: "t".into(),
            rate: None,
            description: String::new(),
            requests: sessions
                .iter()
                .enumerate()
                .map(|(i, s)| BenchRequest {
                    at_ms: i as f64,
                    segments: vec![Segment::new("r", i as u64, 16)],
                    max_tokens: 1,
                    session: s.to_string(),
                })
                .collect(),
            notes: Vec::new(),
        }
    }

    fn addrs(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("127.0.0.1:{}", 10_000 + i))
            .collect()
    }

    #[test]
    fn one_listener_takes_everything() {
        let t = Targets::one("a:1".into());
        assert_eq!((t.pick(0, "x"), t.pick(7, "y")), ("a:1", "a:1"));
        assert_eq!(t.mode(), "");
        let w = workload(&["s", "s"]);
        let single = Targets::spread(addrs(1), &w, GatewaySpread::Auto);
        assert_eq!(single.mode(), "");
        assert_eq!(single.pick(3, "s"), "127.0.0.1:10000");
    }

    #[test]
    fn without_sessions_requests_go_round_robin() {
        let w = workload(&["a", "b", "c", "d", "e", "f"]);
        assert!(!has_sessions(&w));
        let t = Targets::spread(addrs(3), &w, GatewaySpread::Auto);
        assert_eq!(t.mode(), "round robin");
        let picked: Vec<&str> = (0..6).map(|i| t.pick(i, "same")).collect();
        let a = addrs(3);
        assert_eq!(picked, [&a[0], &a[1], &a[2], &a[0], &a[1], &a[2]]);
    }

    #[test]
    fn with_sessions_a_session_keeps_its_gateway_and_sessions_spread() {
        let w = workload(&["a", "b", "a"]);
        assert!(has_sessions(&w));
        let rr = Targets::spread(addrs(2), &w, GatewaySpread::RoundRobin);
        assert_eq!(rr.mode(), "round robin");
        assert_ne!(
            rr.pick(0, "a"),
            rr.pick(1, "a"),
            "a session's turns alternate"
        );
        let t = Targets::spread(addrs(2), &w, GatewaySpread::Auto);
        assert_eq!(t.mode(), "by session");
        // One session, whatever its requests' positions: one gateway.
        let s = "mt-c7";
        let first = t.pick(0, s);
        assert!((1..50).all(|i| t.pick(i, s) == first));
        // Many sessions: both gateways get a fair part (a hash, not one side).
        let on_first = (0..1000)
            .filter(|c| t.pick(0, &format!("mt-c{c}")) == addrs(2)[0])
            .count();
        assert!((350..=650).contains(&on_first), "{on_first} of 1000");
        // Stable across runs: FNV-1a of fixed bytes.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn empty_sessions_do_not_count_as_sessions() {
        assert!(!has_sessions(&workload(&["", ""])));
    }
}
