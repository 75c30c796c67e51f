#!/usr/bin/env python3
"""Checks that kvroute's compose files, indexer.toml and envoy.yaml agree with each other.

    python3 compose/validate.py                       # structure only (needs PyYAML)
    python3 compose/validate.py --indexer target/debug/kvroute-indexer --model-dir DIR \
        --envoy ENVOY --wasm target/wasm32-wasip1/release/kvroute_filter.wasm

Docker is not needed. The structural checks read docker-compose.yml (vLLM) and
docker-compose.sim.yml (kvroute-sim) and check, for each:

* the services: envoy, indexer (sharing Envoy's network namespace), the wasm copy, and two or more
  replicas, each with a static address on the compose network's subnet;
* every replica: `--kv-events-config` is JSON that enables the ZeroMQ publisher on a bound
  `tcp://*:PORT` with a replay endpoint on the replica's static address and a topic;
  `--prefix-caching-hash-algo sha256_cbor`; `--enable-prompt-tokens-details`; vLLM replicas reserve
  distinct GPUs and share one HF cache volume;
* exposure: `--host` is the replica's static address, no replica publishes a port (HTTP, events and
  replay carry prompts and admin endpoints), Envoy publishes its listener port and nothing else
  except on the host's loopback, and Envoy's admin listens on 127.0.0.1;
* indexer.toml: every replica's HTTP, event and replay address, topic, model name, block size,
  hash algorithm and vLLM version match the replica services, and no replica is missing or extra;
  the model directory is mounted into the indexer;
* envoy.yaml: the fallback cluster lists exactly the replicas, the indexer cluster is the indexer's
  `listen` address, the wasm file is where the wasm volume is mounted, the listener port is
  published, and the file equals ../envoy/envoy.yaml rendered with its values except for the
  listener address;
* docker-compose.two-layers.yml's LiteLLM (docs/two-layers.md): the pinned image, one deployment per
  model group at Envoy's address, num_retries at most 1, no cooldowns, client headers forwarded (the
  indexer's session header among them), the master key from the environment, custom_auth next to
  the config, and Envoy published on the host's loopback only.

With --indexer/--model-dir, indexer.toml is also parsed by `kvroute-indexer serve --check-config`
(the real parser; model_dir pointed at DIR). With --envoy/--wasm, envoy.yaml is checked by
`envoy --mode validate` with the real filter (which also parses the plugin configuration).
Exit status 0 when everything holds; 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

try:
    import tomllib
except ImportError:  # Python 3.10 (README's minimum): the TOML parser pip itself vendors
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
COMPOSE_FILES = {
    "docker-compose.yml": "vllm",
    "docker-compose.sim.yml": "sim",
    "docker-compose.two-layers.yml": "sim",
}
# The LiteLLM recipe (docs/two-layers.md): at most this many retries at the top layer.
LITELLM_MAX_RETRIES = 1
LITELLM_PIN = "litellm[proxy]==1.108.7"
KV_EVENTS_KEYS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}
DST_HEADER = "x-envoy-original-dst-host"


class Problems:
    """Collects problems; each names the file it is about."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.checks = 0

    def check(self, ok: Any, where: str, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.items.append(f"{where}: {message}")
        return bool(ok)


# ---------------------------------------------------------------------------------------------
# Compose helpers


def interpolate(value: Any, where: str, problems: Problems) -> Any:
    """Resolves compose's `${NAME:-default}` to its default; other forms are refused."""
    if isinstance(value, dict):
        return {k: interpolate(v, where, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, where, problems) for v in value]
    if not isinstance(value, str):
        return value
    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}", lambda m: m.group(2), value)
    # `${NAME:?message}`: required, no default (secrets); stands for itself here.
    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?[^}]*\}", lambda m: f"<{m.group(1)}>", out)
    bare = re.sub(r"\$\$", "", out)
    problems.check(
        "$" not in bare,
        where,
        f"{value!r}: use ${{NAME:-default}} so the file works without an environment",
    )
    return out.replace("$$", "$")


def as_list(command: Any) -> list[str]:
    if command is None:
        return []
    if isinstance(command, str):
        return command.split()
    return [str(c) for c in command]


def flag_values(args: list[str], name: str) -> list[str]:
    """Values of `--name V` and `--name=V`."""
    values = []
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            values.append(args[i + 1])
        elif a.startswith(name + "="):
            values.append(a[len(name) + 1 :])
    return values


