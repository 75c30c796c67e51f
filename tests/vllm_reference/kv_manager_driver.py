#!/usr/bin/env python3
"""Run vLLM 0.33.0's own KV cache manager on scripted operation sequences; print what it did.

The manager is vLLM's ``KVCacheManager`` with its coordinators, single-type managers and
``BlockPool``, imported verbatim from the release wheel (``fetch_vllm.py`` extracts them into
``<cache>/vllm-wheel/kvmgr`` next to small, clearly marked stand-ins for the modules that would pull
in torch or the engine). Block hashes come from vLLM's own ``get_request_block_hasher``. Only the
request object and the scheduler's few lines around the manager (what to allocate, when a token is
appended) are ours; they mirror vLLM's scheduler for one request at a time.

Input (stdin, one JSON document)::

    {"sequences": [{"layout": L, "ops": [OP, ...]}, ...]}

    L  = {"num_blocks": 64, "block_size": 16, "hash_block_size": 16, "hash_algo": "sha256",
          "max_in_flight_tokens": 256,  # optional (vLLM: max_num_batched_tokens x concurrent
                                        # batches; sizes a sliding group's admission cap)
          "groups": [{"kind": "full_attention"} | {"kind": "sliding_window", "window": 128}, ...]}
    OP = {"op": "add", "id": "r1", "prompt": [tokens], "chunk": 64, "token": 7,
          "cache_salt": "tenant-a", "report_full": true}     (the last two optional)
             get_computed_blocks (`report_full`: the request's kv_cache_report_mode is "full"), then allocate_slots(full_sequence_must_fit=True) for the hit
             plus min(chunk, rest) tokens (the scheduler admitting a waiting request); not admitted
             when it does not fit. When the prompt is done, `token` is appended (the sampled one).
       | {"op": "step", "id": "r1", "chunk": 64, "token": 7}
             allocate_slots for min(chunk, uncomputed) tokens of a running request; on success the
             tokens count as computed (+ `token` appended when all are); on failure the request is
             preempted (freed), as vLLM's scheduler does with the last running request.
       | {"op": "free", "id": "r1"}      the request finished
       | {"op": "reset"}                 reset_prefix_cache()

Output (stdout): one JSON line per sequence, ``{"results": [R, ...]}``, one R per op::

    R = {"hit": tokens | null, "ok": bool | null, "events_hex": "..", "events": [..],
         "blocks": [[block ids of group 0], ...] | null}

``hit`` is get_computed_blocks' number of computed tokens (add only); ``ok`` whether the
allocation (or reset) succeeded; ``events_hex`` the msgpack of
``KVEventBatch(ts=0.0, events=take_events(), data_parallel_rank=0)`` with vLLM's own structs and
encoder (empty string when no event); ``events`` the same as JSON (for diagnostics); ``blocks`` the
request's block table per group after the op (``null`` when it holds none). A step or free of a
request vLLM does not hold (the other side admitted it, vLLM did not) gives ``"unknown": true``. Exit 3 when the
extracted modules are missing ("run `cargo xtask setup`"), 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def kv_manager_dir() -> Path:
    explicit = os.environ.get("KVROUTE_VLLM_WHEEL_DIR")
    if explicit:
        return Path(explicit) / "kvmgr"
    root = os.environ.get("KVROUTE_CACHE")
    base = Path(root) if root else REPO_ROOT / "target" / "kvroute-cache"
    return base / "vllm-wheel" / "kvmgr"


PKG = kv_manager_dir()
if not (PKG / "READY").is_file():
    print(f"vLLM's KV cache manager modules are missing ({PKG}): run `cargo xtask setup`",
          file=sys.stderr)
    sys.exit(3)
sys.path.insert(0, str(PKG))

import msgspec  # noqa: E402
import torch  # noqa: E402  (the stand-in: dtypes only)
from vllm.distributed.kv_events import KVEventBatch  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402

ENCODER = msgspec.msgpack.Encoder()


class BadInput(Exception):
    pass


class DriverRequest:
    """The attributes of vLLM's ``Request`` that the KV cache manager and the hasher read."""

    def __init__(
        self, request_id: str, prompt: list[int], block_hasher, cache_salt=None, report_full=False
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        self.lora_request = None
        self.mm_features: list = []
        self.cache_salt = cache_salt
        self.kv_cache_report_mode = "full" if report_full else "incremental"
        self.prompt_embeds = None
        self.session_id = None
        self.skip_reading_prefix_cache = False
        self.shared_prefix_boundary = 0
        self._block_hasher = block_hasher
        self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token: int) -> None:
        # vLLM's Request.append_output_token_ids: the token, then the newly full blocks' hashes.
        self.all_token_ids.append(token)
        self.block_hashes.extend(self._block_hasher(self))


