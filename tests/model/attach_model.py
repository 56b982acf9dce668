"""A model of Attach over the protocol's own code (`cpcache.agreement.attach`):
ranks with scheduler programs (a list of descriptors each attaches, one after
the other), every order of their steps (publish, look, deadline passing, the
confirmation round completing or timing out, the rendezvous store restarting
and forgetting every key, the domain forming again after a confirmation timed
out) over one store. Invariants (docs/design.md rule 11):

- one outcome per attempt: every rank that followed an attempt got the same
  (without store restarts: the same outcome; with them: attached on every
  rank or on none);
- "attached" only when every rank of the domain is attached in that attempt,
  with the descriptor its own scheduler sent;
- docs/protocol.md's remedy converges: from every end state, one more attach of
  the same descriptor on every rank, in time, attaches every rank.

The confirmation round is a collective of the epoch's own group: the i-th
confirmation of every rank meets in one round, which completes once all have
entered it, or times out for a rank whose peers have not (the group is then
unusable, and the domain forms again in the next epoch once no Attach is in
progress: `rank.epochs.Formation._reform` waits for it).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace

import numpy as np

from cpcache.agreement import attach
from cpcache.errors import FailedPrecondition, Unavailable

from .explore import DictStore, explore

TIMEOUT_S = 1.0


def namespace(epoch: int) -> str:
    return f"model/epoch{epoch}"


@dataclass(frozen=True)
class RankState:
    program: tuple[str, ...]
    calls_done: int = 0
    attempt: int = 0  # the attempt of the call in progress (0: none)
    last_joined: tuple[int, int] = (0, 0)  # (epoch, attempt) of the last attempt joined
    published: bool = True  # false once a restarted store forgot this rank's descriptor
    confirming: str = ""  # the decision read (JSON) while in the confirmation round
    confirms: int = 0  # confirmations entered in this epoch's group
    outcomes: tuple[tuple[tuple[int, int], str, str], ...] = ()  # ((epoch, attempt), outcome, descriptor)

    @property
    def waiting(self) -> bool:
        return self.attempt != 0

    @property
    def finished(self) -> bool:
        return not self.waiting and self.calls_done == len(self.program)


@dataclass(frozen=True)
class State:
    store: tuple[tuple[str, bytes], ...]
    ranks: tuple[RankState, ...]
    epoch: int = 0
    broken: bool = False  # a confirmation timed out: the group is unusable until the domain forms again
    restarts_left: int = 0  # store restarts still to explore


def descriptor(name: str) -> dict[str, str]:
    return {"geometry": name}


def outcome_of(decision: dict, rank: int, name: str) -> str:
    try:
        attach.follow(decision, rank, descriptor(name), TIMEOUT_S)
    except FailedPrecondition:
        return "differ"
    except Unavailable:
        return "missing"
    return "attached"


class AttachModel:
    def __init__(self, programs: tuple[tuple[str, ...], ...], deadlines: bool = True, restarts: int = 0,
                 confirm: bool = True) -> None:
        self.programs = programs
        self.deadlines = deadlines
        self.restarts = restarts
        self.confirm = confirm  # False: the decision read from the store is followed as it is
        self.all_ranks = tuple(range(len(programs)))

    def initial(self) -> State:
        return State((), tuple(RankState(p) for p in self.programs), restarts_left=self.restarts)

    def events(self, state: State) -> list[tuple[str, State]]:
        out = []
        ns = namespace(state.epoch)
        for r, rank in enumerate(state.ranks):
            if not rank.waiting and rank.calls_done < len(rank.program) and not state.broken:
                store = DictStore(dict(state.store))
                epoch, joined = rank.last_joined
                attempt = attach.next_attempt(store, ns, joined if epoch == state.epoch else 0)
                name = rank.program[rank.calls_done]
                attach.Attempt(store, ns, r, self.all_ranks, descriptor(name), attempt).publish()
                out.append((f"r{r} attaches {name} in attempt {attempt}", self._with(state, store, r, replace(
                    rank, attempt=attempt, last_joined=(state.epoch, attempt), published=True))))
            if rank.waiting and not rank.confirming:
                for expired in (False, True) if self.deadlines else (False,):
                    store = DictStore(dict(state.store))
                    name = rank.program[rank.calls_done]
                    joined = attach.Attempt(store, ns, r, self.all_ranks, descriptor(name), rank.attempt)
                    if not rank.published:
                        joined.publish()  # once per connection: the store restarted
                    decision = joined.look(expired)
                    if decision is None:
                        if not rank.published:
                            out.append((f"r{r} publishes again", self._with(state, store, r, replace(
                                rank, published=True))))
                        continue  # nothing changed: no new state
                    what = "deadline passes" if expired else "looks"
                    if decision["outcome"] in (attach.ATTACHED, attach.DIFFER) and self.confirm:
                        confirming = replace(rank, published=True, confirming=json.dumps(decision, sort_keys=True),
                                             confirms=rank.confirms + 1)
                        out.append((f"r{r} {what}: reads {decision['outcome']} in attempt {rank.attempt}, "
                                    f"confirms", self._with(state, store, r, confirming)))
                        continue
                    result = outcome_of(decision, r, name)
                    out.append((f"r{r} {what}: {result} in attempt {rank.attempt}",
                                self._with(state, store, r, self._done(rank, state.epoch, result))))
        out += self._confirmations(state)
        if state.restarts_left:
            ranks = tuple(replace(rank, published=not rank.waiting) for rank in state.ranks)
            out.append(("the store restarts", replace(state, store=(), ranks=ranks,
                                                      restarts_left=state.restarts_left - 1)))
        if state.broken and not any(rank.waiting for rank in state.ranks):
            ranks = tuple(replace(rank, confirms=0) for rank in state.ranks)
            out.append((f"the domain forms again in epoch {state.epoch + 1}",
                        replace(state, epoch=state.epoch + 1, broken=False, ranks=ranks)))
        return out

    def _confirmations(self, state: State) -> list[tuple[str, State]]:
        confirming = [r for r, rank in enumerate(state.ranks) if rank.confirming]
        if not confirming:
            return []
        out = []
        ranks = state.ranks
        together = {ranks[r].confirms for r in confirming}
        if not state.broken and len(confirming) == len(ranks) and len(together) == 1:
            # Every rank entered the same round: it completes, MIN over the domain.
            vectors = [attach.confirmation_vector(rank.attempt, json.loads(rank.confirming)) for rank in ranks]
            reduced = np.minimum.reduce(vectors)
            done = []
            for rank, vector in zip(ranks, vectors):
                name = rank.program[rank.calls_done]
                same = np.array_equal(reduced, vector)
                result = outcome_of(json.loads(rank.confirming), 0, name) if same else "mismatch"
                done.append(self._done(rank, state.epoch, result))
            out.append(("the confirmation round completes", replace(state, ranks=tuple(done))))
            return out
        if self.deadlines or state.broken:
            for r in confirming:
                # A peer has not entered (it read another outcome, or is slow): this rank's round times out.
                timed_out = list(ranks)
                timed_out[r] = self._done(ranks[r], state.epoch, "unconfirmed")
                out.append((f"r{r}'s confirmation times out", replace(state, ranks=tuple(timed_out), broken=True)))
        return out

    @staticmethod
    def _done(rank: RankState, epoch: int, result: str) -> RankState:
        name = rank.program[rank.calls_done]
        return replace(rank, attempt=0, calls_done=rank.calls_done + 1, confirming="",
                       outcomes=(*rank.outcomes, ((epoch, rank.attempt), result, name)))

    @staticmethod
    def _with(state: State, store: DictStore, r: int, rank: RankState) -> State:
        ranks = list(state.ranks)
        ranks[r] = rank
        return replace(state, store=store.frozen(), ranks=tuple(ranks))

    def check(self, state: State, trace: tuple[str, ...]) -> None:
        by_attempt: dict[tuple[int, int], dict[int, tuple[str, str]]] = {}
        for r, rank in enumerate(state.ranks):
            for attempt, result, name in rank.outcomes:
                by_attempt.setdefault(attempt, {})[r] = (result, name)
        for attempt, followed in by_attempt.items():
            results = {result for result, _ in followed.values()}
            if self.restarts:  # a restarted store may refuse differently on each rank: never attached on one only
                results = {result == "attached" for result in results}
            assert len(results) == 1, f"attempt {attempt} split: {followed}; trace: {list(trace)}"
        if not all(rank.finished for rank in state.ranks):
            return
        for attempt, followed in by_attempt.items():
            if "attached" in {result for result, _ in followed.values()}:
                assert set(followed) == set(self.all_ranks), (
                    f"attempt {attempt} attached ranks {sorted(followed)} only, not the whole domain "
                    f"{list(self.all_ranks)}; trace: {list(trace)}")
                assert len({name for _, name in followed.values()}) == 1, (
                    f"attempt {attempt} attached different descriptors {followed}; trace: {list(trace)}")

    def remedy(self, state: State) -> AttachModel:
        """From an end state: every rank attaches descriptor A once more, in time."""
        return _Remedy(self, state)


class _Remedy(AttachModel):
    def __init__(self, base: AttachModel, start: State) -> None:
        super().__init__(tuple((*r.program, "A") for r in start.ranks), deadlines=False)
        self.restarts = base.restarts  # the outcomes before the remedy may differ as the base allowed
        self.confirm = base.confirm
        self.start = start

    def initial(self) -> State:
        return replace(self.start, restarts_left=0,
                       ranks=tuple(replace(r, program=(*r.program, "A")) for r in self.start.ranks))

    def check(self, state: State, trace: tuple[str, ...]) -> None:
        super().check(state, trace)
        if all(rank.finished for rank in state.ranks):
            last = {rank.outcomes[-1][:2] for rank in state.ranks}
            assert len(last) == 1 and next(iter(last))[1] == "attached", (
                f"attaching again everywhere did not converge: {[r.outcomes[-1] for r in state.ranks]}; "
                f"trace: {list(trace)}")


def programs(ranks: int, calls: int, names: str = "AB") -> list[tuple[tuple[str, ...], ...]]:
    """Every scheduler program of the scope: each rank attaches 0 to `calls`
    times, each time one of `names`."""
    per_rank = [p for n in range(calls + 1) for p in itertools.product(names, repeat=n)]
    return list(itertools.product(per_rank, repeat=ranks))


def check_scope(ranks: int, calls: int, restarts: int = 0, confirm: bool = True) -> tuple[int, int, int]:
    """Explore every program of the scope (with up to `restarts` store
    restarts anywhere), with the remedy from every end state. Returns
    (programs, states, transitions)."""
    states = transitions = 0
    scope = programs(ranks, calls)
    for program in scope:
        model = AttachModel(program, restarts=restarts, confirm=confirm)
        ends: list[State] = []

        def check(state: State, trace: tuple[str, ...], model: AttachModel = model, ends: list = ends) -> None:
            model.check(state, trace)
            if all(rank.finished for rank in state.ranks):
                ends.append(state)

        found = explore(model.initial(), model.events, check)
        states, transitions = states + found.states, transitions + found.transitions
        for end in ends:
            remedy = model.remedy(end)
            found = explore(remedy.initial(), remedy.events, remedy.check)
            states, transitions = states + found.states, transitions + found.transitions
    return len(scope), states, transitions
