"""Run in SGLang's environment by test_tier_events.py: the KV events the
backend queues for the host pool and storage (cpcache/integrations/sglang/
tier_events.py), fed agreed replies as a session follows them, set beside
the events SGLang's own unified radix cache queues for the same tokens on
its device tier, then encoded and decoded as SGLang's publisher and a
subscriber do (msgspec, `KVEventBatch`). Prints one JSON report."""

from __future__ import annotations

import json
import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_sglang  # noqa: E402,F401  (before SGLang)
import msgspec  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.events import KvEventLoraNames  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture  # noqa: E402

from cpcache.client.messages import StepResult  # noqa: E402
from cpcache.integrations.sglang.tier_events import SglangHashes, TierEvents  # noqa: E402
from cpcache.keys import chain, request_namespace_seed  # noqa: E402

PAGE = 4
TOKENS = [(7 * i + 3) % 500 + 1 for i in range(4 * PAGE)]  # 4 pages
LORA_KEY = "adapter-extra-" + "0123456789abcdef0123456789abcdef"  # Req puts the adapter's id last
CASES = {  # name -> (extra_key, cache_salt, dynamo format, LoRA-named extra key)
    "plain": (None, None, False, False),
    "cache_salt": (None, "tenant-a", False, False),
    "extra_key": ("not-an-adapter", None, False, False),
    "lora": (LORA_KEY, None, False, True),
    "lora_and_salt": (LORA_KEY, "tenant-b", False, True),
    "dynamo": ("not-an-adapter", "tenant-c", True, False),
    "dynamo_lora": (LORA_KEY, None, True, True),
}


class LoraReq:
    def __init__(self, extra_key: str) -> None:
        self.extra_key = extra_key
        self.lora_id = extra_key[-32:]


def lora_names(named: bool) -> KvEventLoraNames:
    table = KvEventLoraNames()
    if named:
        table.register(LoraReq(LORA_KEY), "adapter-a")
    return table


def pages_of(events: list) -> list[dict]:
    """Coalesced BlockStored events, one entry per page."""
    out = []
    for event in events:
        parent = event.parent_block_hash
        for i, block in enumerate(event.block_hashes):
            out.append({"hash": block, "parent": parent, "tokens": list(event.token_ids[i * PAGE : (i + 1) * PAGE]),
                        "cache_salt": event.cache_salt, "lora_name": event.lora_name, "medium": str(event.medium.value
                        if hasattr(event.medium, "value") else event.medium)})
            parent = block
    return out


def sglangs_own(extra_key: str | None, salt: str | None, dynamo: bool, named: bool) -> list[dict]:
    """SGLang's device tree's events for TOKENS, inserted as two requests (a
    prefix, then the whole): a chain over two tree nodes."""
    cfg = CacheConfig(page_size=PAGE, dtype=torch.float32, num_layers=1, full_attention_layer_ids=(0,))
    cache, allocator, _ = build_fixture(cfg, enable_kv_cache_events=True, dynamo_kv_event_format=dynamo,
                                        kv_event_lora_names=lora_names(named), tree_core_backend="python")
    cache.take_events()
    for n in (2 * PAGE, len(TOKENS)):
        key = RadixKey(array("q", TOKENS[:n]), extra_key=extra_key, cache_salt=salt)
        cache.insert(InsertParams(key=key, value=allocator.alloc(n)))
    return pages_of([e for e in cache.take_events() if isinstance(e, BlockStored)])


def page_keys(extra_key: str | None, salt: str | None) -> list[bytes]:
    """The backend's page keys of TOKENS (before any flush)."""
    return [bytes.fromhex(h) for h in chain(TOKENS, PAGE, request_namespace_seed(extra_key, salt))]


def reply(step: int, **decided) -> StepResult:
    return StepResult(step, step, {}, 0, b"", **decided)


def roundtrip(events: list) -> list:
    """As SGLang's ZMQ publisher encodes a batch and a subscriber decodes it."""
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events, attn_dp_rank=0))
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    return decoded.events


