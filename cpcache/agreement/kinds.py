"""The one registry of question kinds: what each kind is called, how its
answers reduce, and which part of the system asks it.

A round packs, settles and explains questions through this table only, so a
kind cannot be packed with one reduction and read back with another, and a
divergence report can always name what it saw (an unknown code is named by
its number, never raised on).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpcache.values import Reduce


@dataclass(frozen=True)
class QuestionKind:
    code: int
    name: str
    reduce: Reduce | None  # None: the asker picks MIN or MAX per question (scheduler votes)
    owner: str  # who asks it: "scheduler", "prefetch", "write", ...

    def __int__(self) -> int:
        return self.code


_REGISTRY: dict[int, QuestionKind] = {}


def register(code: int, name: str, reduce: Reduce | None, owner: str) -> QuestionKind:
    """Add a kind; registering the same kind twice is harmless, a clash is a bug."""
    kind = QuestionKind(code, name, reduce, owner)
    known = _REGISTRY.setdefault(code, kind)
    if known != kind:
        raise ValueError(f"question kind {code} is already registered as {known}")
    return kind


def lookup(code: int) -> QuestionKind | None:
    return _REGISTRY.get(int(code))


def describe(code: int) -> str:
    kind = lookup(code)
    return kind.name if kind else f"kind {int(code)}"


def registered() -> tuple[QuestionKind, ...]:
    return tuple(sorted(_REGISTRY.values(), key=lambda k: k.code))


VOTE = register(1, "vote", None, "scheduler")  # answered in the round that asks it
