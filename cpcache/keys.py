"""Page keys (docs/design.md §7).

``h_i = sha256(h_{i-1} || tokens_i as 4-byte little endian)``: the same bytes
as SGLang's ``get_hash_str``. A chain starts from a seed: the daemon's
`namespace_seed` for its own schedulers, or, when SGLang drives it, SGLang's
hashes as they come (`request_namespace_seed` is SGLang's
``storage_namespace_seed`` for requests with an extra key or cache salt).

Hashes come from schedulers and are not trusted to separate tenants: the
daemon puts the tenant of the attached model (`tenant_of`: model id, model
dtype, KV geometry) in front of every storage key, so a scheduler attached as
one model never reaches another model's pages through the hashes it sends.
A tenant is what a client declares, not an identity: any client may attach
as any model (docs/security.md, "Tenants"). The key ends with a suffix from
the declared sharding of the KV, never from rank numbers by habit. The host
layout is in neither: a stored page is in one order whatever the daemon's
host layout (`HostPool`), so daemons of different layouts share pages.
"""

from __future__ import annotations

import array
import functools
import hashlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cpcache.errors import InvalidArgument

SHARDINGS = ("cp_replicated", "cp_sharded")


def namespace_seed(model_id: str, dtype: str, layout: str, page_size: int) -> str:
    """The hex hash every chain of this model's pages starts from."""
    return hashlib.sha256(f"cpcache:{model_id}:{dtype}:{layout}:{page_size}".encode()).hexdigest()


def request_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """SGLang's ``storage_namespace_seed``: the seed of a namespaced request's
    chain (None when it has neither an extra key nor a cache salt)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def generation_pages(pages: list[str], generation: int) -> list[str]:
    """SGLang's page hashes `pages` as named after the `generation`-th cache
    flush: each hash renamed on its own, so a process that has SGLang's
    hashes and the generation (a decode server's offload) names a page as
    the flushed prefill does, and no page of one generation is a page of
    another (generation 0 is SGLang's hashes themselves)."""
    if generation == 0:
        return pages
    return [hashlib.sha256(f"cpcache-flush:{generation}:{page}".encode()).hexdigest() for page in pages]


def flush_record(number: int) -> str:
    """The page name of the `number`-th flush record a prefill server
    publishes in its store (`integrations/sglang/flush_records.py`)."""
    return hashlib.sha256(f"cpcache-flush-record:{number}".encode()).hexdigest()


def tenant_of(model_id: str, geometry_fingerprint: int, model_dtype: str = "") -> str:
    """The storage namespace of an attached model: its id, the dtype it
    computes in (`model_dtype`, with its weight quantization if any) and its
    KV geometry (whose fingerprint holds the KV dtype, page size, layers,
    heads per rank and head size). Everything that makes two servers' pages
    of one token chain differ must be here or in the key's sharding suffix:
    SGLang's own hashes hold none of it. An empty `model_dtype` (a client
    that does not send it) gives the tenant it had before it existed."""
    dtype = f":{model_dtype}" if model_dtype else ""
    return hashlib.sha256(f"cpcache-tenant:{model_id}:{geometry_fingerprint}{dtype}".encode()).hexdigest()[:16]


def page_hash(tokens: Sequence[int], prior: str | None) -> str:
    """SGLang's ``get_hash_str``: sha256 over the prior hash's bytes, then each
    token as 4 bytes little endian (unsigned)."""
    return _page_hash(token_bytes(tokens), prior)


def chain(tokens: Sequence[int], page_size: int, seed: str | None) -> list[str]:
    """Hashes of every full page of `tokens`, each chained on the last."""
    data = memoryview(token_bytes(tokens))
    width = 4 * page_size
    hashes, prior = [], seed
    for start in range(0, len(data) - width + 1, width):
        prior = _page_hash(data[start : start + width], prior)
        hashes.append(prior)
    return hashes


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Each token as 4 bytes little endian, unsigned: one conversion for the
    whole sequence (a token outside 0 .. 2**32 - 1 raises OverflowError, as
    `int.to_bytes` does)."""
    packed = array.array("I", tokens)  # "I" is 4 bytes wherever cpcache runs (checked at import)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _page_hash(data: bytes | memoryview, prior: str | None) -> str:
    hasher = hashlib.sha256()
    if prior:
        hasher.update(bytes.fromhex(prior))
    hasher.update(data)
    return hasher.hexdigest()


assert array.array("I").itemsize == 4, "a token is hashed as 4 bytes"


@dataclass(frozen=True)
class ShardingSpec:
    """How this rank's KV relates to the other ranks' KV for the same page."""

    cp: str = "cp_replicated"  # "cp_replicated": each CP rank holds the whole page
    tp_sharded_heads: bool = True  # MHA heads split over attention TP; False for MLA
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""  # `tenant_of` the attached model: the first part of every storage key

    def __post_init__(self) -> None:
        if self.cp not in SHARDINGS:
            raise InvalidArgument(f"sharding: cp must be one of {', '.join(SHARDINGS)}, got {self.cp!r}")
        if not 0 <= self.cp_rank < self.cp_size or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"sharding: ranks out of range ({self})")

    def suffix(self) -> str:
        parts = []
        if self.cp == "cp_sharded":
            parts.append(f"cp{self.cp_rank}_{self.cp_size}")
        if self.tp_sharded_heads:
            parts.append(f"tp{self.tp_rank}_{self.tp_size}")
        return "_".join(parts)

    @functools.cached_property
    def _key_parts(self) -> tuple[str, str]:
        # Every page of a backup needs its key: formatted once, not per page.
        suffix = self.suffix()
        return (f"{self.tenant}." if self.tenant else ""), (f"_{suffix}" if suffix else "")

    @functools.cached_property
    def _writer(self) -> tuple[int, int]:
        """(replicas, this rank's place among them) for `writes`."""
        cp_replicas = 1 if self.cp == "cp_sharded" else self.cp_size
        tp_replicas = 1 if self.tp_sharded_heads else self.tp_size
        me = (self.cp_rank if cp_replicas > 1 else 0) * tp_replicas + (self.tp_rank if tp_replicas > 1 else 0)
        return cp_replicas * tp_replicas, me

    def storage_key(self, page: str) -> str:
        prefix, suffix = self._key_parts
        return f"{prefix}{page}{suffix}"

    def storage_keys(self, pages: Iterable[bytes]) -> tuple[str, ...]:
        prefix, suffix = self._key_parts
        return tuple(f"{prefix}{page.hex()}{suffix}" for page in pages)

    def share(self, pages: Iterable[bytes], slots: Iterable[int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The keys and slots of the pages this rank writes (`writes`)."""
        mine = [(h, slot) for page, slot in zip(pages, slots) if self.writes(h := page.hex())]
        return tuple(self.storage_key(h) for h, _ in mine), tuple(slot for _, slot in mine)

    def writes(self, page: str) -> bool:
        """Whether this rank writes `page` to storage. Ranks that hold the same
        bytes under the same key form a replica group (CP ranks of a
        cp_replicated page; attention-TP ranks too when heads are not split,
        as with MLA); each group elects one writer per page, balanced by
        hash(page) mod size. The others skip the write and still take part in
        the ack round."""
        replicas, me = self._writer
        if replicas == 1:
            return True
        return int(page[:16], 16) % replicas == me
