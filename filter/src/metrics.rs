//! The filter's Envoy stats. Envoy prefixes them with `wasmcustom.`, e.g.
//! `wasmcustom.kvroute.fail_open.indexer_timeout`. Counters are process-wide (every VM defines the
//! same names, Envoy sums them).

use crate::host::{self, MetricKind};
use crate::protocol::FailOpen;

/// Counters and histograms, by event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// A request on a routed path was seen.
    Requests,
    /// A request got a replica from the indexer.
    Routed,
    /// A request on a routed path with no body (passed through).
    NoBody,
    /// A client-supplied `x-envoy-original-dst-host` was removed.
    SpoofedHeaderRemoved,
    /// An oversized body was answered with 413.
    RejectedTooLarge,
    /// The dst header could not be removed; the request was refused with 503.
    StripFailedRejected,
    /// The body was rewritten with `kv_cache_report_mode`.
    BodyRewritten,
    /// `POST /v1/complete` issued.
    CompleteSent,
    /// `POST /v1/complete` could not be issued.
    CompleteFailed,
    /// A request ended before its route answer was used or before its response ended (client
    /// left, stream reset); reported to the indexer as abandoned.
    Abandoned,
    /// A model tokenizer became ready in a VM.
    TokenizerLoaded,
    /// A tokenizer fetch or build failed.
    TokenizerLoadFailed,
    /// An online check: the engine's prompt tokens equal the filter's.
    TokenCheckAgreed,
    /// An online check: the engine's prompt tokens differ (the model then fails open).
    TokenCheckDisagreed,
    /// A sampled request whose response carried no prompt ids (error, reset, too large).
    TokenCheckIncomplete,
    /// `POST /v1/models/{model}/agreement` could not be issued.
    AgreementReportFailed,
}

impl Counter {
    const ALL: [Counter; 16] = [
        Counter::Requests,
        Counter::Routed,
        Counter::NoBody,
        Counter::SpoofedHeaderRemoved,
        Counter::RejectedTooLarge,
        Counter::StripFailedRejected,
        Counter::BodyRewritten,
        Counter::CompleteSent,
        Counter::CompleteFailed,
        Counter::Abandoned,
        Counter::TokenizerLoaded,
        Counter::TokenizerLoadFailed,
        Counter::TokenCheckAgreed,
        Counter::TokenCheckDisagreed,
        Counter::TokenCheckIncomplete,
        Counter::AgreementReportFailed,
    ];

    fn name(self) -> &'static str {
        match self {
            Counter::Requests => "kvroute.requests",
            Counter::Routed => "kvroute.routed",
            Counter::NoBody => "kvroute.no_body",
            Counter::SpoofedHeaderRemoved => "kvroute.spoofed_header_removed",
            Counter::RejectedTooLarge => "kvroute.rejected_too_large",
            Counter::StripFailedRejected => "kvroute.strip_failed_rejected",
            Counter::BodyRewritten => "kvroute.body_rewritten",
            Counter::CompleteSent => "kvroute.complete_sent",
            Counter::CompleteFailed => "kvroute.complete_failed",
            Counter::Abandoned => "kvroute.abandoned",
            Counter::TokenizerLoaded => "kvroute.tokenizer_loaded",
            Counter::TokenizerLoadFailed => "kvroute.tokenizer_load_failed",
            Counter::TokenCheckAgreed => "kvroute.token_check.agreed",
            Counter::TokenCheckDisagreed => "kvroute.token_check.disagreed",
            Counter::TokenCheckIncomplete => "kvroute.token_check.incomplete",
            Counter::AgreementReportFailed => "kvroute.agreement_report_failed",
        }
    }
}

/// Histograms (microseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Histogram {
    /// Body parse + template + tokenise + keys.
    PrepareUs,
    /// Round trip of `POST /v1/route`.
    RouteCallUs,
}

impl Histogram {
    const ALL: [Histogram; 2] = [Histogram::PrepareUs, Histogram::RouteCallUs];

    fn name(self) -> &'static str {
        match self {
            Histogram::PrepareUs => "kvroute.prepare_us",
            Histogram::RouteCallUs => "kvroute.route_call_us",
        }
    }
}

/// Name of the gauge holding a VM's linear memory size (bytes). Every VM sets the same gauge, so
/// it shows the last reporting VM (they are alike: one tokenizer per model each).
const VM_MEMORY_GAUGE: &str = "kvroute.vm_memory_bytes";

