"""How a step whose call failed unanswered ends (client/recovery.py), in
every case of the daemon's and the peers' answers: the daemon that took the
step answers a retry with what it kept; once it is gone, the peers' daemons
tell; a peer that has not taken the step decides it only once this rank's
daemon is gone, by fencing it; a peer that may still tell is asked again,
one that never can is not waited for. (The same on real daemons:
tests/multirank/test_daemon_loss_agreed.py.)"""

import grpc
import pytest

from cpcache import errors
from cpcache.client.recovery import StepRecovery, daemon_gone, unanswered
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import NOT_TAKEN

pytestmark = pytest.mark.timeout(30)

REQUEST = pb.StepRequest(step=7, epoch=3)
REPLY = pb.StepReply(step=7, round=7, state_digest=42, epoch=3)


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name

    def trailing_metadata(self):
        return ()


DEADLINE = Failed(grpc.StatusCode.DEADLINE_EXCEEDED)
GONE = Failed(grpc.StatusCode.UNAVAILABLE)


def daemon(*answers):
    """The rank's own daemon: each resend takes the next answer (raised if an error)."""
    sent = []

    def resend(request, timeout_s):
        sent.append(request.SerializeToString())
        answer = answers[min(len(sent) - 1, len(answers) - 1)]
        if isinstance(answer, BaseException):
            raise answer
        return answer
    resend.sent = sent
    return resend


def peer(*answers):
    """A peer's daemon: each ask takes the next answer (raised if an error)."""
    asked = []

    def ask(request, timeout_s):
        asked.append((request.epoch, request.step))
        answer = answers[min(len(asked) - 1, len(answers) - 1)]
        if isinstance(answer, BaseException):
            raise answer
        return answer
    ask.asked = asked
    return ask


def fencing_peer():
    """A peer's daemon that has not taken the step: "not taken" while the
    asker's daemon may still take part, the fenced failure once it is gone."""
    fences = []

    def ask(request, timeout_s):
        fences.append((request.fence, request.asking_rank if request.HasField("asking_rank") else None))
        if not request.fence:
            return failed_outcome(not_taken=True)
        return pb.OutcomeReply(error=pb.StepError(status="UNAVAILABLE", reason="PEER_LOST",
                                                  message="step 7 failed: fenced"))
    ask.fences = fences
    return ask


def no_pause(seconds):
    pass


def failed_outcome(not_taken=False):
    error = pb.StepError(status="UNAVAILABLE", reason="PEER_LOST", message="rank 1 did not take part")
    if not_taken:
        error.reason, error.message = "UNAVAILABLE", "rank 1 has not taken step 7"
        error.metadata[NOT_TAKEN] = "1"
    return pb.OutcomeReply(error=error)


def test_what_counts_as_unanswered():
    assert unanswered(DEADLINE) and not daemon_gone(DEADLINE)
    assert unanswered(GONE) and daemon_gone(GONE)
    assert not unanswered(Failed(grpc.StatusCode.FAILED_PRECONDITION))


def test_a_deadline_passed_is_answered_by_a_retry_of_the_same_bytes():
    own = daemon(REPLY)
    assert StepRecovery(own, [], 1.0, 3.0).outcome(REQUEST, DEADLINE) == REPLY
    assert own.sent == [REQUEST.SerializeToString()]


def test_a_daemon_gone_after_its_round_leaves_the_step_to_a_peer_that_decided_it():
    own, other = daemon(GONE), peer(pb.OutcomeReply(reply=REPLY))
    assert StepRecovery(own, [other], 1.0, 3.0).outcome(REQUEST, GONE) == REPLY
    assert own.sent == [] and other.asked == [(3, 7)]


def test_a_round_that_failed_on_the_peers_fails_here_with_their_error():
    with pytest.raises(errors.PeerLost, match="did not take part"):
        StepRecovery(daemon(GONE), [peer(failed_outcome())], 1.0, 3.0).outcome(REQUEST, GONE)


