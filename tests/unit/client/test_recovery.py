"""How a step whose call failed unanswered ends (client/recovery.py), in
every case of the daemon's and the peers' answers: the daemon that took the
step answers a retry with what it kept; once it is gone, the peers' daemons
tell; a peer that has not taken the step decides it only once this rank's
daemon is gone. (The same on real daemons: tests/multirank/test_daemon_loss_agreed.py.)"""

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


def peer(answer):
    asked = []

    def ask(request, timeout_s):
        asked.append((request.epoch, request.step))
        if isinstance(answer, BaseException):
            raise answer
        return answer
    ask.asked = asked
    return ask


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


def test_a_step_no_peer_took_fails_once_this_daemon_is_gone():
    with pytest.raises(errors.Unavailable):
        StepRecovery(daemon(GONE), [peer(failed_outcome(not_taken=True))], 1.0, 3.0).outcome(REQUEST, GONE)


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


def test_a_daemon_that_dies_while_retried_makes_a_peer_s_not_taken_final():
    own = daemon(DEADLINE, GONE)
    with pytest.raises(errors.Unavailable, match="not taken"):
        StepRecovery(own, [peer(failed_outcome(not_taken=True))], 0.01, 30.0).outcome(REQUEST, DEADLINE)
    assert len(own.sent) == 2


def test_nobody_can_tell_fails_with_the_step_s_own_error():
    with pytest.raises(errors.Unavailable, match="no daemon of the domain could tell"):
        StepRecovery(daemon(GONE), [], 1.0, 3.0).outcome(REQUEST, GONE)


def test_a_step_without_an_epoch_is_only_retried():
    bare = pb.StepRequest(step=7)
    other = peer(pb.OutcomeReply(reply=REPLY))
    with pytest.raises(errors.Unavailable):
        StepRecovery(daemon(GONE), [other], 1.0, 3.0).outcome(bare, GONE)
    assert other.asked == []
