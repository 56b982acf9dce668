"""Device pages with known bytes, for the drivers that check what a load
brought: the bytes a forward pass writes for a page are a function of its
storage key, so every rank that holds a page can check it."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from cpcache.dataplane.pools import DevicePool


def page_content(storage_key: str, nbytes: int) -> np.ndarray:
    """The bytes a forward pass writes for a page: a function of its storage
    key (so CP ranks that share a page write the same bytes)."""
    seed = hashlib.blake2b(storage_key.encode(), digest_size=64).digest()
    reps = -(-nbytes // len(seed))
    return np.frombuffer(seed * reps, dtype=np.uint8)[:nbytes]


def write_page(pool: DevicePool, device_page: int, content: np.ndarray) -> None:
    view = pool.page_view(device_page)
    view.copy_(torch.from_numpy(content.copy()).view(view.dtype).view(view.shape))


def read_page(pool: DevicePool, device_page: int) -> np.ndarray:
    view = pool.page_view(device_page)  # a page is strided across layers
    return view.contiguous().view(-1).view(torch.uint8).numpy()
