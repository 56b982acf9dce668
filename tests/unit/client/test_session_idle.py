"""The SGLang backend's per-iteration hook (`SchedulerSession.iterate`) when the
iteration has nothing to say: no cache operation made since the last step
and nothing open that a round must decide. Such an iteration sends no Step
(no RPC, no round), and whether an iteration sends one depends only on what
every rank's scheduler has alike (its own calls and the agreed replies),
never on local timing: so the number of rounds stays a function of the
scheduler's iterations (docs/design.md rule 2).

The daemon here is a deterministic model of one: every rank's model gets the
same steps and so answers them alike, as agreed replies are alike."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import pytest

from cpcache.client import session as session_module
from cpcache.client.messages import StepResult
from cpcache.client.session import SchedulerSession
from cpcache.requests import CacheRequests

pytestmark = pytest.mark.timeout(60)


class ModelDaemon:
    """Answers steps as an agreed domain at agreement lag 0 would, from the
    steps alone. A round asks its questions of the operations open before
    its step, then opens the step's. A write is acked (or failed, one in
    seven) in the round after the step that carried it. A prefetch's
    storage hit is agreed `lookup_rounds` after its step and its pages are
    read `fetch_rounds` after that; only a poll lets it end: a round after
    the poll's asks it once (a poll before the hit waits for it), and it
    ends if read; a revoke ends it in its own round. A load is decided in
    its own step's round. `work` and `ready` are this rank's own timing:
    CPU burnt before a reply is handed over, and whether it reads as arrived
    before that."""

    def __init__(self, work: Callable[[], None] = lambda: None, ready: bool = True, *,
                 lookup_rounds: int = 1, fetch_rounds: int = 1, backup_rounds: int = 0) -> None:
        self.work = work
        self.ready = ready  # whether a reply reads as arrived before it is waited for
        self.lookup_rounds, self.fetch_rounds = lookup_rounds, fetch_rounds
        self.backup_rounds = backup_rounds  # rounds from an ack to its backup's end (the daemon's own)
        self._backups: dict[int, int] = {}  # op -> round its backup is agreed in
        self.steps: list[int] = []
        self._writes: dict[int, tuple[int, tuple[bytes, ...]]] = {}  # op -> (round it is decided in, pages)
        self._prefetches: dict[int, list[int]] = {}  # op -> [round its hit is agreed in, its poll's step (0: none)]

    def step_later(self, step: int, votes: object = (), requests: CacheRequests | None = None,
                   epoch: int | None = None) -> Callable[[], StepResult]:
        requests = requests or CacheRequests()
        self.steps.append(step)
        hits, done = {}, {}
        for op, (hit_round, polled) in list(self._prefetches.items()):  # asked before the step opens
            if step == hit_round:
                hits[op] = 1
            elif step > hit_round and polled:
                if step >= hit_round + self.fetch_rounds:
                    done[op] = 1
                    del self._prefetches[op]
                else:
                    self._prefetches[op][1] = 0  # not yet: the scheduler polls again
        for write in requests.writes:
            self._writes[write.op_id] = (step + 1, write.pages)
        revoked = {op: "revoked" for op in requests.revokes if self._prefetches.pop(op, None) is not None}
        for prefetch in requests.prefetches:
            self._prefetches[prefetch.op_id] = [step + self.lookup_rounds, 0]
        for op in requests.prefetch_polls:
            if op in self._prefetches:
                self._prefetches[op][1] = step
        acks = tuple(op for op, (at, _) in self._writes.items() if at == step and op % 7)
        failures = tuple(op for op, (at, _) in self._writes.items() if at == step and not op % 7)
        entered = tuple(page for op in acks for page in self._writes[op][1])
        for op in acks + failures:
            del self._writes[op]
        if self.backup_rounds:
            self._backups.update((op, step + self.backup_rounds) for op in acks)
        backed_up = {op: True for op, at in self._backups.items() if at == step}
        self._backups = {op: at for op, at in self._backups.items() if at > step}
        reply = StepResult(step=step, round=step, decisions={}, digest=step, wire=b"", write_acks=acks,
                           write_failures=failures, prefetch_hits=hits, prefetch_done=done, prefetch_revoked=revoked,
                           loads={x.op_id: len(x.pages) for x in requests.loads}, host_entered=entered,
                           backups=backed_up, daemon_open=len(self._backups))

        return _Waiting(reply, self.work, ready=self.ready)


class _Waiting:
    """What waits for a step's reply, with a future's `done()`: a backend that
    asked it (local timing) would decide differently on a rank whose reply
    is late."""

    def __init__(self, reply: StepResult, work: Callable[[], None], ready: bool) -> None:
        self._reply, self._work, self._ready = reply, work, ready

    def done(self) -> bool:
        return self._ready

    def __call__(self) -> StepResult:
        self._work()
        self._ready = True
        return self._reply


def session_over(daemon: ModelDaemon) -> SchedulerSession:
    return SchedulerSession(daemon, first_step=1)  # type: ignore[arg-type]  # the model answers the calls used


def test_an_idle_iteration_sends_no_step():
    daemon = ModelDaemon()
    c = session_over(daemon)
    assert not any(c.iterate() for _ in range(100))  # each says it called nothing
    assert daemon.steps == [] and not c.in_flight()

    decided: list[bool] = []
    c.write_through([b"p1", b"p2"], [3, 4], None, done=decided.append)
    assert c.iterate()  # sends the write
    assert c.iterate()  # takes its step's reply; the write is still open: one more step decides it
    assert c.iterate()  # takes the reply that acks it; nothing open, nothing sent
    assert daemon.steps == [1, 2] and decided == [True] and not c.busy()
    assert not any(c.iterate() for _ in range(100))
    assert daemon.steps == [1, 2]
    assert c.match([b"p1", b"p2", b"p3"]) == 2  # the mirror followed the agreed reply


def test_an_idle_iteration_makes_no_call_and_costs_microseconds():
    class NoCalls:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"an idle iteration called the daemon ({name})")

    c = SchedulerSession(NoCalls(), first_step=1)  # type: ignore[arg-type]
    durations = []
    for _ in range(2000):
        started = time.perf_counter()
        c.iterate()
        durations.append(time.perf_counter() - started)
    # A few microseconds here; the bound leaves room for a loaded machine.
    assert statistics.median(durations) < 50e-6


def drive(c: SchedulerSession, daemon: ModelDaemon, seed: int, iterations: int = 400) -> list[tuple[int, bool]]:
    """The scheduler's calls of one run, chosen by `seed` (every rank's
    scheduler makes the same): -> per iteration, (steps sent so far, whether
    this iteration's hook sent one, whether it called the daemon at all)."""
    rng = random.Random(seed)
    open_rids: list[str] = []
    out = []
    for i in range(iterations):
        roll = rng.random()
        if roll < 0.04:
            c.write_through([bytes([i % 256, 1])], [i % 64], None, done=lambda acked: None)
        elif roll < 0.06:
            rid = f"r{i}"
            c.prefetch([bytes([i % 256, 2])], 16, None, rid=rid)
            open_rids.append(rid)
        elif roll < 0.08 and open_rids:
            c.prefetch_ended(rng.choice(open_rids))
        elif roll < 0.09 and open_rids:
            c.release(open_rids.pop(0))
        elif roll < 0.10:
            c.load_now([], [])  # a load waits for its own step
        before = len(daemon.steps)
        called = c.iterate()
        out.append((before, len(daemon.steps) > before, called))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_skip_decision_is_the_same_on_every_rank_whatever_the_local_timing(monkeypatch, seed):
    clocks = {"fast": iter(range(10**9)), "slow": iter(range(0, 10**12, 10**5))}  # microseconds per read
    which = ["fast"]
    monkeypatch.setattr(session_module.time, "perf_counter", lambda: next(clocks[which[0]]) * 1e-6)
    monkeypatch.setattr(session_module.time, "monotonic", lambda: next(clocks[which[0]]) * 1e-9)
    work = random.Random(seed)
    prompt = ModelDaemon()
    # Replies handed over late and unevenly, never arrived before they are waited for.
    late = ModelDaemon(work=lambda: sum(range(work.randrange(1, 20_000))), ready=False)
    runs = {}
    for name, daemon in (("fast", prompt), ("slow", late)):
        which[0] = name
        c = session_over(daemon)
        runs[name] = drive(c, daemon, seed)
    assert runs["fast"] == runs["slow"]
    assert prompt.steps == late.steps
    sent = sum(s for _, s, _ in runs["fast"])
    quiet = sum(not called for _, _, called in runs["fast"])
    assert 0 < sent and quiet > len(runs["fast"]) // 2  # some iterations stepped, most had nothing to say


def test_a_load_a_step_carried_keeps_iterations_stepping_until_it_is_decided():
    c = SchedulerSession(None, first_step=1)
    ended: list[bool] = []
    op = c.load([b"p1"], [5], done=ended.append)
    step, _ = c.next_step()
    assert c.busy() and not ended  # open at the daemon: only a later round decides it
    c.follow(StepResult(step=step, round=step, decisions={}, digest=step, wire=b"", loads={op: 1}))
    assert ended == [True] and not c.busy()


def test_a_prefetch_past_its_hit_steps_only_for_its_polls():
    """A request queued behind others keeps its prefetch open for many
    iterations; once its storage hit is agreed the daemon asks nothing of it
    until it is polled, so those iterations send no step."""
    daemon = ModelDaemon()
    c = session_over(daemon)
    c.prefetch([b"p1"], 16, None, rid="queued")
    assert c.iterate()  # sends the prefetch
    assert c.iterate()  # its step's reply: the hit is not agreed yet; one more step
    assert c.iterate()  # the reply that agrees its hit: nothing more to send
    assert daemon.steps == [1, 2]
    assert not any(c.iterate() for _ in range(100))  # open, waiting for a poll: no step, no round
    assert daemon.steps == [1, 2] and c.busy() and not c.needs_step()
    polls = 0
    while not c.prefetch_ended("queued"):  # SGLang polls at each iteration that it considers the request
        polls += 1
        assert c.iterate()
    assert c.take_prefetched("queued") == 1 and polls == 3  # asked in the round after its poll's
    assert c.iterate() and not c.needs_step()  # takes the reply of the last (stale) poll; nothing else is open
    assert not c.busy() and not any(c.iterate() for _ in range(10))
    assert daemon.steps == [1, 2, 3, 4, 5]


def step_until_quiet(c: SchedulerSession, limit: int = 50) -> int:
    """Iterate, with no call of the scheduler's, until an iteration sends nothing: -> iterations that did."""
    for n in range(limit):
        if not c.iterate():
            return n
    raise AssertionError(f"still stepping after {limit} iterations")


def test_one_poll_is_followed_until_the_round_that_answers_it():
    daemon = ModelDaemon()
    c = session_over(daemon)
    c.prefetch([b"p1"], 16, None, rid="r")
    step_until_quiet(c)
    assert not c.prefetch_ended("r")  # one poll, never repeated
    step_until_quiet(c)
    assert c.prefetch_ended("r") and c.take_prefetched("r") == 1  # answered by the round after its step's


def test_a_poll_sent_before_a_slow_hit_is_answered_once_the_hit_is_agreed():
    """The daemon keeps a poll that came before the hit and asks it in the
    round after the hit's: the session steps until then."""
    daemon = ModelDaemon(lookup_rounds=4)
    c = session_over(daemon)
    c.prefetch([b"p1"], 16, None, rid="r")
    assert c.iterate()  # sends the prefetch
    assert not c.prefetch_ended("r")  # polled at once, as SGLang does when the request is first considered
    step_until_quiet(c)
    assert c.prefetch_ended("r") and c.take_prefetched("r") == 1
    assert daemon.steps == [1, 2, 3, 4, 5, 6]


def test_iterations_step_while_the_daemon_has_operations_of_its_own_open():
    """A backup the daemon opened after an ack is decided only by rounds:
    the session steps until the reply says none is open."""
    daemon = ModelDaemon(backup_rounds=2)
    c = session_over(daemon)
    c.write_through([b"p1"], [3], None, done=lambda stored: None)
    assert step_until_quiet(c) == 5  # the write's step, its ack's, two while its backup is open, its backup's reply
    assert daemon.steps == [1, 2, 3, 4] and c.tally.backups_stored == 1 and not c.needs_step()
