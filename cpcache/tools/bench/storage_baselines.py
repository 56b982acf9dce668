"""What a storage mover is measured against, beside the bare calls: the same
integrity work done by hand on the raw backend, and the calls SGLang's own
backends make for the same pages.

- framed file: what a put must do for a page never to be read torn (XXH3 of
  the page, the 40-byte header, one `writev` into a temp file, a rename) and
  what a get must do to trust it (one `readv`, the header and checksum
  checked). No put-if-absent check, no recency, no capacity bookkeeping,
  no workers: the floor under the file mover.
- framed Mooncake: the page and its header in one multi-buffer put of
  registered memory; a multi-buffer get, the header and checksum checked.
- SGLang's Mooncake calls: what its `MooncakeStore` (storage/mooncake_store/
  mooncake_store.py) does for a zero-copy page of the page_first_direct MHA
  layout: one key per K and V run, `batch_is_exist` then `batch_put_from`
  of the runs not yet stored; `batch_get_into` of the runs.

SGLang's own `HiCacheFile` runs in SGLang's environment (`movers_sglang.py`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cpcache.dataplane.storage import PageBuffer
from cpcache.dataplane.storage.framing import HEADER, Verdict, check_page, pack_header


def framed_file(root: Path, geometry: int, pages: list[PageBuffer],
                names: Callable[[], list[str]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """(put, get) of every page, framed, by hand: get reads the last put's files."""
    root.mkdir(parents=True, exist_ok=True)
    last: list[list[str]] = []

    def put() -> None:
        written = names()
        for name, page in zip(written, pages):
            views = page.views
            tmp = root / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if os.writev(fd, [pack_header(geometry, views), *views]) != HEADER.size + page.nbytes:
                    raise RuntimeError(f"bench movers: short write of {name}")
            finally:
                os.close(fd)
            os.replace(tmp, root / name)
        last.append(written)

    def get() -> None:
        header = bytearray(HEADER.size)
        for name, page in zip(last[-1], pages):
            fd = os.open(root / name, os.O_RDONLY)
            try:
                got = os.readv(fd, [header, *page.views])
            finally:
                os.close(fd)
            if got != HEADER.size + page.nbytes or check_page(header, page.views, geometry) is not Verdict.VALID:
                raise RuntimeError(f"bench movers: framed page {name} did not read back")

    return put, get


class HeaderArena:
    """Registered memory for the headers of one batch of framed Mooncake pages."""

    def __init__(self, store: object, pages: int) -> None:
        self.buffer = np.zeros(pages * HEADER.size, dtype=np.uint8)
        self.address = self.buffer.ctypes.data
        if store.register_buffer(self.address, self.buffer.nbytes) != 0:  # type: ignore[attr-defined]
            raise RuntimeError("bench movers: cannot register the header arena with Mooncake")

    def slot(self, i: int) -> tuple[int, np.ndarray]:
        return self.address + i * HEADER.size, self.buffer[i * HEADER.size : (i + 1) * HEADER.size]


def framed_mooncake(store: object, geometry: int, pages: list[PageBuffer],
                    keys: Callable[[], list[str]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """(put, get) of every page, framed, by hand on the raw store: get reads the last put's keys."""
    arena = HeaderArena(store, len(pages))
    last: list[list[str]] = []

    def pointers_and_sizes() -> tuple[list[list[int]], list[list[int]]]:
        pointers = [[arena.slot(i)[0], *(a for a, _ in page.parts)] for i, page in enumerate(pages)]
        sizes = [[HEADER.size, *(v.nbytes for _, v in page.parts)] for page in pages]
        return pointers, sizes

    def put() -> None:
        for i, page in enumerate(pages):
            arena.slot(i)[1][:] = np.frombuffer(pack_header(geometry, page.views), dtype=np.uint8)
        named = keys()
        pointers, sizes = pointers_and_sizes()
        codes = store.batch_put_from_multi_buffers(named, pointers, sizes)  # type: ignore[attr-defined]
        if any(c != 0 for c in codes):
            raise RuntimeError("bench movers: a framed Mooncake put failed")
        last.append(named)

    def get() -> None:
        pointers, sizes = pointers_and_sizes()
        got = store.batch_get_into_multi_buffers(last[-1], pointers, sizes)  # type: ignore[attr-defined]
        for i, page in enumerate(pages):
            if got[i] != HEADER.size + page.nbytes or check_page(
                    arena.slot(i)[1].tobytes(), page.views, geometry) is not Verdict.VALID:
                raise RuntimeError("bench movers: a framed Mooncake page did not read back")

    return put, get


def sglang_mooncake_calls(store: object, pages: list[PageBuffer],
                          keys: Callable[[], list[str]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """(put, get) as SGLang's MooncakeStore does them: a key per run of each page."""
    runs = [(address, view.nbytes) for page in pages for address, view in page.parts]
    last: list[list[str]] = []

    def put() -> None:
        named = [f"{key}_{i}" for key in keys() for i in range(len(pages[0].parts))]
        exist = store.batch_is_exist(named)  # type: ignore[attr-defined]
        todo = [i for i, e in enumerate(exist) if e != 1]
        codes = store.batch_put_from([named[i] for i in todo], [runs[i][0] for i in todo],  # type: ignore[attr-defined]
                                     [runs[i][1] for i in todo])
        if any(c != 0 for c in codes):
            raise RuntimeError("bench movers: a Mooncake put as SGLang makes it failed")
        last.append(named)

    def get() -> None:
        got = store.batch_get_into(last[-1], [a for a, _ in runs], [n for _, n in runs])  # type: ignore[attr-defined]
        if any(g != n for g, (_, n) in zip(got, runs)):
            raise RuntimeError("bench movers: a Mooncake get as SGLang makes it failed")

    return put, get
