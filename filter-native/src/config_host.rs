//! The shared plugin's host on Envoy's main thread ([`ConfigHost`]: the configuration's
//! callouts and counters), and the conversions both hosts use.

use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_filter::metrics::{Histogram, Metric, MetricIds};
use kvroute_filter::seam::{CallId, Callout, Host, HostError, HostResult, Level};

use crate::abi::{self, CEnum};
use crate::envoy::{self, CalloutRequest, CalloutStart, ConfigHandle};

/// The configuration's Envoy side and stat ids: what a [`ConfigHost`] needs.
#[derive(Debug)]
pub struct ConfigSide {
    pub envoy: ConfigHandle,
    pub metrics: MetricIds<usize>,
}

pub(crate) fn level(level: Level) -> CEnum {
    match level {
        Level::Trace => abi::LOG_TRACE,
        Level::Debug => abi::LOG_DEBUG,
        Level::Info => abi::LOG_INFO,
        Level::Warn => abi::LOG_WARN,
        Level::Error => abi::LOG_ERROR,
    }
}

pub(crate) fn now_nanos() -> Option<u64> {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    u64::try_from(since.as_nanos()).ok()
}

pub(crate) fn timeout_ms(call: &Callout<'_>) -> u64 {
    u64::try_from(call.timeout.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn started(start: CalloutStart) -> HostResult<CallId> {
    match start {
        CalloutStart::Started(id) => Ok(CallId(id)),
        CalloutStart::Refused(abi::CALLOUT_INIT_CLUSTER_NOT_FOUND) => {
            Err(HostError::UnknownCluster)
        }
        CalloutStart::Refused(code) => Err(HostError::Failed(format!(
            "callout refused (http_callout_init_result {code})"
        ))),
    }
}

/// The plugin's host: the configuration's callouts and counters (main thread).
pub struct ConfigHost<'a> {
    side: &'a ConfigSide,
}

impl<'a> ConfigHost<'a> {
    /// The host of the configuration `side`.
    pub fn new(side: &'a ConfigSide) -> Self {
        Self { side }
    }
}

impl Host for ConfigHost<'_> {
    fn now_nanos(&self) -> Option<u64> {
        now_nanos()
    }

    fn increment(&self, metric: Metric) {
        if let Some(id) = self.side.metrics.get(metric) {
            self.side.envoy.increment(id);
        }
    }

    fn record(&self, _histogram: Histogram, _value: u64) {
        // The plugin records no histograms; the per-request ones go through the stream.
    }

    fn log_enabled(&self, at: Level) -> bool {
        envoy::log_enabled(level(at))
    }

    fn log(&self, at: Level, message: &str) {
        envoy::log(level(at), message);
    }

    fn dispatch(&mut self, call: &Callout<'_>) -> HostResult<CallId> {
        started(self.side.envoy.http_callout(&CalloutRequest {
            cluster: call.cluster,
            headers: call.headers,
            body: call.body.unwrap_or_default(),
            timeout_ms: timeout_ms(call),
        }))
    }
}
