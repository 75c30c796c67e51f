#!/usr/bin/env python3
"""Publish hex-encoded KV event payloads on a ZeroMQ PUB endpoint the way vLLM frames them.

Reads hex lines on stdin, binds an XPUB socket (a PUB that also sees subscriptions) on
``--endpoint``, waits until a subscriber has subscribed (so nothing is lost to the slow-joiner
race), then sends each payload as vLLM does: ``[topic, seq (8 bytes big-endian), payload]``, seq
counting from ``--first-seq``. Used to self-test ``decode_with_vllm.py --endpoint``.
"""

from __future__ import annotations

import argparse
import sys
import time

import zmq


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True, help="e.g. tcp://127.0.0.1:5557 (bound)")
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--first-seq", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds to wait for a subscriber (default 30)")
    args = ap.parse_args()
    payloads = [bytes.fromhex(l.strip()) for l in sys.stdin if l.strip()]

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 5000)
    pub.bind(args.endpoint)
    if not pub.poll(int(args.timeout * 1000)):
        print(f"no subscriber on {args.endpoint} within {args.timeout}s", file=sys.stderr)
        return 2
    pub.recv()  # the subscription message
    topic = args.topic.encode()
    for i, p in enumerate(payloads):
        pub.send_multipart([topic, (args.first_seq + i).to_bytes(8, "big"), p])
    time.sleep(0.2)
    pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
