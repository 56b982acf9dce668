"""The faults of `cpcache bench sglang-chaos` (sglang_chaos.py), and the
processes they hit: the daemons `cpcache launch` starts and the schedulers
`sglang.launch_server` spawns, found by walking /proc from their parents.

Faults come one at a time, uniform(0.75, 1.25) x --fault-every-s seconds after
the last one ended, each on a random rank, their kinds dealt from a shuffled
deck (each kind once in every deck):

single faults
- `daemon_sigkill`: the rank's daemon is killed; the launcher starts it again;
- `daemon_sigterm`: a graceful stop; the launcher starts it again;
- `daemon_sigstop`: the daemon stopped for uniform(0.5, 2) x the agreement
  timeout, then SIGCONT;
- `scheduler_sigstop`: the rank's SGLang scheduler (`sglang::scheduler_..TPn`,
  a child of the launch_server process) stopped for uniform(1.05, 1.3) x the
  backend's `timeout_s`, then SIGCONT;

combined faults (the rank and another one, its partner)
- `two_daemons`: both ranks' daemons at once, each killed, stopped gracefully
  or SIGSTOPped (for uniform(0.5, 2) x the agreement timeout);
- `kill_while_stopped`: the partner's daemon SIGSTOPped (or its scheduler,
  for uniform(1.05, 1.3) x the backend's `timeout_s`), and while it is, the
  rank's daemon killed;
- `term_during_reform`: the rank's daemon killed, and as soon as the
  launcher has started it again (the domain forming anew), the partner's
  daemon stopped gracefully.

Right before each, the victim's daemon is asked what it has open (Status and
Stats: open questions, loads, writes, prefetches, backups).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cpcache.testing.chaos_episodes import Fault
from cpcache.testing.daemon_probe import what_is_open

if TYPE_CHECKING:
    from cpcache.testing.sglang_cpu.stacks import Stack

SINGLE = ("daemon_sigkill", "daemon_sigterm", "daemon_sigstop", "scheduler_sigstop")
COMBINED = ("two_daemons", "kill_while_stopped", "term_during_reform")
KINDS = SINGLE + COMBINED
DAEMON_STOP = (0.5, 2.0)  # x the agreement timeout
SCHEDULER_STOP = (1.05, 1.3)  # x the backend's timeout_s: past its call deadline
RESTART_WAIT_S = 30.0  # longest wait for the launcher to start a killed daemon again

# -- processes ----------------------------------------------------------------------------

def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part for part in raw.decode(errors="replace").split("\0") if part]


def children(pid: int) -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _parent(int(entry)) == pid]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def scheduler_pids(server_pid: int) -> dict[int, int]:
    """rank -> pid of the server's scheduler processes (their titles, set by
    SGLang: `sglang::scheduler_TP0`, `sglang::scheduler_ATTN_CP1_TP1`)."""
    found: dict[int, int] = {}
    for pid in descendants(server_pid):
        title = " ".join(_argv(pid)).strip()
        if title.startswith("sglang::scheduler"):
            rank = re.search(r"_TP(\d+)", title)
            found[int(rank[1]) if rank else 0] = pid
    return found


def daemon_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of `rank`'s current daemon process, a child of `cpcache launch`."""
    for pid in children(launcher_pid):
        argv = _argv(pid)
        if "cpcache.daemon" in argv and "--rank" in argv and argv[argv.index("--rank") + 1:][:1] == [str(rank)]:
            return pid
    return None


