"""Request traces (Mooncake FAST'25 format) turned into page-hash chains.

Each request lists `hash_ids`, one per 512-token block; equal ids at the same
position mean the same prefix. A block's tokens are synthesized from its id,
so the page hashes are real `cpcache.keys` chains over real token bytes.

Any trace in this format replays, not only the shipped ones: hash ids may be
any non-negative integers (of any size), `input_length` any non-negative
count. A request's pages are its first `input_length // page_size` pages, cut
short where its blocks run out.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
VOCAB = 151936  # token ids fall in [0, VOCAB): a real tokenizer's range (Qwen2's)


@dataclass(frozen=True)
class Request:
    index: int  # the request's line number in its trace, from 0
    timestamp_ms: int
    input_tokens: int
    blocks: tuple[int, ...]


def _non_negative_int(value: object, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: {what} must be a non-negative integer, got {value!r}")
    return value


def parse(line: str, index: int, where: str = "trace") -> Request:
    """One JSON line of a trace; ValueError naming the line if it is not one."""
    where = f"{where}:{index + 1}"
    try:
        row = json.loads(line)
        hash_ids = row["hash_ids"]
        timestamp, input_length = row["timestamp"], row["input_length"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a trace request ({exc})") from None
    if not isinstance(hash_ids, list):
        raise ValueError(f"{where}: hash_ids must be a list, got {hash_ids!r}")
    blocks = tuple(_non_negative_int(b, "every hash id", where) for b in hash_ids)
    if isinstance(timestamp, float) and timestamp.is_integer():
        timestamp = int(timestamp)
    if isinstance(timestamp, bool) or not isinstance(timestamp, int):
        raise ValueError(f"{where}: timestamp must be an integer, got {timestamp!r}")
    return Request(index, timestamp, _non_negative_int(input_length, "input_length", where), blocks)


def load(path: str | Path, limit: int | None = None, skip: int = 0) -> list[Request]:
    """Requests `skip` .. `skip + limit` of a trace (blank lines skipped)."""
    out: list[Request] = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if i < skip:
                continue
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(parse(line, i, str(path)))
    return out


@functools.lru_cache(maxsize=4096)
def _block_token_bytes(block: int) -> bytes:
    if block < 0:
        raise ValueError(f"hash id {block} is negative")
    digest = hashlib.shake_256(b"cpcache.sim.block/" + str(block).encode()).digest(4 * BLOCK_TOKENS)
    tokens = np.frombuffer(digest, dtype="<u4") % np.uint32(VOCAB)
    return tokens.astype("<u4").tobytes()


def block_tokens(block: int) -> np.ndarray:
    """The 512 tokens of a block: uint32 ids below VOCAB, drawn from SHAKE-256
    of the hash id's decimal digits, so any non-negative id (however large)
    gives valid tokens, the same on every machine, and distinct ids give
    distinct blocks (but for a hash collision)."""
    return np.frombuffer(_block_token_bytes(int(block)), dtype="<u4").copy()


class PageHasher:
    """Page hashes of a request's prompt: the sha256 chain of cpcache.keys,
    computed a block at a time and remembered by (previous page, block)."""

    def __init__(self, seed_hex: str, page_size: int) -> None:
        if page_size < 1 or BLOCK_TOKENS % page_size:
            raise ValueError(f"page_size {page_size} must divide the trace's {BLOCK_TOKENS}-token blocks")
        self.seed = seed_hex
        self.page_size = page_size
        self._memo: dict[tuple[bytes | None, int], list[bytes]] = {}

    def pages(self, request: Request) -> list[bytes]:
        full_pages = request.input_tokens // self.page_size
        out: list[bytes] = []
        prior: bytes | None = bytes.fromhex(self.seed)
        for block in request.blocks:
            if len(out) >= full_pages:
                break
            key = (prior, block)
            chunk = self._memo.get(key)
            if chunk is None:
                chunk = self._hash_block(prior, block)
                self._memo[key] = chunk
            out += chunk
            prior = chunk[-1]
        return out[:full_pages]

    def _hash_block(self, prior: bytes | None, block: int) -> list[bytes]:
        tokens = _block_token_bytes(int(block))
        out = []
        step = 4 * self.page_size
        for start in range(0, 4 * BLOCK_TOKENS, step):
            hasher = hashlib.sha256()
            if prior:
                hasher.update(prior)
            hasher.update(tokens[start : start + step])
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
            if not pages:
                break
            prefix = r.blocks[: b + 1]
            total += pages
            if prefix in seen:
                hit += pages
            seen.add(prefix)
    return hit / total if total else 0.0
