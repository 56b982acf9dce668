"""An exhaustive explorer for small protocol models: depth-first over every
order of the enabled events, each state visited once (states are hashable
values), checking an invariant in every state reached.

A model gives `initial()`, `events(state) -> [(label, next_state)]` and
`check(state, trace) -> None` (raises AssertionError naming the trace). The
explorer returns how many states and transitions it saw."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass


@dataclass
class Explored:
    states: int = 0
    transitions: int = 0
    terminals: int = 0


def explore(initial: Hashable, events: Callable[[Hashable], Iterable[tuple[str, Hashable]]],
            check: Callable[[Hashable, tuple[str, ...]], None], limit: int = 2_000_000) -> Explored:
    seen = {initial}
    stack: list[tuple[Hashable, tuple[str, ...]]] = [(initial, ())]
    found = Explored(states=1)
    while stack:
        state, trace = stack.pop()
        check(state, trace)
        successors = list(events(state))
        if not successors:
            found.terminals += 1
        for label, following in successors:
            found.transitions += 1
            if following not in seen:
                seen.add(following)
                found.states += 1
                if found.states > limit:
                    raise AssertionError(f"more than {limit} states: the scope is too large")
                stack.append((following, (*trace, label)))
    return found


class DictStore:
    """The rendezvous store's semantics (torch's TCPStore) over a dict, for
    running the protocol's own code inside a model."""

    def __init__(self, data: dict[str, bytes] | None = None) -> None:
        self.data = dict(data or {})

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.data.get(key)
        if (current is None and expected == "") or (current is not None and current == expected.encode()):
            self.data[key] = desired.encode()
            return desired.encode()
        return current if current is not None else expected.encode()

    def frozen(self) -> tuple[tuple[str, bytes], ...]:
        return tuple(sorted(self.data.items()))