def group_spec(g: dict, block_size: int):
    common = dict(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
    kind = g.get("kind")
    if kind == "full_attention":
        return FullAttentionSpec(**common)
    if kind == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=int(g["window"]))
    raise BadInput(f"unknown group kind {kind!r}")


def make_manager(layout: dict) -> tuple[KVCacheManager, object]:
    bs = int(layout["block_size"])
    hbs = int(layout.get("hash_block_size", bs))
    groups = [
        KVCacheGroupSpec([f"layer.{i}"], group_spec(g, bs))
        for i, g in enumerate(layout["groups"])
    ]
    config = KVCacheConfig(
        num_blocks=int(layout["num_blocks"]),
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        hash_block_size=hbs,
    )
    manager = KVCacheManager(
        config,
        max_model_len=int(layout.get("max_model_len", 1 << 20)),
        max_in_flight_tokens=layout.get("max_in_flight_tokens"),
        scheduler_block_size=bs,
        hash_block_size=hbs,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    hash_fn = get_hash_fn_by_name(layout.get("hash_algo", "sha256"))
    kv_cache_utils.init_none_hash(hash_fn)
    return manager, kv_cache_utils.get_request_block_hasher(hbs, hash_fn)


def to_json(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def event_json(ev) -> dict:
    out = {"type": type(ev).__name__}
    for field in ev.__struct_fields__:
        out[field] = to_json(getattr(ev, field))
    return out


def block_table(manager: KVCacheManager, request_id: str):
    groups = manager.coordinator.get_blocks(request_id)
    if not any(groups):
        return None
    return [[b.block_id for b in blocks] for blocks in groups]


def run_sequence(seq: dict) -> list[dict]:
    manager, hasher = make_manager(seq["layout"])
    requests: dict[str, DriverRequest] = {}
    results = []
    for op in seq["ops"]:
        kind = op.get("op")
        res: dict = {"hit": None, "ok": None, "blocks": None}
        rid = op.get("id")
        if kind == "add":
            if rid in requests:
                raise BadInput(f"request {rid} added twice")
            req = DriverRequest(
                rid, op["prompt"], hasher, op.get("cache_salt"), bool(op.get("report_full"))
            )
            blocks, hit, _ = manager.get_computed_blocks(req)
            n = min(int(op["chunk"]), req.num_tokens - hit)
            ok = manager.allocate_slots(
                req, n, hit, blocks, full_sequence_must_fit=True
            ) is not None
            res["hit"], res["ok"] = hit, ok
            if ok:
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = hit + n
                if req.num_computed_tokens == req.num_tokens:
                    req.append_output_token(int(op["token"]))
                requests[rid] = req
                res["blocks"] = block_table(manager, rid)
        elif kind == "step":
            req = requests.get(rid)
            if req is None:  # the other side admitted it, vLLM did not: reported, not fatal
                res["unknown"] = True
                n = 0
            else:
                n = min(int(op["chunk"]), req.num_tokens - req.num_computed_tokens)
            if req is not None:
                ok = manager.allocate_slots(req, n) is not None
                res["ok"] = ok
                if ok:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens == req.num_tokens:
                        req.append_output_token(int(op["token"]))
                    res["blocks"] = block_table(manager, rid)
                else:
                    manager.free(req)
                    del requests[rid]
        elif kind == "free":
            req = requests.pop(rid, None)
            if req is None:
                res["unknown"] = True
            else:
                manager.free(req)
        elif kind == "reset":
            res["ok"] = manager.reset_prefix_cache()
        else:
            raise BadInput(f"unknown op {kind!r}")
        events = manager.take_events()
        res["events"] = [event_json(e) for e in events]
        res["events_hex"] = (
            ENCODER.encode(KVEventBatch(ts=0.0, events=events, data_parallel_rank=0)).hex()
            if events
            else ""
        )
        results.append(res)
    return results


def main() -> None:
    try:
        doc = json.load(sys.stdin)
        for seq in doc["sequences"]:
            print(json.dumps({"results": run_sequence(seq)}), flush=True)
    except (BadInput, KeyError, TypeError, ValueError) as e:
        print(f"bad input: {e!r}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
