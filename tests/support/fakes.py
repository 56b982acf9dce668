"""Fakes shared by the in-process tests: one rank's local I/O whose
completion, delay and failure the test controls (`FakeIO`, driven by an
`IOPlan`), and a domain of one rank for the stepper (`OneRankEngine`)."""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass

from cpcache.agreement.rounds import MIN_CAPACITY, RoundInput
from cpcache.state.intents import CopyToDevice, CopyToHost, Fetch, Lookup, Store
from cpcache.state.questions import NOT_YET, BackupOutcome, CopyOutcome


@dataclass
class IOPlan:
    """How one replica's I/O behaves: delays in steps, failure rates."""

    seed: int = 0
    max_delay: int = 2
    fail_rate: float = 0.0
    timeout_rate: float = 0.0  # stores that time out (and keep reading a while)
    storage_hit: float = 1.0  # chance that a lookup finds every page (else a random prefix)


@dataclass
class Job:
    kind: str
    serial: int
    slots: tuple[int, ...]
    remaining: int  # steps until it ends
    fail: bool = False
    size: int = 0  # pages (fetch) / storage hit (lookup)
    done: int = 0  # fetch: pages done so far
    ended: bool = False
    started: int = 0
    linger: int = 0  # a timed-out store keeps reading this many steps after it reported
    timed_out: bool = False

    def busy_slots(self) -> tuple[int, ...]:
        if self.ended and self.linger <= 0:
            return ()
        if self.kind == "fetch" and not self.ended:
            return self.slots[self.done:]
        return self.slots


class FakeIO:
    """One replica's local I/O, implementing `LocalProgress`, fed by intents."""

    def __init__(self, plan: IOPlan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.jobs: dict[int, Job] = {}  # by serial: the one data job of an operation
        self.lookups: dict[int, Job] = {}  # by serial: storage lookups (no slots)
        self.now = 0
        self.draining = False  # every job ends at once, none fails or times out (`end_all`)

    def _delay(self) -> int:
        return 0 if self.draining else self.rng.randint(0, self.plan.max_delay)

    def _fails(self) -> bool:
        return not self.draining and self.rng.random() < self.plan.fail_rate

    def start(self, intents: list) -> None:
        for intent in intents:
            table = self.lookups if isinstance(intent, Lookup) else self.jobs
            assert intent.serial not in table, f"serial {intent.serial} started twice"
            match intent:
                case Lookup():
                    n = len(intent.keys)
                    hit = n if self.rng.random() < self.plan.storage_hit else self.rng.randint(0, n)
                    job = Job("lookup", intent.serial, (), self._delay(), size=hit)
                case Fetch():
                    job = Job("fetch", intent.serial, intent.slots, self._delay(), self._fails(),
                              size=len(intent.slots))
                case CopyToHost():
                    job = Job("to_host", intent.serial, intent.slots, self._delay(), self._fails())
                case Store():
                    job = Job("store", intent.serial, intent.slots, self._delay(), self._fails())
                    if not self.draining and self.rng.random() < self.plan.timeout_rate:
                        job.timed_out, job.linger = True, self.rng.randint(1, 4)
                case CopyToDevice():
                    job = Job("to_device", intent.serial, intent.slots, self._delay(), self._fails())
                case _:
                    raise AssertionError(f"unknown intent {intent!r}")
            job.started = self.now
            table[intent.serial] = job
            if job.remaining == 0:
                self._end(job)

    def _end(self, job: Job) -> None:
        job.ended = True
        if job.kind == "fetch":
            job.done = self.rng.randint(0, job.size) if job.fail else job.size

    def tick(self) -> None:
        """One step of time passes."""
        self.now += 1
        for job in (*self.jobs.values(), *self.lookups.values()):
            if job.ended:
                if job.linger > 0:
                    job.linger = 0 if self.draining else job.linger - 1
                continue
            if self.draining:
                job.remaining = 0
            else:
                job.remaining -= 1
                if job.kind == "fetch" and not job.fail and job.done < job.size:
                    job.done += 1
            if job.remaining <= 0:
                self._end(job)

    def drain(self) -> None:
        """Nothing to take in: progress is read from the jobs directly."""

    def end_all(self) -> None:
        """Every job ends now, and every later one as soon as it starts."""
        self.draining = True
        for job in (*self.jobs.values(), *self.lookups.values()):
            if not job.ended:
                self._end(job)
            job.linger = 0

    def forget(self, serials: list[int]) -> None:
        pass  # jobs are kept: the harness checks their history

    # -- LocalProgress ---------------------------------------------------------------

    def exists(self, serial: int) -> int:
        job = self.lookups.get(serial)
        return job.size if job is not None and job.ended else NOT_YET

    def fetched(self, serial: int) -> int:
        job = self.jobs.get(serial)
        return job.done if job else 0

    def fetch_ended(self, serial: int) -> bool:
        job = self.jobs.get(serial)
        return job is None or job.ended

    def elapsed_s(self, serial: int) -> float:
        job = self.jobs.get(serial)
        return float(self.now - job.started) if job else 0.0

    def read_failed(self, serial: int) -> bool:
        job = self.jobs.get(serial)
        return job is not None and job.ended and job.done < job.size

    def _outcome(self, serial: int) -> CopyOutcome:
        job = self.jobs.get(serial)
        if job is None or not job.ended:
            return CopyOutcome.PENDING
        return CopyOutcome.FAILED if job.fail else CopyOutcome.OK

    def write_outcome(self, serial: int) -> CopyOutcome:
        return self._outcome(serial)

    def load_outcome(self, serial: int) -> CopyOutcome:
        return self._outcome(serial)

    def backup_outcome(self, serial: int) -> BackupOutcome:
        job = self.jobs.get(serial)
        if job is None or not job.ended:
            return BackupOutcome.PENDING
        if job.timed_out:
            return BackupOutcome.TIMED_OUT
        return BackupOutcome.FAILED if job.fail else BackupOutcome.STORED

    def idle(self, slots: list[int]) -> bool:
        return not (set(slots) & self.busy())

    def busy(self) -> set[int]:
        return {s for job in self.jobs.values() for s in job.busy_slots()}


class OneRankEngine:
    """A domain of one: the MIN of a round is its own vector."""

    def __init__(self) -> None:
        self.capacity = MIN_CAPACITY

    def submit(self, round_input: RoundInput) -> Future:
        future: Future = Future()
        vector, self.capacity = round_input.reduce(lambda v: None, self.capacity)
        future.set_result(round_input.decode(vector))
        return future
