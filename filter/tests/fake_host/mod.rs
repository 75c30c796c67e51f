//! A host for the filter's logic in unit tests: headers and bodies in memory, a manual clock,
//! callouts recorded (the test answers them), counters by stat name, failures on demand.

#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use kvroute_filter::metrics::{Histogram, Metric};
use kvroute_filter::plugin::Plugin;
use kvroute_filter::protocol::FailOpen;
use kvroute_filter::seam::{
    Body, CallId, CallReply, Callout, Headers, Host, HostError, HostResult, Level, StreamHost,
};
use serde_json::Value;

/// One callout the logic issued.
#[derive(Debug, Clone)]
pub struct Call {
    pub id: CallId,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u128,
    /// Issued with `dispatch_detached`.
    pub detached: bool,
}

impl Call {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("callout body is JSON")
    }
}

/// A local reply the logic sent.
#[derive(Debug, Clone)]
pub struct LocalReply {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
}

#[derive(Debug, Default)]
pub struct FakeHost {
    pub now_ns: Cell<u64>,
    pub request_headers: Vec<(String, String)>,
    pub response_headers: Vec<(String, String)>,
    pub request_body: Vec<u8>,
    pub response_chunk: Vec<u8>,
    pub counters: RefCell<BTreeMap<&'static str, u64>>,
    pub histograms: RefCell<Vec<(Histogram, u64)>>,
    pub logs: RefCell<Vec<(Level, String)>>,
    pub calls: Vec<Call>,
    pub next_call: u64,
    pub local_reply: Option<LocalReply>,
    pub resumed: u32,
    /// Header removal fails (a host that cannot strip).
    pub fail_remove: bool,
    /// `dispatch` fails with this.
    pub fail_dispatch: Option<HostError>,
    /// Replacing a body fails.
    pub fail_body_replace: bool,
    /// What `upstream_address` reports (where the proxy's own balancer sent the request).
    pub upstream: Option<String>,
}

impl FakeHost {
    pub fn new() -> Self {
        let h = Self::default();
        h.now_ns.set(1_700_000_000_000_000_000);
        h
    }

    /// A `POST path` request with these extra headers and body.
    pub fn post(path: &str, extra: &[(&str, &str)], body: &[u8]) -> Self {
        let mut h = Self::new();
        h.request_headers = vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            ("content-length".into(), body.len().to_string()),
        ];
        for (k, v) in extra {
            h.request_headers.push(((*k).into(), (*v).into()));
        }
        h.request_body = body.to_vec();
        h
    }

    pub fn advance_ms(&self, ms: u64) {
        self.now_ns.set(self.now_ns.get() + ms * 1_000_000);
    }

    pub fn count(&self, name: &str) -> u64 {
        self.counters.borrow().get(name).copied().unwrap_or(0)
    }

    pub fn fail_opens(&self) -> Vec<(&'static str, u64)> {
        self.counters
            .borrow()
            .iter()
            .filter(|(k, _)| k.starts_with("kvroute.fail_open."))
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    pub fn fail_open_count(&self, reason: FailOpen) -> u64 {
        self.count(Metric::from(reason).name())
    }

    pub fn request_header(&self, name: &str) -> Option<&str> {
        find(&self.request_headers, name)
    }

    pub fn response_header(&self, name: &str) -> Option<&str> {
        find(&self.response_headers, name)
    }

    pub fn last_call(&self) -> &Call {
        self.calls.last().expect("a callout was issued")
    }

    pub fn detached_calls(&self) -> Vec<&Call> {
        self.calls.iter().filter(|c| c.detached).collect()
    }

    fn record_call(&mut self, call: &Callout<'_>, detached: bool) -> CallId {
        self.next_call += 1;
        let id = CallId(self.next_call);
        self.calls.push(Call {
            id,
            cluster: call.cluster.to_string(),
            headers: call
                .headers
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            body: call.body.unwrap_or_default().to_vec(),
            timeout_ms: call.timeout.as_millis(),
            detached,
        });
        id
    }

    fn headers_mut(&mut self, map: Headers) -> &mut Vec<(String, String)> {
        match map {
            Headers::Request => &mut self.request_headers,
            Headers::Response => &mut self.response_headers,
        }
    }
}

fn find<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

impl Host for FakeHost {
    fn now_nanos(&self) -> Option<u64> {
        Some(self.now_ns.get())
    }

    fn increment(&self, metric: Metric) {
        *self.counters.borrow_mut().entry(metric.name()).or_default() += 1;
    }

    fn record(&self, histogram: Histogram, value: u64) {
        self.histograms.borrow_mut().push((histogram, value));
    }

    fn log(&self, level: Level, message: &str) {
        self.logs.borrow_mut().push((level, message.to_string()));
    }

