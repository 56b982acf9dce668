"""A model of one rank leaving its epoch while a round is in its collective
and its data-plane jobs are queued or running (docs/design.md rule 10), checked in
every order of: the peer entering the round late or never (timeout), the
rank leaving, its engine thread returning, the stepper applying, the join,
the detach (session end, device jobs counted), the next session attaching,
and each job starting and ending.

The model mirrors the code it stands for, step by step: `Formation._reform` in
rank/epochs.py (close the engine, then `Stepper.finish_in_flight`, then
`Stepper.leave`, then the detach), `AgreementEngine._one_round` (a round whose
collective completed is delivered, closed or not: the peer that completed it
applies it), `AgreementEngine._fail_pending` (the close sentinel is put back)
and `close` (joins, then destroys the groups), `Stepper._apply` (a stepper
that left applies nothing), `Transfers.submit`/`_run` (a job binds its
session's pool when issued; a copy issued while its session was open runs to
its end, since a forward may read it, one issued after the end is refused),
`Formation._detach` (the session ends, then the rank waits until no job of it
touches its pool: counted, queued or running). The real-daemon tests in
tests/multirank/test_fencing.py check the same behaviour on the code.

Mutations reintroduce the defects the model found: `apply_after_leave` (the join
gives up after a time and the round is applied after the detach),
`leave_first` (the stepper leaves before the engine is closed, so a round its
peer completed and applied is discarded here), `pool_at_run_time` (jobs read
the current pool when they run, are not refused, and the drain gives up after
a time), `sentinel_eaten` (a failed round drains the close sentinel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

JOBS = ("load", "write")  # load: host -> device, queued before; write: device -> host, issued by the late round


@dataclass(frozen=True)
class S:
    collective: str = "waiting"  # waiting | completed (peer entered) | timed_out
    thread: str = "in_collective"  # in_collective | returned | stuck (no sentinel to read)
    delivered: str = ""  # "" | result | refused | failed
    closed: bool = False  # engine closed (the rank left)
    left: bool = False  # the stepper left
    applied: str = ""  # "" | before_leave | after_leave
    phase: str = "epoch"  # epoch | joining | settling | detaching | detached | new
    groups: str = "open"  # open | destroyed
    session_ended: bool = False
    # per job: none | queued | running | done | refused; and the pool it writes or reads
    load: str = "queued"
    load_pool: str = "P0"  # bound at issue time
    write: str = "none"
    write_pool: str = ""
    write_open: bool = True  # issued while its session was open (the load always is)
    violations: tuple[str, ...] = ()


class FencingModel:
    def __init__(self, mutations: frozenset[str] = frozenset()) -> None:
        self.m = mutations

    def initial(self) -> S:
        return S()

    def events(self, s: S) -> list[tuple[str, S]]:
        out: list[tuple[str, S]] = []
        m = self.m
        if s.collective == "waiting":
            out.append(("peer enters the round late", replace(s, collective="completed")))
            out.append(("the round times out", replace(s, collective="timed_out")))
        if s.phase == "epoch":
            out.append(("the rank starts leaving its epoch (engine closed)",
                        replace(s, closed=True, phase="joining", left="leave_first" in m)))
        if s.thread == "in_collective" and s.collective != "waiting":
            if s.collective == "timed_out":
                # The engine breaks; `_fail_pending` runs with the close sentinel queued (if closed).
                eaten = "sentinel_eaten" in m and s.closed
                out.append(("the engine breaks", replace(s, thread="stuck" if eaten else "returned",
                                                         delivered="failed")))
            else:
                out.append(("the engine returns the completed round", replace(s, thread="returned",
                                                                              delivered="result")))
        if s.delivered == "result" and not s.applied:
            if s.left and "apply_after_leave" not in m:
                out.append(("the stepper refuses the round (left)", replace(s, delivered="refused")))
            else:
                # Applied: the round's write-through is issued in the stepper's session.
                issued = replace(s, applied="after_leave" if s.left else "before_leave", write="queued",
                                 write_pool="P0", write_open=not s.session_ended)
                if s.left:
                    issued = replace(issued, violations=(*s.violations, "a round was applied after its rank left"))
                out.append(("the stepper applies the round", issued))
        if s.phase == "joining":
            if s.thread == "returned":
                out.append(("the join ends; groups destroyed", replace(s, phase="settling", groups="destroyed")))
            elif "apply_after_leave" in m or "sentinel_eaten" in m:
                out.append(("the join gives up after its time", replace(s, phase="detaching", left=True)))
        if s.phase == "settling" and not (s.delivered == "result" and not s.applied):
            out.append(("the steps in flight have ended; the stepper leaves",
                        replace(s, phase="detaching", left=True)))
        if s.phase == "detaching":
            ended = replace(s, session_ended=True)
            issued = any(getattr(s, j) in ("queued", "running") for j in JOBS)
            if not issued or "pool_at_run_time" in m:
                out.append(("the session ends; its pool is let go", replace(ended, phase="detached")))
        if s.phase == "detached":
            out.append(("the next session attaches (pool P1, slot s reused)", replace(s, phase="new")))
        for job in JOBS:
            state = getattr(s, job)
            if state == "queued":
                issued_open = job == "load" or s.write_open
                if s.session_ended and not issued_open and "pool_at_run_time" not in m:
                    out.append((f"the {job} is refused", replace(s, **{job: "refused"})))
                else:
                    pool = getattr(s, f"{job}_pool")
                    if "pool_at_run_time" in m:
                        pool = {"new": "P1", "detached": "none"}.get(s.phase, "P0")
                    out.append((f"the {job} starts", replace(s, **{job: "running", f"{job}_pool": pool})))
            if state == "running":
                done = replace(s, **{job: "done"})
                pool = getattr(s, f"{job}_pool")
                harm = []
                if pool == "P1":
                    harm.append(f"an old session's {job} landed in the next session's pool")
                if job == "write" and s.phase == "new":
                    harm.append("an old epoch's copy overwrote a slot the next session holds")
                out.append((f"the {job} ends", replace(done, violations=(*s.violations, *harm))))
        return out

    def check(self, s: S, trace: tuple[str, ...]) -> None:
        assert not s.violations, f"{s.violations[0]}; trace: {list(trace)}"
        if s.phase == "new" and s.collective == "completed" and s.thread == "returned":
            # The peer completed the round and applied it (it had not left).
            assert s.applied, f"the peer applied a round this rank did not; trace: {list(trace)}"
        if s.phase == "new":
            running = [j for j in JOBS if getattr(s, j) == "running"]
            assert not running or "pool_at_run_time" in self.m, f"next session opened while {running} ran"


def check_fencing(mutations: frozenset[str] = frozenset(), collect: set[str] | None = None):
    """Explore every order. With `collect`, violations are gathered there
    (by kind) instead of failing at the first."""
    from .explore import explore

    model = FencingModel(mutations)

    def check(s: S, trace: tuple[str, ...]) -> None:
        try:
            model.check(s, trace)
            if not model.events(s):
                # Every end: the epoch really left (thread joined, groups destroyed), the next session serving.
                assert s.phase == "new" and s.groups == "destroyed", (
                    f"the epoch was not really left: ended in phase {s.phase} with its groups {s.groups}; "
                    f"trace: {list(trace)}")
        except AssertionError as exc:
            if collect is None:
                raise
            collect.add(str(exc).split(";")[0])

    return explore(model.initial(), model.events, check)
