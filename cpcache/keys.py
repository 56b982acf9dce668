"""Page keys (DESIGN section 7).

``h_i = sha256(h_{i-1} || tokens_i as 4-byte little endian)``: the same bytes
as SGLang's ``get_hash_str``, seeded by a namespace (model id, KV dtype,
layout, page size) so two models never share keys. The storage key adds a
suffix from the declared sharding of the KV, never from rank numbers by habit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from cpcache.errors import InvalidArgument

SHARDINGS = ("cp_replicated", "cp_sharded")


def namespace_seed(model_id: str, dtype: str, layout: str, page_size: int) -> str:
    """The hex hash every chain of this model's pages starts from."""
    return hashlib.sha256(f"cpcache:{model_id}:{dtype}:{layout}:{page_size}".encode()).hexdigest()


def page_hash(tokens: Sequence[int], prior: str | None) -> str:
    """SGLang's ``get_hash_str``: sha256 over the prior hash's bytes, then each
    token as 4 bytes little endian (unsigned)."""
    hasher = hashlib.sha256()
    if prior:
        hasher.update(bytes.fromhex(prior))
    for token in tokens:
        hasher.update(int(token).to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def chain(tokens: Sequence[int], page_size: int, seed: str | None) -> list[str]:
    """Hashes of every full page of `tokens`, each chained on the last."""
    hashes, prior = [], seed
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = page_hash(tokens[start : start + page_size], prior)
        hashes.append(prior)
    return hashes


@dataclass(frozen=True)
class ShardingSpec:
    """How this rank's KV relates to the other ranks' KV for the same page."""

    cp: str = "cp_replicated"  # "cp_replicated": each CP rank holds the whole page
    tp_sharded_heads: bool = True  # MHA heads split over attention TP; False for MLA
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

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

    def storage_key(self, page: str) -> str:
        suffix = self.suffix()
        return f"{page}_{suffix}" if suffix else page

    def writes(self, page: str) -> bool:
        """Whether this rank writes `page` to storage. Replicated pages have one
        elected writer per replica group, balanced by hash(page) mod size; the
        others skip the write (and still take part in the ack round)."""
        if self.cp == "cp_sharded" or self.cp_size == 1:
            return True
        return int(page[:16], 16) % self.cp_size == self.cp_rank

