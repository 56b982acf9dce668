"""`cpcache bench soak`: a million agreed decisions through four real daemons
with faults injected on every side, checking at every step that the ranks
agree and that every page loaded back holds the bytes written.

One domain of 4 ranks (TP 4 x CP 2: attention TP 2 x CP 2) on the file
backend, each rank with its own injected faults (storage delays and
failures, device <-> host copy delays and failures, round delays). One
driver process plays the replicated scheduler: each step sends the same
`Step` to all ranks at once, carrying many votes (rank-dependent values, MIN
or MAX: each agreed vote is one decision) and a mix of cache operations
(write-throughs of device pages with known content, load-backs of pages the
host index holds, prefetches of chains written earlier, polls, revokes).

Scheduler-side faults are injected too:

- cancelled calls: one rank's call gets a 1 ms deadline, then the same step
  is sent again (same step, same bytes); its reply must be byte-identical to
  the other ranks';
- one-rank rejections: one rank gets the step with a repeated vote id; it
  must answer `InvalidArgument`, every other rank `RejectedByPeer` naming it.

Checked every step: replies byte-identical on every rank (`divergences`),
agreed values equal to the MIN/MAX of what the ranks sent
(`wrong_decisions`), no call longer than `HANG_S` (`hangs`), and, after each
acknowledged load and `WaitLoads`, the target device pages of every rank
hold exactly the bytes that rank wrote (`wrong_bytes`, in pages). Copy and
storage failures come back as `write_failures` / `load_failures` / short
prefetches: legitimate, counted in the cache operations' tally (`cache`),
which the one scheduler-side session keeps (`cpcache.client.SchedulerSession`:
the driver collects each step's operations there and follows the agreed
reply there).

Exit status 0 iff divergences, hangs, wrong bytes, wrong decisions and
unexpected errors are all 0.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cpcache import errors
from cpcache.client import AsyncClient, CacheRequests, SchedulerSession, StepResult
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec
from cpcache.testing.sim.pages import page_content, read_page, write_page
from cpcache.testing.soak_report import SoakReport, print_progress
from cpcache.topology import Topology
from cpcache.values import Reduce

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
TOPOLOGY = Topology(tp=4, cp=2)
HANG_S = 30.0  # a call (or a step's calls together) longer than this is a hang
HASTY_S = 0.001  # the deadline of a call cancelled at once (it may not even reach the daemon)
MID_ROUND_S = 0.05  # the deadline of a call cancelled while its daemon waits in the round for its peers
VALUE_BOUND = 1 << 62
BIG_VOTES = (1024, 4096)  # the vote count of a big step: uniform in this range

# Faults per rank: (storage delay ms, storage fail rate, copy delay ms, copy fail rate, round delay ms).
RANK_FAULTS = {
    0: (0.0, 0.0, 0.0, 0.0, 0.0),
    1: (5.0, 0.02, 1.0, 0.01, 0.5),
    2: (20.0, 0.05, 3.0, 0.02, 0.0),
    3: (2.0, 0.01, 0.5, 0.005, 1.0),
}


@dataclass
class SoakConfig:
    decisions: int = 1_000_000
    seed: int = 1
    votes_per_step: int = 48  # ordinary steps carry 1 .. 2*this-1 votes (mean: this)
    big_every: int = 64  # one step in this many (on average) carries BIG_VOTES votes: the vector grows, then shrinks
    device_pages: int = 512
    host_pool_pages: int = 192
    cancel_every: int = 29  # on average, one step in this many has one rank's call cancelled
    reject_every: int = 31  # on average, one step in this many is rejected by one rank
    writes_per_step: int = 2  # at most
    loads_per_step: int = 2  # at most
    prefetch_every: int = 3
    revoke_every: int = 4  # one open prefetch in this many is revoked rather than polled
    max_chain: int = 6  # pages per written chain: 1..max_chain
    run_dir: Path | None = None


def rank_spec(run_dir: Path, seed: int, host_pool_pages: int) -> DomainSpec:
    per_rank = {
        rank: dict(fault_storage_delay_ms=sd, fault_storage_fail_rate=sf, fault_copy_delay_ms=cd,
                   fault_copy_fail_rate=cf, fault_delay_ms=rd, fault_seed=seed * 100 + rank)
        for rank, (sd, sf, cd, cf, rd) in RANK_FAULTS.items()
    }
    return DomainSpec(TOPOLOGY, run_dir, agreement_timeout_s=10.0,
                      extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=host_pool_pages,
                                 prefetch_threshold_tokens=GEOMETRY.page_size),
                      per_rank=per_rank)


class ReplicatedScheduler:
    """The replicated scheduler: one model of the cache operations, sent
    alike to every rank; per-rank device pools with per-rank page bytes."""

    def __init__(self, cfg: SoakConfig, domain: LocalDomain, run_dir: Path) -> None:
        self.cfg = cfg
        self.domain = domain
        self.run_dir = run_dir
        self.rng = random.Random(cfg.seed)
        self.nprng = np.random.default_rng(cfg.seed)
        self.t = SoakReport()
        self.session = SchedulerSession()  # one model of the cache operations, sent alike to every rank
        self.t.cache = self.session.tally
        self.votes_sent = 0
        self.ranks = domain.size
        self.clients: list[AsyncClient] = []
        self.hasty: list[AsyncClient] = []
        self.mid_round: list[AsyncClient] = []
        self.pools: list[DevicePool] = []
        self.suffixes: list[str] = []
        self.next_chain = 0
        self.free = list(range(cfg.device_pages - 1, -1, -1))
        # Loads the last reply agreed, to check: (op, pages, targets, chain).
        self.landed: list[tuple[int, list[bytes], list[int], list[bytes]]] = []
        self.known: list[list[bytes]] = []  # chains acknowledged once (host, then perhaps storage)
        self.busy: set[bytes] = set()  # pages of chains an open operation names
        op_ids = np.arange(1, BIG_VOTES[1] + 1, dtype=np.int64)
        self.vote_ids = op_ids.tolist()  # a step's votes are the first n of these
        self.vote_reduces = [Reduce.MIN if op % 2 else Reduce.MAX for op in self.vote_ids]
        self.is_min = (op_ids % 2 == 1)

    # -- setup -------------------------------------------------------------------

    async def attach(self) -> None:
        for socket in self.domain.sockets:
            self.pools.append(DevicePool.create_sealed(GEOMETRY, self.cfg.device_pages))
            self.clients.append(AsyncClient(socket, timeout_s=HANG_S))
        # Attach is agreed across the domain: every rank at once.
        await asyncio.gather(*(c.attach("soak", GEOMETRY, self.cfg.device_pages, pool_fd=p.fd)
                               for c, p in zip(self.clients, self.pools)))
        for rank, socket in enumerate(self.domain.sockets):
            self.hasty.append(AsyncClient(socket, timeout_s=HASTY_S))
            self.mid_round.append(AsyncClient(socket, timeout_s=MID_ROUND_S))
            c = TOPOLOGY.coordinates(rank)
            self.suffixes.append(ShardingSpec(cp_rank=c.cp, cp_size=TOPOLOGY.cp, tp_rank=c.atp,
                                              tp_size=TOPOLOGY.atp).suffix())

    async def close(self) -> None:
        for client in (*self.clients, *self.hasty, *self.mid_round):
            await client.close()

    # -- device pages ----------------------------------------------------------------

    def _content(self, rank: int, page: bytes) -> np.ndarray:
        return page_content(f"{page.hex()}_{self.suffixes[rank]}", GEOMETRY.page_bytes)

    def _scribble(self, rank: int, device_page: int) -> None:
        """Garbage in a load target, so a load that did not land shows."""
        write_page(self.pools[rank], device_page, np.full(GEOMETRY.page_bytes, 0xA5, dtype=np.uint8))

    # -- one step's content --------------------------------------------------------------

    def _new_chain(self) -> list[bytes]:
        self.next_chain += 1
        n = self.rng.randint(1, self.cfg.max_chain)
        return [hashlib.sha256(f"soak-{self.cfg.seed}-{self.next_chain}-{i}".encode()).digest() for i in range(n)]

    async def _plan_ops(self) -> None:
        """This step's cache operations, collected in the session."""
        cfg, rng, session = self.cfg, self.rng, self.session
        for op_id in session.open_prefetches():
            if rng.randrange(cfg.revoke_every) == 0:
                session.revoke(op_id)
            else:
                session.poll(op_id)
        for _ in range(rng.randint(0, cfg.writes_per_step)):
            chain = self._new_chain()
            if len(self.free) < len(chain) + 8:
                break
            sources = [self.free.pop() for _ in chain]
            for rank in range(self.ranks):
                for page, d in zip(chain, sources):
                    write_page(self.pools[rank], d, self._content(rank, page))
            session.write_through(chain, sources, done=functools.partial(self._written, chain, sources))
            self.busy.update(chain)
        candidates = [c for c in self.known[-64:] if not self.busy.intersection(c)]
        rng.shuffle(candidates)
        for chain in candidates[: rng.randint(0, cfg.loads_per_step)]:
            # The host index is shared state: any rank's answer is every rank's.
            host = (await self.clients[rng.randrange(self.ranks)].match(chain)).host_pages
            if host == 0 or len(self.free) < host:
                continue
            pages = chain[:host]
            targets = [self.free.pop() for _ in pages]
            for rank in range(self.ranks):
                for d in targets:
                    self._scribble(rank, d)
            self._load(pages, targets, chain)
            self.busy.update(chain)
        candidates = [c for c in self.known[-256:] if not self.busy.intersection(c)]
        if candidates and rng.randrange(cfg.prefetch_every) == 0:
            chain = rng.choice(candidates)
            host = (await self.clients[0].match(chain)).host_pages
            if host < len(chain):
                rest = chain[host:]
                parent = chain[host - 1] if host else None
                session.prefetch(rest, len(rest) * GEOMETRY.page_size, parent,
                                 done=functools.partial(self._prefetched, chain))
                self.busy.update(chain)

    def _load(self, pages: list[bytes], targets: list[int], chain: list[bytes]) -> None:
        def landed(ok: bool) -> None:
            if ok:  # checked once every rank's copy is waited for
                self.landed.append((op, pages, targets, chain))
            else:  # failed on some rank, or never taken
                self.free.extend(targets)
                self.busy.difference_update(chain)

        op = self.session.load(pages, targets, done=landed)

    def _prefetched(self, chain: list[bytes], _pages: int) -> None:
        self.busy.difference_update(chain)

    def _written(self, chain: list[bytes], sources: list[int], stored: bool) -> None:
        """A write-through ended (or was never taken): its device pages are free again."""
        self.free.extend(sources)
        self.busy.difference_update(chain)
        if stored:
            self.known.append(chain)

    def _votes(self) -> tuple[list[list], np.ndarray]:
        """This step's votes: the same questions on every rank, rank-dependent
        values; and the agreed value each must get."""
        cfg = self.cfg
        if cfg.big_every and self.rng.randrange(cfg.big_every) == 0:
            n = self.rng.randint(*BIG_VOTES)
        else:
            n = self.rng.randint(1, 2 * cfg.votes_per_step - 1)
        self.votes_sent += n
        self.t.max_votes_per_step = max(self.t.max_votes_per_step, n)
        values = self.nprng.integers(-VALUE_BOUND, VALUE_BOUND, size=(self.ranks, n), dtype=np.int64)
        expected = np.where(self.is_min[:n], values.min(axis=0), values.max(axis=0))
        ids, reduces = self.vote_ids[:n], self.vote_reduces[:n]
        per_rank = [list(zip(ids, reduces, row.tolist())) for row in values]
        return per_rank, expected

    # -- one step -------------------------------------------------------------------

    async def _retrying(self, rank: int, step: int, votes: list[tuple[int, Reduce, int]],
                        requests: CacheRequests) -> StepResult:
        """A call cancelled by its deadline, then the same request again."""
        try:
            return await self.hasty[rank].step(step, votes, requests)
        except errors.Unavailable:
            self.t.cancelled_calls += 1
        self.t.retried_steps += 1
        return await self.clients[rank].step(step, votes, requests)

    async def step(self) -> None:
        cfg, rng, t = self.cfg, self.rng, self.t
        t.steps += 1
        inject = rng.randrange(cfg.cancel_every * cfg.reject_every)
        reject_rank = rng.randrange(self.ranks) if inject < cfg.cancel_every else None
        cancel_rank = rng.randrange(self.ranks) if reject_rank is None and inject % cfg.cancel_every == 1 else None
        if reject_rank is None:  # a rejected step opens nothing: the cache work waits for later steps
            await self._plan_ops()
        step, requests = self.session.next_step()
        votes, expected = self._votes()
        if cancel_rank is not None and rng.randrange(2):
            # This rank's call goes first, alone: its daemon enters the round and
            # waits for peers that have not been sent anything, until the
            # call's deadline cancels it. Then every rank, that one retrying.
            try:
                early = await self.mid_round[cancel_rank].step(step, votes[cancel_rank], requests)
                t.unexpected_errors += 1
                t.note(f"step {step}: rank {cancel_rank} answered round {early.round} before its peers had the step")
            except errors.Unavailable:
                t.cancelled_calls += 1
                t.cancelled_mid_round += 1
            cancel_rank = None
            t.retried_steps += 1
        calls: list[Awaitable[StepResult]] = []
        for rank, client in enumerate(self.clients):
            mine = votes[rank]
            if rank == reject_rank:
                mine = mine + [mine[0]]  # a vote id twice: this rank refuses the step
            if rank == cancel_rank:
                calls.append(self._retrying(rank, step, mine, requests))
            else:
                calls.append(client.step(step, mine, requests))
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG_S * 2)
        except TimeoutError:
            t.hangs += 1
            t.note(f"step {step}: no answer from every rank within {HANG_S * 2:.0f}s")
            raise
        if reject_rank is not None:
            self._check_rejection(step, reject_rank, results)
            return
        failed = [(r, x) for r, x in enumerate(results) if isinstance(x, BaseException)]
        if failed:
            for rank, exc in failed:
                if isinstance(exc, errors.Divergence):
                    t.divergences += 1
                elif isinstance(exc, errors.Unavailable) and "Deadline" in str(exc):
                    t.hangs += 1
                else:
                    t.unexpected_errors += 1
                t.note(f"step {step} rank {rank}: {type(exc).__name__}: {exc}")
            self.session.not_taken(requests)
            return
        replies = [r for r in results if isinstance(r, StepResult)]
        if len({r.wire for r in replies}) != 1:
            t.divergences += 1
            t.note(f"step {step}: replies differ across ranks")
            return
        t.accepted_steps += 1
        reply = replies[0]
        ids = self.vote_ids[: len(expected)]
        got = np.fromiter((reply.decisions.get(op, 0) for op in ids), dtype=np.int64, count=len(ids))
        wrong = int(np.count_nonzero(got != expected)) + abs(len(reply.decisions) - len(ids))
        if wrong:
            t.wrong_decisions += wrong
            t.note(f"step {step}: {wrong} agreed values differ from MIN/MAX of the votes")
        t.decisions += len(reply.decisions)
        self.session.follow(reply)
        await self._check_loads()

    def _check_rejection(self, step: int, rank: int, results: list[StepResult | BaseException]) -> None:
        t = self.t
        own = results[rank]
        good = isinstance(own, errors.InvalidArgument)
        for r, x in enumerate(results):
            if r != rank:
                good = good and isinstance(x, errors.RejectedByPeer) and x.rank == rank \
                    and x.peer_status == "INVALID_ARGUMENT"
        if good:
            t.injected_rejections += 1
            return
        if any(isinstance(x, errors.Divergence) for x in results):
            t.divergences += 1
        else:
            t.unexpected_errors += 1
        t.note(f"step {step}: rank {rank} rejected, answers: {[type(x).__name__ for x in results]} "
               f"{[str(x)[:200] for x in results if isinstance(x, BaseException)]}")

    async def _check_loads(self) -> None:
        """The loads the last reply agreed: once every rank's copy is waited
        for, every rank's target pages must hold that rank's bytes."""
        landed, self.landed = self.landed, []
        if not landed:
            return
        done = [op for op, *_ in landed]
        await asyncio.wait_for(asyncio.gather(*(c.wait_loads(done, timeout_s=HANG_S) for c in self.clients)),
                               HANG_S + 10)
        t = self.t
        for op_id, pages, targets, chain in landed:
            for rank in range(self.ranks):
                for page, d in zip(pages, targets):
                    if not np.array_equal(read_page(self.pools[rank], d), self._content(rank, page)):
                        t.wrong_bytes += 1
                        t.note(f"load {op_id}: rank {rank} device page {d} holds wrong bytes")
                    t.verified_pages += 1
            self.free.extend(targets)
            self.busy.difference_update(chain)


