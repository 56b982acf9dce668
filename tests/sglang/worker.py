"""One rank of an SGLang server, reduced to its cache: SGLang 0.5.23's own
pool, allocator and radix cache objects, built through SGLang's registry with
the `cpcache` backend (or SGLang's plain radix cache, as a baseline), driven
through a trace slice the way SGLang's scheduler drives them.

Run in SGLang's environment by tests/sglang/test_backend.py, one process per
rank. Writes a JSON report: per request what was hit where, the agreed
decisions, and how many loaded KV bytes were wrong.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_sglang  # noqa: E402,F401  (before SGLang)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

import cpcache.integrations.sglang as cpcache_sglang  # noqa: E402
from cpcache.integrations.sglang.server_flags import STORAGE_EXTRA_CONFIG  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 2, 2, 16  # per rank: attention TP splits the heads
DTYPE = torch.bfloat16


def block_tokens(block: int, size: int) -> list[int]:
    """The tokens of one trace block (a trace hash id), deterministic."""
    return [(block * 7919 + i * 104729) % 32000 for i in range(size)]


def page_kv(page_hash: bytes, tp_rank: int, page_size: int) -> np.ndarray:
    """This rank's KV bytes of a page: a function of the page's chained hash
    (so of its whole prefix) and of the rank's heads. [layers, 2, ps, H, D*2] bytes."""
    seed = int.from_bytes(hashlib.blake2b(page_hash + bytes([tp_rank]), digest_size=8).digest(), "little")
    shape = (LAYERS, 2, page_size, HEADS, HEAD_DIM * 2)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def trace_slice(path: str, conversations: int, min_turns: int) -> list[dict]:
    """Every turn of the first `conversations` multi-turn conversations of the
    trace (a conversation: requests sharing their second block), in trace
    order. A plain window of the trace shares almost nothing: its turns are
    far apart."""
    with open(path) as fh:
        entries = [json.loads(line) for line in fh]
    turns: dict[int, list[int]] = {}
    for i, entry in enumerate(entries):
        if len(entry["hash_ids"]) > 1:
            turns.setdefault(entry["hash_ids"][1], []).append(i)
    chosen = [t for t in turns.values() if len(t) >= min_turns][:conversations]
    return [entries[i] for i in sorted(i for t in chosen for i in t)]


class Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        ps = args.page_size
        cpcache_sglang.register()  # as SGLang loads its plugins: before any pool exists
        # As a server started with the flags docs/sglang.md gives (storage prefetch through the daemon).
        backend = {"radix_cache_backend": cpcache_sglang.NAME} if args.backend == "cpcache" else {}
        server_args = ServerArgs(model_path="dummy", page_size=ps, tp_size=args.tp, attn_cp_size=args.cp,
                                 enable_hierarchical_cache=True, **backend,
                                 hicache_storage_backend="dynamic",
                                 hicache_storage_backend_extra_config=json.dumps(STORAGE_EXTRA_CONFIG))
        set_global_server_args_for_scheduler(server_args)
        self.req_to_token_pool = ReqToTokenPool(size=args.max_reqs, max_context_len=args.max_context,
                                                device="cpu", enable_memory_saver=False)
        self.kv_pool = MHATokenToKVPool(size=args.device_pages * ps, page_size=ps, dtype=DTYPE, head_num=HEADS,
                                        head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                                        enable_memory_saver=False)
        self.allocator = PagedTokenToKVPoolAllocator(size=args.device_pages * ps, page_size=ps, dtype=DTYPE,
                                                     device="cpu", kvcache=self.kv_pool, need_sort=False)
        params = CacheInitParams(req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=ps, disable=False,
                                 tree_components=(ComponentType.FULL,))
        if args.backend == "cpcache":
            context = TreeCacheBuildContext(
                server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=None, model_config=None,
                tp_size=args.tp, tp_rank=args.rank, tp_group=None)
            self.cache = get_radix_cache_factory(cpcache_sglang.NAME)(context)
        else:
            self.cache = UnifiedRadixCache(params=params)
        self.wrong_bytes = 0
        self.checked_pages = 0
        self.records: list[dict] = []

    # -- KV in the device pool ----------------------------------------------------------

    def _page_views(self, slot: int) -> list[torch.Tensor]:
        ps = self.args.page_size
        # Read as the forward reads: through the pool, which waits for each
        # layer of the batch's loads (the overlapped load-back).
        return [buf[slot : slot + ps].view(torch.uint8) for layer in range(LAYERS)
                for buf in (self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer))]

    def write_kv(self, hashes: list[bytes], slots: torch.Tensor) -> None:
        ps = self.args.page_size
        for i, h in enumerate(hashes):
            kv = page_kv(h, self.args.tp_rank, ps).reshape(LAYERS * 2, ps, HEADS, HEAD_DIM * 2)
            for view, part in zip(self._page_views(int(slots[i * ps])), kv):
                view.copy_(torch.from_numpy(part))

    def check_kv(self, hashes: list[bytes], slots: torch.Tensor) -> None:
        ps = self.args.page_size
        for i, h in enumerate(hashes):
            kv = page_kv(h, self.args.tp_rank, ps).reshape(LAYERS * 2, ps, HEADS, HEAD_DIM * 2)
            for view, part in zip(self._page_views(int(slots[i * ps])), kv):
                self.wrong_bytes += int((view.numpy() != part).sum())
            self.checked_pages += 1

    # -- one request, as the scheduler handles it ------------------------------------------

    def serve(self, number: int, tokens: list[int], abort: bool) -> None:
        cache, ps = self.cache, self.args.page_size
        req = Req(rid=f"r{number}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        key = RadixKey(array("q", tokens))
        record = {"rid": req.rid, "tokens": len(tokens)}
        cache.check_hicache_events()
        first = cache.match_prefix(MatchPrefixParams(key=key))
        if hasattr(cache, "daemon_session"):
            known = first.device_prefix_len
            cache.prefetch_from_storage(req.cache_request_handle, first.last_device_node, tokens[known:],
                                        matched_prefix_tokens=tokens[:known])
        if abort:
            cache.release_aborted_request(req.cache_request_handle)
            cache.check_hicache_events()
            record["aborted"] = True
            self.records.append(record)
            return
        polls = 0
        while not cache.check_prefetch_progress(req.cache_request_handle):
            cache.check_hicache_events()
            polls += 1
            if polls > 1000:
                raise RuntimeError(f"{req.rid}: prefetch never ended")
        record["prefetched"] = cache.prefetch_loaded_tokens_by_reqid.pop(req.cache_request_handle, 0)
        match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
        req.last_node = match.last_device_node
        record["device_hit"] = match.device_prefix_len
        record["host_hit"] = match.host_hit_length
        loaded = 0
        if match.host_hit_length > 0:
            self._make_room(match.host_hit_length)
            loaded, req.last_node = cache.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
        record["loaded"] = loaded
        # The batch's forward: SGLang gives the batch the index of its loads
        # (-1: none), and the worker sets it as the pool's consumer.
        consumer = cache.ready_to_load_host_cache() if hasattr(cache, "daemon_session") else -1
        counter = getattr(self.kv_pool, "layer_transfer_counter", None)
        if counter is not None:
            counter.set_consumer(consumer)
        pages = len(tokens) // ps
        full = pages * ps
        hashes = cache.page_hashes(key) if hasattr(cache, "page_hashes") else [
            hashlib.sha256(str(tokens[: (i + 1) * ps]).encode()).digest() for i in range(pages)]
        prefix = match.device_prefix_len + loaded
        prefix_slots = cache.path_device_indices(req.last_node)[:prefix]
        if len(prefix_slots) != prefix:
            raise RuntimeError(f"{req.rid}: {len(prefix_slots)} prefix slots for a prefix of {prefix}")
        self.check_kv(hashes[: prefix // ps], prefix_slots)
        lock = cache.inc_lock_ref(req.last_node).to_dec_params()  # the prefix is in use by the request
        if full > prefix:  # "prefill": compute the rest, then cache it
            self._make_room(full - prefix)
            slots = self.allocator.alloc(full - prefix)
            if slots is None:
                raise RuntimeError(f"{req.rid}: no room for {full - prefix} tokens")
            self.write_kv(hashes[prefix // ps :], slots)
            # prev_prefix_len: the prefix's slots are the tree's own; SGLang frees
            # only duplicates past it.
            cache.insert(InsertParams(key=key[:full], value=torch.cat([prefix_slots, slots]), prev_prefix_len=prefix))
        cache.dec_lock_ref(req.last_node, lock)
        record["computed"] = full - prefix
        self.records.append(record)

    def _make_room(self, tokens: int) -> None:
        if self.allocator.available_size() < tokens:
            self.cache.evict(EvictParams(num_tokens=tokens - self.allocator.available_size()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("cpcache", "sglang"), required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--min-turns", type=int, default=3)
    parser.add_argument("--max-blocks", type=int, default=40)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=96)
    parser.add_argument("--max-reqs", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--atp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="the server's TP size (the daemons' too)")
    parser.add_argument("--cp", type=int, default=1, help="the server's attention CP size")
    parser.add_argument("--rank", type=int, default=0, help="this scheduler's global rank")
    parser.add_argument("--abort-every", type=int, default=9)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = Rank(args)
    started = time.monotonic()
    for number, entry in enumerate(trace_slice(args.trace, args.conversations, args.min_turns)):
        blocks = entry["hash_ids"][: args.max_blocks]
        tokens = [t for block in blocks for t in block_tokens(block, args.block_tokens)]
        rank.serve(number, tokens, abort=args.abort_every > 0 and number % args.abort_every == args.abort_every - 1)
    cache = rank.cache
    report: dict = {"records": rank.records, "wrong_bytes": rank.wrong_bytes, "checked_pages": rank.checked_pages}
    if hasattr(cache, "daemon_session"):
        drained = 0
        while cache.has_pending_cache_operations():
            cache.check_hicache_events()
            drained += 1
            if drained > 1000:
                raise RuntimeError("pending cache operations never drained")
        tally = cache.daemon_session.tally
        report["tally"] = dict(vars(tally))
        report["decisions"] = cache.daemon_session.decisions.entries
        report["stats"] = cache.daemon_session.client.stats()
    report["seconds"] = time.monotonic() - started
    Path(args.out).write_text(json.dumps(report, default=list))


if __name__ == "__main__":
    main()
