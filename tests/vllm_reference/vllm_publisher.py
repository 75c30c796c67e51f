#!/usr/bin/env python3
"""Publish a scripted KV event scenario through vLLM's own ``ZmqEventPublisher`` (0.33.0 or older).

The publisher is made the way vLLM's scheduler makes it:
``EventPublisherFactory.create(KVEventsConfig(...), data_parallel_rank)``, one per DP rank (vLLM
offsets the ports by the rank itself), from the ``kv_events.py`` that ``fetch_vllm.py`` extracted
from the release wheel. Events are vLLM's own msgspec structs (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared`` in a ``KVEventBatch``), so every byte on the wire, the live framing and the
ROUTER replay protocol are vLLM's.

``--kv-events-impl 0.11.0|0.23.0|0.25.0`` loads that release's verbatim ``kv_events.py`` instead
(fetched by ``fetch_vllm.py`` into ``legacy/<version>``): 0.11.0 and 0.23.0 send events as msgpack
arrays, 0.25.0 as maps, and all three reply to replay requests without the topic frame. Events
are built with that module's own structs: a scenario field the release's struct lacks is dropped
(0.11.0: ``lora_name``, ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``; 0.23.0 / 0.25.0:
the newer fields of 0.33.0), so expectations must say what the engine could not publish. These
releases cannot bind ``tcp://*:0`` per DP rank (they would add the rank to port 0), so with
``data_parallel_size > 1`` a ``:0`` endpoint is replaced by a free base port for ``dp`` consecutive
ports; ``kv_event_sources`` is then read from the bound sockets (those releases have no
``GET /kv_event_sources``).

Protocol with the caller (a test):

* stdout, one JSON object per line:
  ``{"ready": true, "kv_event_sources": {"0": {...}, "1": {...}}}`` once every publisher is bound
  (the same shape as vLLM's ``GET /kv_event_sources``: each rank's resolved ``KVEventsConfig``),
  plus ``"impl"`` (the release) and ``"structs"``: per event class, its fields in wire order and
  whether it encodes as an array;
  ``{"published": k, "batches": n, "last_seq": {"0": s0, ...}}`` after phase ``k`` was handed to
  the publisher threads and flushed (each phase's batches are buffered for replay).
* stdin: one line per further phase (any text, e.g. ``next``). Phase 0 is published without
  waiting, ``--start-delay`` seconds after binding, so a subscriber that connects later can only
  get it through replay. EOF on stdin (or ``--linger`` seconds after the last phase) ends the
  process after ``shutdown()`` of every publisher.

Scenario JSON::

    {"topic": "kv-events", "data_parallel_size": 2, "block_size": 4,
     "phases": [[{"rank": 0, "events": [EVENT, ...]}, ...], ...]}

``EVENT`` is ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h|null,
"token_ids": [...], "medium": "GPU"|"CPU"|..., "lora_name": s|null, "lora_id": n|null,
"extra_keys": [[...]|null, ...]|null}``, ``{"type": "BlockRemoved", "block_hashes": [...],
"medium": ...}`` or ``{"type": "AllBlocksCleared"}``. A hash is an integer (u64, may be >= 2^63)
or ``"hex:..."`` for a bytes hash. Other keys (e.g. ``"comment"``, ``"expect"``) are ignored.

Exit status: 0 done; 2 bad arguments or scenario; 3 vLLM's module is missing (run
``cargo xtask setup``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


DEFAULT_IMPL = "0.33.0"
LEGACY_IMPLS = ("0.11.0", "0.23.0", "0.25.0")


def vllm_pkg_dir(explicit: str | None, impl: str) -> Path:
    if explicit:
        return Path(explicit)
    sys.path.insert(0, str(HERE))
    from fetch_vllm import cache_dir, legacy_pkg_dir  # our own helpers: the fetcher's cache rules

    return cache_dir() / "pkg" if impl == DEFAULT_IMPL else legacy_pkg_dir(impl)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def wire_hash(h):
    if isinstance(h, str) and h.startswith("hex:"):
        return bytes.fromhex(h[4:])
    if isinstance(h, int) and 0 <= h < 2**64:
        return h
    raise ValueError(f"bad block hash {h!r}: want a u64 or 'hex:...'")


def build(cls, **fields):
    """``cls(**fields)`` keeping only the fields this release's struct has."""
    return cls(**{k: v for k, v in fields.items() if k in cls.__struct_fields__})


