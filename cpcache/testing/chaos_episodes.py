"""The chaos bench's reading of what happened (`sglang_chaos.py`): the
server's `cpcache: rank` lines (fallbacks, attaches, slots given back) timed
and grouped into episodes (from one rank's fallback while every rank was
attached until every rank is attached again), each laid at the last fault
before it began, and the report's figures: per fault, whether the ranks fell
back and attached again at the same iterations, time without tiers."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cpcache.testing.daemon_probe import open_labels
from cpcache.testing.sglang_cpu.servers import Watched

# -- the server's log ------------------------------------------------------------------------

PATTERNS = (
    ("fell_back", re.compile(r"cpcache: rank (\d+) fell back to the device tree at iteration (\d+)")),
    ("attached", re.compile(r"cpcache: rank (\d+) attached again at iteration (\d+)")),
    ("not_attached", re.compile(r"cpcache: rank (\d+) could not attach again at iteration (\d+)")),
    ("gave_back", re.compile(r"cpcache: rank (\d+) gave back (\d+) device slots")),
    ("flushed_holding", re.compile(r"cpcache: rank (\d+) flushed while (\d+) device slots")),
)
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)")  # SGLang's, with SGLANG_LOG_MS=1
MARKER = "cpcache: rank"


@dataclass
class Fault:
    number: int
    kind: str
    rank: int
    at: float  # wall clock (time.time()) when the signal was sent
    seen: dict[str, Any]  # what the victim's daemon had open just before (`what_is_open`)
    pid: int | None = None
    pause_s: float = 0.0  # SIGSTOP: how long until SIGCONT
    missed: str = ""  # why no signal was sent (no such process)



class LineTimes:
    """When each `cpcache: rank` line of a process's output was seen (for
    lines without SGLang's millisecond stamp)."""

    def __init__(self, process: Watched) -> None:
        self.process = process
        self.seen: dict[int, float] = {}
        self.exited_at: float | None = None  # when the process was seen gone
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sglang-chaos-lines", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        p, count = self.process, 0

        def more() -> bool:
            return len(p.lines) > count or p.exited.is_set() or self._done.is_set()

        while not self._done.is_set():
            with p.new_line:
                p.new_line.wait_for(more, timeout=1.0)
                now, new = time.time(), p.lines[count:]
            for offset, line in enumerate(new):
                if MARKER in line:
                    self.seen[count + offset] = now
            count += len(new)
            # The process itself, not its pipe: children it left behind may hold the pipe open.
            if self.exited_at is None and p.proc.poll() is not None:
                self.exited_at = now
            if not new and p.exited.is_set():
                return

    def timed(self) -> list[tuple[float, str]]:
        """(when, line) of every `cpcache: rank` line so far, in log order."""
        with self.process.new_line:
            lines = list(enumerate(self.process.lines))
        return [(self.seen.get(i, time.time()), line) for i, line in lines if MARKER in line]

    def stop(self) -> None:
        self._done.set()
        with self.process.new_line:
            self.process.new_line.notify_all()
        self._thread.join(5)


@dataclass(frozen=True)
class Event:
    at: float
    what: str  # a PATTERNS name
    rank: int
    value: int  # the iteration, or the slots
    line: str


def events_of(timed: Sequence[tuple[float, str]]) -> list[Event]:
    out = []
    for seen, line in timed:
        for what, pattern in PATTERNS:
            found = pattern.search(line)
            if found:
                stamp = STAMP.search(line)
                at = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S.%f").timestamp() if stamp else seen
                out.append(Event(at, what, int(found[1]), int(found[2]), line.strip()))
                break
    return out


@dataclass
class Episode:
    """From a rank's fallback while every rank was attached until every rank
    is attached again (`end`; None: not by the end of the run)."""

    start: float
    fallbacks: dict[int, int] = field(default_factory=dict)  # rank -> iteration of its first fallback
    fallen_at: dict[int, float] = field(default_factory=dict)
    reattaches: dict[int, int] = field(default_factory=dict)  # rank -> iteration it attached again (last)
    attached_at: dict[int, float] = field(default_factory=dict)
    end: float | None = None
    refallbacks: int = 0  # a rank fell back again before the others were attached again
    attach_failures: int = 0
    slots_given_back: int = 0
    lines: list[str] = field(default_factory=list)

    def fallback_differs(self, ranks: int) -> bool:
        return set(self.fallbacks) != set(range(ranks)) or len(set(self.fallbacks.values())) > 1 \
            or self.refallbacks > 0

    def reattach_differs(self) -> bool:
        if self.end is None:
            return bool(self.reattaches)  # some ranks attached again, others not
        return set(self.reattaches) != set(self.fallbacks) or len(set(self.reattaches.values())) > 1

    def without_tiers_s(self) -> float | None:
        return None if self.end is None else round(self.end - self.start, 3)


def episodes_of(events: Sequence[Event]) -> list[Episode]:
    found: list[Episode] = []
    current: Episode | None = None
    fallen: set[int] = set()
    for event in events:
        if event.what == "fell_back":
            if current is None:
                current = Episode(event.at)
                found.append(current)
            if event.rank in current.fallbacks:
                current.refallbacks += 1
            else:
                current.fallbacks[event.rank] = event.value
                current.fallen_at[event.rank] = event.at
            fallen.add(event.rank)
        elif current is None:
            if event.what == "gave_back" and found:  # logged after the episode's last attach
                found[-1].slots_given_back += event.value
            continue
        elif event.what == "attached":
            current.reattaches[event.rank] = event.value
            current.attached_at[event.rank] = event.at
            fallen.discard(event.rank)
            if not fallen:
                current.end = event.at
        elif event.what == "not_attached":
            current.attach_failures += 1
        elif event.what == "gave_back":
            current.slots_given_back += event.value
        if current is not None:
            current.lines.append(event.line)
            if current.end is not None:
                current = None
    return found


