//! Generation attempts and injected failures: every `POST /v1/completions` and
//! `/v1/chat/completions` is counted as it arrives (before it is parsed), and `POST /admin/fail`
//! makes the next N of them answer an error status, as a failing engine would. Tests count the
//! attempts a router or a gateway above it makes (retries stack up there, not here).

use std::sync::atomic::{AtomicU64, Ordering};

/// The replica's attempt counter and its armed failures.
#[derive(Debug, Default)]
pub struct Faults {
    received: AtomicU64,
    injected: AtomicU64,
    /// How many of the next attempts fail.
    armed: AtomicU64,
    /// The status they fail with.
    status: AtomicU64,
}

/// What `POST /admin/fail` accepts: `{"requests": N, "status": S}` (S defaults to 500; N = 0
/// disarms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailPlan {
    /// How many of the next generation requests fail.
    pub requests: u64,
    /// Their HTTP status: 500-599.
    #[serde(default = "default_status")]
    pub status: u16,
}

fn default_status() -> u16 {
    500
}

impl FailPlan {
    /// Rejects statuses that are not server errors (a 4xx would not look like a failing replica).
    pub fn check(&self) -> Result<(), String> {
        if (500..=599).contains(&self.status) {
            Ok(())
        } else {
            Err(format!(
                "\"status\" must be a server error (500-599), got {}",
                self.status
            ))
        }
    }
}

impl Faults {
    /// Arms (or disarms, with 0 requests) the next failures.
    pub fn arm(&self, plan: FailPlan) {
        self.status.store(u64::from(plan.status), Ordering::SeqCst);
        self.armed.store(plan.requests, Ordering::SeqCst);
    }

    /// Counts one generation attempt; `Some(status)` when it must fail.
    pub fn attempt(&self) -> Option<u16> {
        self.received.fetch_add(1, Ordering::Relaxed);
        let took = self
            .armed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if !took {
            return None;
        }
        self.injected.fetch_add(1, Ordering::Relaxed);
        u16::try_from(self.status.load(Ordering::SeqCst)).ok()
    }

    /// (attempts received, attempts failed on purpose).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.received.load(Ordering::Relaxed),
            self.injected.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_failures_run_out_and_every_attempt_counts() {
        let f = Faults::default();
        assert_eq!(f.attempt(), None);
        f.arm(FailPlan {
            requests: 2,
            status: 503,
        });
        assert_eq!(f.attempt(), Some(503));
        assert_eq!(f.attempt(), Some(503));
        assert_eq!(f.attempt(), None);
        assert_eq!(f.counts(), (4, 2));
        f.arm(FailPlan {
            requests: 5,
            status: 500,
        });
        f.arm(FailPlan {
            requests: 0,
            status: 500,
        });
        assert_eq!(f.attempt(), None);
    }

    #[test]
    fn only_server_errors_are_accepted() {
        let plan: FailPlan = serde_json::from_str(r#"{"requests": 1}"#).expect("plan");
        assert_eq!(plan.status, 500);
        assert!(plan.check().is_ok());
        let bad: FailPlan =
            serde_json::from_str(r#"{"requests": 1, "status": 404}"#).expect("plan");
        assert!(bad.check().is_err());
        assert!(serde_json::from_str::<FailPlan>(r#"{"request": 1}"#).is_err());
    }
}