def make_event(kv, ev: dict, block_size: int):
    kind = ev.get("type")
    if kind == "BlockStored":
        parent = ev.get("parent_block_hash")
        extra = ev.get("extra_keys")
        return build(
            kv.BlockStored,
            block_hashes=[wire_hash(h) for h in ev["block_hashes"]],
            parent_block_hash=None if parent is None else wire_hash(parent),
            token_ids=list(ev["token_ids"]),
            block_size=int(ev.get("block_size", block_size)),
            lora_id=ev.get("lora_id"),
            medium=ev.get("medium", kv.MEDIUM_GPU),
            lora_name=ev.get("lora_name"),
            extra_keys=None
            if extra is None
            else [None if k is None else tuple(k) for k in extra],
            group_idx=ev.get("group_idx", 0),
            kv_cache_spec_kind=ev.get("kv_cache_spec_kind", "full_attention"),
        )
    if kind == "BlockRemoved":
        return build(
            kv.BlockRemoved,
            block_hashes=[wire_hash(h) for h in ev["block_hashes"]],
            medium=ev.get("medium", kv.MEDIUM_GPU),
            group_idx=ev.get("group_idx", 0),
        )
    if kind == "AllBlocksCleared":
        return kv.AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


def struct_facts(kv) -> dict:
    """Per event class of the loaded module: fields in wire order, array or map encoding."""
    return {
        name: {
            "fields": list(getattr(kv, name).__struct_fields__),
            "array_like": bool(getattr(kv, name).__struct_config__.array_like),
        }
        for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    }


def free_port_run(n: int) -> int:
    """A port p with p..p+n-1 all free on 127.0.0.1 right now (best effort)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        probes = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                probes.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in probes:
                t.close()
    raise OSError(f"no run of {n} free ports")


def concrete_endpoint(ep: str | None, dp: int) -> str | None:
    """``tcp://*:0`` -> ``tcp://*:<free base port>`` for releases that offset port 0 by the rank."""
    if ep is None or dp <= 1 or not ep.startswith("tcp://") or not ep.endswith(":0"):
        return ep
    return f"{ep[:-2]}:{free_port_run(dp)}"


def bound(sock) -> str | None:
    """The endpoint a socket is bound to, wildcard host as 127.0.0.1 (where a test connects)."""
    import zmq  # pyzmq, which vLLM's module needs anyway

    if sock is None:
        return None
    ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return ep.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://127.0.0.1:")


def legacy_sources(publishers, config) -> dict:
    """What ``GET /kv_event_sources`` would say, read from each publisher's bound sockets."""
    out = {}
    for rank, p in enumerate(publishers):
        d = asdict(config)
        d["endpoint"] = bound(p._pub)  # noqa: SLF001
        d["replay_endpoint"] = bound(p._replay)  # noqa: SLF001
        out[str(rank)] = d
    return out


