//! Completion reports held back so that they ride on the next route call (`RouteRequest::
//! completed`: one exchange with the indexer for both) instead of one `POST /v1/complete` each.
//! A report never waits much longer than `complete_hold_ms`: what is still held then is sent on
//! the host's tick, all in one `/v1/complete` batch. The queue is bounded (`max_held_completions`):
//! when full, everything held is sent at once.
//!
//! Held reports live in the host instance's [`crate::plugin::Plugin`] (one per Wasm VM, one per
//! process in the native build) and die with it: a proxy killed with reports held loses them, and
//! the indexer ends those decisions at their deadlines, as for requests still running then.

use std::time::Duration;

use kvroute_core::api::CompleteReport;

use crate::config::FilterConfig;
use crate::hlog;
use crate::metrics::Counter;
use crate::protocol::indexer_post_headers;
use crate::seam::{Callout, Host, HostResult};

/// The reports held, oldest first.
#[derive(Debug)]
pub struct HeldReports {
    reports: Vec<CompleteReport>,
    /// Host time (ms) the oldest held report was held.
    since_ms: u64,
    /// Most reports held.
    max: usize,
}

impl HeldReports {
    /// An empty queue holding at most `max` reports (at least one).
    pub fn new(max: usize) -> Self {
        Self {
            reports: Vec::new(),
            since_ms: 0,
            max: max.max(1),
        }
    }

    /// Reports held now.
    pub fn len(&self) -> usize {
        self.reports.len()
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }

    /// Holds `report`; returns everything held, to send now, when the queue is full.
    pub fn hold(&mut self, report: CompleteReport, now_ms: u64) -> Option<Vec<CompleteReport>> {
        if self.reports.is_empty() {
            self.since_ms = now_ms;
        }
        self.reports.push(report);
        (self.reports.len() >= self.max).then(|| self.take())
    }

    /// Takes everything held (to carry on a route call).
    pub fn take(&mut self) -> Vec<CompleteReport> {
        std::mem::take(&mut self.reports)
    }

    /// When [`HeldReports::take_due`] with `hold_ms` will take something (host ms): the oldest
    /// report's end of hold; `None` while nothing is held.
    pub fn due_at_ms(&self, hold_ms: u64) -> Option<u64> {
        (!self.reports.is_empty()).then(|| self.since_ms.saturating_add(hold_ms))
    }

    /// Takes everything held when the oldest report has waited `hold_ms` or more.
    pub fn take_due(&mut self, now_ms: u64, hold_ms: u64) -> Vec<CompleteReport> {
        if !self.reports.is_empty() && now_ms.saturating_sub(self.since_ms) >= hold_ms {
            self.take()
        } else {
            Vec::new()
        }
    }

    /// Puts back reports a route call may not have delivered, ahead of the newer ones (the
    /// indexer takes a report it already applied as an unknown decision, harmlessly). Returns
    /// everything held, to send now, when that fills the queue.
    pub fn give_back(
        &mut self,
        mut reports: Vec<CompleteReport>,
        now_ms: u64,
    ) -> Option<Vec<CompleteReport>> {
        if reports.is_empty() {
            return None;
        }
        if self.reports.is_empty() {
            self.since_ms = now_ms;
        }
        reports.append(&mut self.reports);
        self.reports = reports;
        (self.reports.len() >= self.max).then(|| self.take())
    }
}

/// The body of `POST /v1/complete` for `reports`: one report as an object (what every indexer
/// of this contract takes), several as a JSON array.
pub fn reports_body(reports: &[CompleteReport]) -> Vec<u8> {
    match reports {
        [one] => serde_json::to_vec(one),
        many => serde_json::to_vec(many),
    }
    .unwrap_or_default()
}

