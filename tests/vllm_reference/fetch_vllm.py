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

Legacy releases (0.11.0, 0.23.0, 0.25.0: other wire layouts) are fetched too, without
downloading their wheels: the manylinux x86_64 wheel's URL comes from PyPI's simple index, and
``zipfile`` reads only the zip directory and the few members it needs through HTTP range requests
(about 1 MB per release). The verbatim ``kv_events.py`` of each must match the sha256 pinned
below, or nothing is written. Layout, one importable tree per release::

    legacy/<version>/vllm/...   kv_events.py (verbatim) + that release's stand-ins
    legacy/<version>/READY      version, wheel file name, sha256; present once it is complete

``--no-legacy`` skips them. Their directories go to stderr (stdout stays the ``pkg`` line).

vLLM's KV cache manager (``kv_manager_driver.py``) is extracted from the same wheel into
``kvmgr/`` (its modules verbatim, stand-ins for what needs torch or the engine; ``kvmgr/READY``
records the wheel and a digest of the stand-ins).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
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


# ---------------------------------------------------------------------------------------------
# Legacy releases: kv_events.py read from the wheel with HTTP range requests.

PYPI_SIMPLE = "https://pypi.org/simple/vllm/"
HTTP_TIMEOUT = 60.0
KV_EVENTS_CONFIG = "vllm/config/kv_events.py"

# Per release: the wheel we read (manylinux x86_64, no build tag), the sha256 of its verbatim
# kv_events.py (computed once from the wheel; it also matches the wheel's RECORD), and two facts
# about that release's KVEventsConfig that the stand-in must reproduce (checked against the
# wheel's vllm/config/kv_events.py): the `publisher` default, and whether __post_init__ turns
# enable_kv_cache_events into publisher "zmq" (0.11 has no such step: publisher must be given).
# (0.23.0 also has a build-tag-2 wheel; its kv_events.py is the same file.)
LEGACY = {
    "0.11.0": {
        "wheel": "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl",
        "sha256": "232ccb502d7c8ed3b6e55b7dc0dd6d82b4c6baa8637e10862b71d260dc8f04f2",
        "publisher_default": '"null"',
        "post_init": False,
    },
    "0.23.0": {
        "wheel": "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "sha256": "24841685ad6db3543a19b9639eea24e1992ab37c4773c775da9f4140bb813322",
        "publisher_default": "None",
        "post_init": True,
    },
    "0.25.0": {
        "wheel": "vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "sha256": "f566d4756ab562f7851806a1471f9a580682d6a6b2637d6a2e99580e5fa42756",
        "publisher_default": "None",
        "post_init": True,
    },
}
# Every release above has exactly these KVEventsConfig fields, in this order.
KV_EVENTS_CONFIG_FIELDS = [
    "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
    "max_queue_size", "topic",
]


class Offline(Exception):
    """PyPI could not be reached."""


