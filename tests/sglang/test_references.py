"""The session's reference servers (tests/sglang/stacks.py References),
without SGLang: stand-in servers that record their starts and stops. One
start per model family and TP while stacks use it; idle ones stay up (up to
IDLE_KEPT) for the next user of their kind, the least recently asked for
stopped past that; one in use is never stopped; one found exited is started
again, its replies kept; an idle one is paused, and resumed when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.stacks import Shape
from tests.sglang import stacks


class Exited:
    def poll(self) -> int:
        return 0


class Running:
    def poll(self) -> None:
        return None


class Process:
    def __init__(self) -> None:
        self.proc: Running | Exited = Running()
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


class FakeServer:
    def __init__(self, name: str, model: Path, tp: int, log: list[str]) -> None:
        self.name, self.model, self.tp, self.log = name, model, tp, log
        self.process: Process | None = None

    def start(self) -> FakeServer:
        self.log.append(f"start {self.name}")
        self.process = Process()
        return self

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    log: list[str] = []
    monkeypatch.setattr(stacks, "make_tiny_model", lambda path, family: path)
    monkeypatch.setattr(stacks, "reference_server",
                        lambda name, model, work, family, tp: FakeServer(name, model, tp, log))
    return stacks.References(tmp_path), log


QWEN_CP, QWEN_CP_ZIGZAG = Shape("qwen3", tp=2, cp=2), Shape("qwen3", tp=2, cp=2, zigzag=True, storage="mooncake")
MLA_CP, LLAMA = Shape("deepseek_v2", tp=2, cp=2), Shape("llama", tp=2)
MOE_CP = Shape("qwen3_moe", tp=2, cp=2)


def test_stacks_of_one_family_and_tp_share_one_reference_and_its_replies(pool):
    references, log = pool
    with references.use(QWEN_CP) as first:
        first.replies[(1, 2)] = "reply"
    with references.use(QWEN_CP_ZIGZAG) as second:
        assert second is first and second.replies == {(1, 2): "reply"}
    assert log == ["start reference-qwen3-tp1"]
    assert first.server.model == references.model("qwen3") == references.work / "qwen3"


def test_idle_ones_stay_up_to_the_kept_number_then_the_least_recently_used_stops_never_one_in_use(pool):
    references, log = pool
    assert stacks.IDLE_KEPT == 3
    with references.use(QWEN_CP):
        with references.use(LLAMA):  # both in use: both up
            pass
        assert log == ["start reference-qwen3-tp1", "start reference-llama-tp2"]
    with references.use(MLA_CP):  # three kinds, two idle: all stay up
        pass
    with references.use(QWEN_CP):  # back to the first: no start
        pass
    assert log[2:] == ["start reference-deepseek_v2-tp1"]
    with references.use(MOE_CP):  # a fourth: the least recently asked for idle one (llama) stops first
        with references.use(LLAMA):  # again, while the fourth is in use: two in use, two idle
            pass
        assert log[3:] == ["stop reference-llama-tp2", "start reference-qwen3_moe-tp1", "start reference-llama-tp2"]
    # Four idle once the fourth is given back: the least recently asked for stops.
    assert log[6:] == ["stop reference-deepseek_v2-tp1"]
    references.stop()
    assert sorted(log[7:]) == ["stop reference-llama-tp2", "stop reference-qwen3-tp1", "stop reference-qwen3_moe-tp1"]


def test_a_reference_found_exited_starts_again_with_its_replies(pool):
    references, log = pool
    with references.use(QWEN_CP) as first:
        first.replies[(3,)] = "kept"
        first.server.process.proc = Exited()
    with references.use(QWEN_CP) as again:
        assert again is not first and again.replies == {(3,): "kept"}
    assert log == ["start reference-qwen3-tp1", "stop reference-qwen3-tp1", "start reference-qwen3-tp1"]


def test_an_idle_reference_is_paused_and_resumed_when_asked_for_again(pool):
    references, log = pool
    with references.use(QWEN_CP) as first:
        assert not first.server.process.paused
        with references.use(QWEN_CP_ZIGZAG):  # a second user: still running when the first leaves
            pass
        assert not first.server.process.paused
    assert first.server.process.paused  # nobody uses it: no CPU
    with references.use(QWEN_CP_ZIGZAG) as again:
        assert again is first and not again.server.process.paused
    assert log == ["start reference-qwen3-tp1"]

