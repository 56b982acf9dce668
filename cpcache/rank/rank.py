"""One rank wired together, without gRPC: what the daemon's servicer calls.

A `Rank` decides in its domain's current epoch (`epochs.Formation`), attaches
device pools (`attach.Attacher`) and answers the calls that read this
rank's cache: `step`, `attach`, `match`, `wait_loads`, `stats`. It checks
what it is asked (the wire layer only converts messages) and raises the
library's errors. Touched from the event loop only.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from cpcache.agreement.bounded import StoreTimeout, bounded_async
from cpcache.agreement.rounds import Questions
from cpcache.config import DaemonConfig
from cpcache.errors import (
    CacheError,
    EpochEnded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PeerLost,
    Unavailable,
)
from cpcache.rank.assembly import CacheRuntime
from cpcache.rank.attach import Attacher
from cpcache.rank.epochs import Formation
from cpcache.rank.phases import StepPhases
from cpcache.rank.standing import RankHost, Standing
from cpcache.rank.stats import RankStats
from cpcache.rank.stepper import StepAnswer, Stepper
from cpcache.requests import CacheRequests, check_page_hashes
from cpcache.topology import Topology

MAX_WAIT_S = 3600.0  # the longest a WaitLoads may ask to wait


class Rank:
    def __init__(self, config: DaemonConfig, host: RankHost) -> None:
        self.config = config
        self.formation = Formation(config, host)
        self.attacher = Attacher(config, self.formation)

    @property
    def epoch(self) -> int:
        return self.formation.epoch

    @property
    def standing(self) -> Standing:
        return self.formation.standing

    @property
    def domain_ranks(self) -> tuple[int, ...]:
        return tuple(self.formation.domain.ranks)

    @property
    def failure(self) -> CacheError | None:
        engine = self.formation.engine
        return engine.failure if engine is not None else None

    @property
    def attached(self) -> bool:
        stepper = self.formation.stepper
        return stepper is not None and stepper.runtime is not None

    # -- decisions --------------------------------------------------------------

    def admit(self) -> Stepper:
        """The stepper deciding now; `Unavailable` (or the engine's failure) if none is."""
        return self.formation.admit()

    def attached_runtime(self) -> CacheRuntime:
        """The attached cache, while decisions are taken."""
        runtime = self.admit().runtime
        if runtime is None:
            raise FailedPrecondition("no device pool is attached: call Attach first")
        return runtime

    async def step(self, step: int, votes: Questions, requests: CacheRequests = CacheRequests(), *,
                   invalid: CacheError | None = None, request_digest: int = 0, epoch: int | None = None
                   ) -> tuple[StepAnswer, StepPhases]:
        """One scheduler step (`Stepper.step`), in the current epoch.
        `epoch`: the one the scheduler's session opened in (None: unchecked). A
        retry of a step that epoch took gets its kept answer, even once the
        epoch has ended; any other step of an ended epoch opens nothing.
        -> the answer, and the phases of the stepper that gave it (where the
        caller adds its own)."""
        ended = self.formation.recent.get(epoch) if epoch is not None else None
        if ended is not None and 0 < step <= ended.last_step:
            stepper = ended
        else:
            stepper = self.admit()
            if epoch is not None and stepper.epoch != epoch:
                raise EpochEnded(f"step {step} belongs to a session of epoch {epoch}, which has ended on rank "
                                 f"{self.config.rank} (it serves epoch {stepper.epoch}): attach again")
        answer = await stepper.step(step, votes, requests, invalid=invalid, request_digest=request_digest)
        return answer, stepper.phases

    def outcome(self, epoch: int, step: int, fence_for: int | None = None) -> asyncio.Future[StepAnswer]:
        """What step `step` of epoch `epoch` answers here (`Stepper.kept`);
        `Unavailable` when this rank cannot tell (it keeps no such epoch).
        `fence_for`: the asking scheduler's rank (-1: unknown), whose daemon is gone. A step
        this rank has not taken then fails here for good (`Stepper.fence`), so
        that no round of it completes later, and this rank leaves the epoch
        (its peer's daemon is gone): the answer is that failure."""
        stepper = self.formation.recent.get(epoch)
        if stepper is None:
            raise Unavailable(f"rank {self.config.rank} keeps no epoch {epoch} (it serves epoch {self.epoch}, and "
                              f"keeps {sorted(self.formation.recent)}): it cannot tell how step {step} ended")
        if fence_for is not None and not self.config.agreement_lag:
            asker = f"rank {fence_for}" if fence_for >= 0 else "a peer"
            failure = PeerLost(f"step {step} of epoch {epoch} failed: the daemon of {asker} is gone and its scheduler "
                               f"asked how the step ended before rank {self.config.rank} took it",
                               (fence_for,) if fence_for >= 0 else ())
            if stepper.fence(step, failure) and stepper is self.formation.stepper:
                self.formation.reform_soon(f"the daemon of {asker} is gone (step {step} fenced)")
        return stepper.kept(step)

    def check_scheduler(self, scheduler: Topology, scheduler_rank: int) -> None:
        """The scheduler attaching declared its topology: refuse it unless
        it is this daemon's, and it is this daemon's rank."""
        differs = self.config.topology.scheduler_mismatch(self.config.rank, scheduler, scheduler_rank)
        if differs:
            raise FailedPrecondition(
                f"attach: the scheduler's topology is not this daemon's: {differs}; start the daemons with "
                "the scheduler's sizes (cpcache launch --tp/--cp/--dp/--pp) and connect rank r to rank r's socket")

    async def match(self, pages: Sequence[bytes], host_only: bool = False) -> tuple[int, int]:
        """How many leading `pages` the host pool holds, and storage (0
        when `host_only`): a storage that does not answer within
        `storage_timeout_s` is `Unavailable`."""
        runtime = self.attached_runtime()
        pages = list(pages)
        check_page_hashes(pages, "match")
        host = runtime.state.match(pages)
        backend = runtime.io.storage
        if backend is None or not pages or host_only:
            return host, 0
        keys = list(runtime.state.ledger.sharding.storage_keys(pages))
        timeout_s = runtime.io.storage_timeout_s
        try:
            # On the storage executor (never the loop's default pool, which
            # exit waits for); a call still queued at the deadline is dropped.
            storage = await bounded_async(lambda: backend.exists_prefix(keys), timeout_s, "match",
                                          start=runtime.io.run_storage_call)
        except StoreTimeout:
            raise Unavailable(f"match: storage did not answer within storage_timeout_s ({timeout_s:g}s)") from None
        except RuntimeError as exc:  # the storage executor is shut down: the daemon is stopping
            raise Unavailable(f"match: storage is closed ({exc})") from None
        return host, storage

    async def wait_loads(self, op_ids: Sequence[int], timeout_s: float) -> None:
        """Wait until this rank's copies of the loads `op_ids` have ended
        (0: no limit); `Unavailable` if one failed or the time ran out."""
        runtime = self.attached_runtime()
        if not (math.isfinite(timeout_s) and 0 <= timeout_s <= MAX_WAIT_S):
            raise InvalidArgument(f"timeout_s must be between 0 and {MAX_WAIT_S:.0f} seconds")
        futures = []
        for op_id in op_ids:
            job = runtime.io.load_future(op_id)
            if job is None:
                raise NotFound(f"load {op_id} is not in flight on this rank")
            futures.append(asyncio.wrap_future(job))
        timeout = timeout_s or None
        try:
            results = await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in futures)), timeout)
        except TimeoutError:
            raise Unavailable(f"loads {list(op_ids)} did not finish within {timeout}s") from None
        failed = [op_id for op_id, result in zip(op_ids, results) if not result.success]
        if failed:
            raise Unavailable(f"loads {failed} failed on this rank; the step that ends them reports them in "
                              f"load_failures")

    def stats(self) -> RankStats:
        return RankStats.of(self.formation.engine, self.formation.stepper)