def _open(req: urllib.request.Request):
    req.add_header("User-Agent", "kvroute-fetch_vllm")
    try:
        return urllib.request.urlopen(req, timeout=HTTP_TIMEOUT)
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as e:  # DNS, refused, timeout, TLS
        raise Offline(f"{req.full_url}: {getattr(e, 'reason', e)}") from e


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file; reads become HTTP range requests.

    Bytes are fetched in aligned chunks and kept, so ``zipfile``'s small reads around the same
    places (end of central directory, central directory, one local header + member) cost a
    handful of requests. Every reply must be 206 with the expected total size.
    """

    CHUNK = 1 << 18

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self.pos = 0
        self.chunks: dict[int, bytes] = {}
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the file")
        self.pos = base + offset
        return self.pos

    def _fetch(self, first: int, last: int) -> None:
        """Fetches chunks first..=last in one request."""
        start = first * self.CHUNK
        end = min(self.size, (last + 1) * self.CHUNK) - 1
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
        with _open(req) as r:
            if r.status != 206:
                raise SystemExit(f"{self.url}: HTTP {r.status} to a range request (want 206)")
            total = r.headers.get("Content-Range", "").rpartition("/")[2]
            if total != str(self.size):
                raise SystemExit(
                    f"{self.url}: Content-Range {r.headers.get('Content-Range')!r}, "
                    f"but PyPI's index says the wheel has {self.size} bytes")
            data = r.read()
        self.requests += 1
        if len(data) != end - start + 1:
            raise SystemExit(f"{self.url}: got {len(data)} bytes for range {start}-{end}")
        for i in range(first, last + 1):
            off = (i - first) * self.CHUNK
            self.chunks[i] = data[off:off + self.CHUNK]

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or self.pos + n > self.size:
            n = max(0, self.size - self.pos)
        if n == 0:
            return b""
        first, last = self.pos // self.CHUNK, (self.pos + n - 1) // self.CHUNK
        missing = [i for i in range(first, last + 1) if i not in self.chunks]
        if missing:
            self._fetch(missing[0], missing[-1])
        buf = b"".join(self.chunks[i] for i in range(first, last + 1))
        off = self.pos - first * self.CHUNK
        out = buf[off:off + n]
        self.pos += len(out)
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def wheel_location(filename: str) -> tuple[str, int]:
    """URL and size of one vllm wheel, from PyPI's simple index (PEP 691 JSON)."""
    req = urllib.request.Request(
        PYPI_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with _open(req) as r:
        index = json.load(r)
    for f in index.get("files", []):
        if f.get("filename") == filename:
            if not isinstance(f.get("size"), int):
                raise SystemExit(f"{PYPI_SIMPLE}: no size for {filename}")
            return f["url"], f["size"]
    raise SystemExit(f"{PYPI_SIMPLE} does not list {filename}")


def legacy_root() -> Path:
    return cache_dir() / "legacy"


def legacy_pkg_dir(version: str) -> Path:
    """The importable tree of one legacy release (``sys.path`` entry)."""
    return legacy_root() / version


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ready_text(version: str) -> str:
    pin = LEGACY[version]
    return f"{version}\n{pin['wheel']}\n{pin['sha256']}\n"


def legacy_ready(version: str) -> bool:
    pkg = legacy_pkg_dir(version)
    ready, module = pkg / "READY", pkg / VERBATIM
    return (ready.is_file() and ready.read_text() == _ready_text(version) and module.is_file()
            and _sha256(module.read_bytes()) == LEGACY[version]["sha256"])


def check_config_facts(version: str, source: str) -> None:
    """Refuses when the release's KVEventsConfig is not what the stand-in reproduces."""
    pin = LEGACY[version]
    body = source.split("class KVEventsConfig", 1)[-1]
    fields = re.findall(r"^    (\w+): [^=\n]+=\s*([^\n#]+?)\s*(?:#.*)?$", body, re.M)
    names = [n for n, _ in fields]
    publisher = dict(fields).get("publisher")
    post_init = "def __post_init__" in body
    if (names != KV_EVENTS_CONFIG_FIELDS or publisher != pin["publisher_default"]
            or post_init != pin["post_init"]):
        raise SystemExit(
            f"vllm {version} {KV_EVENTS_CONFIG}: fields {names}, publisher default "
            f"{publisher}, __post_init__ {post_init}: not what the stand-in assumes; update it")


def legacy_standins(version: str, alias: str) -> dict[str, str]:
    """The stand-ins one legacy kv_events.py needs: it imports KVEventsConfig, init_logger and
    ExternalBlockHash (nothing else of vLLM)."""
    pin = LEGACY[version]
    post_init = (
        "\n    def __post_init__(self):\n"
        "        if self.publisher is None:\n"
        "            self.publisher = 'zmq' if self.enable_kv_cache_events else 'null'\n"
        if pin["post_init"] else "")
    publisher = "'null'" if pin["publisher_default"] == '"null"' else "None"
    standins = {k: v for k, v in STANDINS.items() if k.endswith("__init__.py")}
    standins["vllm/logger.py"] = STANDINS["vllm/logger.py"]
    standins["vllm/config/kv_events.py"] = (
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\n"
        "class KVEventsConfig:\n"
        f"    # vLLM {version}'s fields and defaults (checked against the wheel).\n"
        "    enable_kv_cache_events: bool = False\n"
        f"    publisher: str | None = {publisher}\n"
        "    endpoint: str = 'tcp://*:5557'\n"
        "    replay_endpoint: str | None = None\n"
        "    buffer_steps: int = 10_000\n"
        "    hwm: int = 100_000\n"
        "    max_queue_size: int = 100_000\n"
        "    topic: str = ''\n"
        f"{post_init}"
    )
    standins["vllm/v1/core/kv_cache_utils.py"] = (
        "from typing import TypeAlias, Union  # noqa: F401\n\n"
        f"# Read from vLLM {version}'s {ALIAS_SOURCE}.\n"
        f"ExternalBlockHash: TypeAlias = {alias}\n"
    )
    return standins


def legacy_alias(version: str, source: str) -> str:
    m = re.search(r"^ExternalBlockHash\s*(?::\s*TypeAlias\s*)?=\s*(.+)$", source, re.M)
    alias = m.group(1).strip() if m else None
    if alias not in ("bytes | int", "int | bytes", "Union[bytes, int]", "Union[int, bytes]"):
        raise SystemExit(f"vllm {version} {ALIAS_SOURCE}: ExternalBlockHash is {alias!r}; "
                         "update the stand-in")
    return alias


def fetch_legacy(version: str) -> Path:
    pin = LEGACY[version]
    pkg = legacy_pkg_dir(version)
    if legacy_ready(version):
        return pkg
    url, size = wheel_location(pin["wheel"])
    remote = RangeFile(url, size)
    with zipfile.ZipFile(remote) as z:
        module = z.read(VERBATIM)
        alias = legacy_alias(version, z.read(ALIAS_SOURCE).decode())
        check_config_facts(version, z.read(KV_EVENTS_CONFIG).decode())
    got = _sha256(module)
    if got != pin["sha256"]:
        raise SystemExit(
            f"vllm {version}: {VERBATIM} from {pin['wheel']} has sha256 {got}, "
            f"pinned {pin['sha256']}: refusing it")
    tmp = pkg.with_name(pkg.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / VERBATIM).parent.mkdir(parents=True)
    (tmp / VERBATIM).write_bytes(module)
    for rel, body in legacy_standins(version, alias).items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(STANDIN_HEADER + body)
    (tmp / "READY").write_text(_ready_text(version))
    shutil.rmtree(pkg, ignore_errors=True)
    tmp.rename(pkg)
    print(f"vllm {version}: {VERBATIM} read from {pin['wheel']} with {remote.requests} range "
          f"requests ({sum(map(len, remote.chunks.values()))} of {size} bytes)", file=sys.stderr)
    return pkg


def ensure_legacy() -> list[Path]:
    out = []
    for version in LEGACY:
        try:
            out.append(fetch_legacy(version))
        except Offline as e:
            raise SystemExit(
                f"cannot fetch vLLM {version}'s kv_events.py: PyPI is unreachable ({e}). "
                f"Run this once with network access; it is then cached in {legacy_root()}"
            ) from None
        except urllib.error.HTTPError as e:
            raise SystemExit(f"cannot fetch vLLM {version}'s kv_events.py: {e.url}: HTTP "
                             f"{e.code} {e.reason}") from None
    return out


# ---------------------------------------------------------------------------------------------
# vLLM's KV cache manager (kv_manager_driver.py): its own modules, verbatim, from the same wheel.

# Copied byte for byte: the manager, its coordinators, single-type managers, block pool, and
# what they import that needs neither torch nor a running engine.
KV_MANAGER_VERBATIM = (
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_metrics.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/kv_cache_spec_registry.py",
    "vllm/v1/kv_cache_layout.py",
    "vllm/v1/hisparse/block_pool.py",
    "vllm/distributed/kv_events.py",
    "vllm/utils/math_utils.py",
    "vllm/utils/hashing.py",
)

KV_MANAGER_HEADER = (
    "# kvroute stand-in, NOT vLLM code: replaces a vLLM module that would pull in torch, CUDA or\n"
    "# the engine with the few names vLLM's KV cache manager imports (only what the driver\n"
    "# exercises). Written by tests/vllm_reference/fetch_vllm.py.\n"
)

KV_MANAGER_STANDINS = {
    "vllm/__init__.py": '"""Stand-in package root (the real one imports torch)."""\n',
    "vllm/distributed/__init__.py": "",
    "vllm/config/__init__.py": (
        "class VllmConfig:  # type annotations only\n"
        "    pass\n\n\n"
        "def get_current_vllm_config_or_none():\n"
        "    return None\n"
    ),
    "vllm/config/kv_events.py": STANDINS["vllm/config/kv_events.py"],
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": STANDINS["vllm/utils/network_utils.py"],
    # vLLM's envs.py reads every engine setting; the manager reads one (default "1", as vLLM).
    "vllm/envs.py": (
        "import os\n\n"
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = bool(\n"
        "    int(os.getenv('VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES', '1'))\n"
        ")\n"
    ),
    "vllm/logger.py": (
        "import logging\n\n\n"
        "class _Logger(logging.Logger):\n"
        "    def debug_once(self, msg, *args, **kwargs):\n"
        "        self.debug(msg, *args)\n\n"
        "    def info_once(self, msg, *args, **kwargs):\n"
        "        self.info(msg, *args)\n\n"
        "    def warning_once(self, msg, *args, **kwargs):\n"
        "        self.warning(msg, *args)\n\n\n"
        "def init_logger(name: str) -> logging.Logger:\n"
        "    logging.setLoggerClass(_Logger)\n"
        "    try:\n"
        "        return logging.getLogger(name)\n"
        "    finally:\n"
        "        logging.setLoggerClass(logging.Logger)\n"
    ),
    # The built-in specs are registered by vLLM's own register_all_kvcache_specs; the platform
    # hook only adds out-of-tree ones.
    "vllm/platforms.py": (
        "class _Platform:\n"
        "    def register_custom_kv_cache_specs(self, vllm_config):\n"
        "        pass\n\n\n"
        "current_platform = _Platform()\n"
    ),
    "vllm/multimodal/__init__.py": "",
    "vllm/multimodal/utils.py": (
        "def get_mm_features_in_window(mm_features, start, end):\n"
        "    raise NotImplementedError('the driver sends no multimodal requests')\n"
    ),
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/hisparse/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    # Only the enum's name is used (a MambaSpec default); the driver builds no Mamba groups.
    "vllm/v1/attention/backends/registry.py": (
        "import enum\n\n\n"
        "class MambaAttentionBackendEnum(enum.Enum):\n"
        "    MAMBA1 = 'mamba1'\n"
        "    MAMBA2 = 'mamba2'\n"
    ),
    # The request is the driver's own duck type; the manager reads RequestStatus members.
    "vllm/v1/request.py": (
        "import enum\n\n\n"
        "class Request:  # type annotations only; the driver passes its own request object\n"
        "    pass\n\n\n"
        "class RequestStatus(enum.IntEnum):  # the members up to PREEMPTED, in vLLM's order\n"
        "    WAITING = enum.auto()\n"
        "    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()\n"
        "    WAITING_FOR_REMOTE_KVS = enum.auto()\n"
        "    WAITING_FOR_STREAMING_REQ = enum.auto()\n"
        "    RUNNING = enum.auto()\n"
        "    PREEMPTED = enum.auto()\n"
    ),
    "vllm/v1/metrics/__init__.py": "",
    # Statistics only (log_stats is off in the driver).
    "vllm/v1/metrics/stats.py": (
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\n"
        "class KVCacheEvictionEvent:\n"
        "    lifetime_seconds: float\n"
        "    idle_seconds: float\n"
        "    reuse_gaps_seconds: tuple\n\n\n"
        "class PrefixCacheStats:\n"
        "    def record(self, *args, **kwargs):\n"
        "        pass\n"
    ),
    "vllm/v1/utils.py": (
        "def tensor_data(tensor):\n"
        "    raise NotImplementedError('prompt embeddings are not driven')\n"
    ),
    "vllm/utils/torch_utils.py": (
        "def get_dtype_size(dtype):\n"
        "    return dtype.itemsize\n"
    ),
    # kv_cache_interface.py imports torch for dtypes (spec fields) and tensor type hints.
    "torch/__init__.py": (
        "class dtype:\n"
        "    def __init__(self, name: str, itemsize: int):\n"
        "        self.name, self.itemsize = name, itemsize\n\n"
        "    def __repr__(self):\n"
        "        return f'torch.{self.name}'\n\n\n"
        "float16 = dtype('float16', 2)\n"
        "bfloat16 = dtype('bfloat16', 2)\n"
        "float32 = dtype('float32', 4)\n\n\n"
        "class Tensor:  # type hints only\n"
        "    pass\n"
    ),
}


def kv_manager_dir() -> Path:
    return cache_dir() / "kvmgr"


def ensure_kv_manager(wheel: Path) -> Path:
    """vLLM's KV cache manager modules (verbatim) + stand-ins, importable from ``kvmgr``."""
    pkg = kv_manager_dir()
    ready_text = f"{VLLM_VERSION}\n{wheel.name}\n" + "".join(
        f"{_sha256(KV_MANAGER_HEADER.encode() + body.encode())[:16]} {rel}\n"
        for rel, body in sorted(KV_MANAGER_STANDINS.items())
    )
    ready = pkg / "READY"
    if ready.is_file() and ready.read_text() == ready_text:
        return pkg
    tmp = pkg.with_name(pkg.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for rel in KV_MANAGER_VERBATIM:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(rel))
    for rel, body in KV_MANAGER_STANDINS.items():
        if rel in KV_MANAGER_VERBATIM:
            raise SystemExit(f"{rel} is both verbatim and a stand-in")
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(KV_MANAGER_HEADER + body)
    (tmp / "READY").write_text(ready_text)
    shutil.rmtree(pkg, ignore_errors=True)
    tmp.rename(pkg)
    return pkg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-legacy", action="store_true",
                    help="only vLLM 0.33.0 (skip the 0.11.0 / 0.23.0 / 0.25.0 kv_events.py)")
    args = ap.parse_args()
    pkg = ensure()
    wheel = find_wheel(cache_dir())
    if wheel is None:
        raise SystemExit("the vllm wheel vanished after extraction")
    print(f"kv manager: {ensure_kv_manager(wheel)}", file=sys.stderr)
    if not args.no_legacy:
        for d in ensure_legacy():
            print(f"legacy: {d}", file=sys.stderr)
    print(pkg)


if __name__ == "__main__":
    main()
