"""How a stored page is framed, whatever the backend: a 40-byte header
(magic, version, geometry fingerprint, payload length, XXH3-64 checksum of
the payload) before the page bytes. A reader checks all of it, so a
truncated, corrupt, foreign or other-geometry object reads as a miss, never
as KV."""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import TypeVar

import numpy as np
import xxhash

MAGIC = b"CPCPAGE1"
HEADER = struct.Struct("<8sIIQQQ")  # magic, version, reserved, geometry, length, checksum
VERSION = 1
T = TypeVar("T")
R = TypeVar("R")
# HEADER's layout as a record, to check a batch's headers at once
HEADER_RECORD = np.dtype([("magic", "S8"), ("version", "<u4"), ("reserved", "<u4"), ("geometry", "<u8"),
                          ("length", "<u8"), ("checksum", "<u8")])
assert HEADER_RECORD.itemsize == HEADER.size


class Verdict(enum.Enum):
    VALID = "valid"
    DAMAGED = "damaged"  # truncated, not a page, or bytes that do not match their checksum: delete it
    FOREIGN = "foreign"  # a whole page of another geometry: not ours to read, nor to delete


def checksum(payload: memoryview | bytes | list[memoryview]) -> int:
    """XXH3-64 of a page's bytes, given whole or as the runs that make it up."""
    if not isinstance(payload, list):
        return xxhash.xxh3_64_intdigest(payload)
    hasher = xxhash.xxh3_64()
    for part in payload:
        hasher.update(part)
    return hasher.intdigest()


def _length(payload: memoryview | bytes | list[memoryview]) -> int:
    return sum(len(p) for p in payload) if isinstance(payload, list) else len(payload)


def _fields(geometry: int, payload: memoryview | bytes | list[memoryview],
            digest: int | None) -> tuple[bytes, int, int, int, int, int]:
    """The header's fields, in HEADER's order."""
    return MAGIC, VERSION, 0, geometry, _length(payload), checksum(payload) if digest is None else digest


def pack_header(geometry: int, payload: memoryview | bytes | list[memoryview], digest: int | None = None) -> bytes:
    return HEADER.pack(*_fields(geometry, payload, digest))


def pack_header_into(buffer: memoryview, offset: int, geometry: int,
                     payload: memoryview | bytes | list[memoryview], digest: int | None = None) -> None:
    """pack_header, written in place (a registered arena's slot)."""
    HEADER.pack_into(buffer, offset, *_fields(geometry, payload, digest))


def check_header(header: bytes | bytearray | memoryview, geometry: int, nbytes: int) -> tuple[Verdict, int]:
    """The verdict on a header alone, and the checksum it promises."""
    if len(header) != HEADER.size:
        return Verdict.DAMAGED, 0
    magic, version, _, their_geometry, length, digest = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        return Verdict.DAMAGED, 0
    if their_geometry != geometry:
        return Verdict.FOREIGN, 0
    if length != nbytes:
        return Verdict.DAMAGED, 0  # this geometry's pages are all nbytes long
    return Verdict.VALID, digest


def check_page(header: bytes | bytearray | memoryview, payload: memoryview | list[memoryview],
               geometry: int, nbytes: int | None = None) -> Verdict:
    """The verdict on a header and the payload read after it (`nbytes`: its length, where known)."""
    verdict, digest = check_header(header, geometry, _length(payload) if nbytes is None else nbytes)
    if verdict is Verdict.VALID and checksum(payload) != digest:
        return Verdict.DAMAGED
    return verdict


def in_spans(work: Callable[[list[T]], list[R]], items: list[T], workers: Executor | None,
             spans: int) -> list[R]:
    """`work` over `items` cut into `spans` runs, in order: the caller takes
    the first run, `workers` the others at once (XXH3 releases the GIL).
    Workers that take no more work (shut down: the backend closed, or the
    interpreter exiting) leave their runs to the caller: never an exception."""
    if workers is None or spans < 2 or len(items) < 2:
        return work(items)
    step = -(-len(items) // spans)
    runs = [items[i : i + step] for i in range(0, len(items), step)]
    futures: list[Future[list[R]]] = []
    for run in runs[1:]:
        try:
            futures.append(workers.submit(work, run))
        except RuntimeError:
            break
    done = work(runs[0])
    for future in futures:
        done += future.result()
    for run in runs[1 + len(futures) :]:
        done += work(run)
    return done


def digests(payloads: Sequence[list[memoryview]], indices: Sequence[int]) -> list[int]:
    """`checksum` of the pages at `indices`, with the least Python per page
    (a batch of small pages costs its calls, not its bytes): a page of one
    run is one call, of two runs (K and V) a hasher fed both."""
    whole, hasher = xxhash.xxh3_64_intdigest, xxhash.xxh3_64
    out = []
    for i in indices:
        runs = payloads[i]
        if len(runs) == 1:
            out.append(whole(runs[0]))
            continue
        state = hasher(runs[0])
        for run in runs[1:]:
            state.update(run)
        out.append(state.intdigest())
    return out


def check_batch(headers: bytes | memoryview, payloads: Sequence[list[memoryview]], lengths: np.ndarray,
                read_whole: np.ndarray, geometry: int, workers: Executor | None = None,
                spans: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """check_page over a batch, at once: `headers` back to back, one per
    payload (`lengths`: each payload's bytes; `read_whole`: whether its
    object read in full, header and payload: one that did not is damaged,
    unchecked). -> (valid, damaged): boolean masks; a page in neither is
    foreign. The header fields of the whole batch are compared as arrays and
    the checksums too; each page costs its hash alone (`digests`), hashed
    in `spans` runs (`in_spans`)."""
    records = np.frombuffer(headers, dtype=HEADER_RECORD, count=len(payloads))
    ours = (records["magic"] == MAGIC) & (records["version"] == VERSION) & read_whole
    foreign = ours & (records["geometry"] != geometry)
    whole = np.flatnonzero(ours & ~foreign & (records["length"] == lengths))
    hashed = in_spans(lambda run: digests(payloads, run), whole.tolist(), workers, spans)
    valid = np.zeros(len(payloads), dtype=bool)
    valid[whole] = np.asarray(hashed, dtype=np.uint64) == records["checksum"][whole]
    return valid, ~valid & ~foreign


def check_pages(headers: bytes, payloads: Sequence[list[memoryview]], lengths: Sequence[int],
                read_whole: Sequence[bool], geometry: int, workers: Executor | None = None,
                spans: int = 1) -> list[Verdict]:
    """check_batch's verdicts, one per page."""
    valid, damaged = check_batch(headers, payloads, np.asarray(lengths, dtype=np.uint64),
                                 np.asarray(read_whole, dtype=bool), geometry, workers, spans)
    return [Verdict.VALID if ok else Verdict.DAMAGED if bad else Verdict.FOREIGN
            for ok, bad in zip(valid.tolist(), damaged.tolist())]