def _send(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True



# -- faults ---------------------------------------------------------------------------------


class Injector(threading.Thread):
    """The fault scheduler: one fault at a time until `until` (monotonic)
    or `halt`, each after a random wait."""

    def __init__(self, stack: Stack, *, seed: int, kinds: Sequence[str], every_s: float, agreement_s: float,
                 timeout_s: float, until: float) -> None:
        super().__init__(name="sglang-chaos-faults", daemon=True)
        self.stack = stack
        self.rng = random.Random(seed)
        self.kinds = tuple(kinds)
        self.every_s, self.agreement_s, self.timeout_s, self.until = every_s, agreement_s, timeout_s, until
        self.halt = threading.Event()
        self.faults: list[Fault] = []
        self._deck: list[str] = []

    def server_alive(self) -> bool:
        process = self.stack.cpcache.process
        return process is not None and process.proc.poll() is None

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(0.75, 1.25) * self.every_s):
            if time.monotonic() >= self.until or not self.server_alive():
                return
            if not self._deck:
                self._deck = list(self.kinds)
                self.rng.shuffle(self._deck)
            self.inject(self._deck.pop(), self.rng.randrange(self.stack.ranks))

    def inject(self, kind: str, rank: int) -> Fault:
        seen = what_is_open(self.stack.daemons.socket(rank))
        fault = Fault(len(self.faults) + 1, kind, rank, time.time(), seen)
        self.faults.append(fault)
        if kind in COMBINED:
            partner = self.rng.choice([r for r in range(self.stack.ranks) if r != rank])
            getattr(self, f"_{kind}")(fault, partner)
        elif kind == "scheduler_sigstop":
            self._freeze(fault, self._scheduler(rank), self._pause(SCHEDULER_STOP, self.timeout_s))
        elif kind == "daemon_sigstop":
            self._freeze(fault, self._daemon(rank), self._pause(DAEMON_STOP, self.agreement_s))
        else:
            self._signal(fault, self._daemon(rank), signal.SIGKILL if kind == "daemon_sigkill" else signal.SIGTERM)
        return fault

    # -- combined

    def _two_daemons(self, fault: Fault, partner: int) -> None:
        actions = {r: self.rng.choice((signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP))
                   for r in (fault.rank, partner)}
        pids = {r: self._daemon(r) for r in actions}
        fault.pid = pids[fault.rank]
        if None in pids.values():
            fault.missed = "no such process"
            return
        fault.at = time.time()
        sent = [pid for r, pid in pids.items() if pid is not None and _send(pid, actions[r])]
        if not sent:
            fault.missed = "gone before the signal"
        stopped = [pid for r, pid in pids.items() if pid is not None and actions[r] == signal.SIGSTOP]
        if stopped:
            fault.pause_s = self._pause(DAEMON_STOP, self.agreement_s)
            self._hold(fault.pause_s)
            for pid in stopped:
                _send(pid, signal.SIGCONT)

    def _kill_while_stopped(self, fault: Fault, partner: int) -> None:
        scheduler = self.rng.random() < 0.5
        held = self._scheduler(partner) if scheduler else self._daemon(partner)
        fault.pid = self._daemon(fault.rank)
        if held is None or fault.pid is None:
            fault.missed = "no such process"
            return
        fault.pause_s = (self._pause(SCHEDULER_STOP, self.timeout_s) if scheduler
                         else self._pause(DAEMON_STOP, self.agreement_s))
        if not _send(held, signal.SIGSTOP):
            fault.missed = "gone before the signal"
            return
        try:
            fault.at = time.time()
            _send(fault.pid, signal.SIGKILL)
            self._hold(fault.pause_s)
        finally:
            _send(held, signal.SIGCONT)

    def _term_during_reform(self, fault: Fault, partner: int) -> None:
        fault.pid = self._daemon(fault.rank)
        if fault.pid is None:
            fault.missed = "no such process"
            return
        fault.at = time.time()
        if not _send(fault.pid, signal.SIGKILL):
            fault.missed = "gone before the signal"
            return
        if self._restarted(fault.rank, fault.pid) is None:
            fault.missed = "not started again"
            return
        peer = self._daemon(partner)
        if peer is not None:
            _send(peer, signal.SIGTERM)

    # -- the pieces

    def _signal(self, fault: Fault, pid: int | None, sig: int) -> None:
        fault.pid = pid
        if pid is None:
            fault.missed = "no such process"
            return
        fault.at = time.time()
        if not _send(pid, sig):
            fault.missed = "gone before the signal"

    def _freeze(self, fault: Fault, pid: int | None, pause_s: float) -> None:
        fault.pause_s = pause_s
        self._signal(fault, pid, signal.SIGSTOP)
        if fault.missed or pid is None:
            return
        try:
            self._hold(pause_s)
        finally:
            _send(pid, signal.SIGCONT)

    def _hold(self, pause_s: float) -> None:
        time.sleep(pause_s)  # the fault itself: the process stays stopped this long

    def _pause(self, span: tuple[float, float], scale: float) -> float:
        return round(self.rng.uniform(*span) * scale, 2)

    def _daemon(self, rank: int) -> int | None:
        assert self.stack.daemons.process is not None
        return daemon_pid(self.stack.daemons.process.proc.pid, rank)

    def _scheduler(self, rank: int) -> int | None:
        assert self.stack.cpcache.process is not None
        return scheduler_pids(self.stack.cpcache.process.proc.pid).get(rank)

    def _restarted(self, rank: int, old: int) -> int | None:
        """The pid of `rank`'s next daemon once the launcher has started it
        (None after RESTART_WAIT_S or a halt)."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while time.monotonic() < deadline:
            pid = self._daemon(rank)
            if pid is not None and pid != old:
                return pid
            if self.halt.wait(0.02):  # /proc has no event for a new child: looked at every 20 ms
                return None
        return None
