//! Harness for the filter's end-to-end tests: what is Envoy-specific (the filter's build
//! artifacts, rendering envoy.yaml, starting Envoy with the filter, reading its stats). Processes,
//! ports, the HTTP client, the fakes and the sim/indexer fleet come from `kvroute-testkit`.

#![allow(dead_code, unused_imports)]

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

pub use kvroute_testkit::fake_indexer::{tokenizer_answer, FakeIndexer, RouteMode, TokenizerMode};
pub use kvroute_testkit::fake_server::{echo_replica, Reply, Request, TestServer};
pub use kvroute_testkit::filter_build::FilterBuild;
pub use kvroute_testkit::fleet::{Indexer, Sim, SimPlan, ADMIN_TOKEN};
pub use kvroute_testkit::http::{http, post_json, try_http, FullResponse as Response};
pub use kvroute_testkit::paths::{
    bin, envoy_bin, model_dir, need, newest_mtime, target_dir, workspace,
};
pub use kvroute_testkit::ports::free_port;
pub use kvroute_testkit::process::{wait_for, Proc};
pub use kvroute_testkit::text::filler;

/// A scratch directory `target/e2e/<name>-<pid>` for logs and rendered configs.
pub fn scratch(name: &str) -> PathBuf {
    kvroute_testkit::paths::scratch("e2e", name)
}

/// The filter .wasm, checked to be newer than the filter's and core's sources (unless given
/// explicitly through `KVROUTE_FILTER_WASM`).
pub fn wasm_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_FILTER_WASM").filter(|v| !v.is_empty()) {
        return need(PathBuf::from(p), "kvroute_filter.wasm");
    }
    let p = need(
        target_dir().join("wasm32-wasip1/release/kvroute_filter.wasm"),
        "kvroute_filter.wasm",
    );
    let built = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
    if let Some(built) = built {
        for dir in ["filter/src", "core/src"] {
            if let Some(newest) = newest_mtime(&workspace().join(dir)) {
                assert!(
                    newest <= built,
                    "{} is older than {dir}: rebuild it with `cargo build -p kvroute-filter --target wasm32-wasip1 --release` (cargo xtask test does)",
                    p.display()
                );
            }
        }
    }
    p
}

/// Which build of the filter the e2e tests run in Envoy: `KVROUTE_FILTER_BUILD=wasm` (default)
/// or `native` (the dynamic module); `cargo xtask test` runs the e2e suites with both.
pub fn filter_build() -> FilterBuild {
    FilterBuild::from_env().unwrap_or_else(|e| panic!("KVROUTE_FILTER_BUILD: {e}"))
}

/// The native dynamic module (`KVROUTE_FILTER_NATIVE`, or the release build in the target
/// directory: `cargo build -p kvroute-filter-native --release`, which `cargo xtask test` runs).
pub fn native_module_path() -> PathBuf {
    let path = std::env::var_os("KVROUTE_FILTER_NATIVE")
        .filter(|v| !v.is_empty())
        .map_or_else(
            || target_dir().join("release/libkvroute_filter_native.so"),
            PathBuf::from,
        );
    need(path, "libkvroute_filter_native.so")
}

// ---------------------------------------------------------------------------------------------
// Envoy.

/// How to render envoy/envoy.yaml.
pub struct EnvoyOptions {
    pub plugin_config: Value,
    pub indexer_port: u16,
    pub replicas: Vec<String>,
    /// Keep the kvroute Wasm filter (false = plain Envoy, for baselines and the attack control).
    pub with_filter: bool,
    pub concurrency: usize,
    /// The VM configuration (offline tokenizers), `Value::Null` for none.
    pub vm_config: Value,
    /// Text replacements applied to the rendered envoy.yaml (e.g. a shorter timeout for a test);
    /// each `from` must occur.
    pub yaml_edits: Vec<(String, String)>,
    /// Run the native dynamic-module build (envoy/envoy-native.yaml with this `.so`) instead of
    /// the Wasm filter.
    pub native_module: Option<PathBuf>,
}

impl EnvoyOptions {
    pub fn new(indexer_port: u16, replicas: Vec<String>, plugin_config: Value) -> Self {
        Self {
            plugin_config,
            indexer_port,
            replicas,
            with_filter: true,
            concurrency: 1,
            vm_config: Value::Null,
            yaml_edits: Vec::new(),
            native_module: (filter_build() == FilterBuild::Native).then(native_module_path),
        }
    }
}

pub struct Envoy {
    pub proc: Proc,
    pub port: u16,
    pub admin: u16,
    pub concurrency: usize,
    /// Runs the native dynamic module (one plugin per process) rather than the Wasm filter.
    pub native: bool,
}

