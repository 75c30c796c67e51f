//! The shipped Envoy configurations are accepted by the real Envoy (`--mode validate`): the
//! rendered `envoy/envoy.yaml`, and the Envoy parts of the Istio EnvoyFilter (its ECDS Wasm config,
//! clusters and route patch, assembled into a bootstrap). Istio itself does not run here.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn validate(name: &str, config: &str) {
    let dir = scratch(name);
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, config).expect("write config");
    let out = Command::new(envoy_bin())
        .arg("--mode")
        .arg("validate")
        .arg("--disable-hot-restart")
        .arg("-c")
        .arg(&path)
        .output()
        .expect("run envoy");
    assert!(
        out.status.success(),
        "envoy rejected {name}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_shipped_envoy_yaml_validates() {
    let opts = EnvoyOptions::new(
        8190,
        vec!["127.0.0.1:8001".into(), "127.0.0.1:8002".into()],
        json!({"models": {"qwen3": {}}}),
    );
    validate("shipped", &render_envoy(&opts, 10000, 9901));
}

/// YAML documents as JSON, through the venv's Python (PyYAML comes with transformers).
fn yaml_docs(path: &std::path::Path) -> Vec<Value> {
    let python = std::env::var_os("KVROUTE_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/kvroute-cache/venv/bin/python"));
    assert!(
        python.exists(),
        "{} missing: run `cargo xtask setup`",
        python.display()
    );
    let out = Command::new(python)
        .arg("-c")
        .arg("import json,sys,yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))")
        .arg(path)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn the_istio_envoyfilter_carries_valid_envoy_config() {
    let docs = yaml_docs(&workspace().join("envoy/istio/envoyfilter-kvroute.yaml"));
    let filter = docs
        .iter()
        .find(|d| d["kind"] == "EnvoyFilter")
        .expect("an EnvoyFilter");
    let patches = filter["spec"]["configPatches"].as_array().expect("patches");
    let of = |kind: &str| -> Vec<&Value> {
        patches
            .iter()
            .filter(|p| p["applyTo"] == kind)
            .map(|p| &p["patch"]["value"])
            .collect()
    };
    let ext = of("EXTENSION_CONFIG");
    assert_eq!(ext.len(), 1);
    let mut wasm = ext[0]["typed_config"].clone();
    assert_eq!(wasm["config"]["allow_on_headers_stop_iteration"], true);
    assert_ne!(wasm["config"]["failure_policy"], "FAIL_OPEN");
    // The ECDS name is what the HTTP_FILTER patch references.
    assert_eq!(of("HTTP_FILTER")[0]["name"], ext[0]["name"]);
    // Istio's agent turns the remote module into a local file; do the same for validation.
    wasm["config"]["vm_config"]["code"] = json!({"local": {"filename": wasm_path()}});
    let plugin_cfg = wasm["config"]["configuration"]["value"]
        .as_str()
        .expect("configuration string");
    kvroute_filter::config::FilterConfig::parse(plugin_cfg.as_bytes())
        .expect("the example plugin configuration is valid");
    let mut clusters: Vec<Value> = of("CLUSTER").into_iter().cloned().collect();
    clusters.push(json!({"name": "vllm-fallback", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "vllm-fallback", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}}));
    let routed = of("HTTP_ROUTE")[0].clone();
    let bootstrap = json!({
        "static_resources": {
            "listeners": [{
                "name": "gw",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gw",
                        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
                            routed,
                            {"name": "vllm-fallback", "match": {"prefix": "/"}, "route": {"cluster": "vllm-fallback"}}]}]},
                        "http_filters": [
                            {"name": ext[0]["name"], "typed_config": wasm},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}],
            "clusters": clusters}});
    validate("istio-parts", &bootstrap.to_string());

    let reference = yaml_docs(&workspace().join("envoy/istio/wasmplugin-reference.yaml"));
    let plugin = &reference[0];
    assert_eq!(plugin["kind"], "WasmPlugin");
    kvroute_filter::config::FilterConfig::parse(
        plugin["spec"]["pluginConfig"].to_string().as_bytes(),
    )
    .expect("the WasmPlugin's pluginConfig is valid");
}
