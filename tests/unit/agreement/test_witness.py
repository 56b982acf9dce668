"""A round that fails here may have completed on a peer (docs/design.md rule
4): the engine asks its peers before it fails the round, and a peer's result
for it is delivered here as the peers apply it; a result that does not hold
this rank's values is never applied; nothing is written per completed round."""

import threading

import numpy as np
import pytest

from cpcache.agreement.collective import Rendezvous, host_store
from cpcache.agreement.engine import AgreementEngine, Recovered, RoundFaults
from cpcache.agreement.rounds import Questions, RoundInput
from cpcache.agreement.witness import Record, RoundWitness, record_key, wanted_key
from cpcache.errors import PeerLost
from cpcache.values import Reduce

pytestmark = pytest.mark.timeout(60)


class Reducer:
    """A domain of ranks whose other ranks always send `peer_values`; fails
    (as a timeout would) the rounds listed in `failing`."""

    def __init__(self, failing=()) -> None:
        self.failing = set(failing)
        self.rounds = 0
        self.closed = threading.Event()

    def min_inplace(self, vector: np.ndarray) -> None:
        self.rounds += 1
        if self.rounds in self.failing:
            raise RuntimeError("gloo: Timed out waiting 2000ms for recv operation to complete")

    def close(self) -> None:
        self.closed.set()


def voted(number, value=5):
    return RoundInput.pack(number, Questions.votes([9], [Reduce.MIN], [value]), digest=0)


def test_a_failed_round_a_peer_completed_is_delivered_as_there_and_the_engine_breaks_after_it():
    asked = []
    peer_result, _ = voted(2, value=3).reduce(lambda v: None, 64)  # the peer's MIN: 3 (this rank sent 5)

    def diagnose(number, exc):
        asked.append(number)
        return Recovered(1, peer_result, PeerLost(f"round {number} ended the epoch"))

    reducer = Reducer(failing={2})
    engine = AgreementEngine(reducer, None, diagnose)
    assert engine.submit(voted(1)).result(10).number == 1
    result = engine.submit(voted(2)).result(10)
    assert (result.number, list(result.values)) == (2, [3])
    assert asked == [2] and engine.rounds_recovered == 1
    with pytest.raises(PeerLost, match="round 2 ended the epoch"):
        engine.submit(voted(3)).result(10)
    assert reducer.rounds == 2  # no round runs after the recovered one
    engine.close()


def test_a_result_without_this_ranks_values_is_never_applied():
    other, _ = voted(2, value=7).reduce(lambda v: None, 64)  # 7 > this rank's 5: not a MIN over it

    def diagnose(number, exc):
        return Recovered(1, other, PeerLost("the epoch ends"))

    engine = AgreementEngine(Reducer(failing={1}), None, diagnose)
    with pytest.raises(PeerLost, match="the epoch ends"):
        engine.submit(voted(2)).result(10)
    assert engine.rounds_recovered == 0
    engine.close()


def test_a_round_lost_after_it_completed_by_fault_injection_asks_like_a_timed_out_one():
    asked = []

    def diagnose(number, exc):
        asked.append((number, str(exc)))
        return PeerLost(f"round {number} failed")

    reducer = Reducer()
    engine = AgreementEngine(reducer, None, diagnose, faults=RoundFaults(lost_after_complete=2))
    assert engine.submit(voted(1)).result(10).number == 1
    with pytest.raises(PeerLost, match="round 2 failed"):
        engine.submit(voted(2)).result(10)
    assert reducer.rounds == 2 and asked[0][0] == 2 and "fault injection" in asked[0][1]
    engine.close()


@pytest.fixture
def rdzv():
    store = host_store()
    yield Rendezvous("127.0.0.1", store.port, "edge-test", epoch=3, timeout_s=10.0)
    del store


def test_records_are_published_only_once_a_peer_asks(rdzv):
    store = rdzv.connect()
    witness = RoundWitness(rdzv, 1, (0, 1, 2))
    witness.completed(4, np.arange(3, dtype=np.int64))
    witness.beat(store, 4)
    assert not store.check([record_key(rdzv, 1)])  # nobody asked: nothing written
    asking = RoundWitness(rdzv, 0, (0, 1, 2))
    asking.failed()
    asking.beat(store, 0)  # raises the flag, publishes its own (final) record
    assert store.check([wanted_key(rdzv, (0, 1, 2))])
    assert Record.decode(store.get(record_key(rdzv, 0))).final
    witness.beat(store, 5)
    record = Record.decode(store.get(record_key(rdzv, 1)))
    assert (record.number, record.final, record.entered, list(record.vector)) == (4, False, 5, [0, 1, 2])
    witness.completed(5, np.arange(2, dtype=np.int64))  # a peer still in the round may complete it later
    witness.beat(store, 5)
    assert Record.decode(store.get(record_key(rdzv, 1))).number == 5


def test_recover_finds_a_peers_result_or_ends_once_every_live_peer_is_final_below(rdzv):
    store = rdzv.connect()
    ranks = (0, 1, 2)
    mine, completer, late = (RoundWitness(rdzv, r, ranks) for r in ranks)
    mine.failed()
    mine.beat(store, 0)
    late.completed(6, np.array([1], dtype=np.int64))
    late.ended()
    late.beat(store, 0)
    completer.completed(7, np.array([4, 2], dtype=np.int64))
    completer.beat(store, 7)
    assert mine.recover(store, rdzv.connect, 7, {}, 30.0, 0.01, 0.0)[0] == 1
    # Nobody completed round 8: one peer is final below it, the other had
    # not entered it when the flag was up (it cannot complete it any more).
    assert mine.recover(store, rdzv.connect, 8, {}, 30.0, 0.01, 0.0) is None


def test_recover_waits_for_a_peer_that_entered_the_round_until_it_completes_it(rdzv):
    store = rdzv.connect()
    ranks = (0, 1)
    mine, peer = RoundWitness(rdzv, 0, ranks), RoundWitness(rdzv, 1, ranks)
    mine.failed()
    mine.beat(store, 3)
    peer.completed(2, np.array([1], dtype=np.int64))
    peer.beat(store, 3)  # in round 3: it may yet complete it

    class Polled:
        """The store, the peer completing round 3 at the third poll."""

        polls = 0

        def check(self, keys):
            Polled.polls += 1
            if Polled.polls == 3:
                peer.completed(3, np.array([0], dtype=np.int64))
                peer.beat(store, 3)
            return store.check(keys)

        def get(self, key):
            return store.get(key)

    rank, vector = mine.recover(Polled(), rdzv.connect, 3, {}, 60.0, 0.01, 0.0)
    assert (rank, list(vector), Polled.polls) == (1, [0], 3)


def test_recover_counts_a_peer_dead_only_while_its_beat_stays_still(rdzv):
    store = rdzv.connect()
    ranks = (0, 1, 2)
    mine, live = RoundWitness(rdzv, 0, ranks), RoundWitness(rdzv, 1, ranks)
    mine.failed()
    mine.beat(store, 0)
    live.ended()
    live.beat(store, 0)
    store.set("beat-of-2", "1 8")
    assert mine.recover(store, rdzv.connect, 8, {2: "beat-of-2"}, 30.0, 0.01, 0.05) is None
