//! One filter configuration (`dynamic_module_config` instance): the shared [`Plugin`] (one
//! tokenizer and one segment cache per Envoy process, used by every worker), the stat ids, the
//! way to the main thread, and the queue of detached callouts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_filter::metrics::{MetricIds, MetricKind};
use kvroute_filter::plugin::{Plugin, PluginError, TICK};
use kvroute_filter::seam::{CallId, CallReply, Callout};
use kvroute_filter::tick_plan::IDLE_TICK;
use serde_json::Value;

use crate::config_host::{ConfigHost, ConfigSide};
use crate::envoy::log_error;
use crate::envoy::{CalloutRequest, CalloutStart, ConfigHandle};
use crate::main_thread::{MainThread, EVENT_FLUSH, EVENT_TICK};

/// Most detached callouts (completion reports) waiting for the main thread; more are refused (and
/// counted as `complete_failed`), so a stalled main thread cannot grow memory without bound.
const MAX_QUEUED_CALLOUTS: usize = 4096;

/// A callout issued on the configuration's behalf once the main thread runs.
#[derive(Debug)]
struct QueuedCallout {
    cluster: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout: Duration,
}

/// One filter configuration, shared (`Arc`) by every stream of every worker.
#[derive(Debug)]
pub struct NativeConfig {
    pub side: ConfigSide,
    pub plugin: Arc<Plugin>,
    main: Arc<MainThread>,
    queued: Mutex<Vec<QueuedCallout>>,
    flush_posted: AtomicBool,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum NativeConfigError {
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("Envoy gave the filter configuration no scheduler")]
    NoScheduler,
}

/// Splits the filter configuration into the plugin configuration (the Wasm build's JSON) and the
/// VM configuration: a native filter has one configuration string, so the Wasm build's
/// `vm_config.configuration` (offline tokenizers, `tokenizer_source: vm_config`) rides in it as a
/// top-level `vm_config` member, a name the plugin configuration refuses as unknown.
pub fn split_config(raw: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(raw) else {
        return (raw.to_vec(), Vec::new());
    };
    let Some(vm) = fields.remove("vm_config") else {
        return (raw.to_vec(), Vec::new());
    };
    let plugin = serde_json::to_vec(&Value::Object(fields)).unwrap_or_default();
    let vm = serde_json::to_vec(&vm).unwrap_or_default();
    (plugin, vm)
}

impl NativeConfig {
    /// Defines the stats, validates the configuration and loads offline tokenizers, then starts
    /// the tick driver (the first tick fetches the tokenizers from the indexer).
    pub fn new(envoy: ConfigHandle, raw: &[u8]) -> Result<Self, NativeConfigError> {
        let (metrics, failed) = MetricIds::define(|kind, name| match kind {
            MetricKind::Counter => envoy.define_counter(name),
            MetricKind::Histogram => envoy.define_histogram(name),
        });
        if !failed.is_empty() {
            log_error(&format!(
                "kvroute: metrics not defined: {}",
                failed.join(", ")
            ));
        }
        let side = ConfigSide { envoy, metrics };
        let (plugin_config, vm_config) = split_config(raw);
        let plugin = Plugin::configure(&ConfigHost::new(&side), &plugin_config, &vm_config)?;
        let scheduler = envoy
            .new_scheduler()
            .ok_or(NativeConfigError::NoScheduler)?;
        let plugin = Arc::new(plugin);
        // Weak both ways: the plugin and the ticker do not keep each other alive.
        let due_of = Arc::downgrade(&plugin);
        let main = MainThread::start(
            scheduler,
            TICK,
            IDLE_TICK,
            Box::new(move || due_of.upgrade().and_then(|p| p.next_tick_ms())),
        );
        let ticker = Arc::downgrade(&main);
        plugin.set_tick_waker(Box::new(move |due_ms| {
            if let Some(main) = ticker.upgrade() {
                main.wake(due_ms);
            }
        }));
        Ok(Self {
            side,
            plugin,
            main,
            queued: Mutex::new(Vec::new()),
            flush_posted: AtomicBool::new(false),
        })
    }

    /// A scheduler event, on the main thread.
    pub fn on_event(&self, event: u64) {
        let mut host = ConfigHost::new(&self.side);
        match event {
            EVENT_TICK => self.plugin.on_tick(&mut host),
            EVENT_FLUSH => self.flush(),
            _ => {}
        }
    }

    /// A configuration callout answered, on the main thread: a tokenizer for the plugin, or the
    /// answer to a report (nothing to do).
    pub fn on_callout_done(&self, id: u64, reply: &CallReply) {
        self.plugin
            .on_call_reply(&mut ConfigHost::new(&self.side), CallId(id), reply);
    }

    /// Queues a callout that must outlive its stream and asks the main thread to send it.
    pub fn queue_detached(&self, call: &Callout<'_>) -> Result<(), String> {
        {
            let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            if queued.len() >= MAX_QUEUED_CALLOUTS {
                return Err("the queue of reports is full".into());
            }
            queued.push(QueuedCallout {
                cluster: call.cluster.to_owned(),
                headers: call
                    .headers
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                body: call.body.unwrap_or_default().to_vec(),
                timeout: call.timeout,
            });
        }
        if !self.flush_posted.swap(true, Ordering::AcqRel) && !self.main.post(EVENT_FLUSH) {
            return Err("the filter configuration is shutting down".into());
        }
        Ok(())
    }

    /// Sends every queued callout (main thread).
    fn flush(&self) {
        self.flush_posted.store(false, Ordering::Release);
        let queued = std::mem::take(&mut *self.queued.lock().unwrap_or_else(|e| e.into_inner()));
        for call in queued {
            let headers: Vec<(&str, &str)> = call
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let request = CalloutRequest {
                cluster: &call.cluster,
                headers: &headers,
                body: &call.body,
                timeout_ms: u64::try_from(call.timeout.as_millis()).unwrap_or(u64::MAX),
            };
            if let CalloutStart::Refused(code) = self.side.envoy.http_callout(&request) {
                crate::envoy::log_debug(&format!(
                    "kvroute: queued report to {} not sent (callout refused: {code})",
                    call.cluster
                ));
            }
        }
    }

    /// Stops the tick driver (configuration destroy, main thread).
    pub fn shutdown(&self) {
        self.main.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_config_member_is_taken_out_of_the_plugin_configuration() {
        let (plugin, vm) =
            split_config(br#"{"route_timeout_ms": 250, "vm_config": {"models": {}}}"#);
        assert_eq!(
            serde_json::from_slice::<Value>(&plugin).expect("json"),
            serde_json::json!({"route_timeout_ms": 250})
        );
        assert_eq!(
            serde_json::from_slice::<Value>(&vm).expect("json"),
            serde_json::json!({"models": {}})
        );
    }

    #[test]
    fn other_configurations_pass_unchanged() {
        for raw in [
            &b""[..],
            b"  ",
            b"{not json",
            br#"{"route_timeout_ms": 250}"#,
            b"[1]",
        ] {
            assert_eq!(split_config(raw), (raw.to_vec(), Vec::new()));
        }
    }
}