def wait_flushed(publishers, timeout: float) -> None:
    """Waits until every publisher thread has sent (and buffered) what it was given."""
    deadline = time.monotonic() + timeout
    for p in publishers:
        while p._event_queue.unfinished_tasks and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True, help="scenario JSON file")
    ap.add_argument("--endpoint", default="tcp://*:0",
                    help="rank 0 PUB endpoint as in --kv-events-config (default tcp://*:0)")
    ap.add_argument("--replay-endpoint", default="tcp://*:0",
                    help="rank 0 ROUTER endpoint; 'none' disables replay (default tcp://*:0)")
    ap.add_argument("--start-delay", type=float, default=0.0,
                    help="seconds between binding and publishing phase 0")
    ap.add_argument("--linger", type=float, default=120.0,
                    help="seconds to keep serving replay after the last phase (EOF ends earlier)")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--kv-events-impl", default=DEFAULT_IMPL, choices=[DEFAULT_IMPL, *LEGACY_IMPLS],
                    help="whose kv_events.py publishes (default 0.33.0)")
    ap.add_argument("--vllm-dir",
                    help="extracted tree (default: fetch_vllm.py's cache: pkg, or legacy/<impl>)")
    args = ap.parse_args()
    legacy = args.kv_events_impl != DEFAULT_IMPL

    pkg = vllm_pkg_dir(args.vllm_dir, args.kv_events_impl)
    if not (pkg / "READY").is_file() or not (pkg / "vllm/distributed/kv_events.py").is_file():
        print(f"vLLM {args.kv_events_impl}'s kv_events.py is not extracted in {pkg}: "
              "run `cargo xtask setup`", file=sys.stderr)
        return 3
    if legacy and not (pkg / "READY").read_text().startswith(f"{args.kv_events_impl}\n"):
        print(f"{pkg} does not hold vLLM {args.kv_events_impl}", file=sys.stderr)
        return 3
    sys.path.insert(0, str(pkg))
    import vllm.distributed.kv_events as kv  # vLLM's own module (verbatim from the wheel)
    from vllm.config.kv_events import KVEventsConfig  # stand-in dataclass, vLLM's fields

    try:
        scenario = json.loads(Path(args.scenario).read_text())
        dp = int(scenario.get("data_parallel_size", 1))
        block_size = int(scenario.get("block_size", 16))
        phases = [
            [(int(b.get("rank", 0)), [make_event(kv, e, block_size) for e in b["events"]])
             for b in phase]
            for phase in scenario["phases"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bad scenario {args.scenario}: {e}", file=sys.stderr)
        return 2
    if any(not 0 <= rank < dp for phase in phases for rank, _ in phase):
        print("bad scenario: a batch's rank is outside data_parallel_size", file=sys.stderr)
        return 2

    endpoint = args.endpoint
    replay_endpoint = None if args.replay_endpoint == "none" else args.replay_endpoint
    if legacy:
        endpoint = concrete_endpoint(endpoint, dp)
        replay_endpoint = concrete_endpoint(replay_endpoint, dp)
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        replay_endpoint=replay_endpoint,
        buffer_steps=args.buffer_steps,
        topic=scenario.get("topic", ""),
    )
    # What vLLM's EngineCore does per DP rank.
    publishers = [kv.EventPublisherFactory.create(config, rank) for rank in range(dp)]
    if not all(isinstance(p, kv.ZmqEventPublisher) for p in publishers):
        print("EventPublisherFactory did not make a ZmqEventPublisher", file=sys.stderr)
        return 2
    if legacy:
        sources = legacy_sources(publishers, config)
    else:
        sources = {
            str(rank): asdict(p.get_publisher_config()) for rank, p in enumerate(publishers)
        }
    emit({
        "ready": True,
        "impl": args.kv_events_impl,
        "structs": struct_facts(kv),
        "kv_event_sources": sources,
    })

    next_phase = threading.Event()
    stdin_closed = threading.Event()

    def read_stdin() -> None:
        for _ in sys.stdin:
            next_phase.set()
        stdin_closed.set()
        next_phase.set()

    threading.Thread(target=read_stdin, daemon=True).start()

    sent = [0] * dp
    time.sleep(max(0.0, args.start_delay))
    for k, phase in enumerate(phases):
        if k > 0:
            next_phase.wait()
            next_phase.clear()
            if stdin_closed.is_set():
                break
        for rank, events in phase:
            # The scheduler leaves data_parallel_rank unset; the publisher fills it in.
            publishers[rank].publish(kv.KVEventBatch(ts=time.time(), events=events))
            sent[rank] += 1
        wait_flushed(publishers, 10.0)
        emit({
            "published": k,
            "batches": len(phase),
            "last_seq": {str(r): sent[r] - 1 for r in range(dp) if sent[r]},
        })

    stdin_closed.wait(timeout=max(0.0, args.linger))
    for p in publishers:
        p.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