/// Metric ids of one VM. A metric that could not be defined is simply not recorded.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    counters: Vec<Option<u32>>,
    fail_open: Vec<Option<u32>>,
    histograms: Vec<Option<u32>>,
    vm_memory: Option<u32>,
}

impl Metrics {
    /// Defines every metric; returns the names that failed (for one log line).
    pub fn define() -> (Self, Vec<&'static str>) {
        let mut failed = Vec::new();
        let mut def = |kind, name: &'static str| match host::define_metric(kind, name) {
            Ok(id) => Some(id),
            Err(_) => {
                failed.push(name);
                None
            }
        };
        let counters = Counter::ALL
            .iter()
            .map(|c| def(MetricKind::Counter, c.name()))
            .collect();
        let fail_open = FailOpen::ALL
            .iter()
            .map(|r| def(MetricKind::Counter, fail_open_name(*r)))
            .collect();
        let histograms = Histogram::ALL
            .iter()
            .map(|h| def(MetricKind::Histogram, h.name()))
            .collect();
        let vm_memory = def(MetricKind::Gauge, VM_MEMORY_GAUGE);
        (
            Self {
                counters,
                fail_open,
                histograms,
                vm_memory,
            },
            failed,
        )
    }

    /// Counts one event.
    pub fn inc(&self, c: Counter) {
        if let Some(Some(id)) = Counter::ALL
            .iter()
            .position(|x| *x == c)
            .and_then(|i| self.counters.get(i))
        {
            let _ = host::increment_metric(*id, 1);
        }
    }

    /// Counts one fail-open by reason.
    pub fn fail_open(&self, r: FailOpen) {
        if let Some(Some(id)) = FailOpen::ALL
            .iter()
            .position(|x| *x == r)
            .and_then(|i| self.fail_open.get(i))
        {
            let _ = host::increment_metric(*id, 1);
        }
    }

    /// Records a histogram value.
    pub fn record(&self, h: Histogram, value: u64) {
        if let Some(Some(id)) = Histogram::ALL
            .iter()
            .position(|x| *x == h)
            .and_then(|i| self.histograms.get(i))
        {
            let _ = host::record_metric(*id, value);
        }
    }
}

impl Metrics {
    /// Publishes this VM's linear memory size.
    pub fn record_vm_memory(&self) {
        if let Some(id) = self.vm_memory {
            let _ = host::record_metric(id, vm_memory_bytes());
        }
    }
}

/// The VM's linear memory in bytes (0 off wasm).
pub fn vm_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        (core::arch::wasm32::memory_size::<0>() as u64) * 65_536
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

fn fail_open_name(r: FailOpen) -> &'static str {
    match r {
        FailOpen::IndexerUnavailable => "kvroute.fail_open.indexer_unavailable",
        FailOpen::IndexerTimeout => "kvroute.fail_open.indexer_timeout",
        FailOpen::IndexerError => "kvroute.fail_open.indexer_error",
        FailOpen::BadAnswer => "kvroute.fail_open.bad_answer",
        FailOpen::TokenMismatch => "kvroute.fail_open.token_mismatch",
        FailOpen::UnknownModel => "kvroute.fail_open.unknown_model",
        FailOpen::NotJson => "kvroute.fail_open.not_json",
        FailOpen::NoModel => "kvroute.fail_open.no_model",
        FailOpen::TooLarge => "kvroute.fail_open.too_large",
        FailOpen::TokenizerNotReady => "kvroute.fail_open.tokenizer_not_ready",
        FailOpen::TokenizeError => "kvroute.fail_open.tokenize_error",
        FailOpen::PromptTooLong => "kvroute.fail_open.prompt_too_long",
        FailOpen::ContractMismatch => "kvroute.fail_open.contract_mismatch",
        FailOpen::HostcallError => "kvroute.fail_open.hostcall_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_match_the_reasons() {
        for r in FailOpen::ALL {
            assert_eq!(
                fail_open_name(r),
                format!("kvroute.fail_open.{}", r.as_str())
            );
        }
    }

    #[test]
    fn recording_without_a_host_is_harmless() {
        let (m, failed) = Metrics::define();
        assert_eq!(failed.len(), Counter::ALL.len() + FailOpen::ALL.len() + 3);
        m.record_vm_memory();
        m.inc(Counter::Routed);
        m.fail_open(FailOpen::NotJson);
        m.record(Histogram::PrepareUs, 3);
    }
}
