"""On hosts without CUDA, SGLang's KV pool allocated in shared memory from
the start, so the daemon maps it where it lies.

`install` (run by the plugin's `register`, in every SGLang process, before
any pool exists) wraps the buffer allocation of SGLang's MHA and MLA
token-to-KV pools. When the server runs the cpcache backend on the CPU, a
pool's buffers are views of one memfd, sealed against shrinking and growing
(what the daemon requires), laid out as SGLang lays them out itself: MHA
one [2, padded rows, heads, head_dim] block per layer whose halves are K and
V, MLA one [rows, 1, kv_dim] block per layer. DSA's indexer keys (one
(index pages, bytes) buffer per layer, made after the KV) join the KV in one
memfd: the daemon maps one memory per pool. A memfd starts zeroed, as
SGLang's `torch.zeros` buffers do. Anything else (CUDA, another backend,
another layout) allocates as SGLang does.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from cpcache.geometry import PART_ALIGN

log = logging.getLogger(__name__)

BACKEND = "cpcache"
_ATTRIBUTE = "_cpcache_shared_memory"  # on the SGLang pool whose buffers live in it


@dataclass
class SharedMemory:
    """A sealed memfd mapped here; SGLang's buffers are views of it."""

    fd: int
    address: int  # of the mapping's first byte
    nbytes: int
    mapping: mmap.mmap

    @staticmethod
    def create(nbytes: int, name: str = "cpcache-sglang-kv") -> SharedMemory:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapping = mmap.mmap(fd, nbytes)
        memory = SharedMemory(fd, 0, nbytes, mapping)
        memory.address = memory.bytes().data_ptr()
        return memory

    def bytes(self) -> torch.Tensor:
        return torch.frombuffer(self.mapping, dtype=torch.uint8)


def memory_of(kv_pool: Any) -> SharedMemory | None:
    """The shared memory `kv_pool`'s buffers live in, if `install` put them there."""
    return getattr(kv_pool, _ATTRIBUTE, None)


def _backend_selected() -> bool:
    try:
        from sglang.srt.runtime_context import get_memory

        return get_memory().radix_cache_backend == BACKEND
    except Exception:  # no server published (a pool built outside a server): SGLang's own allocation
        return False


def _on_cpu(kv_pool: Any) -> bool:
    return torch.device(kv_pool.device).type == "cpu"


def _mha_buffers(kv_pool: Any) -> None:
    rows = kv_pool.size + kv_pool.page_size
    padded = -(-rows // kv_pool.page_size) * kv_pool.page_size  # as SGLang pads its fused K/V blocks
    shape = (kv_pool.layer_num, 2, padded, kv_pool.head_num, kv_pool.head_dim)
    blocks = _allocate(kv_pool, shape)
    kv_pool.k_buffer = [blocks[layer, 0, :rows] for layer in range(kv_pool.layer_num)]
    kv_pool.v_buffer = [blocks[layer, 1, :rows] for layer in range(kv_pool.layer_num)]


def _mla_shape(kv_pool: Any) -> tuple[int, ...]:
    return (kv_pool.layer_num, kv_pool.size + kv_pool.page_size, 1, kv_pool.kv_cache_dim)


def _mla_buffers(kv_pool: Any) -> None:
    blocks = _allocate(kv_pool, _mla_shape(kv_pool))
    kv_pool.kv_buffer = [blocks[layer] for layer in range(kv_pool.layer_num)]


def _allocate(kv_pool: Any, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = kv_pool.store_dtype
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    memory = SharedMemory.create(nbytes)
    setattr(kv_pool, _ATTRIBUTE, memory)
    log.info("cpcache: SGLang's KV pool (%d layers, %d bytes) allocated in shared memory", shape[0], nbytes)
    return memory.bytes().view(dtype).view(shape)


def _with_index_keys(original: Any) -> Any:
    """Wrap DSA's `_create_index_key_cache`: where the pool's KV is in shared
    memory, the indexer's buffers join it in one new memfd (nothing is
    written yet: both are zeros), the KV rebound there with its pointer table."""
    @functools.wraps(original)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        cache = original(self, *args, **kwargs)
        if memory_of(self) is not None:
            _rehome_with_index_keys(self, cache)
        return cache

    create._cpcache_wrapped = True  # type: ignore[attr-defined]
    return create


def _rehome_with_index_keys(kv_pool: Any, cache: Any) -> None:
    old = memory_of(kv_pool)
    assert old is not None
    kv_shape, kv_dtype = _mla_shape(kv_pool), kv_pool.store_dtype
    kv_bytes = torch.Size(kv_shape).numel() * kv_dtype.itemsize
    offsets, end = [], -(-kv_bytes // PART_ALIGN) * PART_ALIGN
    for buffer in cache.buffer:
        offsets.append(end)
        end = -(-(end + buffer.numel() * buffer.element_size()) // PART_ALIGN) * PART_ALIGN
    memory = SharedMemory.create(end)
    flat = memory.bytes()
    blocks = flat[:kv_bytes].view(kv_dtype).view(kv_shape)
    kv_pool.kv_buffer = [blocks[layer] for layer in range(kv_pool.layer_num)]
    kv_pool.data_ptrs = torch.tensor([b.data_ptr() for b in kv_pool.kv_buffer], dtype=torch.uint64,
                                     device=kv_pool.device)
    cache.buffer = [flat[start : start + b.numel() * b.element_size()].view(b.dtype).view(b.shape)
                    for start, b in zip(offsets, cache.buffer)]
    setattr(kv_pool, _ATTRIBUTE, memory)
    os.close(old.fd)
    log.info("cpcache: SGLang's DSA pool (%d layers, KV and indexer keys, %d bytes) allocated in shared memory",
             kv_pool.layer_num, end)


def _wrap(original: Any, shared: Any, wanted: Any) -> Any:
    @functools.wraps(original)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        if wanted(self) and _on_cpu(self) and _backend_selected():
            return shared(self)
        return original(self, *args, **kwargs)

    create._cpcache_wrapped = True  # type: ignore[attr-defined]
    return create


def _mha_wanted(kv_pool: Any) -> bool:
    return (getattr(kv_pool, "kv_cache_layout", "nhd") == "nhd" and not getattr(kv_pool, "use_hnd", False)
            and getattr(kv_pool, "v_head_dim", kv_pool.head_dim) == kv_pool.head_dim)


def install() -> None:
    """Wrap the allocation of SGLang's MHA (`_create_buffers_normal`), MLA
    (`_create_buffers`) and DSA (`_create_index_key_cache`) pools (once;
    later calls do nothing)."""
    from sglang.srt.mem_cache import memory_pool

    for cls, name, shared, wanted in (
            (memory_pool.MHATokenToKVPool, "_create_buffers_normal", _mha_buffers, _mha_wanted),
            (memory_pool.MLATokenToKVPool, "_create_buffers", _mla_buffers, lambda pool: True)):
        original = cls.__dict__.get(name)
        if original is None or getattr(original, "_cpcache_wrapped", False):
            continue
        setattr(cls, name, _wrap(original, shared, wanted))
    dsa: Any = getattr(memory_pool, "DSATokenToKVPool", None)
    original = dsa.__dict__.get("_create_index_key_cache") if dsa is not None else None
    if original is not None and not getattr(original, "_cpcache_wrapped", False):
        dsa._create_index_key_cache = _with_index_keys(original)
