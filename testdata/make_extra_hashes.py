#!/usr/bin/env python3
"""Generate testdata/extra_hashes.json: block-hash vectors for gaps in golden_hashes.json,
computed by vLLM 0.33.0's own code through the reference harness (same format as
golden_hashes.json). Run from a copy of the harness after ./fetch_vllm.sh && ./setup.sh:

    cp -r /work/shared/vllm/harness /tmp/harness && cd /tmp/harness && ./fetch_vllm.sh && ./setup.sh
    ./venv/bin/python /work/main/testdata/make_extra_hashes.py > /work/main/testdata/extra_hashes.json
"""

import json
import os
import random
import sys

sys.path.insert(0, os.getcwd())
from vllmref_common import VLLM_COMMIT, VLLM_VERSION, compute  # noqa: E402

rng = random.Random(20260509)


def toks(n, lo=0, hi=151_935):
    return [rng.randrange(lo, hi) for _ in range(n)]


# token ids around every pickle/CBOR width boundary, including >= 2**31 (pickle LONG1)
WIDE = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 3_000_000_000, 7,
        4_294_000_000, 151_643, 2**24, 2**31 + 1]
LOTS_OF_MM = [
    {"identifier": "img-aaaa", "offset": 2, "length": 3},
    {"identifier": "img-bbbb", "offset": 6, "length": 2},
    {"identifier": "img-cccc", "offset": 10, "length": 30},   # blocks 0, 1, 2: offsets 10, -6, -22
    {"identifier": "aud-dddd", "offset": 41, "length": 4},
    {"identifier": "img-eeee", "offset": 46, "length": 1},
]

cases = [
    ("sha256_bs64_2000_lora", {"algo": "sha256", "block_size": 64, "token_ids": toks(2000),
                               "lora_name": "sql-lora", "lora_path": "/models/loras/sql"}),
    ("sha256_cbor_bs256_3000_salt", {"algo": "sha256_cbor", "block_size": 256,
                                     "token_ids": toks(3000), "cache_salt": "tenant-b"}),
    ("sha256_bs16_wide_tokens", {"algo": "sha256", "block_size": 16, "token_ids": WIDE * 3}),
    ("sha256_cbor_bs16_wide_tokens", {"algo": "sha256_cbor", "block_size": 16,
                                      "token_ids": WIDE * 3}),
    ("sha256_bs16_mm_across_3_blocks", {"algo": "sha256", "block_size": 16, "token_ids": toks(60),
                                        "mm_features": LOTS_OF_MM}),
    ("sha256_cbor_bs16_mm_across_3_blocks", {"algo": "sha256_cbor", "block_size": 16,
                                             "token_ids": toks(60), "mm_features": LOTS_OF_MM}),
    ("sha256_bs16_unicode_salt_lora_mm", {"algo": "sha256", "block_size": 16, "token_ids": toks(50),
                                          "cache_salt": "ténant-🚀-日本", "lora_name": "lörä",
                                          "lora_path": "/m/ä", "mm_features": LOTS_OF_MM[:3]}),
    ("sha256_cbor_bs16_unicode_salt", {"algo": "sha256_cbor", "block_size": 16,
                                       "token_ids": toks(40), "cache_salt": "ténant-🚀-日本"}),
    ("xxhash_cbor_bs16_seed_42_mm", {"algo": "xxhash_cbor", "block_size": 16, "token_ids": toks(60),
                                     "seed": "42", "mm_features": LOTS_OF_MM}),
    ("xxhash_bs16_seed_7_lora_salt_mm", {"algo": "xxhash", "block_size": 16, "token_ids": toks(60),
                                         "seed": "7", "lora_name": "sql-lora",
                                         "lora_path": "/models/loras/sql", "cache_salt": "s-1",
                                         "mm_features": LOTS_OF_MM}),
    # one-character strings are CPython singletons: name == path == salt pickle as memo gets
    ("sha256_bs16_single_char_lora_and_salt", {"algo": "sha256", "block_size": 16,
                                               "token_ids": toks(40), "lora_name": "a",
                                               "lora_path": "a", "cache_salt": "a"}),
    # a block bigger than pickle's 64 KiB frame target: several frames in one preimage
    ("sha256_bs10000_multi_frame", {"algo": "sha256", "block_size": 10000,
                                    "token_ids": [3_000_000_000 + i for i in range(10000)],
                                    "cache_salt": "x" * 300}),
]

out = {
    "generator": "testdata/make_extra_hashes.py (via /work/shared/vllm/harness vllmref_common.compute)",
    "vllm_version": VLLM_VERSION,
    "vllm_commit": VLLM_COMMIT,
    "cases": [{"name": n, "input": spec, "output": compute(spec, with_event=True)}
              for n, spec in cases],
}
json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
print()
