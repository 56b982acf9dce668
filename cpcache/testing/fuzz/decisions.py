"""Steps (the one decision RPC): one step number, strictly increasing, sent to
every rank (the same hostile request everywhere, a hostile request on one
rank and a valid one on the others, two different hostile ones, identical
raw bytes), and out-of-range, stale and retried step numbers to one rank
only. Each round is checked: accepted everywhere with
byte-identical replies or refused everywhere, the cache digest the same on
every rank and unchanged by a refused step."""

from __future__ import annotations

import asyncio
import random

from cpcache.client import AsyncClient
from cpcache.testing.fuzz.generate import Gen
from cpcache.testing.fuzz.report import Report
from cpcache.testing.fuzz.wire import DECISIONS, MAX_STEP, CallOutcome, RankChannel, parse, short
from cpcache.v1 import daemon_pb2 as pb


class DecisionRounds:
    """The decision rounds of one fuzz run, and what they left open (ids
    that later polls, revokes, loads and waits aim at)."""

    def __init__(self, ranks: list[RankChannel], clients: list[AsyncClient], report: Report, seed: int,
                 gen: Gen, local_gen: Gen) -> None:
        self.ranks = ranks
        self.clients = clients
        self.report = report
        self.rng = random.Random(seed)
        self.gen = gen
        self.local_gen = local_gen
        self.step = 0  # the last step number any rank took
        self.last_requests: list[tuple[str, bytes, CallOutcome] | None] = [None] * len(self.ranks)
        self.digest: int | None = None
        self.recent: list[list[bytes]] = [[] for _ in self.ranks]  # requests of the last rounds, per rank

    async def digests(self) -> list[int | None]:
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
        return "Step", pb.StepRequest(step=step).SerializeToString()  # nothing but the step number

    def check_round(self, sent: list[tuple[str, bytes]], outcomes: list[CallOutcome]) -> bool:
        """One round's answers; returns whether the step was refused everywhere."""
        detail = "; ".join(f"rank {i} {rpc} -> {o.code} {o.reason}: {short(o.message)[:300]}"
                           for i, ((rpc, _), o) in enumerate(zip(sent, outcomes)))
        for (rpc, data), outcome in zip(sent, outcomes):
            self.report.check_status(rpc, outcome, data)
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

    def learn(self, sent: list[tuple[str, bytes]], outcomes: list[CallOutcome]) -> None:
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
                               raw: bool = False) -> CallOutcome:
        outcome = await self.ranks[rank].call(rpc, data)
        self.report.count(rpc, outcome, raw)
        self.report.check_status(rpc, outcome, data)
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
            request = gen.decision(r.choice([0, 2**63, 2**63 + 1, 2**64 - 1]))
            await self.local_step_check(r.randrange(n), method, request.SerializeToString(), {"INVALID_ARGUMENT"},
                                        None)
            return
        if pick < 0.09 and self.step > 0:  # a stale step number, not a retry: no round
            stale = r.choice([self.step, max(1, self.step - r.randint(1, 100)), 1])
            request = gen.decision(stale)
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
            self.report.check_status(rpc, outcome, data)
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
            parsed = parse(method, data)
            sent = [(method, data)] * n
            if parsed is None:
                self.step = prev  # no rank takes it
                outcomes = await asyncio.gather(*(rank.call(method, data) for rank in self.ranks))
                for o in outcomes:
                    self.report.count(method, o, raw=True)
                    self.report.check_undecodable(method, o, data)
                return
            if parsed.step != step:
                if prev < parsed.step <= MAX_STEP:
                    self.step = parsed.step
                    await self.round(sent, [True] * n)  # a fresh step after all
                    return
                self.step = prev
                expect = {"INVALID_ARGUMENT"} if not 0 < parsed.step <= MAX_STEP else {"FAILED_PRECONDITION"}
                for rank in range(n):
                    await self.local_step_check(rank, method, data, expect, None, raw=True)
                return
            await self.round(sent, [True] * n)
            return
        hostile = gen.decision(step).SerializeToString()
        if pick < 0.55:  # the same hostile request everywhere
            sent = [(method, hostile)] * n
        elif pick < 0.85:  # hostile on one rank, valid on the others
            bad = r.randrange(n)
            sent = [(method, hostile) if i == bad else self.benign(step) for i in range(n)]
        else:  # different hostile requests
            sent = [(method, hostile)] + [(method, gen.decision(step).SerializeToString())
                                          for _ in range(n - 1)]
        await self.round(sent, [False] * n)

    def raw_for(self, method: str, step: int) -> bytes | None:
        """Raw bytes whose step, when they decode at all, cannot use up the step space."""
        template = self.gen.decision(step).SerializeToString()
        for _ in range(8):
            data = self.gen.raw(template)
            request = parse(method, data)
            if request is None or request.step == 0 or request.step > MAX_STEP or request.step <= step + 2**32:
                return data
        return None

    async def run(self, per_rpc: int) -> None:
        """Send `per_rpc` steps, in a seeded order."""
        left = {m: per_rpc for m in DECISIONS}
        while any(v > 0 for v in left.values()):
            method = self.rng.choice([m for m, v in left.items() if v > 0])
            before = self.report.sent[method]
            await self.decision_once(method)
            left[method] -= self.report.sent[method] - before
