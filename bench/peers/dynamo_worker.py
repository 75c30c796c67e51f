"""A Dynamo worker in front of one kvroute-sim replica (used by `cargo xtask bench routing --peers`).

Dynamo's frontend only routes to workers registered with its runtime. This shim registers one
worker per simulated replica with token input, relays the replica's ZeroMQ KV events to the
router through Dynamo's own ``KvEventPublisher(zmq_endpoint=...)``, and serves each routed
request by streaming it to the replica's ``/v1/completions`` with the token ids as the prompt,
yielding every token as soon as its chunk arrives, so the time to first token seen by the client
is the replica's plus the network hops. It runs without etcd or NATS: file discovery, TCP request
plane, ZMQ event plane, everything on 127.0.0.1 (set by the caller through DYN_* variables).
"""

import argparse
import asyncio
import json
import logging
import signal

import aiohttp
from tokenizers import Tokenizer

from dynamo.llm import (
    KvEventPublisher,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    WorkerType,
    register_model,
)
from dynamo.runtime import DistributedRuntime

log = logging.getLogger("kvroute-dynamo-worker")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim-url", required=True, help="the replica, e.g. http://127.0.0.1:8001")
    p.add_argument("--kv-events", required=True, help="the replica's ZMQ PUB, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-topic", default="kv-events")
    p.add_argument("--model-path", required=True, help="directory with tokenizer.json")
    p.add_argument("--model-name", default="qwen3")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--total-kv-blocks", type=int, default=None)
    p.add_argument("--endpoint", default="dynamo.backend.generate")
    return p.parse_args()


class SimHandler:
    """Streams a preprocessed (token-id) request through the simulator."""

    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession):
        self.url = args.sim_url.rstrip("/") + "/v1/completions"
        self.model = args.model_name
        self.session = session
        # The simulator streams text, one token per chunk; Dynamo's protocol carries token ids.
        self.tokenizer = Tokenizer.from_file(f"{args.model_path}/tokenizer.json")

    async def generate(self, request, context=None):
        token_ids = request.get("token_ids") or []
        stop = request.get("stop_conditions") or {}
        max_tokens = stop.get("max_tokens") or 16
        body = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        produced = 0
        cached = None
        finish = None
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:500]
                yield {"token_ids": [], "finish_reason": f"error: replica HTTP {resp.status}: {text}"}
                return
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                        continue
                    text = choice.get("text") or ""
                    ids = self.tokenizer.encode(text, add_special_tokens=False).ids or [0]
                    produced += len(ids)
                    yield {"token_ids": ids}
        details = None if cached is None else {"cached_tokens": cached}
        yield {
            "token_ids": [],
            "finish_reason": finish or "length",
            "completion_usage": {
                "prompt_tokens": len(token_ids),
                "completion_tokens": produced,
                "total_tokens": len(token_ids) + produced,
                "prompt_tokens_details": details,
            },
        }


async def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint(args.endpoint)
    publisher = KvEventPublisher(
        endpoint=endpoint,
        kv_block_size=args.block_size,
        zmq_endpoint=args.kv_events,
        zmq_topic=args.kv_topic,
    )
    config = ModelRuntimeConfig()
    if args.total_kv_blocks:
        config.total_kv_blocks = args.total_kv_blocks
    config.kv_event_publishing_enabled = True
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        handler = SimHandler(args, session)
        await register_model(
            ModelInput.Tokens,
            ModelType.Completions | ModelType.Chat,
            endpoint,
            args.model_path,
            args.model_name,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=args.block_size,
            runtime_config=config,
        )
        serving = asyncio.ensure_future(endpoint.serve_endpoint(handler.generate))
        log.info("serving %s for %s (events %s)", args.endpoint, args.sim_url, args.kv_events)
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done() and serving.exception() is not None:
            raise serving.exception()
    del publisher
    runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