def test_a_peer_that_cannot_tell_is_skipped_for_one_that_can():
    skipped, decided = peer(Failed(grpc.StatusCode.UNAVAILABLE)), peer(pb.OutcomeReply(reply=REPLY))
    assert StepRecovery(daemon(GONE), [skipped, decided], 1.0, 3.0).outcome(REQUEST, GONE) == REPLY


def test_a_step_no_peer_took_is_fenced_once_this_daemon_is_gone():
    other = fencing_peer()
    with pytest.raises(errors.PeerLost, match="fenced"):
        StepRecovery(daemon(GONE), [other], 1.0, 3.0, rank=2).outcome(REQUEST, GONE)
    assert other.fences == [(True, 2)]


def test_a_step_no_peer_took_yet_waits_for_a_living_daemon():
    """A stalled daemon may still take part in the round with that peer: its
    own answer is awaited."""
    own = daemon(DEADLINE, DEADLINE, REPLY)
    other = peer(failed_outcome(not_taken=True))
    assert StepRecovery(own, [other], 0.01, 30.0).outcome(REQUEST, DEADLINE) == REPLY
    assert len(own.sent) == 3 and len(other.asked) == 3


def test_a_peer_that_decided_answers_before_a_stalled_daemon_is_waited_for_again():
    own = daemon(DEADLINE)
    other = peer(pb.OutcomeReply(reply=REPLY))
    assert StepRecovery(own, [other], 0.01, 30.0).outcome(REQUEST, DEADLINE) == REPLY
    assert own.sent == []


def test_a_daemon_that_dies_while_retried_has_its_step_fenced():
    own, other = daemon(DEADLINE, GONE), fencing_peer()
    with pytest.raises(errors.PeerLost, match="fenced"):
        StepRecovery(own, [other], 0.01, 30.0).outcome(REQUEST, DEADLINE)
    assert len(own.sent) == 2 and other.fences == [(False, None), (False, None), (True, None)]


def test_a_stopped_peer_is_asked_again_until_it_tells():
    """This rank's daemon died between its round and its reply; the peer that
    applied the step is stopped for longer than a call's deadline."""
    pauses = []
    other = peer(DEADLINE, DEADLINE, pb.OutcomeReply(reply=REPLY))
    recovery = StepRecovery(daemon(GONE), [other], 0.01, 30.0, pause=pauses.append)
    assert recovery.outcome(REQUEST, GONE) == REPLY
    assert len(other.asked) == 3 and pauses == [0.05, 0.1]


def test_a_flooded_peer_is_asked_again():
    other = peer(Failed(grpc.StatusCode.RESOURCE_EXHAUSTED), pb.OutcomeReply(reply=REPLY))
    assert StepRecovery(daemon(GONE), [other], 0.01, 30.0, pause=no_pause).outcome(REQUEST, GONE) == REPLY


def test_a_peer_that_may_tell_is_waited_for_no_longer_than_the_wait():
    other = peer(DEADLINE)
    with pytest.raises(errors.Unavailable, match=r"no daemon of the domain told within 0s"):
        StepRecovery(daemon(GONE), [other], 0.01, 0.05, pause=no_pause).outcome(REQUEST, GONE)
    assert len(other.asked) >= 2


def test_peers_that_can_never_tell_are_not_waited_for():
    """Nothing listens on their sockets, or they restarted: no later ask can tell."""
    pauses = []
    dead, restarted = peer(GONE), peer(Failed(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(errors.Unavailable, match="can tell"):
        StepRecovery(daemon(GONE), [dead, restarted], 0.01, 30.0, pause=pauses.append).outcome(REQUEST, GONE)
    assert pauses == []


def test_nobody_can_tell_fails_with_the_step_s_own_error():
    with pytest.raises(errors.Unavailable, match="no daemon of the domain can tell"):
        StepRecovery(daemon(GONE), [], 1.0, 3.0).outcome(REQUEST, GONE)


def test_a_step_without_an_epoch_is_only_retried():
    bare = pb.StepRequest(step=7)
    other = peer(pb.OutcomeReply(reply=REPLY))
    with pytest.raises(errors.Unavailable):
        StepRecovery(daemon(GONE), [other], 1.0, 3.0).outcome(bare, GONE)
    assert other.asked == []
