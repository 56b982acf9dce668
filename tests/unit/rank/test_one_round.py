"""The round exists once (docs/design.md §10: `rank/` is what the replica
harness runs N copies of): the stepper and the replica harness both apply
a round through `CacheRuntime.apply_round`, and the harness keeps no copy of
its logic nor reaches into private fields; nor does any tool or test kit
shipped in the package (the state bench, the simulator, the soak...)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from cpcache.agreement.rounds import Questions
from cpcache.config import CacheConfig
from cpcache.keys import ShardingSpec
from cpcache.rank.runtime import CacheRuntime
from cpcache.rank.stepper import Stepper
from cpcache.requests import CacheRequests, WriteRequest
from cpcache.state.allocator import PageAllocator
from cpcache.state.machine import CacheState
from tests.replicas.harness import Domain
from tests.support.fakes import FakeIO, IOPlan, OneRankEngine

HARNESS = Path(__file__).resolve().parents[2] / "replicas" / "harness.py"
PACKAGE = Path(__file__).resolve().parents[3] / "cpcache"
DRIVERS = ("tools", "testing")  # the package's folders that drive a cache but are not rank/
# What applying a round does to the state: only `apply_round` may call these.
ROUND_STEPS = {"open", "open_each", "apply", "questions", "take_changes", "take_closed", "forget"}
A_WRITE = CacheRequests(writes=(WriteRequest(1, (b"\x01" * 32,), (0,)),))


@pytest.fixture
def rounds(monkeypatch) -> list[int]:
    """The round numbers applied through `CacheRuntime.apply_round`."""
    applied: list[int] = []
    original = CacheRuntime.apply_round

    def counting(self, number, *args, **kwargs):
        applied.append(number)
        return original(self, number, *args, **kwargs)

    monkeypatch.setattr(CacheRuntime, "apply_round", counting)
    return applied


def test_the_harness_applies_rounds_through_the_ranks_apply_round(rounds):
    domain = Domain([IOPlan(max_delay=0), IOPlan(max_delay=0)], CacheConfig())
    domain.step(A_WRITE)
    domain.step(CacheRequests())
    assert rounds == [1, 1, 2, 2]  # each round once per replica
    assert domain.lead.ledger.by_op_id == {}  # the write opened and was acknowledged, through it


def test_the_stepper_applies_rounds_through_the_same_apply_round(rounds):
    async def two_steps() -> None:
        stepper = Stepper(OneRankEngine())  # type: ignore[arg-type]
        state = CacheState(CacheConfig(), PageAllocator(4), ShardingSpec(), 16, 64)
        stepper.runtime = CacheRuntime(state, FakeIO(IOPlan(max_delay=0)))  # type: ignore[arg-type]
        await stepper.step(1, Questions.empty(), A_WRITE)
        await stepper.step(2, Questions.empty(), CacheRequests())

    asyncio.run(two_steps())
    assert rounds == [1, 2]


def round_steps_called(tree: ast.AST) -> list[str]:
    """Where `tree` calls a step of the round itself (`os.open` is a file's, not the round's)."""
    return [f"line {node.lineno}: calls .{node.func.attr}(), a step of the round" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ROUND_STEPS
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "os")]


def test_the_harness_keeps_no_copy_of_the_round_and_touches_no_private_field():
    tree = ast.parse(HARNESS.read_text())
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert ("cpcache.rank.runtime", "CacheRuntime") in imported
    offenders = round_steps_called(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                offenders.append(f"line {node.lineno}: reads the private field .{node.attr}")
    assert not offenders, "\n".join(offenders)


def test_no_tool_or_test_kit_in_the_package_keeps_a_copy_of_the_round():
    assert all((PACKAGE / folder).is_dir() for folder in DRIVERS)
    modules = sorted(path for folder in DRIVERS for path in (PACKAGE / folder).rglob("*.py"))
    assert any(path.name == "state.py" and path.parent.name == "bench" for path in modules)  # the scan sees them
    offenders = [f"{path.relative_to(PACKAGE.parent)} {where}" for path in modules
                 for where in round_steps_called(ast.parse(path.read_text()))]
    assert not offenders, "\n".join(offenders)


def test_the_scan_finds_a_round_written_by_hand():
    by_hand = "state.check(requests)\nstate.open(number, requests)\nstate.apply(result)\nstate.index.take_changes()\n"
    assert [line.split(":")[0] for line in round_steps_called(ast.parse(by_hand))] == ["line 2", "line 3", "line 4"]
