"""Attaching a device pool to a rank (docs/design.md rule 11): the cache is opened
here, then every rank of the domain agrees that all of them attached the
same thing (`agreement.attach`: one agreed attempt, then a confirmation
round); only then is it used. What is agreed is the attach's descriptor:
what shapes the shared state, plus what the attach resumes.

The outcome belongs to the rank, not to the call: a cancelled call does not
undo it, and a retry of the attach that began the session gets its answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from cpcache.agreement.attach import Unconfirmed, agree_on_attach
from cpcache.config import DaemonConfig
from cpcache.dataplane.pools import DevicePool
from cpcache.errors import Unavailable
from cpcache.geometry import KVGeometry
from cpcache.keys import namespace_seed
from cpcache.rank.assembly import CacheRuntime, check_host_budget, open_runtime, start_session
from cpcache.rank.cache_closing import close_storage
from cpcache.rank.epochs import Formation, Held
from cpcache.rank.stepper import Stepper
from cpcache.state import carryover
from cpcache.state.machine import STATE_RULES

log = logging.getLogger("cpcached")


@dataclasses.dataclass(frozen=True)
class Attached:
    """What an Attach tells the scheduler."""

    page_bytes: int
    host_pages: int
    host_layout: str
    storage: str  # the backend's name, or "none"
    key_seed: str  # hex seed of this model's page-hash chains
    resumed_pages: int = 0  # host pages carried over from the previous session or epoch
    epoch: int = 0  # the epoch the session opened in: its steps name it
    host_pool_ticket: str = ""  # where the scheduler takes the host pool, read-only (the daemon's handover)
    last_step: int = 0  # the last step taken as the session began: its first step is any after it
    daemon_instance: int = 0  # this daemon process (its step-outcome ring's), set by the daemon


@dataclasses.dataclass(frozen=True)
class _LastAttach:
    """The attach that began the current session, to answer its retries."""

    stepper: Stepper
    descriptor: dict[str, Any]
    pool: tuple[int, ...]
    step: int
    attached: Attached
    attempt: int = 0  # the client's, telling its retries from a new attach (0: none)


def attach_descriptor(config: DaemonConfig, model_id: str, geometry: KVGeometry, device_pages: int,
                      model_dtype: str = "") -> dict[str, Any]:
    """What must be the same on every rank: it shapes the shared state (and
    the tenant of its storage keys: a reattach that changes any of it,
    the model's dtype included, resumes nothing). The model dtype is in it
    only when declared: an older client's attach agrees with daemons that
    predate the field, a newer one's never does (they would key its pages
    apart). `state_rules`: daemons whose state machines could apply the
    same agreed rounds differently never attach as one domain (they would
    diverge later, on some round): they are refused at attach, by name."""
    shape = dataclasses.asdict(geometry)
    if not geometry.beside:  # as before parts existed: daemons of either version agree on it
        del shape["beside"]
    descriptor = {"model_id": model_id, "geometry": shape, "device_pages": device_pages,
                  "host_pool_pages": config.host_pool_pages, "host_layout": config.host_layout,
                  "cache": dataclasses.asdict(config.cache_config), "state_rules": STATE_RULES}
    if model_dtype:
        descriptor["model_dtype"] = model_dtype
    return descriptor


class Attacher:
    def __init__(self, config: DaemonConfig, formation: Formation) -> None:
        self.config = config
        self._formation = formation
        self._task: asyncio.Future[Attached] | None = None
        self._last: _LastAttach | None = None
        self._joined = (-1, 0)  # (epoch, attempt) of the last attach agreement this rank joined
        self._sessions = 0  # data-plane sessions opened

    async def decide(self, model_id: str, geometry: KVGeometry, device_pages: int, kind: str,
                     open_device: Callable[[], DevicePool], model_dtype: str = "", attempt: int = 0) -> Attached:
        """Attach the pool `open_device` opens (blocking: run on a thread),
        `kind` naming how it was handed over, for the log; `model_dtype`
        (the dtype the model computes in) is part of the tenant. `attempt`:
        the client's (AttachRequest.attempt), which a retry repeats."""
        task = asyncio.ensure_future(self._open_and_agree(model_id, geometry, device_pages, kind, open_device,
                                                          model_dtype, attempt))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    async def _open_and_agree(self, model_id: str, geometry: KVGeometry, device_pages: int, kind: str,
                              open_device: Callable[[], DevicePool], model_dtype: str, attempt: int) -> Attached:
        formation = self._formation
        while self._task is not None and not self._task.done():
            # One at a time: a retry of a cancelled call waits for that call's attach.
            await asyncio.wait({self._task})
        last = self._last
        if attempt and last is not None and last.attempt == attempt:
            # A retry of the attach that began the last session, whatever
            # became of it since: its answer, never a new agreement (its
            # peers were told that one). A session whose epoch has ended
            # fails its first step on every rank alike. The pool it hands
            # over again is taken and let go.
            await asyncio.to_thread(open_device)
            return last.attached
        await formation.wait_reformed()
        formation.admit()
        # The pool is opened and checked before anything else changes: a bad
        # one is refused without ending the session that works.
        check_host_budget(self.config, geometry)
        device = await asyncio.to_thread(open_device)
        descriptor = attach_descriptor(self.config, model_id, geometry, device_pages, model_dtype)
        # Whether loads are overlapped, and with how many slots, shapes every
        # rank's scheduler steps alike: agreed like the pool.
        descriptor["load_signal_slots"] = device.signals.slots if device.signals is not None else 0
        stepper = formation.admit()
        last = self._last
        if (stepper.runtime is not None and last is not None and last.stepper is stepper
                and last.descriptor == descriptor and last.pool == device.identity and stepper.last_step == last.step):
            return last.attached  # a retry of the attach that began this session: the same answer
        if stepper.runtime is not None:
            # A scheduler attached again (it restarted): its old session ends
            # on every rank the same way, by forming the domain again; what
            # the host pool holds is carried over.
            await formation.reform("a scheduler attached again: its previous session ends")
            stepper = formation.admit()
        task = asyncio.ensure_future(self._agree(stepper, model_id, model_dtype, geometry, device, descriptor,
                                                  kind, attempt))
        self._task = task
        formation.attach_started(task)
        return await task

    async def _agree(self, stepper: Stepper, model_id: str, model_dtype: str, geometry: KVGeometry,
                     device: DevicePool, descriptor: dict[str, Any], kind: str, attempt: int = 0) -> Attached:
        formation, config = self._formation, self.config
        runtime: CacheRuntime | None = None
        kept = formation.kept_for(descriptor)
        # What the attach resumes is part of what every rank must agree on.
        resumes = 0
        if kept is not None and len(kept.runtime.state.ledger.index):
            resumes = carryover.digest(kept.runtime.state.ledger.index)
        confirmer = formation.confirmer
        try:
            runtime = await asyncio.to_thread(self._open_runtime, model_id, model_dtype, geometry, device, kept)
            if kept is None:
                runtime.state.carried_over([], formation.busy)
            # From here the domain decides, once, for every rank alike: nothing
            # local may refuse after this point (refusals come before, above).
            # Domains of one deployment (attention-DP replicas) attach apart.
            namespace = f"{formation.rdzv.namespace}/domain{'-'.join(map(str, formation.domain.ranks))}"
            epoch, joined = self._joined
            assert confirmer is not None
            rdzv, this_epoch = formation.rdzv, formation.epoch
            store_timeout_s = max(1.0, min(5.0, config.agreement_timeout_s / 4))

            def joining(attempt: int) -> None:
                self._joined = (this_epoch, attempt)

            try:
                await asyncio.to_thread(agree_on_attach, lambda: rdzv.connect(timeout_s=store_timeout_s), namespace,
                                        config.rank, formation.domain.ranks, {**descriptor, "resumes": resumes},
                                        joined if epoch == this_epoch else 0, config.agreement_timeout_s,
                                        confirmer, on_attempt=joining)
            except Unconfirmed:
                # The confirmation's collective timed out: its group is unusable.
                formation.reform_soon("an Attach was not confirmed by every rank")
                raise
            if formation.stepper is not stepper:
                # The epoch ended while it was decided: it ended for every rank,
                # and with it the session every rank attached in it.
                raise Unavailable("the domain formed again while this Attach was agreed; attach again")
        except BaseException:
            if runtime is not None and kept is None:
                runtime.io.close()
            raise  # a kept runtime stays kept, for the next attempt: no session was opened on it
        old = formation.release_kept() if kept is None else None
        if old is not None:  # another model or geometry, agreed: start clean
            # Decided: nothing may fail here any more (a storage that fails to
            # close is logged, not answered), or ranks would end apart.
            await close_storage(old.runtime, "closing the previous cache's storage")
        # The session's jobs bind this pool when they are issued; the previous
        # session of this runtime ended (and its device jobs with it) on detach.
        self._sessions += 1
        formation.session_started(stepper, start_session(runtime, formation.epoch, self._sessions, device), descriptor)
        resumed = len(runtime.state.ledger.index) if kept is not None else 0
        key_seed = namespace_seed(model_id, geometry.dtype, config.host_layout, geometry.page_size)
        log.info("attached %r (model dtype %r, KV %s) in epoch %d: %d device pages of %d bytes (%s), %d host pages "
                 "resumed", model_id, model_dtype, geometry.dtype, formation.epoch, device.pages, geometry.page_bytes,
                 kind, resumed)
        storage = runtime.io.storage
        attached = Attached(geometry.page_bytes, config.host_pool_pages, config.host_layout,
                            storage.name if storage else "none", key_seed, resumed, formation.epoch,
                            last_step=stepper.last_step)
        self._last = _LastAttach(stepper, descriptor, device.identity, stepper.last_step, attached, attempt)
        if self._sessions == config.faults.exit_after_attach:
            log.error("fault injection: exiting after Attach %d was agreed, before answering it", self._sessions)
            os._exit(137)
        if config.faults.stall_after_attach_ms:
            log.error("fault injection: stalling %.0f ms after Attach %d was agreed, before answering it",
                      config.faults.stall_after_attach_ms, self._sessions)
            time.sleep(config.faults.stall_after_attach_ms / 1000)  # the loop itself, frozen
        return attached

    def _open_runtime(self, model_id: str, model_dtype: str, geometry: KVGeometry, device: DevicePool,
                      kept: Held | None) -> CacheRuntime:
        check_host_budget(self.config, geometry)
        if kept is not None:  # the same model, dtype and geometry: the host pool and its pages go on
            return kept.runtime
        return open_runtime(self.config, geometry, device, model_id, model_dtype)
