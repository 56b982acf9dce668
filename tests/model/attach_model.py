"""A model of Attach over the protocol's own code (`cpcache.agreement.attach`):
ranks with scheduler programs (a list of descriptors each attaches, one after
the other), every order of their steps (publish, look, deadline passing)
over one store. Invariants (DESIGN rule 11):

- one outcome per attempt: every rank that followed an attempt got the same;
- "attached" only when every rank of the domain is attached in that attempt,
  with the descriptor its own scheduler sent;
- the README's remedy converges: from every end state, one more attach of
  the same descriptor on every rank, in time, attaches every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from cpcache.agreement import attach
from cpcache.errors import FailedPrecondition, Unavailable

from .explore import DictStore, explore

NAMESPACE = "model/epoch0"
TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RankState:
    program: tuple[str, ...]
    calls_done: int = 0
    attempt: int = 0  # the attempt of the call in progress (0: none)
    last_joined: int = 0
    outcomes: tuple[tuple[int, str, str], ...] = ()  # (attempt, outcome, descriptor)

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
    def __init__(self, programs: tuple[tuple[str, ...], ...], deadlines: bool = True) -> None:
        self.programs = programs
        self.deadlines = deadlines
        self.all_ranks = tuple(range(len(programs)))

    def initial(self) -> State:
        return State((), tuple(RankState(p) for p in self.programs))

    def events(self, state: State) -> list[tuple[str, State]]:
        out = []
        for r, rank in enumerate(state.ranks):
            if not rank.waiting and rank.calls_done < len(rank.program):
                store = DictStore(dict(state.store))
                attempt = attach.next_attempt(store, NAMESPACE, rank.last_joined)
                name = rank.program[rank.calls_done]
                attach.Attempt(store, NAMESPACE, r, self.all_ranks, descriptor(name), attempt).publish()
                out.append((f"r{r} attaches {name} in attempt {attempt}",
                            self._with(state, store, r, replace(rank, attempt=attempt, last_joined=attempt))))
            if rank.waiting:
                for expired in (False, True) if self.deadlines else (False,):
                    store = DictStore(dict(state.store))
                    name = rank.program[rank.calls_done]
                    decision = attach.Attempt(store, NAMESPACE, r, self.all_ranks, descriptor(name),
                                              rank.attempt).look(expired)
                    if decision is None:
                        continue  # nothing changed: no new state
                    result = outcome_of(decision, r, name)
                    done = replace(rank, attempt=0, calls_done=rank.calls_done + 1,
                                   outcomes=(*rank.outcomes, (rank.attempt, result, name)))
                    what = "deadline passes" if expired else "looks"
                    out.append((f"r{r} {what}: {result} in attempt {rank.attempt}", self._with(state, store, r, done)))
        return out

    @staticmethod
    def _with(state: State, store: DictStore, r: int, rank: RankState) -> State:
        ranks = list(state.ranks)
        ranks[r] = rank
        return State(store.frozen(), tuple(ranks))

    def check(self, state: State, trace: tuple[str, ...]) -> None:
        by_attempt: dict[int, dict[int, tuple[str, str]]] = {}
        for r, rank in enumerate(state.ranks):
            for attempt, result, name in rank.outcomes:
                by_attempt.setdefault(attempt, {})[r] = (result, name)
        for attempt, followed in by_attempt.items():
            results = {result for result, _ in followed.values()}
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
        self.start = start

    def initial(self) -> State:
        return State(self.start.store, tuple(replace(r, program=(*r.program, "A")) for r in self.start.ranks))

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


def check_scope(ranks: int, calls: int) -> tuple[int, int, int]:
    """Explore every program of the scope, with the remedy from every end
    state. Returns (programs, states, transitions)."""
    states = transitions = 0
    scope = programs(ranks, calls)
    for program in scope:
        model = AttachModel(program)
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
