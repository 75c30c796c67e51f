#!/usr/bin/env python3
"""Fetch vLLM's own KV event classes from the release wheel on PyPI, without installing vLLM.

Downloads ``vllm==0.33.0`` (``pip download --no-deps``, ~340 MB, cached) and extracts only
``vllm/distributed/kv_events.py``. That module imports a few heavy vLLM modules (torch, pydantic
configs, network helpers); this script writes small stand-ins for exactly those imports, so the
real ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` msgspec structs
import with only ``msgspec`` and ``pyzmq`` installed.

Cache layout (``$KVROUTE_VLLM_WHEEL_DIR``, else ``$KVROUTE_CACHE/vllm-wheel``, else
``<repo>/target/kvroute-cache/vllm-wheel``)::

    vllm-0.33.0-*.whl          the wheel, as pip downloaded it
    pkg/vllm/...               kv_events.py (verbatim) + stand-ins; put ``pkg`` on sys.path
    pkg/READY                  version + wheel file name; present once extraction succeeded

Prints the ``pkg`` directory on success. Re-running is a no-op when ``pkg/READY`` matches.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
REPO_ROOT = Path(__file__).resolve().parents[2]

# The real module, copied byte for byte.
VERBATIM = "vllm/distributed/kv_events.py"
# A module we only read a fact from (the ExternalBlockHash alias), never copy.
ALIAS_SOURCE = "vllm/v1/core/kv_cache_utils.py"

STANDIN_HEADER = (
    "# kvroute stand-in, NOT vLLM code: replaces a vLLM module that would pull in torch or\n"
    "# pydantic with the few names vllm/distributed/kv_events.py imports. Written by\n"
    "# tests/vllm_reference/fetch_vllm.py.\n"
)

STANDINS = {
    "vllm/__init__.py": '"""Stand-in package root (the real one imports torch)."""\n',
    "vllm/distributed/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/utils/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/logger.py": (
        "import logging\n\n\n"
        "def init_logger(name: str) -> logging.Logger:\n"
        "    return logging.getLogger(name)\n"
    ),
    # Only the publisher uses KVEventsConfig; a plain dataclass with vLLM 0.33.0's fields.
    "vllm/config/kv_events.py": (
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\n"
        "class KVEventsConfig:\n"
        "    enable_kv_cache_events: bool = False\n"
        "    publisher: str | None = None\n"
        "    endpoint: str = 'tcp://*:5557'\n"
        "    replay_endpoint: str | None = None\n"
        "    buffer_steps: int = 10_000\n"
        "    hwm: int = 100_000\n"
        "    max_queue_size: int = 100_000\n"
        "    topic: str = ''\n\n"
        "    def __post_init__(self):\n"
        "        if self.publisher is None:\n"
        "            self.publisher = 'zmq' if self.enable_kv_cache_events else 'null'\n"
    ),
    # Network helpers used by the publisher only (the decoder never calls them).
    "vllm/utils/network_utils.py": (
        "import ipaddress\n\n\n"
        "def get_ip() -> str:\n"
        "    return '127.0.0.1'\n\n\n"
        "def is_valid_ipv6_address(address: str) -> bool:\n"
        "    try:\n"
        "        ipaddress.IPv6Address(address)\n"
        "        return True\n"
        "    except ValueError:\n"
        "        return False\n\n\n"
        "def get_tcp_uri(ip: str, port: int) -> str:\n"
        "    return f'tcp://[{ip}]:{port}' if is_valid_ipv6_address(ip) else f'tcp://{ip}:{port}'\n\n\n"
        "def split_zmq_path(path: str):\n"
        "    scheme, _, rest = path.partition('://')\n"
        "    if scheme in ('ipc', 'inproc'):\n"
        "        return scheme, rest, ''\n"
        "    host, _, port = rest.rpartition(':')\n"
        "    return scheme, host.strip('[]'), port\n"
    ),
}


def cache_dir() -> Path:
    explicit = os.environ.get("KVROUTE_VLLM_WHEEL_DIR")
    if explicit:
        return Path(explicit)
    root = os.environ.get("KVROUTE_CACHE")
    if root:
        return Path(root) / "vllm-wheel"
    return REPO_ROOT / "target" / "kvroute-cache" / "vllm-wheel"


def find_wheel(d: Path) -> Path | None:
    wheels = sorted(d.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return wheels[0] if wheels else None


def download(d: Path) -> Path:
    wheel = find_wheel(d)
    if wheel:
        return wheel
    d.mkdir(parents=True, exist_ok=True)
    print(f"downloading vllm=={VLLM_VERSION} (no deps, ~340 MB) into {d}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
         "--only-binary=:all:", "-d", str(d), "-q"],
        check=True,
    )
    wheel = find_wheel(d)
    if not wheel:
        raise SystemExit(f"pip download finished but no vllm-{VLLM_VERSION} wheel is in {d}")
    return wheel


def external_block_hash_alias(source: str) -> str:
    m = re.search(r"^ExternalBlockHash\s*:\s*TypeAlias\s*=\s*(.+)$", source, re.M)
    if not m:
        raise SystemExit(f"{ALIAS_SOURCE}: ExternalBlockHash alias not found; update the stand-in")
    alias = m.group(1).strip()
    if alias not in ("bytes | int", "int | bytes"):
        raise SystemExit(f"{ALIAS_SOURCE}: ExternalBlockHash is now {alias!r}; update the stand-in")
    return alias


def extract(wheel: Path, pkg: Path) -> None:
    tmp = pkg.with_name(pkg.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        kv_events = z.read(VERBATIM)
        alias = external_block_hash_alias(z.read(ALIAS_SOURCE).decode())
    target = tmp / VERBATIM
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(kv_events)
    standins = dict(STANDINS)
    standins["vllm/v1/core/kv_cache_utils.py"] = (
        "from typing import TypeAlias\n\n"
        f"# Read from the wheel's {ALIAS_SOURCE}.\n"
        f"ExternalBlockHash: TypeAlias = {alias}\n"
    )
    for rel, body in standins.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(STANDIN_HEADER + body)
    (tmp / "READY").write_text(f"{VLLM_VERSION}\n{wheel.name}\n")
    shutil.rmtree(pkg, ignore_errors=True)
    tmp.rename(pkg)


def ensure() -> Path:
    d = cache_dir()
    pkg = d / "pkg"
    ready = pkg / "READY"
    wheel = find_wheel(d)
    if wheel and ready.is_file() and ready.read_text() == f"{VLLM_VERSION}\n{wheel.name}\n":
        return pkg
    wheel = download(d)
    extract(wheel, pkg)
    return pkg


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(ensure())


if __name__ == "__main__":
    main()