/// Removes the `- name: envoy.filters.http.wasm` list item (up to the next filter).
fn cut_wasm_filter(text: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    let mut indent = 0;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let this_indent = line.len() - trimmed.len();
        if trimmed.starts_with("- name: envoy.filters.http.wasm") {
            skipping = true;
            indent = this_indent;
            continue;
        }
        if skipping && trimmed.starts_with("- ") && this_indent == indent {
            skipping = false;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

pub fn render_envoy(opts: &EnvoyOptions, listen: u16, admin: u16) -> String {
    // Plain Envoy (no filter) is the Wasm template with the filter cut out.
    let native = opts.with_filter && opts.native_module.is_some();
    let file = if native {
        "envoy/envoy-native.yaml"
    } else {
        "envoy/envoy.yaml"
    };
    let template = std::fs::read_to_string(workspace().join(file)).expect("read envoy template");
    let mut text = template;
    if !opts.with_filter {
        text = cut_wasm_filter(&text);
    }
    let endpoints: Vec<Value> = opts
        .replicas
        .iter()
        .map(|r| {
            let addr: SocketAddr = r.parse().expect("replica addr");
            serde_json::json!({"endpoint": {"address": {"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}}}})
        })
        .collect();
    let wasm = if opts.with_filter && !native {
        wasm_path().display().to_string()
    } else {
        "unused".to_string()
    };
    for (from, to) in &opts.yaml_edits {
        assert!(text.contains(from.as_str()), "envoy.yaml has no {from:?}");
        text = text.replace(from.as_str(), to);
    }
    let module = opts.native_module.as_ref();
    let values = [
        ("LISTEN_PORT", listen.to_string()),
        ("ADMIN_PORT", admin.to_string()),
        ("WASM_PATH", wasm),
        (
            "MODULE_PATH",
            module.map_or_else(String::new, |p| p.display().to_string()),
        ),
        ("INDEXER_PORT", opts.indexer_port.to_string()),
        ("FALLBACK_LB_ENDPOINTS", Value::Array(endpoints).to_string()),
        ("VM_CONFIG", json_string(&opts.vm_config)),
        ("PLUGIN_CONFIG", json_string(&filter_config(opts, native))),
    ];
    kvroute_testkit::stack::render(&text, &values).expect("render the envoy template")
}

/// `v` as a JSON string literal (Envoy reads it as a StringValue); `Value::Null` as `""`.
fn json_string(v: &Value) -> String {
    let text = if v.is_null() {
        String::new()
    } else {
        v.to_string()
    };
    Value::String(text).to_string()
}

/// The filter's configuration: the native build has one string, so the VM configuration rides
/// in it as a `vm_config` member (docs/filter.md, "Native build").
fn filter_config(opts: &EnvoyOptions, native: bool) -> Value {
    let mut config = opts.plugin_config.clone();
    if native && !opts.vm_config.is_null() {
        if let Value::Object(fields) = &mut config {
            fields.insert("vm_config".into(), opts.vm_config.clone());
        }
    }
    config
}

impl Envoy {
    pub fn start(name: &str, opts: &EnvoyOptions, dir: &Path) -> Envoy {
        let (port, admin) = (free_port(), free_port());
        let yaml = render_envoy(opts, port, admin);
        let native = opts.with_filter && opts.native_module.is_some();
        Self::start_rendered(name, &yaml, (port, admin), opts.concurrency, native, dir)
    }

    /// Starts an Envoy from a configuration already rendered for its `(listener, admin)` ports.
    pub fn start_rendered(
        name: &str,
        yaml: &str,
        (port, admin): (u16, u16),
        concurrency: usize,
        native: bool,
        dir: &Path,
    ) -> Envoy {
        let cfg = dir.join(format!("{name}.yaml"));
        std::fs::write(&cfg, yaml).expect("write envoy config");
        let mut proc = Proc::spawn(
            name,
            Command::new(envoy_bin())
                .arg("-c")
                .arg(&cfg)
                .arg("--concurrency")
                .arg(concurrency.to_string())
                .arg("--disable-hot-restart")
                .arg("--log-level")
                .arg("info")
                .arg("--component-log-level")
                .arg("wasm:debug,dynamic_modules:debug"),
            dir,
        );
        let start = Instant::now();
        loop {
            proc.assert_running();
            if let Ok(r) = try_http(admin, "GET", "/ready", &[], b"", Duration::from_secs(2)) {
                if r.status == 200 && TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    break;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "envoy not ready in 180 s; log:\n{}",
                proc.log_tail()
            );
            thread::sleep(Duration::from_millis(100));
        }
        Envoy {
            proc,
            port,
            admin,
            concurrency,
            native,
        }
    }

    /// A counter or gauge from the admin stats (0 when absent).
    pub fn stat(&self, name: &str) -> u64 {
        let stats = self.stats_containing(&format!("^{name}$"));
        stats
            .into_iter()
            .find(|(k, _)| k == name)
            .map_or(0, |(_, v)| v)
    }

    /// Every stat whose name contains `part` (Envoy's `filter` regex), as (name, value)
    /// (histograms skipped).
    pub fn stats_containing(&self, part: &str) -> Vec<(String, u64)> {
        let r = http(
            self.admin,
            "GET",
            &format!("/stats?filter={part}"),
            &[],
            b"",
        );
        r.text()
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(k, v)| v.trim().parse().ok().map(|v| (k.to_string(), v)))
            .collect()
    }

    /// A filter counter, `wasmcustom.kvroute.<name>` (`dynamicmodulescustom.` for the native
    /// build).
    pub fn kv(&self, name: &str) -> u64 {
        let namespace = if self.native {
            "dynamicmodulescustom"
        } else {
            "wasmcustom"
        };
        self.stat(&format!("{namespace}.kvroute.{name}"))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.proc.log).unwrap_or_default()
    }

    /// Waits until every VM that serves requests loaded the tokenizers of `models` models: one
    /// VM per worker plus the main thread's (Envoy 1.40 also starts a short-lived base VM whose
    /// fetch never completes); the native build loads each once per process.
    pub fn wait_tokenizers(&self, models: u64) {
        let per_model = if self.native {
            1
        } else {
            self.concurrency as u64 + 1
        };
        let n = models * per_model;
        let start = Instant::now();
        while self.kv("tokenizer_loaded") < n {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "tokenizer not loaded in 120 s; envoy log:\n{}",
                self.proc.log_tail()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }
}