/// Issues `POST /v1/complete` for `reports` (nothing when empty) with `send` (a stream's
/// `dispatch_detached`, so the reports outlive the stream, or the plugin's `dispatch`); counts
/// each report as `complete_sent` or `complete_failed`.
pub fn send_reports<H: Host + ?Sized>(
    host: &mut H,
    cfg: &FilterConfig,
    reports: &[CompleteReport],
    send: impl FnOnce(&mut H, &Callout<'_>) -> HostResult<()>,
) {
    if reports.is_empty() {
        return;
    }
    let body = reports_body(reports);
    let headers = indexer_post_headers(cfg, "/v1/complete");
    let call = Callout {
        cluster: &cfg.indexer_cluster,
        headers: &headers,
        body: Some(&body),
        timeout: Duration::from_millis(cfg.complete_timeout_ms),
    };
    let counter = match send(host, &call) {
        Ok(()) => Counter::CompleteSent,
        Err(e) => {
            hlog!(
                host,
                Debug,
                "kvroute: {} completion report(s) not sent: {e}",
                reports.len()
            );
            Counter::CompleteFailed
        }
    };
    for _ in reports {
        host.increment(counter.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(id: &str) -> CompleteReport {
        CompleteReport {
            decision_id: Some(id.into()),
            ..CompleteReport::default()
        }
    }

    fn ids(reports: &[CompleteReport]) -> Vec<&str> {
        reports
            .iter()
            .map(|r| r.decision_id.as_deref().unwrap_or("?"))
            .collect()
    }

    #[test]
    fn reports_wait_for_a_route_call_or_their_hold_time() {
        let mut held = HeldReports::new(8);
        assert_eq!(held.hold(report("a"), 1_000), None);
        assert_eq!(held.hold(report("b"), 1_100), None);
        assert!(held.take_due(1_249, 250).is_empty(), "a has waited 249 ms");
        assert_eq!(ids(&held.take_due(1_250, 250)), ["a", "b"]);
        assert!(held.is_empty());
        // The next report starts a new wait.
        held.hold(report("c"), 2_000);
        assert!(held.take_due(2_100, 250).is_empty());
        assert_eq!(ids(&held.take()), ["c"]);
        assert!(held.take_due(9_999, 250).is_empty(), "nothing held");
    }

    #[test]
    fn a_full_queue_is_sent_at_once() {
        let mut held = HeldReports::new(3);
        assert_eq!(held.hold(report("a"), 0), None);
        assert_eq!(held.hold(report("b"), 0), None);
        let full = held.hold(report("c"), 0).expect("full");
        assert_eq!(ids(&full), ["a", "b", "c"]);
        assert_eq!(held.len(), 0);
    }

    #[test]
    fn reports_given_back_go_first_and_keep_the_bound() {
        let mut held = HeldReports::new(4);
        held.hold(report("new"), 500);
        assert_eq!(
            held.give_back(vec![report("old1"), report("old2")], 600),
            None
        );
        assert_eq!(held.len(), 3);
        let full = held
            .give_back(vec![report("old0")], 700)
            .expect("the bound is reached");
        assert_eq!(ids(&full), ["old0", "old1", "old2", "new"]);
        assert_eq!(held.give_back(Vec::new(), 800), None);
        // Given back into an empty queue: they wait from now.
        held.give_back(vec![report("x")], 1_000);
        assert!(held.take_due(1_100, 250).is_empty());
        assert_eq!(ids(&held.take_due(1_250, 250)), ["x"]);
    }

    #[test]
    fn one_report_is_an_object_several_an_array() {
        let one: serde_json::Value =
            serde_json::from_slice(&reports_body(&[report("a")])).expect("json");
        assert_eq!(one["decision_id"], "a");
        let two: serde_json::Value =
            serde_json::from_slice(&reports_body(&[report("a"), report("b")])).expect("json");
        assert_eq!(two[1]["decision_id"], "b");
        // Both parse with the indexer's reader.
        for body in [
            reports_body(&[report("a")]),
            reports_body(&[report("a"), report("b")]),
        ] {
            assert!(kvroute_core::api::parse_complete_reports(&body).is_ok());
        }
    }
}
