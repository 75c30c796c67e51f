//! The shipped Envoy configurations are accepted by the real Envoy (`--mode validate`): the
//! rendered `envoy/envoy.yaml`, and the Envoy parts of the Istio example (the EnvoyFilter's ECDS
//! Wasm config, clusters, route and connection-manager patches, the VirtualService's routes and the
//! bootstrap ConfigMap's overload manager, assembled into a bootstrap). Istio itself does not run
//! here. Both carry the exposure and abuse limits (path allow-list, client timeouts, overload
//! manager, fallback health); `e2e_paths.rs` shows them working through a real Envoy.

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

fn shipped() -> String {
    let opts = EnvoyOptions::new(
        8190,
        vec!["127.0.0.1:8001".into(), "127.0.0.1:8002".into()],
        json!({"models": {"qwen3": {}}}),
    );
    render_envoy(&opts, 10000, 9901)
}

#[test]
fn the_shipped_envoy_yaml_validates() {
    validate("shipped", &shipped());
}

/// Seconds of a protobuf Duration string (`"10s"`, `"0.25s"`); 0 when absent.
fn secs(v: &Value) -> f64 {
    v.as_str()
        .and_then(|s| s.strip_suffix('s'))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0)
}

/// The client limits every shipped configuration carries (reasons at the top of envoy.yaml).
fn assert_client_limits(what: &str, hcm: &Value) {
    for key in [
        "request_headers_timeout",
        "request_timeout",
        "stream_idle_timeout",
    ] {
        assert!(
            secs(&hcm[key]) > 0.0,
            "{what}: {key} is {} (unbounded)",
            hcm[key]
        );
    }
    assert!(
        secs(&hcm["request_timeout"]) < secs(&hcm["stream_idle_timeout"]),
        "{what}: the upload bound should be the tighter one"
    );
    assert!(
        hcm["max_request_headers_kb"]
            .as_u64()
            .is_some_and(|kb| kb <= 60),
        "{what}"
    );
    assert!(
        secs(&hcm["common_http_protocol_options"]["idle_timeout"]) > 0.0,
        "{what}"
    );
    assert!(
        hcm["http2_protocol_options"]["max_concurrent_streams"].as_u64() > Some(0),
        "{what}"
    );
}

fn assert_overload_manager(what: &str, om: &Value) {
    let monitors: Vec<&str> = om["resource_monitors"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["name"].as_str()).collect())
        .unwrap_or_default();
    for m in [
        "envoy.resource_monitors.fixed_heap",
        "envoy.resource_monitors.global_downstream_max_connections",
    ] {
        assert!(monitors.contains(&m), "{what}: no {m} in {monitors:?}");
    }
    let actions: Vec<&str> = om["actions"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["name"].as_str()).collect())
        .unwrap_or_default();
    for a in [
        "envoy.overload_actions.shrink_heap",
        "envoy.overload_actions.reset_high_memory_stream",
        "envoy.overload_actions.stop_accepting_requests",
    ] {
        assert!(actions.contains(&a), "{what}: no {a} in {actions:?}");
    }
}

