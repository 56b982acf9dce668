"""The one registry of question kinds: what each kind is called and how
its answers reduce.

A round packs, decodes and explains questions through this table only, so a
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


_REGISTRY: dict[int, QuestionKind] = {}


def register(code: int, name: str, reduce: Reduce | None) -> QuestionKind:
    """Add a kind; registering the same kind twice is harmless, a clash is a bug."""
    kind = QuestionKind(code, name, reduce)
    known = _REGISTRY.setdefault(code, kind)
    if known != kind:
        raise ValueError(f"question kind {code} is already registered as {known}")
    return kind


def lookup(code: int) -> QuestionKind | None:
    return _REGISTRY.get(int(code))


def describe(code: int) -> str:
    kind = lookup(code)
    return kind.name if kind else f"kind {int(code)}"


VOTE = register(1, "vote", None)  # the scheduler's votes, answered in the round that asks them