def one_flag(args: list[str], name: str, where: str, problems: Problems) -> str | None:
    values = flag_values(args, name)
    if problems.check(len(values) == 1, where, f"needs exactly one {name} (found {len(values)})"):
        return values[0]
    return None


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of every volume entry, short or long syntax."""
    out = []
    for v in service.get("volumes", []) or []:
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), str(v.get("target", ""))))
        else:
            parts = str(v).split(":")
            if len(parts) >= 2:
                out.append((parts[0], parts[1]))
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def mount_for(service: dict, path: str) -> tuple[str, str] | None:
    """The mount that contains `path` inside the container (longest target wins)."""
    best = None
    for source, target in mounts(service):
        t = target.rstrip("/") or "/"
        if path == t or path.startswith(t + "/"):
            if best is None or len(t) > len(best[1]):
                best = (source, t)
    return best


def static_ip(service: dict, network: str) -> str | None:
    nets = service.get("networks")
    if isinstance(nets, dict) and isinstance(nets.get(network), dict):
        return nets[network].get("ipv4_address")
    return None


def published_container_ports(service: dict) -> set[int]:
    ports = set()
    for p in service.get("ports", []) or []:
        if isinstance(p, dict):
            ports.add(int(p.get("target", 0)))
        else:
            ports.add(int(str(p).split("/")[0].split(":")[-1]))
    return ports


def tcp_port(endpoint: str) -> int | None:
    m = re.fullmatch(r"tcp://(.+):(\d+)", endpoint or "")
    return int(m.group(2)) if m else None


# ---------------------------------------------------------------------------------------------
# Replicas


class Replica:
    def __init__(self, name: str, kind: str, ip: str, port: int, events: int, replay: int, topic: str,
                 model: str, block_size: int, algo: str, version: str | None) -> None:
        self.name, self.kind, self.ip, self.port = name, kind, ip, port
        self.events, self.replay, self.topic = events, replay, topic
        self.model, self.block_size, self.algo, self.version = model, block_size, algo, version

    @property
    def http(self) -> str:
        return f"{self.ip}:{self.port}"


def replica_kind(service: dict) -> str | None:
    image = str(service.get("image", ""))
    command = as_list(service.get("command"))
    if image.startswith("vllm/vllm-openai"):
        entry = as_list(service.get("entrypoint"))
        return "vllm" if entry[:2] == ["vllm", "serve"] else None
    if command[:1] == ["kvroute-sim"]:
        return "sim"
    return None


def check_kv_events(raw: str | None, where: str, problems: Problems) -> tuple[int, int, str] | None:
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        problems.check(False, where, f"--kv-events-config is not JSON ({e})")
        return None
    if not problems.check(isinstance(cfg, dict), where, "--kv-events-config must be a JSON object"):
        return None
    unknown = set(cfg) - KV_EVENTS_KEYS
    problems.check(not unknown, where, f"--kv-events-config has unknown keys {sorted(unknown)}")
    problems.check(cfg.get("enable_kv_cache_events") is True, where,
                   "--kv-events-config must set \"enable_kv_cache_events\": true")
    problems.check(cfg.get("publisher") == "zmq", where,
                   "--kv-events-config must set \"publisher\": \"zmq\" (vLLM <= 0.11 publishes nothing without it)")
    endpoint = cfg.get("endpoint", "tcp://*:5557")
    replay = cfg.get("replay_endpoint")
    topic = cfg.get("topic", "")
    ok = problems.check(isinstance(endpoint, str) and endpoint.startswith("tcp://*:") and tcp_port(endpoint),
                        where, f"--kv-events-config endpoint {endpoint!r} must be tcp://*:PORT (the engine binds it)")
    ok &= problems.check(isinstance(replay, str) and tcp_port(replay), where,
                         f"--kv-events-config needs a replay_endpoint tcp://ADDRESS:PORT (got {replay!r})")
    ok &= problems.check(isinstance(topic, str) and topic != "", where,
                         "--kv-events-config should name a topic")
    if not ok:
        return None
    ep, rp = tcp_port(endpoint), tcp_port(replay)
    problems.check(ep != rp, where, "events and replay endpoints use the same port")
    return ep, rp, topic, replay


def check_replica(name: str, service: dict, kind: str, subnet: ipaddress.IPv4Network, network: str,
                  where: str, problems: Problems) -> Replica | None:
    where = f"{where}: service {name}"
    args = as_list(service.get("command"))
    if kind == "vllm":
        image = str(service.get("image", ""))
        m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", image)
        problems.check(m is not None, where, f"image {image!r} must be pinned to a release (vllm/vllm-openai:vX.Y.Z)")
        version = m.group(1) if m else None
        problems.check(args[:1] != [] and not args[0].startswith("-"), where,
                       "the model must be the first argument of `vllm serve`")
    else:
        version = (flag_values(args, "--vllm-version") or ["0.33.0"])[0]
        model_dir = one_flag(args, "--model-dir", where, problems)
        if model_dir is not None:
            problems.check(mount_for(service, model_dir) is not None, where,
                           f"--model-dir {model_dir} is not mounted")
    algo = one_flag(args, "--prefix-caching-hash-algo", where, problems)
    problems.check(algo == "sha256_cbor", where,
                   f"--prefix-caching-hash-algo must be sha256_cbor (got {algo!r})")
    problems.check("--enable-prompt-tokens-details" in args, where,
                   "needs --enable-prompt-tokens-details (the engine's cached_tokens feed the indexer's hit metrics)")
    events = check_kv_events(one_flag(args, "--kv-events-config", where, problems), where, problems)
    served = one_flag(args, "--served-model-name", where, problems)
    port_s = one_flag(args, "--port", where, problems)
    block_s = one_flag(args, "--block-size", where, problems)
    ip = static_ip(service, network)
    ok = problems.check(ip is not None, where, f"needs a static ipv4_address on network {network}")
    if ip is not None:
        ok &= problems.check(ipaddress.ip_address(ip) in subnet, where, f"{ip} is outside {subnet}")
    # Exposure: the engine's HTTP API (/reset_prefix_cache, /metrics) and its event and replay
    # sockets (every prompt's token ids) stay on the compose network.
    problems.check(flag_values(args, "--host") == [ip], where,
                   f"--host must be the service's compose address {ip} (not every interface: "
                   "the engine's API and, for kvroute-sim, its event sockets would follow)")
    problems.check(not service.get("ports"), where,
                   "a replica publishes no port: its HTTP API, event and replay sockets carry prompts "
                   "and admin endpoints; only Envoy's listener is for clients")
    if events is not None:
        problems.check(events[3] == f"tcp://{ip}:{events[1]}", where,
                       f"replay_endpoint {events[3]!r} must bind the service's compose address "
                       f"(tcp://{ip}:{events[1]}): the replay socket returns past prompts' token ids")
    for label, value in (("--port", port_s), ("--block-size", block_s)):
        ok &= problems.check(value is not None and value.isdigit(), where, f"{label} must be an integer")
    if not ok or events is None or served is None or algo is None:
        return None
    return Replica(name, kind, ip, int(port_s), events[0], events[1], events[2], served, int(block_s), algo, version)


def check_gpus(replicas: dict[str, dict], where: str, problems: Problems) -> None:
    seen: dict[str, str] = {}
    for name, service in replicas.items():
        devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
        if not problems.check(len(gpus) == 1, f"{where}: service {name}",
                              "needs one GPU reservation (deploy.resources.reservations.devices, driver nvidia, capabilities [gpu])"):
            continue
        ids = [str(i) for i in gpus[0].get("device_ids") or []]
        problems.check(bool(ids), f"{where}: service {name}", "GPU reservation needs device_ids (distinct per replica)")
        for i in ids:
            problems.check(i not in seen, f"{where}: service {name}", f"GPU {i} is also reserved by {seen.get(i)}")
            seen[i] = name


def check_hf_cache(replicas: dict[str, dict], volumes: dict, where: str, problems: Problems) -> None:
    sources = set()
    for name, service in replicas.items():
        m = [s for s, t in mounts(service) if t == "/root/.cache/huggingface"]
        problems.check(len(m) == 1 and not is_bind(m[0]), f"{where}: service {name}",
                       "mount the shared named HF cache volume at /root/.cache/huggingface")
        sources.update(m)
    problems.check(len(sources) == 1, where, f"replicas must share one HF cache volume (found {sorted(sources)})")
    for s in sources:
        problems.check(s in volumes, where, f"volume {s} is not declared under volumes:")


# ---------------------------------------------------------------------------------------------
# Envoy


def listener_socket(envoy: dict) -> dict:
    return envoy["static_resources"]["listeners"][0]["address"]["socket_address"]


def clusters(envoy: dict) -> dict[str, dict]:
    return {c["name"]: c for c in envoy["static_resources"]["clusters"]}


def lb_addresses(cluster: dict) -> list[str]:
    out = []
    for group in cluster.get("load_assignment", {}).get("endpoints", []):
        for ep in group.get("lb_endpoints", []):
            sa = ep["endpoint"]["address"]["socket_address"]
            out.append(f"{sa['address']}:{sa['port_value']}")
    return out


def http_manager(envoy: dict) -> dict:
    for f in envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]:
        if f["name"] == "envoy.filters.network.http_connection_manager":
            return f["typed_config"]
    raise KeyError("http_connection_manager")


def wasm_config(envoy: dict) -> dict:
    for f in http_manager(envoy)["http_filters"]:
        if f["name"] == "envoy.filters.http.wasm":
            return f["typed_config"]["config"]
    raise KeyError("envoy.filters.http.wasm")


def first_diff(a: Any, b: Any, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path or '/'}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}/{k}: present in only one file"
            d = first_diff(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def check_template(envoy: dict, template: Path, where: str, problems: Problems) -> None:
    """envoy.yaml must be the template rendered with its own values, except the two addresses."""
    cl = clusters(envoy)
    wasm = wasm_config(envoy)
    values = {
        "LISTEN_PORT": str(listener_socket(envoy)["port_value"]),
        "ADMIN_PORT": str(envoy["admin"]["address"]["socket_address"]["port_value"]),
        "WASM_PATH": wasm["vm_config"]["code"]["local"]["filename"],
        "INDEXER_PORT": lb_addresses(cl["kvroute_indexer"])[0].rsplit(":", 1)[1],
        "FALLBACK_LB_ENDPOINTS": json.dumps(
            cl["kvroute_replicas_fallback"]["load_assignment"]["endpoints"][0]["lb_endpoints"]),
        "PLUGIN_CONFIG": json.dumps(wasm["configuration"]["value"]),
        "VM_CONFIG": json.dumps(wasm["vm_config"]["configuration"]["value"]),
    }
    text = template.read_text()
    for k, v in values.items():
        text = text.replace("{{" + k + "}}", v)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    left = re.findall(r"\{\{[A-Z_]+\}\}", code)
    if not problems.check(not left, where, f"template {template} has placeholders this check does not know: {left}"):
        return
    rendered = yaml.safe_load(text)
    for get in (listener_socket, lambda e: e["admin"]["address"]["socket_address"]):
        problems.check(get(rendered)["address"] == "127.0.0.1", where, "the template no longer listens on 127.0.0.1")
    listener_socket(rendered)["address"] = listener_socket(envoy)["address"]
    diff = first_diff(rendered, envoy)
    problems.check(diff is None, where,
                   f"differs from {template.name} rendered with its values (re-render it): {diff}")


def check_envoy(envoy: dict, envoy_service: dict, replicas: list[Replica], toml_cfg: dict, where: str,
                problems: Problems) -> None:
    sock = listener_socket(envoy)
    problems.check(sock["address"] == "0.0.0.0", where, "the listener must listen on 0.0.0.0 in a container")
    problems.check(int(sock["port_value"]) in published_container_ports(envoy_service), where,
                   f"listener port {sock['port_value']} is not published by the envoy service")
    admin = envoy["admin"]["address"]["socket_address"]
    problems.check(admin["address"] == "127.0.0.1", where,
                   "Envoy's admin must listen on 127.0.0.1 (it has unauthenticated mutating endpoints; "
                   "the replicas share the compose network)")
    for p in envoy_service.get("ports", []) or []:
        spec = str(p.get("published", "")) + ":" + str(p.get("target", "")) if isinstance(p, dict) else str(p)
        host_loopback = isinstance(p, dict) and str(p.get("host_ip", "")) == "127.0.0.1" or spec.startswith("127.0.0.1:")
        problems.check(host_loopback or published_container_ports({"ports": [p]}) == {int(sock["port_value"])}, where,
                       f"envoy publishes {p!r}: only the listener port is for clients (the indexer shares this "
                       "network namespace; publish anything else on the host's loopback at most)")
    cl = clusters(envoy)
    wasm = wasm_config(envoy)
    problems.check(wasm.get("allow_on_headers_stop_iteration") is True, where,
                   "the wasm filter needs allow_on_headers_stop_iteration: true")
    problems.check(wasm.get("failure_policy") != "FAIL_OPEN", where, "never FAIL_OPEN (clients could pick the upstream)")
    try:
        plugin = json.loads(wasm["configuration"]["value"] or "{}")
    except json.JSONDecodeError as e:
        problems.check(False, where, f"plugin configuration is not JSON ({e})")
        plugin = {}
    indexer_cluster = plugin.get("indexer_cluster", "kvroute_indexer")
    if problems.check(indexer_cluster in cl, where, f"plugin's indexer_cluster {indexer_cluster!r} is not a cluster"):
        listen = toml_cfg.get("listen", "127.0.0.1:8190")
        problems.check(lb_addresses(cl[indexer_cluster]) == [listen], where,
                       f"cluster {indexer_cluster} must point at the indexer's listen {listen} "
                       f"(found {lb_addresses(cl[indexer_cluster])})")
    toml_models = {m.get("name") for m in toml_cfg.get("models", [])}
    for name in plugin.get("models", {}):
        problems.check(name in toml_models, where, f"plugin model {name!r} is not in indexer.toml")
    routes = http_manager(envoy)["route_config"]["virtual_hosts"][0]["routes"]
    dst = [r for r in routes if any(h.get("name") == DST_HEADER for h in r["match"].get("headers", []))]
    fallback = [r for r in routes if not r["match"].get("headers")]
    if problems.check(len(dst) == 1 and len(fallback) >= 1, where,
                      f"needs one route matching {DST_HEADER} and a fallback route"):
        dst_cluster = cl.get(dst[0]["route"]["cluster"], {})
        problems.check(dst_cluster.get("type") == "ORIGINAL_DST"
                       and dst_cluster.get("original_dst_lb_config", {}).get("use_http_header") is True,
                       where, "the header route must go to an ORIGINAL_DST cluster with use_http_header: true")
        fb = cl.get(fallback[0]["route"]["cluster"], {})
        want = sorted(r.http for r in replicas)
        problems.check(sorted(lb_addresses(fb)) == want, where,
                       f"fallback cluster endpoints {sorted(lb_addresses(fb))} != replica services {want}")
    filename = wasm["vm_config"]["code"]["local"]["filename"]
    problems.check(mount_for(envoy_service, filename) is not None, where,
                   f"wasm file {filename} is not inside a volume mounted by the envoy service")


# ---------------------------------------------------------------------------------------------
# Indexer TOML


def check_toml(cfg: dict, replicas: list[Replica], indexer: dict, services: dict, where: str,
               problems: Problems) -> None:
    models = cfg.get("models", [])
    if not problems.check(len(models) == 1, where, "compose serves one model: one [[models]] entry"):
        return
    m = models[0]
    for r in replicas:
        rw = f"{where} vs service {r.name}"
        problems.check(m.get("name") == r.model, rw, f"model name {m.get('name')!r} != --served-model-name {r.model!r}")
        problems.check(m.get("block_size") == r.block_size, rw,
                       f"block_size {m.get('block_size')} != --block-size {r.block_size}")
        h = m.get("hash") or {}
        problems.check(h.get("algo") == r.algo, rw, f"hash.algo {h.get('algo')!r} != --prefix-caching-hash-algo {r.algo!r}")
        problems.check(h.get("engine_version", "0.33.0") == r.version, rw,
                       f"hash.engine_version {h.get('engine_version', '0.33.0')!r} != engine version {r.version!r}")
    by_http = {t.get("http"): t for t in m.get("replicas", [])}
    problems.check(len(by_http) == len(m.get("replicas", [])), where, "two replicas share an http address")
    for r in replicas:
        rw = f"{where} vs service {r.name}"
        t = by_http.get(r.http)
        if not problems.check(t is not None, rw, f"no [[models.replicas]] with http = {r.http!r}"):
            continue
        problems.check(t.get("endpoint", r.http) == r.http, rw, f"endpoint {t.get('endpoint')!r} != {r.http!r}")
        problems.check(t.get("events") == [f"tcp://{r.ip}:{r.events}"], rw,
                       f"events {t.get('events')} != ['tcp://{r.ip}:{r.events}']")
        problems.check(t.get("replay") == [f"tcp://{r.ip}:{r.replay}"], rw,
                       f"replay {t.get('replay')} != ['tcp://{r.ip}:{r.replay}']")
        problems.check(t.get("topic", "") == r.topic, rw, f"topic {t.get('topic')!r} != {r.topic!r}")
    extra = set(by_http) - {r.http for r in replicas}
    problems.check(not extra, where, f"replicas {sorted(extra)} have no compose service")
    model_dir = m.get("model_dir")
    if problems.check(isinstance(model_dir, str), where, "models[0].model_dir must be set (the filter gets the tokenizer from the indexer)"):
        mount = mount_for(indexer, model_dir)
        if problems.check(mount is not None, where, f"model_dir {model_dir} is not mounted into the indexer"):
            source = mount[0]
            if not is_bind(source):
                writers = [n for n, s in services.items() if n != "indexer" and any(src == source for src, _ in mounts(s))]
                deps = indexer.get("depends_on") or {}
                problems.check(any(isinstance(deps, dict) and (deps.get(w) or {}).get("condition")
                                   == "service_completed_successfully" for w in writers), where,
                               f"volume {source} must be filled by a one-shot service the indexer depends on")
    snap = (cfg.get("snapshot") or {}).get("path")
    if snap:
        problems.check(mount_for(indexer, str(Path(snap).parent)) is not None, where,
                       f"snapshot directory {Path(snap).parent} is not a volume: a recreated container starts cold")
    problems.check(str(cfg.get("listen", "127.0.0.1:8190")).startswith("127.0.0.1:"), where,
                   "the indexer listens on loopback (it shares Envoy's network namespace)")


# ---------------------------------------------------------------------------------------------


def config_file(service: dict, flag: str, compose_dir: Path, where: str, problems: Problems) -> Path | None:
    args = as_list(service.get("command"))
    path = one_flag(args, flag, where, problems)
    if path is None:
        return None
    mount = mount_for(service, path)
    if not problems.check(mount is not None and is_bind(mount[0]), where, f"{path} is not bind-mounted from compose/"):
        return None
    host = (compose_dir / mount[0]).resolve()
    if mount[1] != path:
        host = host / os.path.relpath(path, mount[1])
    problems.check(host.is_file(), where, f"{host} does not exist")
    return host if host.is_file() else None


def check_compose(path: Path, expected_kind: str, template: Path, problems: Problems) -> dict[str, Path]:
    """Checks one compose file; returns the envoy and indexer config files it uses."""
    where = path.name
    doc = interpolate(yaml.safe_load(path.read_text()), where, problems)
    services = doc.get("services", {})
    for name in ("envoy", "indexer", "filter-wasm"):
        problems.check(name in services, where, f"service {name} is missing")
    if not all(n in services for n in ("envoy", "indexer")):
        return {}
    networks = doc.get("networks", {})
    if not problems.check(len(networks) == 1, where, "define one network with a fixed subnet"):
        return {}
    network, net = next(iter(networks.items()))
    subnets = [c.get("subnet") for c in ((net or {}).get("ipam") or {}).get("config", [])]
    if not problems.check(len(subnets) == 1, where, f"network {network} needs ipam.config with one subnet"):
        return {}
    subnet = ipaddress.ip_network(subnets[0])
    ranges = [c.get("ip_range") for c in net["ipam"]["config"] if c.get("ip_range")]
    dynamic = ipaddress.ip_network(ranges[0]) if ranges else None
    problems.check(dynamic is not None and dynamic.subnet_of(subnet), where,
                   f"network {network} needs an ip_range inside {subnet} for dynamic addresses, "
                   "so no container started first can take a static address")

    envoy_s, indexer_s = services["envoy"], services["indexer"]
    problems.check(re.fullmatch(r"envoyproxy/envoy:v\d+\.\d+\.\d+", str(envoy_s.get("image", ""))) is not None,
                   where, f"envoy image {envoy_s.get('image')!r} must be pinned (envoyproxy/envoy:vX.Y.Z)")
    envoy_ip = static_ip(envoy_s, network)
    problems.check(envoy_ip is not None and ipaddress.ip_address(envoy_ip) in subnet, where,
                   f"envoy needs a static address in {subnet}")
    problems.check(indexer_s.get("network_mode") == "service:envoy", where,
                   "indexer must share Envoy's network namespace (network_mode: service:envoy)")
    iargs = as_list(indexer_s.get("command"))
    problems.check(iargs[:2] == ["kvroute-indexer", "serve"], where, "indexer command must be `kvroute-indexer serve ...`")
    for name, s in services.items():
        b = s.get("build")
        if b:
            df = (path.parent / b.get("context", ".") / b.get("dockerfile", "Dockerfile")).resolve()
            own = "Dockerfile.litellm" if name == "litellm" else "Dockerfile.kvroute"
            problems.check(df == (path.parent / own).resolve() and df.is_file(), where,
                           f"service {name} must build compose/{own}")

    replica_services = {n: s for n, s in services.items() if replica_kind(s)}
    kinds = {replica_kind(s) for s in replica_services.values()}
    problems.check(kinds == {expected_kind} and len(replica_services) >= 2, where,
                   f"needs two or more {expected_kind} replicas (found {sorted(replica_services)})")
    replicas = []
    for n, s in replica_services.items():
        r = check_replica(n, s, replica_kind(s), subnet, network, where, problems)
        if r:
            replicas.append(r)
    ips = [static_ip(s, network) for s in services.values() if static_ip(s, network)]
    problems.check(len(ips) == len(set(ips)), where, f"static addresses are not unique: {ips}")
    for ip in ips:
        problems.check(dynamic is None or ipaddress.ip_address(ip) not in dynamic, where,
                       f"static address {ip} is inside the dynamic ip_range {dynamic}")
    if expected_kind == "vllm":
        check_gpus(replica_services, where, problems)
        check_hf_cache(replica_services, doc.get("volumes") or {}, where, problems)

    # The wasm: copied by filter-wasm into a volume that Envoy mounts.
    wasm_s = services.get("filter-wasm", {})
    cp = as_list(wasm_s.get("command"))
    deps = envoy_s.get("depends_on") or {}
    problems.check(isinstance(deps, dict) and (deps.get("filter-wasm") or {}).get("condition")
                   == "service_completed_successfully", where,
                   "envoy must depend on filter-wasm with condition service_completed_successfully")

    envoy_file = config_file(envoy_s, "-c", path.parent, f"{where}: service envoy", problems)
    toml_file = config_file(indexer_s, "--config", path.parent, f"{where}: service indexer", problems)
    if envoy_file is None or toml_file is None:
        return {}
    envoy = yaml.safe_load(envoy_file.read_text())
    cfg = tomllib.loads(toml_file.read_text())
    ew = f"{envoy_file.name} (for {where})"
    check_envoy(envoy, envoy_s, replicas, cfg, ew, problems)
    check_toml(cfg, replicas, indexer_s, services, f"{toml_file.name} (for {where})", problems)
    filename = wasm_config(envoy)["vm_config"]["code"]["local"]["filename"]
    emount = mount_for(envoy_s, filename)
    if emount and problems.check(len(cp) >= 2 and cp[0] == "cp", where, "filter-wasm must `cp` the .wasm into the volume"):
        wmount = mount_for(wasm_s, cp[-1])
        problems.check(wmount is not None and wmount[0] == emount[0]
                       and os.path.basename(cp[-1]) == os.path.basename(filename), where,
                       f"filter-wasm writes {cp[-1]}, but Envoy loads {filename} from volume {emount[0]}")
    check_template(envoy, template, ew, problems)
    if "litellm" in services:
        check_litellm(services["litellm"], envoy_s, envoy, envoy_ip, cfg, path.parent, where, problems)
    return {"envoy": envoy_file, "toml": toml_file}


# ---------------------------------------------------------------------------------------------
# LiteLLM on top (docs/two-layers.md)


def check_litellm(service: dict, envoy_s: dict, envoy: dict, envoy_ip: str | None, toml_cfg: dict,
                  compose_dir: Path, where: str, problems: Problems) -> None:
    """The top layer: one deployment per model group, kvroute's Envoy; at most one retry; the
    session header forwarded; LiteLLM is the only way in."""
    w = f"{where}: service litellm"
    b = service.get("build") or {}
    dockerfile = compose_dir / b.get("context", ".") / b.get("dockerfile", "Dockerfile")
    problems.check(dockerfile.is_file() and LITELLM_PIN in dockerfile.read_text(), w,
                   f"must build an image that installs {LITELLM_PIN} (the version the two-layer test runs)")
    problems.check(bool(published_container_ports(service)), w, "LiteLLM must publish its port (the clients' entry point)")
    for p in envoy_s.get("ports", []) or []:
        loopback = isinstance(p, dict) and str(p.get("host_ip", "")) == "127.0.0.1" or str(p).startswith("127.0.0.1:")
        problems.check(loopback, where,
                       f"envoy publishes {p!r}: with LiteLLM on top, clients must not reach kvroute around "
                       "its keys (publish Envoy on the host's loopback at most)")
    config = config_file(service, "--config", compose_dir, w, problems)
    if config is None:
        return
    doc = yaml.safe_load(config.read_text()) or {}
    cw = f"{config.parent.name}/{config.name} (for {where})"
    sock = listener_socket(envoy)
    want_base = f"http://{envoy_ip}:{sock['port_value']}/v1"
    groups: dict[str, list[dict]] = {}
    for d in doc.get("model_list") or []:
        groups.setdefault(str(d.get("model_name")), []).append(d.get("litellm_params") or {})
    toml_models = {m.get("name") for m in toml_cfg.get("models", [])}
    problems.check(set(groups) == toml_models, cw,
                   f"model groups {sorted(groups)} != indexer.toml models {sorted(toml_models)}")
    for name, deployments in groups.items():
        problems.check(len(deployments) == 1, cw,
                       f"model group {name!r} has {len(deployments)} deployments: kvroute's Envoy must be the "
                       "only one (LiteLLM would split traffic around kvroute)")
        for d in deployments:
            problems.check(d.get("api_base") == want_base, cw,
                           f"model group {name!r}: api_base {d.get('api_base')!r} != kvroute's Envoy {want_base}")
            problems.check(str(d.get("model", "")) == f"hosted_vllm/{name}", cw,
                           f"model group {name!r}: model must be hosted_vllm/{name} (vLLM's OpenAI API, same name)")
    litellm_settings = doc.get("litellm_settings") or {}
    router = doc.get("router_settings") or {}
    for section, values in (("litellm_settings", litellm_settings), ("router_settings", router)):
        n = values.get("num_retries")
        problems.check(isinstance(n, int) and 0 <= n <= LITELLM_MAX_RETRIES, cw,
                       f"{section}.num_retries must be 0..{LITELLM_MAX_RETRIES} (found {n!r}): retries stack "
                       "with the client's and LiteLLM's default is 2")
    problems.check(router.get("disable_cooldowns") is True, cw,
                   "router_settings.disable_cooldowns must be true: the one deployment is the whole fleet, "
                   "a cooldown would refuse every request of the group")
    general = doc.get("general_settings") or {}
    forwarded = ((litellm_settings.get("model_group_settings") or {}).get("forward_client_headers_to_llm_api")
                 or [])
    everywhere = general.get("forward_client_headers_to_llm_api") is True
    for name in groups:
        problems.check(everywhere or name in forwarded, cw,
                       f"model group {name!r} must forward client headers "
                       "(litellm_settings.model_group_settings.forward_client_headers_to_llm_api)")
    session = str((toml_cfg.get("policy") or {}).get("session_header", "x-session-id")).lower()
    problems.check(session.startswith("x-") and not session.startswith("x-stainless"), cw,
                   f"the indexer's session header {session!r} is not one LiteLLM forwards (x-*, not x-stainless-*)")
    problems.check(str(general.get("master_key", "")).startswith("os.environ/"), cw,
                   "general_settings.master_key must come from the environment (os.environ/...)")
    auth = general.get("custom_auth")
    if auth:
        module = config.parent / (str(auth).rsplit(".", 1)[0] + ".py")
        problems.check(module.is_file(), cw, f"custom_auth {auth!r}: {module.name} is not next to the config")
        inside = flag_values(as_list(service.get("command")), "--config")
        problems.check(bool(inside) and service.get("working_dir") == os.path.dirname(inside[0]), w,
                       "working_dir must be the config's directory (LiteLLM imports custom_auth from there)")


def run_tool(cmd: list[str], where: str, problems: Problems) -> None:
    try:
        env = dict(os.environ, RUST_BACKTRACE="0")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        problems.check(False, where, f"`{' '.join(cmd)}` could not run: {e}")
        return
    lines = (out.stdout + out.stderr).strip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("Error")), None)
    errors = lines[first:first + 6] if first is not None else [
        line for line in lines if re.search(r"\]\[(error|critical)\]", line)][-6:]
    tail = "\n".join(errors or lines[-3:])
    problems.check(out.returncode == 0, where, f"`{' '.join(cmd)}` exited {out.returncode}:\n{tail}")
    if out.returncode == 0:
        print(f"ok: {' '.join(cmd[:1] + cmd[-3:])}: {(out.stdout or out.stderr).strip().splitlines()[-1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=HERE, help="the compose directory (default: this script's)")
    ap.add_argument("--template", type=Path, default=HERE.parent / "envoy" / "envoy.yaml")
    ap.add_argument("--indexer", help="kvroute-indexer binary: check indexer.toml with --check-config")
    ap.add_argument("--model-dir", help="local tokenizer directory replacing model_dir for --indexer")
    ap.add_argument("--envoy", help="envoy binary: `envoy --mode validate` on envoy.yaml")
    ap.add_argument("--wasm", help="kvroute_filter.wasm replacing the container path for --envoy")
    args = ap.parse_args()
    if bool(args.indexer) != bool(args.model_dir) or bool(args.envoy) != bool(args.wasm):
        ap.error("--indexer needs --model-dir and --envoy needs --wasm")

    problems = Problems()
    used: dict[str, set[Path]] = {"envoy": set(), "toml": set()}
    for name, kind in COMPOSE_FILES.items():
        path = args.dir / name
        if not problems.check(path.is_file(), name, "missing"):
            continue
        try:
            files = check_compose(path, kind, args.template, problems)
        except (KeyError, IndexError, TypeError, ValueError, yaml.YAMLError, tomllib.TOMLDecodeError) as e:
            problems.check(False, name, f"unexpected structure: {type(e).__name__}: {e}")
            continue
        for k, v in files.items():
            used[k].add(v)

    with tempfile.TemporaryDirectory(prefix="kvroute-compose-") as tmp:
        for toml_file in sorted(used["toml"]) if args.indexer else []:
            text = re.sub(r'(?m)^model_dir\s*=.*$', f"model_dir = {json.dumps(args.model_dir)}", toml_file.read_text())
            copy = Path(tmp) / toml_file.name
            copy.write_text(text)
            run_tool([args.indexer, "serve", "--config", str(copy), "--check-config"], toml_file.name, problems)
        for envoy_file in sorted(used["envoy"]) if args.envoy else []:
            doc = yaml.safe_load(envoy_file.read_text())
            wasm_config(doc)["vm_config"]["code"]["local"]["filename"] = str(Path(args.wasm).resolve())
            copy = Path(tmp) / envoy_file.name
            copy.write_text(yaml.safe_dump(doc, sort_keys=False))
            run_tool([args.envoy, "--mode", "validate", "-c", str(copy)], envoy_file.name, problems)
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
