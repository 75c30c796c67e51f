#!/usr/bin/env python3
"""Decode KV event batches with vLLM 0.33.0's own msgspec classes and print them as JSON.

Reads msgpack payloads either as hex lines on stdin (default; blank lines and ``#`` comments are
skipped) or live from a ZeroMQ PUB endpoint (``--endpoint tcp://127.0.0.1:5557 --count N``), decodes
each with ``msgspec.msgpack.Decoder(KVEventBatch)`` from the real ``vllm/distributed/kv_events.py``
(fetched by fetch_vllm.py), and prints one JSON object per batch on stdout::

    {"index": 0, "seq": 12 | null, "topic": "kv-events" | null,
     "ts": 1700000000.0, "data_parallel_rank": 0,
     "reencode_identical": true,
     "events": [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": null, ...}]}

Every field of every event is printed (``None`` as null). Bytes (raw-digest hashes, byte extra
keys) print as ``{"hex": "..."}``; tuples print as lists. ``reencode_identical`` says whether
vLLM's own encoder (``msgspec.msgpack.Encoder``) writes exactly the bytes that were received.

A payload vLLM cannot decode prints ``{"index": i, "error": "..."}``. Exit status: 0 when every
payload decoded (and, with ``--require-identical``, re-encoded byte for byte), 1 otherwise, 2 when
``--count`` batches did not arrive within ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def vllm_pkg_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    sys.path.insert(0, str(HERE))
    import fetch_vllm  # noqa: E402  (our own helper next to this file)

    pkg = fetch_vllm.cache_dir() / "pkg"
    if not (pkg / "READY").is_file():
        raise SystemExit(
            f"vLLM's kv_events.py is not in {pkg}: run tests/vllm_reference/fetch_vllm.py "
            "(or `cargo xtask setup`)"
        )
    return pkg


def to_json(v):
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    return v


def event_json(ev) -> dict:
    out = {"type": type(ev).__name__}
    for name in ev.__struct_fields__:
        out[name] = to_json(getattr(ev, name))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-dir", help="directory holding vllm/distributed/kv_events.py "
                    "(default: the fetch_vllm.py cache)")
    ap.add_argument("--endpoint", help="ZeroMQ PUB endpoint to subscribe to instead of stdin")
    ap.add_argument("--topic", default="", help="subscription topic (default: all)")
    ap.add_argument("--count", type=int, default=1, help="batches to read from --endpoint")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds to wait for --count batches (default 30)")
    ap.add_argument("--require-identical", action="store_true",
                    help="also fail when vLLM's encoder would not write the same bytes")
    ap.add_argument("--ready-file", help="with --endpoint: create this file once subscribed "
                    "(vLLM's modules imported, the socket connected), for a caller to wait on")
    args = ap.parse_args()

    sys.path.insert(0, str(vllm_pkg_dir(args.vllm_dir)))
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    failures = 0

    def handle(index: int, payload: bytes, seq=None, topic=None) -> None:
        nonlocal failures
        try:
            batch = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            failures += 1
            print(json.dumps({"index": index, "seq": seq, "error": str(e)}), flush=True)
            return
        identical = encoder.encode(batch) == payload
        if args.require_identical and not identical:
            failures += 1
        print(json.dumps({
            "index": index,
            "seq": seq,
            "topic": topic,
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "reencode_identical": identical,
            "events": [event_json(e) for e in batch.events],
        }), flush=True)

    if args.endpoint:
        import zmq

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
        sub.connect(args.endpoint)
        if args.ready_file:
            with open(args.ready_file, "w") as f:
                f.write("subscribed\n")
        deadline = time.monotonic() + args.timeout
        received = 0
        while received < args.count:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sub.poll(left_ms):
                print(f"timeout: {received} of {args.count} batches from {args.endpoint}",
                      file=sys.stderr)
                return 2
            frames = sub.recv_multipart()
            if len(frames) == 3:
                topic, seq_b, payload = frames
            elif len(frames) == 2:
                topic, seq_b, payload = b"", frames[0], frames[1]
            else:
                failures += 1
                print(json.dumps({"index": received, "error": f"{len(frames)} frames"}), flush=True)
                received += 1
                continue
            seq = int.from_bytes(seq_b, "big") if len(seq_b) == 8 else None
            handle(received, payload, seq, topic.decode("utf-8", "replace"))
            received += 1
        sub.close()
    else:
        index = 0
        for line in sys.stdin:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                payload = bytes.fromhex(line)
            except ValueError as e:
                failures += 1
                print(json.dumps({"index": index, "error": f"bad hex: {e}"}), flush=True)
            else:
                handle(index, payload)
            index += 1

    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
