"""Request traces (Mooncake FAST'25 format) turned into page-hash chains.

Each request lists `hash_ids`, one per 512-token block; equal ids at the same
position mean the same prefix. A block's tokens are synthesized from its id,
so the page hashes are real `cpcache.keys` chains over real token bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    index: int
    timestamp_ms: int
    input_tokens: int
    blocks: tuple[int, ...]


def load(path: str | Path, limit: int | None = None, skip: int = 0) -> list[Request]:
    out = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if i < skip:
                continue
            if limit is not None and len(out) >= limit:
                break
            row = json.loads(line)
            out.append(Request(i, int(row["timestamp"]), int(row["input_length"]), tuple(row["hash_ids"])))
    return out


def block_tokens(block: int) -> np.ndarray:
    return (np.arange(BLOCK_TOKENS, dtype=np.uint32) * 7919 + block * 104729) % 151936


class PageHasher:
    """Page hashes of a request's prompt: the sha256 chain of cpcache.keys,
    computed a block at a time and remembered by (previous page, block)."""

    def __init__(self, seed_hex: str, page_size: int) -> None:
        if BLOCK_TOKENS % page_size:
            raise ValueError(f"page_size {page_size} must divide the trace's {BLOCK_TOKENS}-token blocks")
        self.seed = seed_hex
        self.page_size = page_size
        self._memo: dict[tuple[bytes | None, int], list[bytes]] = {}

    def pages(self, request: Request) -> list[bytes]:
        full_pages = request.input_tokens // self.page_size
        out: list[bytes] = []
        prior: bytes | None = bytes.fromhex(self.seed)
        for block in request.blocks:
            key = (prior, block)
            chunk = self._memo.get(key)
            if chunk is None:
                chunk = self._hash_block(prior, block)
                self._memo[key] = chunk
            out += chunk
            prior = chunk[-1]
            if len(out) >= full_pages:
                break
        return out[:full_pages]

    def _hash_block(self, prior: bytes | None, block: int) -> list[bytes]:
        tokens = block_tokens(block).astype("<u4")
        out = []
        for start in range(0, BLOCK_TOKENS, self.page_size):
            hasher = hashlib.sha256()
            if prior:
                hasher.update(prior)
            hasher.update(tokens[start : start + self.page_size].tobytes())
            prior = hasher.digest()
            out.append(prior)
        return out


def ceiling_hit_rate(requests: list[Request], page_size: int) -> float:
    """The hit rate of an infinite cache: pages whose whole prefix was seen."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    per_block = BLOCK_TOKENS // page_size
    for r in requests:
        full = r.input_tokens // page_size
        for b in range(len(r.blocks)):
            pages = min(per_block, max(0, full - b * per_block))
            prefix = r.blocks[: b + 1]
            total += pages
            if prefix in seen:
                hit += pages
            seen.add(prefix)
    return hit / total if total else 0.0
