"""`cpcache fuzz`: hostile requests against live daemons.

Starts a real two-rank domain (`LocalDomain`, file storage, a small host
pool), attaches a shared-memory device pool on each rank, and sends every
CacheDaemon RPC hostile requests generated from one seed: messages built
field by field (ids near and above 2**63, zero, duplicates, empty and huge
page lists, wrong hash lengths, device pages out of range, NaN/inf/negative
timeouts, unknown enum values, absurd geometry, odd pool paths) and raw
malformed bytes sent through an untyped channel method.

Decision RPCs (Step, Prefetch, Revoke, Ack) go to every rank with the same
step number, strictly increasing (the same hostile request everywhere, a
hostile request on one rank and a valid one on the other, two different
hostile ones, identical raw bytes); out-of-range, stale and retried step
numbers go to one rank only. Local RPCs (Attach, WaitLoads, Match, Stats,
Status) go to one rank, 32 at a time, while the rounds run.

Checked: only documented statuses answer (never UNKNOWN or INTERNAL;
UNAVAILABLE only for WaitLoads); a step is accepted everywhere with
byte-identical replies or refused everywhere (the refusing rank with its own
status, the others REJECTED_BY_PEER, or DIVERGENCE everywhere); the cache
digest is the same on every rank after every round and unchanged by a
refused one; the daemons still serve at the end and a final valid step is
answered alike. Every pool path sent lies inside the fuzz's own run dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

from cpcache.client import AsyncClient
from cpcache.client.core import error_info
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb

SERVICE = "/cpcache.v1.CacheDaemon/"
DECISIONS = ("Step", "Prefetch", "Revoke", "Ack")
LOCALS = ("Attach", "WaitLoads", "Match", "Stats", "Status")
RPCS = ("Attach", "Step", "Prefetch", "Revoke", "Ack", "WaitLoads", "Match", "Stats", "Status")
REQUEST_TYPES: dict[str, type[Message]] = {
    "Attach": pb.AttachRequest, "Step": pb.StepRequest, "Prefetch": pb.PrefetchRequest,
    "Revoke": pb.RevokeRequest, "Ack": pb.AckRequest, "WaitLoads": pb.WaitLoadsRequest,
    "Match": pb.MatchRequest, "Stats": pb.StatsRequest, "Status": pb.StatusRequest,
}
DOCUMENTED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"}
ALLOWED = {rpc: DOCUMENTED | ({"UNAVAILABLE"} if rpc == "WaitLoads" else set()) for rpc in RPCS}
# What gRPC itself answers a request it cannot decode, before any handler runs.
FRAMEWORK_ON_UNDECODABLE = {"INTERNAL", "UNKNOWN", "INVALID_ARGUMENT", "CANCELLED"}

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
DEVICE_PAGES = 8
HOST_PAGES = 16
MAX_STEP = 2**63 - 1
DEADLINE_S = 10.0
AGREEMENT_TIMEOUT_S = 5.0
CONCURRENCY = 32


@dataclass
class Outcome:
    code: str
    reason: str = ""
    message: str = ""
    reply: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.code == "OK"


@dataclass
class Report:
    per_rpc: int
    seed: int
    sent: Counter = field(default_factory=Counter)
    raw_sent: Counter = field(default_factory=Counter)
    statuses: dict = field(default_factory=lambda: defaultdict(Counter))
    violations: list = field(default_factory=list)
    known: Counter = field(default_factory=Counter)  # known bug tag -> violations seen
    rounds: int = 0
    rejected_rounds: int = 0
    accepted_rounds: int = 0
    wall_s: float = 0.0

    def count(self, rpc: str, outcome: Outcome, raw: bool = False) -> None:
        self.sent[rpc] += 1
        if raw:
            self.raw_sent[rpc] += 1
        self.statuses[rpc][outcome.code] += 1

    def violation(self, kind: str, rpc: str, detail: str, request: bytes | str | None = None) -> None:
        tag = known_bug(kind, detail)
        if tag is not None:
            self.known[tag] += 1
            if self.known[tag] > 3:  # counted; a few examples are enough
                return
        elif len(self.violations) >= 500:
            return
        entry = dict(kind=kind, rpc=rpc, detail=detail[:1500], known=tag)
        if isinstance(request, bytes):
            entry["request_hex"] = request[:2048].hex()
        elif request is not None:
            entry["request"] = request[:2048]
        self.violations.append(entry)

    def as_dict(self) -> dict:
        return dict(
            seed=self.seed, per_rpc=self.per_rpc, wall_s=round(self.wall_s, 1),
            rounds=self.rounds, accepted_rounds=self.accepted_rounds, rejected_rounds=self.rejected_rounds,
            rpcs={rpc: dict(sent=self.sent[rpc], raw=self.raw_sent[rpc], statuses=dict(self.statuses[rpc]))
                  for rpc in RPCS},
            violations=self.violations,
            unknown_violations=len(self.new_violations()),
            known_bugs={tag: self.known[tag] for tag in KNOWN_BUGS},
        )

    def new_violations(self) -> list:
        return [v for v in self.violations if v["known"] is None]


# Daemon bugs this fuzz found, already reported: a violation's `known` tag.
KNOWN_BUGS: dict[str, str] = {}


def known_bug(kind: str, detail: str) -> str | None:
    """The KNOWN_BUGS tag of a violation (none are open now)."""
    return None


def short(message: object) -> str:
    text = str(message).replace("\n", " ")
    return text if len(text) < 600 else text[:600] + "..."


# -- generation -------------------------------------------------------------------------------


class Gen:
    """Hostile field values, all drawn from one seeded `random.Random`."""

    def __init__(self, rng: random.Random, run_dir: Path, known_bugs: bool) -> None:
        self.r = rng
        self.run_dir = run_dir
        self.known_bugs = known_bugs
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

    def decision(self, method: str, step: int) -> Message:
        r = self.r
        if method == "Ack":
            return pb.AckRequest(step=step)
        if method == "Revoke":
            return pb.RevokeRequest(step=step, op_ids=self.ids())
        if method == "Prefetch":
            request = pb.PrefetchRequest(step=step, polls=self.ids())
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
        for _ in range(r.choice([0, 0, 1, 1, 2])):
            self.write_op(request.writes.add())
        for _ in range(r.choice([0, 0, 1, 2])):
            self.load_op(request.loads.add())
        return request

    # -- local RPCs

    def attach(self, attached: bool) -> pb.AttachRequest:
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
        elif pick < 0.9 and (self.known_bugs or attached):
            ipc = request.cuda_ipc
            ipc.device = r.choice([0, -1, 7, 2**31 - 1])
            ipc.handle = r.randbytes(r.choice([0, 8, 64]))
            ipc.storage_size = r.choice([0, 2048, 2**64 - 1])
            ipc.storage_offset = r.choice([0, 1, 2**64 - 1])
            ipc.ref_counter_handle = r.randbytes(r.choice([0, 8]))
            ipc.event_handle = r.randbytes(r.choice([0, 64]))
            ipc.event_sync_required = r.random() < 0.5
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

    def local(self, rpc: str, attached: bool) -> Message:
        if rpc == "Attach":
            return self.attach(attached)
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


def parse(rpc: str, data: bytes) -> Message:
    try:
        return REQUEST_TYPES[rpc].FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return None


# -- sending ----------------------------------------------------------------------------------


class Rank:
    def __init__(self, socket: str) -> None:
        self.channel = grpc.aio.insecure_channel(
            "unix:" + socket, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        self.methods = {rpc: self.channel.unary_unary(SERVICE + rpc, request_serializer=None,
                                                      response_deserializer=None) for rpc in RPCS}

    async def call(self, rpc: str, data: bytes, deadline_s: float = DEADLINE_S) -> Outcome:
        try:
            reply = await self.methods[rpc](data, timeout=deadline_s)
        except grpc.aio.AioRpcError as exc:
            info = error_info(exc)
            return Outcome(exc.code().name, info.reason if info is not None else "", exc.details() or "")
        return Outcome("OK", reply=reply)

    async def close(self) -> None:
        await self.channel.close()


class Fuzz:
    def __init__(self, domain: LocalDomain, run_dir: Path, per_rpc: int, seed: int, known_bugs: bool) -> None:
        self.domain = domain
        self.per_rpc = per_rpc
        self.report = Report(per_rpc, seed)
        self.rng = random.Random(seed)
        self.gen = Gen(random.Random(seed + 1), run_dir, known_bugs)
        self.local_gen = Gen(random.Random(seed + 2), run_dir, known_bugs)
        self.ranks = [Rank(s) for s in domain.sockets]
        self.clients = [AsyncClient(s, timeout_s=DEADLINE_S) for s in domain.sockets]
        self.step = 0  # the last step number any rank took
        self.last_requests: list[tuple[str, bytes, Outcome] | None] = [None] * len(self.ranks)
        self.digest: int | None = None
        self.recent: list[list[bytes]] = [[] for _ in self.ranks]  # requests of the last rounds, per rank
        self.attached = False

    def check_status(self, rpc: str, outcome: Outcome, data: bytes, deadline_ok: bool = False) -> None:
        if outcome.code in ALLOWED[rpc]:
            return
        if deadline_ok and outcome.code == "DEADLINE_EXCEEDED":
            return
        self.report.violation("undocumented status", rpc, f"{outcome.code} ({outcome.reason}): "
                              f"{short(outcome.message)}", data)

    # -- local RPCs

    async def local_one(self, rpc: str, rank: int, data: bytes, raw: bool, request: Message | None = None) -> None:
        outcome = await self.ranks[rank].call(rpc, data)
        self.report.count(rpc, outcome, raw)
        if raw and parse(rpc, data) is None:
            if outcome.ok:
                self.report.violation("undecodable request accepted", rpc, "OK", data)
            elif outcome.code in ("UNKNOWN", "INTERNAL"):
                self.report.violation("undocumented status (undecodable bytes)", rpc,
                                      f"{outcome.code}: {short(outcome.message)}", data)
            return
        # A WaitLoads whose own timeout outlasts our deadline may pass it.
        long_wait = rpc == "WaitLoads" and request is not None and not (request.timeout_s < DEADLINE_S - 2)
        self.check_status(rpc, outcome, data, deadline_ok=long_wait)
        if rpc == "Attach" and outcome.ok:
            self.report.violation("hostile attach accepted", rpc, "OK", data)
        if rpc == "Status" and outcome.ok:
            state = pb.StatusReply.FromString(outcome.reply).state
            if state != "serving":
                self.report.violation("not serving", rpc, f"state {state!r}", data)

    def local_request(self, rpc: str) -> tuple[bytes, bool, object]:
        gen = self.local_gen
        request = gen.local(rpc, self.attached)
        data = request.SerializeToString()
        if gen.r.random() < 0.2:
            return gen.raw(data), True, None
        return data, False, request

    async def local_batch(self, rpcs: list[str]) -> None:
        jobs = []
        for rpc in rpcs:
            data, raw, request = self.local_request(rpc)
            jobs.append(self.local_one(rpc, self.local_gen.r.randrange(len(self.ranks)), data, raw, request))
        await asyncio.gather(*jobs)

    # -- decisions

    async def digests(self) -> list[int]:
        stats = await asyncio.gather(*(c.stats() for c in self.clients))
        return [s.get("cache_digest") for s in stats]

    async def check_digest(self, what: str, refused: bool, detail: str) -> None:
        try:
            digests = await self.digests()
        except Exception as exc:  # the daemon stopped answering
            self.report.violation("stats failed", "Stats", f"after {what}: {short(exc)}")
            raise
        if len(set(digests)) != 1:
            self.report.violation("digests differ", what, f"{digests} after {detail}")
        elif refused and self.digest is not None and digests[0] != self.digest:
            self.report.violation("refused step changed the digest", what, f"{self.digest} -> {digests[0]} "
                                  f"after {detail}")
        self.digest = digests[0]

    def benign(self, step: int) -> tuple[str, bytes]:
        return "Ack", pb.AckRequest(step=step).SerializeToString()

    def check_round(self, sent: list[tuple[str, bytes]], outcomes: list[Outcome]) -> bool:
        """One round's answers; returns whether the step was refused everywhere."""
        detail = "; ".join(f"rank {i} {rpc} -> {o.code} {o.reason}: {short(o.message)[:300]}"
                           for i, ((rpc, _), o) in enumerate(zip(sent, outcomes)))
        for (rpc, data), outcome in zip(sent, outcomes):
            self.check_status(rpc, outcome, data)
        oks = [o.ok for o in outcomes]
        self.report.rounds += 1
        if all(oks):
            self.report.accepted_rounds += 1
            if len({o.reply for o in outcomes}) != 1:
                self.report.violation("replies differ", sent[0][0], detail, sent[0][1])
            return False
        if any(oks):
            self.report.violation("accepted on some ranks only", sent[0][0], detail,
                                  next(data for (rpc, data), o in zip(sent, outcomes) if not o.ok))
            return False
        self.report.rejected_rounds += 1
        reasons = [o.reason for o in outcomes]
        if all(r == "REJECTED_BY_PEER" for r in reasons):
            self.report.violation("rejected by peer everywhere", sent[0][0], detail, sent[0][1])
        for o in outcomes:
            if o.reason == "REJECTED_BY_PEER" and o.code != "FAILED_PRECONDITION":
                self.report.violation("rejected by peer with a wrong code", sent[0][0], detail)
        if "DIVERGENCE" in reasons and len(set(reasons)) != 1:
            self.report.violation("divergence on some ranks only", sent[0][0], detail)
        return True

    def learn(self, sent: list[tuple[str, bytes]], outcomes: list[Outcome]) -> None:
        """Remember what an accepted step opened, for later polls, revokes, loads and waits."""
        if not outcomes[0].ok:
            return
        rpc, data = sent[0]
        request = parse(rpc, data)
        reply = pb.StepReply.FromString(outcomes[0].reply)
        gen = self.gen
        if isinstance(request, pb.StepRequest):
            gen.open_ids.extend(op.op_id for op in request.prefetches)
            gen.open_ids.extend(op.op_id for op in request.writes)
            gen.open_ids.extend(op.op_id for op in request.loads)
            for op in request.loads:
                gen.load_ids.append(op.op_id)
            for op in request.writes:
                if op.op_id in reply.write_acks:
                    gen.written.extend(op.pages)
        elif isinstance(request, pb.PrefetchRequest):
            gen.open_ids.extend(op.op_id for op in request.prefetches)
        for lst, keep in ((gen.open_ids, 64), (gen.load_ids, 16), (gen.written, 64)):
            del lst[:-keep]
        self.local_gen.load_ids[:] = gen.load_ids
        self.local_gen.written[:] = gen.written

    async def round(self, sent: list[tuple[str, bytes]], raw: list[bool]) -> None:
        outcomes = await asyncio.gather(*(rank.call(rpc, data) for rank, (rpc, data) in zip(self.ranks, sent)))
        if any(o.reason == "PEER_LOST" for o in outcomes):  # the domain is broken for good: stop here
            self.check_round(sent, list(outcomes))
            raise RuntimeError(f"the domain broke at step {self.step}: {outcomes[0].message}")
        for (rpc, _), outcome, is_raw in zip(sent, outcomes, raw):
            self.report.count(rpc, outcome, is_raw)
        refused = self.check_round(sent, list(outcomes))
        self.learn(sent, list(outcomes))
        for i, (s, o) in enumerate(zip(sent, outcomes)):
            self.last_requests[i] = (s[0], s[1], o)
            self.recent[i].append(s[1])
            del self.recent[i][:-128]
        await self.check_digest(sent[0][0], refused, f"step {self.step}")

    def next_step(self) -> int:
        pick = self.rng.random()
        gap = 1 if pick < 0.9 else self.rng.randint(2, 1000) if pick < 0.995 else self.rng.randint(1, 2**40)
        self.step += gap
        return self.step

    async def local_step_check(self, rank: int, rpc: str, data: bytes, expect: set[str], reason: str | None,
                               raw: bool = False) -> Outcome:
        outcome = await self.ranks[rank].call(rpc, data)
        self.report.count(rpc, outcome, raw)
        self.check_status(rpc, outcome, data)
        if outcome.reason == "PEER_LOST":
            raise RuntimeError(f"the domain broke at step {self.step}: {outcome.message}")
        if outcome.code not in expect or (reason and outcome.reason != reason):
            self.report.violation("wrong answer to a step taking no round", rpc,
                                  f"expected {sorted(expect)} {reason or ''}, got {outcome.code} {outcome.reason}: "
                                  f"{short(outcome.message)}", data)
        return outcome

    async def decision_once(self, method: str) -> None:
        r, gen, n = self.rng, self.gen, len(self.ranks)
        pick = r.random()
        if pick < 0.05:  # a step number out of range, one rank: no round
            request = gen.decision(method, r.choice([0, 2**63, 2**63 + 1, 2**64 - 1]))
            await self.local_step_check(r.randrange(n), method, request.SerializeToString(), {"INVALID_ARGUMENT"},
                                        None)
            return
        if pick < 0.09 and self.step > 0:  # a stale step number, not a retry: no round
            stale = r.choice([self.step, max(1, self.step - r.randint(1, 100)), 1])
            request = gen.decision(method, stale)
            rank = r.randrange(n)
            data = request.SerializeToString()
            if data in self.recent[rank]:  # a retry of a kept step (the daemon keeps 64): its kept outcome
                return
            await self.local_step_check(rank, method, data, {"FAILED_PRECONDITION", "INVALID_ARGUMENT"}, None)
            return
        if pick < 0.12 and self.last_requests[0] is not None:  # a retry: the kept outcome
            rank = r.randrange(n)
            kept = self.last_requests[rank]
            assert kept is not None  # every rank has sent one once rank 0 has
            rpc, data, before = kept
            if rpc != method:
                return
            outcome = await self.ranks[rank].call(rpc, data)
            self.report.count(rpc, outcome)
            self.check_status(rpc, outcome, data)
            if (outcome.code, outcome.reply) != (before.code, before.reply):
                self.report.violation("retry answered differently", rpc,
                                      f"first {before.code} {short(before.message)}, then {outcome.code} "
                                      f"{short(outcome.message)}", data)
            return
        prev = self.step
        step = self.next_step()
        if pick < 0.27:  # identical raw bytes on every rank
            data = self.raw_for(method, step)
            if data is None:
                self.step = prev
                return
            request = parse(method, data)
            sent = [(method, data)] * n
            if request is None:
                self.step = prev  # no rank takes it
                outcomes = await asyncio.gather(*(rank.call(method, data) for rank in self.ranks))
                for o in outcomes:
                    self.report.count(method, o, raw=True)
                    if o.ok:
                        self.report.violation("undecodable request accepted", method, "OK", data)
                    elif o.code in ("UNKNOWN", "INTERNAL"):
                        self.report.violation("undocumented status (undecodable bytes)", method,
                                              f"{o.code}: {short(o.message)}", data)
                return
            if request.step != step:
                if prev < request.step <= MAX_STEP:
                    self.step = request.step
                    await self.round(sent, [True] * n)  # a fresh step after all
                    return
                self.step = prev
                expect = {"INVALID_ARGUMENT"} if not 0 < request.step <= MAX_STEP else {"FAILED_PRECONDITION"}
                for rank in range(n):
                    await self.local_step_check(rank, method, data, expect, None, raw=True)
                return
            await self.round(sent, [True] * n)
            return
        hostile = gen.decision(method, step).SerializeToString()
        if pick < 0.55:  # the same hostile request everywhere
            sent = [(method, hostile)] * n
        elif pick < 0.85:  # hostile on one rank, valid on the others
            bad = r.randrange(n)
            sent = [(method, hostile) if i == bad else self.benign(step) for i in range(n)]
        else:  # different hostile requests
            sent = [(method, hostile)] + [(method, gen.decision(method, step).SerializeToString())
                                          for _ in range(n - 1)]
        await self.round(sent, [False] * n)

    def raw_for(self, method: str, step: int) -> bytes | None:
        """Raw bytes whose step, when they decode at all, cannot use up the step space."""
        template = self.gen.decision(method, step).SerializeToString()
        for _ in range(8):
            data = self.gen.raw(template)
            request = parse(method, data)
            if request is None or request.step == 0 or request.step > MAX_STEP or request.step <= step + 2**32:
                return data
        return None

    async def decision_phase(self) -> None:
        left = {m: self.per_rpc for m in DECISIONS}
        while any(v > 0 for v in left.values()):
            method = self.rng.choice([m for m, v in left.items() if v > 0])
            before = self.report.sent[method]
            await self.decision_once(method)
            left[method] -= self.report.sent[method] - before

    # -- whole run

    async def attach_valid(self, run_dir: Path) -> None:
        self.pools = [DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES) for _ in self.clients]
        # Attach is agreed across the domain: every rank at once.
        await asyncio.gather(*(c.attach("fuzz-model", GEOMETRY, DEVICE_PAGES, pool_fd=p.fd)
                               for c, p in zip(self.clients, self.pools)))
        self.attached = True

    async def finish(self) -> None:
        """The daemons still serve; a valid step, then the last one there is, answered alike."""
        for rank, client in enumerate(self.clients):
            status = await client.status()
            if status.state != "serving" or status.failure:
                self.report.violation("not serving at the end", "Status", f"rank {rank}: {status}")
            health = await client.health()
            if health != health_pb2.HealthCheckResponse.SERVING:
                self.report.violation("not healthy at the end", "Health", f"rank {rank}: {health}")
        for step in (self.step + 1, MAX_STEP):
            request = pb.StepRequest(step=step)
            request.votes.op_ids.append(self.gen.fresh_id())
            request.votes.reduces.append(pb.REDUCE_MIN)
            request.votes.values.append(5)
            data = request.SerializeToString()
            outcomes = await asyncio.gather(*(rank.call("Step", data) for rank in self.ranks))
            if not all(o.ok for o in outcomes) or len({o.reply for o in outcomes}) != 1:
                self.report.violation("final valid step failed", "Step",
                                      "; ".join(f"{o.code} {short(o.message)}" for o in outcomes), data)
            self.step = step
        digests = await self.digests()
        if len(set(digests)) != 1:
            self.report.violation("digests differ at the end", "Stats", str(digests))

    async def run(self, run_dir: Path) -> Report:
        attach_dir = run_dir / "attach"
        attach_dir.mkdir()
        (attach_dir / "dir").mkdir()
        (attach_dir / "empty").touch()
        # Attach while nothing is attached (half), then everything else while the rounds run.
        await self._locals({"Attach": self.per_rpc // 2})
        await self.attach_valid(run_dir)
        quotas = {rpc: self.per_rpc - (self.per_rpc // 2 if rpc == "Attach" else 0) for rpc in LOCALS}
        local = asyncio.ensure_future(self._locals(quotas))
        try:
            await self.decision_phase()
        finally:
            await local
        await self.finish()
        return self.report

    async def _locals(self, quotas: dict[str, int]) -> None:
        """Send `quotas[rpc]` requests of each RPC, CONCURRENCY at a time."""
        left = dict(quotas)
        while any(left.values()):
            batch: list[Any] = []
            while len(batch) < CONCURRENCY and any(left.values()):
                rpc = self.local_gen.r.choice([r for r, n in left.items() if n])
                left[rpc] -= 1
                batch.append(rpc)
            await self.local_batch(batch)

    async def close(self) -> None:
        for rank in self.ranks:
            await rank.close()
        for client in self.clients:
            await client.close()


async def fuzz(per_rpc: int, seed: int, known_bugs: bool = True, run_dir: Path | None = None) -> Report:
    """One fuzz run against a fresh two-rank domain; returns its report.
    `known_bugs=False` leaves out requests that hit bugs already reported
    (Attach with a CUDA IPC handle on a host without CUDA)."""
    started = time.monotonic()
    own = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="cpf-")) if run_dir is None else run_dir
    try:
        spec = DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=AGREEMENT_TIMEOUT_S,
                          extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=HOST_PAGES,
                                     prefetch_threshold_tokens=0))
        async with LocalDomain(spec) as domain:
            session = Fuzz(domain, run_dir, per_rpc, seed, known_bugs)
            try:
                report = await session.run(run_dir)
            except Exception as exc:
                report = session.report
                report.violation("fuzz aborted", "-", f"{type(exc).__name__}: {short(exc)}\n"
                                 + "\n".join(domain.log_tail(r, 15) for r in range(domain.size)))
            finally:
                await session.close()
            codes = await domain.stop()
            if any(code != 0 for code in codes):
                report.violation("unclean exit", "-", f"exit codes {codes}\n"
                                 + "\n".join(domain.log_tail(r, 15) for r in range(domain.size)))
    finally:
        if own:
            shutil.rmtree(run_dir, ignore_errors=True)
    report.wall_s = time.monotonic() - started
    return report


def _print(report: Report) -> None:
    d = report.as_dict()
    print(f"cpcache fuzz: seed {d['seed']}, {d['per_rpc']} per RPC, {d['wall_s']} s, {d['rounds']} rounds "
          f"({d['accepted_rounds']} accepted, {d['rejected_rounds']} refused)")
    for rpc, row in d["rpcs"].items():
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(row["statuses"].items()))
        print(f"  {rpc:10} sent {row['sent']:6} (raw {row['raw']:5})  {statuses}")
    print(f"violations: {len(d['violations'])} ({d['unknown_violations']} not known before)")
    for tag, n in d["known_bugs"].items():
        if n:
            print(f"  known bug {tag}: {n}x ({KNOWN_BUGS[tag]})")
    for v in [v for v in d["violations"] if v["known"] is None][:20]:
        print(f"  - {v['kind']} [{v['rpc']}]: {v['detail'][:400]}")


async def main(args: argparse.Namespace) -> int:
    report = await fuzz(args.per_rpc, args.seed)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        _print(report)
    sys.stdout.flush()
    return 0 if not report.violations else 1