def tiers(extra_key: str | None, salt: str | None, dynamo: bool, named: bool) -> dict:
    """The backend's events for TOKENS through every tier turn, decoded."""
    keys = page_keys(extra_key, salt)
    hashes = SglangHashes(PAGE, dynamo, lora_names(named))
    events = TierEvents("file")
    # A write of the first two pages, a prefetch of the last two (as the backend names them).
    events.name(keys[:2], hashes.pages(TOKENS[: 2 * PAGE], extra_key, salt, 0, keys))
    events.name(keys[2:], hashes.pages(TOKENS, extra_key, salt, 2, keys))
    events.prefetching(11, keys[2:])
    report: dict = {}
    # Every page enters the host pool in one round (the reply lists them in hash order).
    events.follow(reply(1, host_entered=tuple(sorted(keys))))
    report["host_entered"] = roundtrip(events.take())
    # Two backups end: the first stored, the second failed on some rank.
    events.follow(reply(2, backups={5: True, 6: False}, backup_pages={5: tuple(keys[:3]), 6: (keys[3],)}))
    report["backups"] = roundtrip(events.take())
    # A later lookup finds storage lacks the second page (evicted, or deleted damaged), then the third.
    events.prefetching(12, keys)
    events.follow(reply(3, prefetch_hits={12: 1}))
    events.prefetching(13, keys[2:])
    events.follow(reply(4, prefetch_hits={11: 0, 13: 0}))  # the 4th page was never stored: no removal
    report["lookups"] = roundtrip(events.take())
    # Two pages leave the host pool; a page nobody named enters (not published).
    events.follow(reply(5, host_left=(keys[3], keys[1]), host_entered=(b"\x01" * 32,)))
    report["host_left"] = roundtrip(events.take())
    # The daemon lost: the host pool's pages go; a new session carries them over.
    events.host_lost()
    report["host_lost"] = roundtrip(events.take())
    events.follow(reply(6, host_entered=(keys[0], keys[2])))
    report["carried_over"] = roundtrip(events.take())
    # /clear_hicache_storage: the host pool's and storage's pages go.
    events.left_behind()
    report["left_behind"] = roundtrip(events.take())
    # A flush forgets everything: later evictions of older pages are not published.
    events.name(keys, hashes.pages(TOKENS, extra_key, salt, 0, keys))
    events.follow(reply(7, host_entered=tuple(keys)))
    events.forget()
    events.follow(reply(8, host_left=tuple(keys)))
    report["after_flush"] = roundtrip(events.take())
    report["counters"] = events.counters()
    return {name: (value if name == "counters" else [describe(e) for e in value]) for name, value in report.items()}


def describe(event) -> dict:
    kind = type(event).__name__
    if isinstance(event, BlockStored):
        return {"type": kind, "pages": pages_of([event])}
    if isinstance(event, BlockRemoved):
        return {"type": kind, "hashes": list(event.block_hashes), "medium": event.medium}
    assert isinstance(event, AllBlocksCleared), event
    return {"type": kind}


def bounded() -> dict:
    events = TierEvents("mooncake", max_queued=2)
    keys = page_keys(None, None)
    hashes = SglangHashes(PAGE)
    # Each page named by its own write, entering in its own round: no coalescing across media.
    events.name(keys, hashes.pages(TOKENS, None, None, 0, keys))
    events.follow(reply(1, host_entered=(keys[0],)))
    events.follow(reply(2, backups={1: True}, backup_pages={1: (keys[0],)}))
    events.follow(reply(3, host_left=(keys[0],)))
    queued = roundtrip(events.take())
    return {"medium": events.storage_medium, "queued": [describe(e) for e in queued], "dropped": events.dropped}


def main() -> None:
    cases = {}
    for name, (extra_key, salt, dynamo, named) in CASES.items():
        cases[name] = {"sglang": sglangs_own(extra_key, salt, dynamo, named),
                       "backend": SglangHashes(PAGE, dynamo, lora_names(named)).pages(
                           TOKENS, extra_key, salt, 0, page_keys(extra_key, salt)),
                       "tiers": tiers(extra_key, salt, dynamo, named)}
        cases[name]["backend"] = [{"hash": p.block_hash, "parent": p.parent, "tokens": list(p.tokens),
                                   "cache_salt": p.cache_salt, "lora_name": p.lora_name, "medium": "GPU"}
                                  for p in cases[name]["backend"]]
    print(json.dumps({"cases": cases, "bounded": bounded()}))


if __name__ == "__main__":
    main()
