"""Closing the agreement engine ends its epoch (docs/design.md rule 10): the round in
its collective ends as it ends on its peers (delivered if it completed,
failed if it failed), rounds not begun never begin, the thread is really joined,
the groups are destroyed, and a failure never eats the close sentinel."""

import threading

import numpy as np
import pytest

from cpcache.agreement.engine import AgreementEngine
from cpcache.agreement.rounds import Questions, RoundInput
from cpcache.errors import PeerLost, Unavailable

pytestmark = pytest.mark.timeout(30)


class GatedReducer:
    """A collective that waits until the test lets it end (as a peer entering
    the round would), or fails it (as a lost peer would)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = False
        self.closed = threading.Event()

    def min_inplace(self, vector: np.ndarray) -> None:
        self.entered.set()
        self.release.wait()
        if self.fail:
            raise RuntimeError("gloo: connection closed by peer")

    def close(self) -> None:
        self.closed.set()


def engine_over(reducer):
    return AgreementEngine(reducer, None, lambda n, exc: PeerLost(f"round {n}: {exc}", (1,)))


def round_input(number):
    return RoundInput.pack(number, Questions.empty(), digest=0)


def test_a_round_its_peer_completes_after_the_close_is_delivered_and_the_thread_joined():
    reducer = GatedReducer()
    engine = engine_over(reducer)
    in_collective = engine.submit(round_input(1))
    queued = engine.submit(round_input(2))
    assert reducer.entered.wait(10)
    closing = threading.Thread(target=engine.close, kwargs=dict(why="epoch 0 was left"))
    closing.start()
    with pytest.raises(Unavailable, match="epoch 0 was left"):
        queued.result(10)  # never begun
    assert not reducer.closed.is_set()  # the groups outlive the collective that uses them
    reducer.release.set()  # a peer enters the round late and completes it
    closing.join(10)
    assert not closing.is_alive() and reducer.closed.is_set()
    assert in_collective.result(10).number == 1  # agreed: the peer that completed it has it too
    with pytest.raises(Unavailable, match="epoch 0 was left"):
        engine.submit(round_input(3)).result(10)


def test_a_failed_round_does_not_eat_the_close_sentinel():
    reducer = GatedReducer()
    engine = engine_over(reducer)
    failing = engine.submit(round_input(1))
    assert reducer.entered.wait(10)
    engine.submit(round_input(2))
    closing = threading.Thread(target=engine.close)
    closing.start()
    reducer.fail = True
    reducer.release.set()  # the round fails: pending rounds are failed, the sentinel stays
    closing.join(10)
    assert not closing.is_alive() and reducer.closed.is_set()
    with pytest.raises(Unavailable):
        failing.result(10)