    fn dispatch(&mut self, call: &Callout<'_>) -> HostResult<CallId> {
        if let Some(e) = self.fail_dispatch.clone() {
            return Err(e);
        }
        Ok(self.record_call(call, false))
    }
}

impl StreamHost for FakeHost {
    fn header(&self, map: Headers, name: &str) -> HostResult<Option<Vec<u8>>> {
        let headers = match map {
            Headers::Request => &self.request_headers,
            Headers::Response => &self.response_headers,
        };
        Ok(find(headers, name).map(|v| v.as_bytes().to_vec()))
    }

    fn set_header(&mut self, map: Headers, name: &str, value: &str) -> HostResult<()> {
        let headers = self.headers_mut(map);
        headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        headers.push((name.to_string(), value.to_string()));
        Ok(())
    }

    fn remove_header(&mut self, map: Headers, name: &str) -> HostResult<()> {
        if self.fail_remove {
            return Err(HostError::Failed("refused".into()));
        }
        self.headers_mut(map)
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        Ok(())
    }

    fn read_body(&self, body: Body, max: usize) -> HostResult<Vec<u8>> {
        let b = match body {
            Body::Request => &self.request_body,
            Body::Response => &self.response_chunk,
        };
        Ok(b[..max.min(b.len())].to_vec())
    }

    fn replace_body(&mut self, body: Body, current_len: usize, new: &[u8]) -> HostResult<()> {
        if self.fail_body_replace {
            return Err(HostError::Failed("refused".into()));
        }
        let target = match body {
            Body::Request => &mut self.request_body,
            Body::Response => &mut self.response_chunk,
        };
        let keep = target.split_off(current_len.min(target.len()));
        *target = new.to_vec();
        target.extend_from_slice(&keep);
        Ok(())
    }

    fn dispatch_detached(&mut self, call: &Callout<'_>) -> HostResult<()> {
        if let Some(e) = self.fail_dispatch.clone() {
            return Err(e);
        }
        self.record_call(call, true);
        Ok(())
    }

    fn send_local_reply(
        &mut self,
        status: u32,
        details: &str,
        body: &[u8],
        _headers: &[(&str, &str)],
    ) -> HostResult<()> {
        self.local_reply = Some(LocalReply {
            status,
            details: details.to_string(),
            body: body.to_vec(),
        });
        Ok(())
    }

    fn resume_request(&mut self) -> HostResult<()> {
        self.resumed += 1;
        Ok(())
    }

    fn upstream_address(&self) -> Option<String> {
        self.upstream.clone()
    }
}

/// The Qwen3 tokenizer files `cargo xtask setup` installs, as the indexer serves them.
pub fn qwen3_bundle_json() -> Vec<u8> {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/kvroute-cache/models/qwen3")
        });
    let files = kvroute_core::request::ModelFiles::from_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: run `cargo xtask setup` or set KVROUTE_MODEL_DIR",
            dir.display()
        )
    });
    // The compact form, as the indexer serves it to the filter's `?form=compact`.
    let bundle = kvroute_core::api::TokenizerBundle {
        block_size: Some(16),
        ..kvroute_core::api::TokenizerBundle::from_files("qwen3", files, true)
            .expect("the compact bundle")
    };
    assert!(bundle.bpe_tables.is_some(), "Qwen3 has a compact form");
    serde_json::to_vec(&bundle).expect("bundle serialises")
}

/// One plugin with `{"models": {"qwen3": {}}}` for the tests that do not change its models.
pub fn default_plugin() -> Arc<Plugin> {
    static PLUGIN: OnceLock<Arc<Plugin>> = OnceLock::new();
    // Reports go at once (not held for a route call): tests sharing this plugin each see their own.
    Arc::clone(PLUGIN.get_or_init(|| {
        plugin_with_qwen3(serde_json::json!({"models": {"qwen3": {}}, "complete_hold_ms": 0}))
    }))
}

/// A configured plugin whose `qwen3` tokenizer was fetched from the (fake) indexer.
pub fn plugin_with_qwen3(config: Value) -> Arc<Plugin> {
    let mut host = FakeHost::new();
    let plugin = Plugin::configure(&host, config.to_string().as_bytes(), b"").expect("configure");
    plugin.on_tick(&mut host);
    let fetch = host.last_call().clone();
    assert_eq!(
        fetch.header(":path"),
        Some("/v1/models/qwen3/tokenizer?form=compact")
    );
    let reply = CallReply {
        status: Some(200),
        contract: None,
        body: qwen3_bundle_json(),
    };
    assert!(plugin.on_call_reply(&mut host, fetch.id, &reply));
    assert_eq!(host.count("kvroute.tokenizer_loaded"), 1);
    Arc::new(plugin)
}
