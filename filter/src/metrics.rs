//! The filter's Envoy stats: names and kinds, the same in every host build. The proxy-wasm build
//! gets them prefixed with `wasmcustom.`, e.g. `wasmcustom.kvroute.fail_open.indexer_timeout`;
//! counters are process-wide (every VM defines the same names, Envoy sums them). A host keeps its
//! own ids in a [`MetricIds`].

use crate::protocol::FailOpen;

/// Counters and histograms, by event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// A request on a routed path was seen.
    Requests,
    /// A request got a replica from the indexer.
    Routed,
    /// Shadow mode: the indexer answered and the destination was left to Envoy.
    Shadowed,
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
    /// A completion report was issued (alone or in a `/v1/complete` batch) or delivered on a
    /// route call.
    CompleteSent,
    /// A completion report could not be issued.
    CompleteFailed,
    /// A completion report rode on a route call (also counted in `CompleteSent`).
    CompleteCarried,
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
    const ALL: [Counter; 18] = [
        Counter::Requests,
        Counter::Routed,
        Counter::Shadowed,
        Counter::NoBody,
        Counter::SpoofedHeaderRemoved,
        Counter::RejectedTooLarge,
        Counter::StripFailedRejected,
        Counter::BodyRewritten,
        Counter::CompleteSent,
        Counter::CompleteFailed,
        Counter::CompleteCarried,
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
            Counter::Shadowed => "kvroute.shadowed",
            Counter::NoBody => "kvroute.no_body",
            Counter::SpoofedHeaderRemoved => "kvroute.spoofed_header_removed",
            Counter::RejectedTooLarge => "kvroute.rejected_too_large",
            Counter::StripFailedRejected => "kvroute.strip_failed_rejected",
            Counter::BodyRewritten => "kvroute.body_rewritten",
            Counter::CompleteSent => "kvroute.complete_sent",
            Counter::CompleteFailed => "kvroute.complete_failed",
            Counter::CompleteCarried => "kvroute.complete_carried",
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

/// One countable or recordable metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// An event counter.
    Counter(Counter),
    /// A fail-open counter, by reason.
    FailOpen(FailOpen),
    /// A histogram.
    Histogram(Histogram),
}

impl From<Counter> for Metric {
    fn from(c: Counter) -> Self {
        Metric::Counter(c)
    }
}

impl From<FailOpen> for Metric {
    fn from(r: FailOpen) -> Self {
        Metric::FailOpen(r)
    }
}

impl From<Histogram> for Metric {
    fn from(h: Histogram) -> Self {
        Metric::Histogram(h)
    }
}

/// The kind of a metric, for the host's definition call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic counter.
    Counter,
    /// Histogram.
    Histogram,
}

impl Metric {
    /// Every metric, counters first.
    pub fn all() -> impl Iterator<Item = Metric> {
        Counter::ALL
            .into_iter()
            .map(Metric::Counter)
            .chain(FailOpen::ALL.into_iter().map(Metric::FailOpen))
            .chain(Histogram::ALL.into_iter().map(Metric::Histogram))
    }

    /// The stat name, the same in every host build (a host may prefix it, e.g. proxy-wasm's
    /// `wasmcustom.`).
    pub fn name(self) -> &'static str {
        match self {
            Metric::Counter(c) => c.name(),
            Metric::FailOpen(r) => fail_open_name(r),
            Metric::Histogram(h) => h.name(),
        }
    }

    /// Counter or histogram.
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::Counter(_) | Metric::FailOpen(_) => MetricKind::Counter,
            Metric::Histogram(_) => MetricKind::Histogram,
        }
    }

    /// Position in [`Metric::all`].
    fn index(self) -> usize {
        match self {
            Metric::Counter(c) => Counter::ALL.iter().position(|x| *x == c).unwrap_or(0),
            Metric::FailOpen(r) => {
                Counter::ALL.len() + FailOpen::ALL.iter().position(|x| *x == r).unwrap_or(0)
            }
            Metric::Histogram(h) => {
                Counter::ALL.len()
                    + FailOpen::ALL.len()
                    + Histogram::ALL.iter().position(|x| *x == h).unwrap_or(0)
            }
        }
    }
}

/// A host's ids of every [`Metric`]; a metric the host could not define is simply not recorded.
#[derive(Debug, Clone, Default)]
pub struct MetricIds<Id> {
    ids: Vec<Option<Id>>,
}

impl<Id: Copy> MetricIds<Id> {
    /// Defines every metric with `define`; returns the names that failed (for one log line).
    pub fn define(
        mut define: impl FnMut(MetricKind, &'static str) -> Option<Id>,
    ) -> (Self, Vec<&'static str>) {
        let mut failed = Vec::new();
        let ids = Metric::all()
            .map(|m| {
                let id = define(m.kind(), m.name());
                if id.is_none() {
                    failed.push(m.name());
                }
                id
            })
            .collect();
        (Self { ids }, failed)
    }

    /// The host's id of `metric`, if it was defined.
    pub fn get(&self, metric: Metric) -> Option<Id> {
        self.ids.get(metric.index()).copied().flatten()
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
    fn every_metric_has_its_own_id() {
        let mut next = 0u32;
        let (ids, failed) = MetricIds::define(|_, name| {
            next += 1;
            (name != "kvroute.routed").then_some(next)
        });
        assert_eq!(failed, vec!["kvroute.routed"]);
        assert_eq!(ids.get(Counter::Routed.into()), None);
        let all: Vec<Option<u32>> = Metric::all().map(|m| ids.get(m)).collect();
        let mut defined: Vec<u32> = all.iter().flatten().copied().collect();
        defined.dedup();
        assert_eq!(defined.len(), Metric::all().count() - 1);
        assert_eq!(
            ids.get(Histogram::RouteCallUs.into()),
            Some(next),
            "histograms come last"
        );
        assert_eq!(
            Metric::from(FailOpen::NotJson).name(),
            "kvroute.fail_open.not_json"
        );
    }
}
