"""`cpcache bench state`: what the replicated state machine costs per step,
in process, with nothing else on the thread: one `CacheState` driven the way
a replay drives a daemon's (write-throughs of new page chains with the host
pool full, so every write evicts; a load of a resident chain; the backups
the write policy queues), every I/O ended at once. Each round is applied
by the rank's own `CacheRuntime.apply_round`, the one the stepper runs. It
times its `open` and `apply` phases with the thread's CPU clock, in blocks,
and reports the median block per step and per page written: the part of a
step's `open` + `apply` phases that is the state machine's own Python, free
of a shared host's noise."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

from cpcache.agreement.rounds import MIN_CAPACITY, Questions
from cpcache.config import CacheConfig
from cpcache.keys import ShardingSpec
from cpcache.rank.runtime import CacheRuntime
from cpcache.requests import CacheRequests, LoadRequest, WriteRequest
from cpcache.state.allocator import PageAllocator
from cpcache.state.intents import Intent
from cpcache.state.machine import CacheState
from cpcache.state.questions import BackupOutcome, CopyOutcome

HOST_PAGES = 4096  # the demo's host pool
DEVICE_PAGES = 2048
WRITES_PER_STEP = 4
PAGES_PER_WRITE = 44  # 176 pages written per step: the demo's mean over its replay
LOAD_PAGES = 20


class _AllDone:
    """Every rank's I/O has ended well the moment it starts: nothing to
    start, drain or forget."""

    def start(self, intents: list[Intent]) -> None:
        pass

    def drain(self) -> None:
        pass

    def forget(self, closed_serials: list[int]) -> None:
        pass

    def read_failed(self, serial: int) -> bool:
        return False

    def exists(self, serial: int) -> int:
        return 0

    def fetched(self, serial: int) -> int:
        return 1 << 30

    def fetch_ended(self, serial: int) -> bool:
        return True

    def elapsed_s(self, serial: int) -> float:
        return 0.0

    def write_outcome(self, serial: int) -> CopyOutcome:
        return CopyOutcome.OK

    def load_outcome(self, serial: int) -> CopyOutcome:
        return CopyOutcome.OK

    def backup_outcome(self, serial: int) -> BackupOutcome:
        return BackupOutcome.STORED

    def idle(self, slots: list[int]) -> bool:
        return True


def _page(n: int) -> bytes:
    return hashlib.blake2b(n.to_bytes(8, "little"), digest_size=32).digest()


class Driver:
    def __init__(self, write_policy: str = "write_through", host_pages: int = HOST_PAGES) -> None:
        self.state = CacheState(CacheConfig(write_policy=write_policy), PageAllocator(host_pages), ShardingSpec(), 16,
                                DEVICE_PAGES)
        self.runtime = CacheRuntime(self.state, _AllDone())  # type: ignore[arg-type]
        self.capacity = MIN_CAPACITY
        self.op = 0
        self.next_page = 0
        self.chains: list[list[bytes]] = []
        self.number = 0

    def requests(self) -> CacheRequests:
        writes = []
        for _ in range(WRITES_PER_STEP):
            self.op += 1
            pages = [_page(self.next_page + i) for i in range(PAGES_PER_WRITE)]
            self.next_page += PAGES_PER_WRITE
            writes.append(WriteRequest(self.op, tuple(pages), tuple(range(PAGES_PER_WRITE)), None))
            self.chains.append(pages)
        loads = []
        if len(self.chains) > 30:
            chain = self.chains[-30][:LOAD_PAGES]
            if self.state.match(chain) == len(chain):
                self.op += 1
                loads.append(LoadRequest(self.op, tuple(chain), tuple(range(LOAD_PAGES))))
        return CacheRequests(writes=tuple(writes), loads=tuple(loads))

    def step(self) -> tuple[float, float]:
        """One step: its round (one rank: the MIN is its own vector), applied
        as the stepper applies it. -> CPU seconds (open, apply)."""
        self.number += 1
        requests = self.requests()
        self.runtime.check(requests)
        round_input = self.runtime.pack(self.number, Questions.empty(), self.runtime.digest, requests)
        vector, self.capacity = round_input.reduce(lambda v: None, self.capacity)
        result = round_input.decode(vector)
        clock = _CPULaps()
        self.runtime.apply_round(self.number, requests, result, _no_io, clock)
        clock.lap("end")
        return clock.between(None, "open"), clock.between("io", "end")


def _no_io(intents: list[Intent]) -> None:
    pass


class _CPULaps:
    """The thread's CPU clock at each phase `apply_round` ends."""

    def __init__(self) -> None:
        self.at: dict[str | None, float] = {None: time.thread_time()}

    def lap(self, phase: str) -> None:
        self.at[phase] = time.thread_time()

    def between(self, start: str | None, end: str) -> float:
        return self.at[end] - self.at[start]


def run(steps: int, repeat: int, write_policy: str = "write_through", host_pages: int = HOST_PAGES) -> dict:
    driver = Driver(write_policy, host_pages)
    while driver.state.ledger.allocator.free_count > 0 or driver.number < 60:  # fill the host pool first
        driver.step()
    blocks = []
    for _ in range(repeat):
        times = [driver.step() for _ in range(steps)]
        blocks.append((sum(t[0] for t in times) / steps, sum(t[1] for t in times) / steps))
    open_us = statistics.median(b[0] for b in blocks) * 1e6
    apply_us = statistics.median(b[1] for b in blocks) * 1e6
    pages = WRITES_PER_STEP * PAGES_PER_WRITE
    return {
        "steps_per_block": steps, "blocks": repeat, "pages_written_per_step": pages,
        "host_pages": host_pages, "write_policy": write_policy,
        "open_us": round(open_us, 1), "apply_us": round(apply_us, 1),
        "open_apply_us": round(open_us + apply_us, 1),
        "open_apply_us_per_page": round((open_us + apply_us) / pages, 2),
        "spread_open_apply_us": [round(min(sum(b) for b in blocks) * 1e6, 1),
                                 round(max(sum(b) for b in blocks) * 1e6, 1)],
    }


def main(args: argparse.Namespace) -> int:
    figures = run(args.steps, args.repeat, args.write_policy)
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"cpcache bench state: one CacheState ({args.write_policy}), host pool of {HOST_PAGES} pages full, "
              f"{figures['pages_written_per_step']} pages written per step, thread CPU, median of "
              f"{args.repeat} blocks of {args.steps} steps")
        print(f"  open {figures['open_us']:.1f} us  apply {figures['apply_us']:.1f} us  "
              f"open + apply {figures['open_apply_us']:.1f} us per step "
              f"({figures['open_apply_us_per_page']:.2f} us per page written; blocks "
              f"{figures['spread_open_apply_us'][0]:.1f} to {figures['spread_open_apply_us'][1]:.1f})")
    sys.stdout.flush()
    return 0