async def soak(cfg: SoakConfig, progress: Callable[[SoakReport, float], None] | None = None) -> SoakReport:
    """Run the soak; returns its report."""
    own_dir = cfg.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="cpsoak-")) if cfg.run_dir is None else cfg.run_dir
    started = time.perf_counter()
    async with LocalDomain(rank_spec(run_dir, cfg.seed, cfg.host_pool_pages)) as domain:
        driver = ReplicatedScheduler(cfg, domain, run_dir)
        await driver.attach()
        t = driver.t
        loop_started = time.perf_counter()
        last_report = loop_started
        try:
            while t.decisions < cfg.decisions:
                await driver.step()
                if t.hangs or t.unexpected_errors > 20:
                    break
                if progress is not None and time.perf_counter() - last_report > 10:
                    last_report = time.perf_counter()
                    progress(t, last_report - loop_started)
        except TimeoutError:
            pass  # counted as a hang
        finally:
            elapsed = time.perf_counter() - loop_started
            await driver.close()
    t.wall_s = round(time.perf_counter() - started, 2)
    t.decisions_per_s = round(t.decisions / elapsed, 1) if elapsed else 0.0
    t.steps_per_s = round(t.steps / elapsed, 2) if elapsed else 0.0
    t.votes_per_step = round(driver.votes_sent / t.steps, 1) if t.steps else 0.0
    if own_dir and t.ok:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    elif not t.ok:
        t.note(f"daemon logs kept in {run_dir}")
    return t


async def main(args: argparse.Namespace) -> int:
    cfg = SoakConfig(decisions=args.decisions, seed=args.seed)
    t = await soak(cfg, None if args.json else print_progress)
    out = asdict(t)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"soak: {t.decisions} agreed decisions in {t.steps} steps ({t.wall_s:.1f} s, "
              f"{t.decisions_per_s:.0f} decisions/s)")
        for key, value in out.items():
            if key not in ("first_errors",):
                print(f"  {key:22s} {value}")
        for line in t.first_errors:
            print(f"  ! {line}")
        print("OK" if t.ok else "FAILED")
    return 0 if t.ok else 1
