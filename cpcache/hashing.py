"""Digests small enough to negate: fingerprints and state digests travel in
int64 slots as x and -x (docs/design.md §4), so they are kept below 2**62."""

from __future__ import annotations

import hashlib

HASH_MASK = (1 << 62) - 1


def hash62(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & HASH_MASK
