"""Naming what differs after a divergence: every rank shares what it asked
through the rendezvous store, and every rank reads the same reports.
Explaining never raises: an unknown kind is named by its number."""

from __future__ import annotations

import datetime
import json
import time
from typing import TYPE_CHECKING

from cpcache.agreement.kinds import describe
from cpcache.agreement.rounds import RoundInput
from cpcache.values import Reduce

if TYPE_CHECKING:
    from torch.distributed import Store


class DivergenceExchange:
    """After a divergence, every rank shares what it asked, so every rank can
    name the ranks and operations that differ. Runs over the rendezvous store:
    the reduced vector was identical everywhere, so every rank takes part."""

    def __init__(self, store: Store, namespace: str, rank: int, domain: tuple[int, ...], timeout_s: float) -> None:
        self._store = store
        self._namespace = namespace
        self._rank = rank
        self._domain = domain
        self._timeout_s = timeout_s

    def _set(self, key: str, value: bytes) -> None:
        # torch's stub types a store value as str; the binding takes bytes as well.
        self._store.set(key, value)  # type: ignore[arg-type]

    def publish_rejection(self, number: int, message: str) -> None:
        """Before entering a round this rank rejects: say why, for the others."""
        self._set(f"{self._namespace}/rejection/{number}/{self._rank}", message.encode()[:4000])

    def rejection_message(self, number: int, rank: int) -> str:
        key = f"{self._namespace}/rejection/{number}/{rank}"
        try:
            self._store.wait([key], datetime.timedelta(seconds=self._timeout_s))
            return self._store.get(key).decode(errors="replace")
        except RuntimeError:
            return f"(rank {rank} did not say why)"

    def explain(self, round_input: RoundInput) -> str:
        prefix = f"{self._namespace}/divergence/{round_input.number}/"
        self._set(prefix + str(self._rank), round_input.description())
        by_rank: dict[int, bytes | None] = {}
        deadline = time.monotonic() + self._timeout_s
        for rank in self._domain:
            left = max(0.05, deadline - time.monotonic())
            try:
                self._store.wait([prefix + str(rank)], datetime.timedelta(seconds=left))
                by_rank[rank] = self._store.get(prefix + str(rank))
            except RuntimeError:
                by_rank[rank] = None
        return explain_divergence(round_input.number, by_rank)


def explain_divergence(number: int, by_rank: dict[int, bytes | None]) -> str:
    """Name the ranks and operations that differ, from every rank's
    `RoundInput.description()` (None for a rank that did not report)."""
    silent = sorted(r for r, d in by_rank.items() if d is None)
    reports = {r: json.loads(d) for r, d in by_rank.items() if d is not None}
    parts = [f"divergence in round {number}"]
    question_sets = {r: {tuple(q) for q in rep["questions"]} for r, rep in reports.items()}
    every = set().union(*question_sets.values()) if question_sets else set()
    for question in sorted(every):
        holders = sorted(r for r, qs in question_sets.items() if question in qs)
        if len(holders) != len(question_sets):
            op_id, kind, reduce = question
            others = sorted(set(question_sets) - set(holders))
            label = reports[holders[0]].get("labels", {}).get(str(op_id))
            named = f"{label} (serial {op_id}" if label else f"operation {op_id} ("
            parts.append(
                f"{named}{', ' if label else ''}{describe(kind)}, {_reduce_name(reduce)}) "
                f"asked by ranks {holders} but not by ranks {others}"
            )
    contents: dict[tuple[str, ...], list[int]] = {}
    for rank, rep in sorted(reports.items()):
        contents.setdefault(tuple(rep.get("content", ())), []).append(rank)
    if len(contents) > 1:
        listing = "; ".join(f"ranks {ranks} were sent [{', '.join(c) or 'no operations'}]"
                            for c, ranks in contents.items())
        parts.append(f"steps differ: {listing}")
    by_digest: dict[int, list[int]] = {}
    for rank, rep in sorted(reports.items()):
        by_digest.setdefault(rep["digest"], []).append(rank)
    if len(by_digest) > 1:
        listing = "; ".join(f"ranks {ranks} have {digest:#x}" for digest, ranks in by_digest.items())
        parts.append(f"shared-state digests differ: {listing}")
    if len(parts) == 1 and len(reports) > 1:
        parts.append("question sets differ in step number or reduction")
    if silent:
        parts.append(f"ranks {silent} did not report their questions")
    return "; ".join(parts)


def _reduce_name(code: int) -> str:
    return Reduce(code).name if code in (Reduce.MIN, Reduce.MAX) else f"reduce {code}"