def still_fallen(lines: Sequence[str]) -> set[int]:
    """The ranks whose last fallback line has no attach line after it."""
    fallen: set[int] = set()
    for event in events_of([(0.0, line) for line in lines if MARKER in line]):
        if event.what == "fell_back":
            fallen.add(event.rank)
        elif event.what == "attached":
            fallen.discard(event.rank)
    return fallen


# -- the report -----------------------------------------------------------------------------


def analyse(faults: Sequence[Fault], events: Sequence[Event], ranks: int, began: float) -> dict[str, Any]:
    """Faults, episodes, and each episode laid at the last fault before it."""
    episodes = episodes_of(events)
    injected = [f for f in faults if not f.missed]
    of_fault: dict[int, list[Episode]] = {f.number: [] for f in injected}
    unprovoked: list[Episode] = []
    for episode in episodes:
        before = [f for f in injected if f.at <= episode.start]
        (of_fault[before[-1].number] if before else unprovoked).append(episode)
    rows: list[dict[str, Any]] = []
    for fault in faults:
        mine = of_fault.get(fault.number, [])
        during = any(e.start < fault.at and (e.end is None or fault.at < e.end) for e in episodes)
        rows.append({
            "n": fault.number, "kind": fault.kind, "rank": fault.rank, "t_s": round(fault.at - began, 2),
            "pause_s": fault.pause_s, "open": open_labels(fault.seen), "seen": fault.seen, "missed": fault.missed,
            "during_fallback": during, "episodes": len(mine),
            "fallback_iterations": [{str(r): i for r, i in sorted(e.fallbacks.items())} for e in mine],
            "reattach_iterations": [{str(r): i for r, i in sorted(e.reattaches.items())} for e in mine],
            "fallback_differs": any(e.fallback_differs(ranks) for e in mine),
            "reattach_differs": any(e.reattach_differs() for e in mine),
            "unfinished": any(e.end is None for e in mine),
            "without_tiers_s": [e.without_tiers_s() for e in mine],
            "slots_given_back": sum(e.slots_given_back for e in mine),
            "attach_failures": sum(e.attach_failures for e in mine),
        })
    by_open: Counter[str] = Counter()
    by_kind_open: dict[str, Counter[str]] = {fault.kind: Counter() for fault in faults}
    for row in rows:
        if not row["missed"]:
            by_open.update(row["open"])
            by_kind_open[row["kind"]].update(row["open"])
    spans = [s for e in episodes if (s := e.without_tiers_s()) is not None]
    per_rank = {str(r): {"fallbacks": sum(e.what == "fell_back" and e.rank == r for e in events),
                         "reattaches": sum(e.what == "attached" and e.rank == r for e in events),
                         "attach_failures": sum(e.what == "not_attached" and e.rank == r for e in events),
                         "slots_given_back": sum(e.value for e in events if e.what == "gave_back" and e.rank == r),
                         "without_tiers_s": round(sum(e.attached_at[r] - e.fallen_at[r] for e in episodes
                                                      if r in e.attached_at and r in e.fallen_at), 1)}
                for r in range(ranks)}
    split = [(row, e) for row in rows for e in of_fault.get(row["n"], [])
             if e.fallback_differs(ranks) or e.reattach_differs()]
    return {
        "faults": len(injected), "faults_missed": len(faults) - len(injected),
        "faults_by_kind": dict(Counter(f.kind for f in injected)),
        "faults_by_open": dict(by_open),
        "faults_by_kind_and_open": {k: dict(c) for k, c in by_kind_open.items() if c},
        "faults_with_fallback": sum(1 for row in rows if row["episodes"]),
        "faults_during_fallback": sum(1 for row in rows if row["during_fallback"] and not row["missed"]),
        "faults_fallback_differs": sum(1 for row in rows if row["fallback_differs"]),
        "faults_reattach_differs": sum(1 for row in rows if row["reattach_differs"]),
        "episodes": len(episodes), "episodes_unfinished": sum(e.end is None for e in episodes),
        "episodes_without_fault": len(unprovoked),
        "fallbacks_unprovoked": [e.lines[:4] for e in unprovoked[:3]],
        "per_rank": per_rank,
        "without_tiers_s": {"total": round(sum(spans), 1), "max": round(max(spans, default=0.0), 1),
                            "mean": round(sum(spans) / len(spans), 2) if spans else 0.0},
        "slots_given_back": sum(e.value for e in events if e.what == "gave_back"),
        "flushes_holding_slots": sum(e.what == "flushed_holding" for e in events),
        "disagreements": [{"fault": row["n"], "kind": row["kind"], "rank": row["rank"], "open": row["open"],
                           "lines": e.lines[:24]} for row, e in split[:5]],
        "fault_list": rows,
    }


def daemon_restarts(launcher: Watched, ranks: int) -> dict[str, Any]:
    """What the launcher said: each rank's exits (codes) and restarts."""
    exits: dict[str, list[str]] = {str(r): [] for r in range(ranks)}
    back_s: list[float] = []
    for line in launcher.lines_with("cpcache: rank "):
        found = re.search(r"cpcache: rank (\d+) exited with code (-?\d+)", line)
        if found and found[1] in exits:
            exits[found[1]].append(found[2])
        back = re.search(r"is back \(pid \d+, serving ([\d.]+)s", line)
        if back:
            back_s.append(float(back[1]))
    return {"daemon_exits": {r: dict(Counter(codes)) for r, codes in exits.items()},
            "daemon_restarts": len(back_s), "daemon_back_s_max": round(max(back_s, default=0.0), 2),
            "daemon_not_serving": len(launcher.lines_with("is not serving"))}
