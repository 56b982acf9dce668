"""Page-hash test vectors from SGLang's own functions (run in SGLang's
environment): chained pages at several page sizes, and a namespaced request.
Prints JSON."""

import json
import sys

from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

TOKENS = [(i * 2654435761) % 151936 for i in range(200)]
CASES = [
    {"page_size": 1, "extra_key": None, "cache_salt": None},
    {"page_size": 16, "extra_key": None, "cache_salt": None},
    {"page_size": 64, "extra_key": None, "cache_salt": None},
    {"page_size": 16, "extra_key": "lora-7", "cache_salt": None},
    {"page_size": 16, "extra_key": None, "cache_salt": "tenant-a"},
    {"page_size": 16, "extra_key": "", "cache_salt": "tenant-b"},
]

out = []
for case in CASES:
    ps = case["page_size"]
    seed = storage_namespace_seed(case["extra_key"], case["cache_salt"])
    hashes, prior = [], seed
    for start in range(0, len(TOKENS) - ps + 1, ps):
        prior = get_hash_str(TOKENS[start : start + ps], prior)
        hashes.append(prior)
    out.append({**case, "seed": seed, "hashes": hashes})
json.dump({"tokens": TOKENS, "cases": out}, sys.stdout)