#[test]
fn the_shipped_envoy_yaml_exposes_only_the_api_and_bounds_clients() {
    let dir = scratch("shipped-structure");
    let path = dir.join("shipped.yaml");
    std::fs::write(&path, shipped()).expect("write");
    let doc = yaml_docs(&path).remove(0);
    assert_overload_manager("envoy.yaml", &doc["overload_manager"]);
    let listener = &doc["static_resources"]["listeners"][0];
    assert_eq!(
        listener["address"]["socket_address"]["address"],
        "127.0.0.1"
    );
    assert_eq!(
        doc["admin"]["address"]["socket_address"]["address"],
        "127.0.0.1"
    );
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    assert_client_limits("envoy.yaml", hcm);
    assert_eq!(hcm["normalize_path"], true);
    assert_eq!(hcm["merge_slashes"], true);
    let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        .as_array()
        .expect("routes");
    // Every route to a cluster is an allow-listed path; the catch-all answers locally.
    for r in &routes[..routes.len() - 1] {
        assert!(r["route"]["cluster"].is_string(), "{r}");
        assert!(
            r["match"]["safe_regex"]["regex"].is_string(),
            "not allow-listed: {r}"
        );
        assert!(
            secs(&r["route"]["timeout"]) == 0.0,
            "long streams need no route timeout: {r}"
        );
    }
    let last = routes.last().expect("a route");
    assert_eq!(last["match"]["prefix"], "/");
    assert_eq!(last["direct_response"]["status"], 404);
    let clusters = doc["static_resources"]["clusters"]
        .as_array()
        .expect("clusters");
    let fallback = clusters
        .iter()
        .find(|c| c["name"] == "kvroute_replicas_fallback")
        .expect("fallback cluster");
    assert_eq!(
        fallback["health_checks"][0]["http_health_check"]["path"],
        "/health"
    );
    assert!(fallback["outlier_detection"]["max_ejection_percent"].as_u64() <= Some(50));
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
    assert!(
        routed["match"]["safe_regex"]["regex"].is_string(),
        "{routed}"
    );
    // The VirtualService's routes as istiod renders them: the allow-listed fallback, then 404.
    let vs = docs
        .iter()
        .find(|d| d["kind"] == "VirtualService")
        .expect("a VirtualService");
    let http_routes = vs["spec"]["http"].as_array().expect("http routes");
    let regex = http_routes[0]["match"][0]["uri"]["regex"]
        .as_str()
        .expect("the fallback route matches an allow-list regex");
    assert_eq!(http_routes[0]["name"], "vllm-fallback");
    let not_found = &http_routes.last().expect("routes")["directResponse"];
    assert_eq!(not_found["status"], 404);
    let hcm_patch = &of("NETWORK_FILTER")[0]["typed_config"];
    assert_client_limits("istio HCM patch", hcm_patch);
    let mut hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gw",
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            routed,
            {"name": "vllm-fallback", "match": {"safe_regex": {"regex": regex}},
             "route": {"cluster": "vllm-fallback", "timeout": "0s"}},
            {"name": "not-found", "match": {"prefix": "/"},
             "direct_response": {"status": 404, "body": {"inline_string": not_found["body"]["string"]}}}]}]},
        "http_filters": [
            {"name": ext[0]["name"], "typed_config": wasm},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]});
    for (k, v) in hcm_patch.as_object().expect("patch") {
        hcm[k] = v.clone();
    }
    let config_map = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .expect("the bootstrap ConfigMap");
    let custom: Value = serde_json::from_str(
        config_map["data"]["custom_bootstrap.json"]
            .as_str()
            .expect("custom_bootstrap.json"),
    )
    .expect("custom_bootstrap.json is JSON");
    assert_overload_manager("istio bootstrap", &custom["overload_manager"]);
    let bootstrap = json!({
        "overload_manager": custom["overload_manager"],
        "static_resources": {
            "listeners": [{
                "name": "gw",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}]}],
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

/// The engines' NetworkPolicy admits their HTTP, event and replay ports from the gateway pods
/// that the EnvoyFilter selects, and from nobody else (an empty `from` would admit everyone).
#[test]
fn the_engine_network_policy_admits_only_the_gateway() {
    let docs = yaml_docs(&workspace().join("envoy/istio/envoyfilter-kvroute.yaml"));
    let filter = docs
        .iter()
        .find(|d| d["kind"] == "EnvoyFilter")
        .expect("an EnvoyFilter");
    let gateway_labels = &filter["spec"]["workloadSelector"]["labels"];
    let gateway_ns = &filter["metadata"]["namespace"];
    let vs = docs
        .iter()
        .find(|d| d["kind"] == "VirtualService")
        .expect("a VirtualService");
    let engines_ns = vs["spec"]["http"][0]["route"][0]["destination"]["host"]
        .as_str()
        .and_then(|h| h.split('.').nth(1))
        .expect("the engines' Service host name.namespace.svc...");
    let policy = yaml_docs(&workspace().join("envoy/istio/networkpolicy-vllm.yaml")).remove(0);
    assert_eq!(policy["kind"], "NetworkPolicy");
    assert_eq!(policy["metadata"]["namespace"], engines_ns);
    assert!(policy["spec"]["policyTypes"]
        .as_array()
        .is_some_and(|t| t.iter().any(|x| x == "Ingress")));
    let rules = policy["spec"]["ingress"].as_array().expect("ingress rules");
    let mut ports = Vec::new();
    for rule in rules {
        let from = rule["from"].as_array().expect("every rule names its peers");
        assert!(!from.is_empty(), "an empty `from` admits everyone: {rule}");
        for peer in from {
            assert_eq!(
                &peer["podSelector"]["matchLabels"], gateway_labels,
                "{peer}"
            );
            assert_eq!(
                &peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
                gateway_ns,
                "{peer}"
            );
        }
        ports.extend(
            rule["ports"]
                .as_array()
                .expect("ports")
                .iter()
                .filter_map(|p| p["port"].as_u64()),
        );
    }
    for port in [8000, 5557, 5558] {
        assert!(
            ports.contains(&port),
            "port {port} not restricted: {ports:?}"
        );
    }
}
