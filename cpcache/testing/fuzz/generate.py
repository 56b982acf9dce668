"""Hostile requests, field by field and as raw bytes, all drawn from one
seeded `random.Random`: ids near and above 2**63, duplicates, empty and huge
page lists, wrong hash lengths, device pages out of range, NaN/inf/negative
timeouts, unknown enum values, absurd geometry, odd pool paths."""

from __future__ import annotations

import math
import random
from pathlib import Path

from google.protobuf.message import Message

from cpcache.testing.fuzz.wire import DEVICE_PAGES, HOST_PAGES, REQUEST_TYPES
from cpcache.v1 import daemon_pb2 as pb


class Gen:
    """Hostile field values, all drawn from one seeded `random.Random`."""

    def __init__(self, rng: random.Random, run_dir: Path) -> None:
        self.r = rng
        self.run_dir = run_dir
        self.hash_pool = [bytes([i]) * 32 for i in range(1, 9)] + [rng.randbytes(32) for _ in range(24)]
        self.written: list[bytes] = []  # hashes a write-through was acknowledged for (host hits)
        self.next_id = 1
        self.open_ids: list[int] = []  # ids of recently accepted operations
        self.load_ids: list[int] = []  # load-backs recently accepted (WaitLoads targets)

    def fresh_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def u64(self) -> int:
        r = self.r
        pick = r.random()
        if pick < 0.45:
            return self.fresh_id()
        if pick < 0.6 and self.open_ids:
            return r.choice(self.open_ids)
        return r.choice([0, 1, 2, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 2, 2**63 - 1, 2**63, 2**63 + 1,
                         2**64 - 2, 2**64 - 1, r.getrandbits(64), r.getrandbits(16)])

    def i64(self) -> int:
        return self.r.choice([0, 1, -1, 5, 2**62, 2**63 - 1, -(2**63), -(2**63) + 1, self.r.getrandbits(63),
                              -self.r.getrandbits(63)])

    def page_hash(self) -> bytes:
        r = self.r
        pick = r.random()
        if pick < 0.1 and self.written:
            return r.choice(self.written)
        if pick < 0.85:
            return r.choice(self.hash_pool)
        return r.choice([b"", b"\x00", r.randbytes(31), r.randbytes(33), r.randbytes(64), r.randbytes(1000),
                         b"\x00" * 32, b"\xff" * 32])

    def count(self) -> int:
        r = self.r
        pick = r.random()
        if pick < 0.15:
            return 0
        if pick < 0.85:
            return r.randint(1, 4)
        if pick < 0.97:
            return r.randint(5, HOST_PAGES + 4)
        return r.choice([200, 3000])

    def pages(self, n: int | None = None) -> list[bytes]:
        n = self.count() if n is None else n
        if n and self.r.random() < 0.2:  # a real chain of distinct hashes
            return [self.r.choice(self.hash_pool) if self.r.random() < 0.05 else self.r.randbytes(32) for _ in range(n)]
        if n and self.r.random() < 0.1 and self.written:
            return [self.r.choice(self.written) for _ in range(n)]
        return [self.page_hash() for _ in range(n)]

    def device_pages(self, n: int) -> list[int]:
        r = self.r
        if r.random() < 0.1:  # a length that does not match the pages
            n = max(0, n + r.choice([-1, 1, 5]))
        out = []
        for _ in range(n):
            pick = r.random()
            if pick < 0.85:
                out.append(r.randrange(DEVICE_PAGES))
            else:
                out.append(r.choice([DEVICE_PAGES, DEVICE_PAGES + 1, 2**31, 2**32 - 1]))
        return out

    def parent(self) -> bytes:
        pick = self.r.random()
        if pick < 0.6:
            return b""
        if pick < 0.9:
            return self.page_hash()
        return self.r.randbytes(self.r.choice([1, 31, 33]))

    def ids(self) -> list[int]:
        n = self.r.choice([0, 0, 1, 1, 1, 2, 3, 8, 100])
        out = [self.u64() for _ in range(n)]
        if out and self.r.random() < 0.15:
            out.append(out[0])  # a duplicate
        return out

    def prefetch_op(self, op: pb.PrefetchOp) -> None:
        op.op_id = self.u64()
        op.pages.extend(self.pages())
        op.tokens = self.r.choice([0, 1, 16, 64, 256, 10_000, 2**32, 2**64 - 1, self.r.getrandbits(64)])
        op.parent = self.parent()
        op.hold = self.r.random() < 0.5

    def write_op(self, op: pb.WriteOp) -> None:
        op.op_id = self.u64()
        pages = self.pages(min(self.count(), HOST_PAGES + 2))
        op.pages.extend(pages)
        op.device_pages.extend(self.device_pages(len(pages)))
        op.parent = self.parent()

    def load_op(self, op: pb.LoadOp) -> None:
        op.op_id = self.u64()
        n = min(self.count(), DEVICE_PAGES + 2)
        pages = [self.r.choice(self.written) for _ in range(n)] if self.written and self.r.random() < 0.7 \
            else self.pages(n)
        op.pages.extend(pages)
        op.device_pages.extend(self.device_pages(len(pages)))

    def reduce(self) -> int:
        pick = self.r.random()
        if pick < 0.85:
            return self.r.choice([pb.REDUCE_MIN, pb.REDUCE_MAX])
        return self.r.choice([0, 3, 7, 99, -1, 2**31 - 1, -(2**31)])

    def votes(self, votes: pb.Votes) -> None:
        n = self.r.choice([0, 0, 1, 2, 3, 16])
        ids = [self.u64() for _ in range(n)]
        if ids and self.r.random() < 0.1:
            ids.append(ids[-1])
        reduces = [self.reduce() for _ in ids]
        values = [self.i64() for _ in ids]
        if ids and self.r.random() < 0.1:  # columns of unequal length
            self.r.choice([reduces, values]).pop()
        votes.op_ids.extend(ids)
        for value in reduces:
            try:
                votes.reduces.append(value)
            except ValueError:
                votes.reduces.append(pb.REDUCE_MIN)
        votes.values.extend(values)

    def decision(self, step: int) -> pb.StepRequest:
        """A hostile step: half the time a scheduler iteration's mix of
        fields, else (a sixth each) one purpose alone: nothing but the step
        number (an ack), only revokes, or only prefetches and polls, up to
        20 prefetches at once."""
        r = self.r
        shape = r.random()
        if shape < 1 / 6:
            return pb.StepRequest(step=step)
        if shape < 2 / 6:
            return pb.StepRequest(step=step, revokes=self.ids())
        if shape < 3 / 6:
            request = pb.StepRequest(step=step, prefetch_polls=self.ids())
            for _ in range(r.choice([0, 1, 1, 2, 3, 20])):
                self.prefetch_op(request.prefetches.add())
            return request
        request = pb.StepRequest(step=step)
        if r.random() < 0.5:
            self.votes(request.votes)
        for _ in range(r.choice([0, 0, 1, 2])):
            self.prefetch_op(request.prefetches.add())
        if r.random() < 0.3:
            request.prefetch_polls.extend(self.ids())
        if r.random() < 0.2:
            request.revokes.extend(self.ids())
        if r.random() < 0.2:
            request.hold_releases.extend(self.ids())
        for _ in range(r.choice([0, 0, 1, 1, 2])):
            self.write_op(request.writes.add())
        for _ in range(r.choice([0, 0, 1, 2])):
            self.load_op(request.loads.add())
        return request

    # -- local RPCs

    def attach(self) -> pb.AttachRequest:
        r = self.r
        request = pb.AttachRequest()
        request.model_id = r.choice(["m", "", "x" * 5000, "\u00e9\u6a21\u578b", "a/b", "\x00", " ", "model"])
        g = request.geometry
        if r.random() < 0.4:
            g.layers, g.kv_kind, g.heads, g.head_dim, g.dtype, g.page_size = 2, "mha", 1, 16, "bfloat16", 16
        else:
            g.layers = r.choice([0, 1, 2, 61, 2**16, 2**32 - 1])
            g.kv_kind = r.choice(["mha", "mla", "", "MHA", "gqa", "\x00"])
            g.heads = r.choice([0, 1, 8, 2**31, 2**32 - 1])
            g.head_dim = r.choice([0, 1, 16, 128, 2**20, 2**32 - 1])
            g.dtype = r.choice(["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "", "torch.bfloat16",
                                "float64"])
            g.page_size = r.choice([0, 1, 16, 64, 2**32 - 1])
        if r.random() < 0.1:
            request.ClearField("geometry")
        request.device_pages = r.choice([0, 1, DEVICE_PAGES, 2**31, 2**32 - 1])
        pick = r.random()
        if pick < 0.8:
            request.shm_path = self.odd_path()
        elif pick < 0.9:
            ipc = request.cuda_ipc
            ipc.device = r.choice([0, -1, 7, 2**31 - 1])
            ipc.handle = r.randbytes(r.choice([0, 8, 64]))
            ipc.storage_size = r.choice([0, 2048, 2**64 - 1])
            ipc.storage_offset = r.choice([0, 1, 2**64 - 1])
            ipc.ref_counter_handle = r.randbytes(r.choice([0, 8]))
            ipc.event_handle = r.randbytes(r.choice([0, 64]))
            ipc.event_sync_required = r.random() < 0.5
            ipc.device_uuid = r.choice(["", "x", "0" * 36, "\u00e9" * 100])
        # else: no pool at all
        return request

    def odd_path(self) -> str:
        """Only names inside the fuzz's own attach dir, none of them a file
        large enough to hold a pool: nothing outside it can be opened."""
        base = self.run_dir / "attach"
        name = self.r.choice([
            "missing", "empty", "dir", "dir/", "a b", "\u00e9t\u00e9", "nul\x00byte", "x" * 300,
            "/".join(["d"] * 40), "missing/deeper", "\n", "..missing", "\u202etxt",
        ])
        return str(base / name) if name != "\n" else str(base) + "/\n"

    def wait_loads(self) -> pb.WaitLoadsRequest:
        r = self.r
        request = pb.WaitLoadsRequest()
        if self.load_ids and r.random() < 0.4:
            request.op_ids.extend(r.sample(self.load_ids, k=min(len(self.load_ids), r.randint(1, 3))))
        else:
            request.op_ids.extend(self.ids())
        request.timeout_s = r.choice([0.0, 0.001, 0.5, 1.0, 3600.0, 3600.5, -1.0, -0.0, math.nan, math.inf,
                                      -math.inf, 1e308, 5e-324, 2.0])
        return request

    def match(self) -> pb.MatchRequest:
        if self.r.random() < 0.01:
            return pb.MatchRequest(pages=[self.r.randbytes(32) for _ in range(20_000)])
        return pb.MatchRequest(pages=self.pages())

    def local(self, rpc: str) -> Message:
        if rpc == "Attach":
            return self.attach()
        if rpc == "WaitLoads":
            return self.wait_loads()
        if rpc == "Match":
            return self.match()
        return REQUEST_TYPES[rpc]()

    # -- raw bytes

    def raw(self, template: bytes) -> bytes:
        r = self.r
        pick = r.random()
        if pick < 0.3:
            return r.randbytes(r.choice([0, 1, 2, 3, 5, 16, 100, 1000]))
        if pick < 0.45:
            return bytes(r.choice([0x08, 0x0A, 0x12, 0x1A, 0xFF, 0x80, 0x00]) for _ in range(r.randint(1, 40)))
        data = bytearray(template)
        if not data:
            return r.randbytes(r.randint(1, 20))
        for _ in range(r.randint(1, 4)):
            how = r.random()
            if how < 0.35:
                i = r.randrange(len(data))
                data[i] ^= 1 << r.randrange(8)
            elif how < 0.6:
                del data[r.randrange(len(data)):]
            elif how < 0.8:
                data += r.randbytes(r.randint(1, 12))
            else:
                i = r.randrange(len(data) + 1)
                data[i:i] = r.choice([b"\x80" * 11, b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\x7f", b"\x07",
                                      b"\x0b", b"\x0c"])
            if not data:
                break
        return bytes(data)
