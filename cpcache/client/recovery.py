"""How a step ended when its daemon gave no answer (docs/design.md rule 12: every
rank's scheduler applies the same decisions at the same step, whatever
happens to a daemon and whenever).

A daemon that lives answers every step within its agreement timeout: the
round completes or fails by then. A reply can still fail to come:

- the call's deadline passed (the scheduler, or the daemon's loop, stalled
  longer than the deadline): the same request is sent again, byte for byte,
  and the daemon answers it with the outcome it kept for that step;
- the daemon is gone (nothing listens on its socket, or a new instance that
  serves a later epoch answers `EpochEnded`): what it recorded of the step
  in its outcome ring (`step_outcomes`, written before it answers) is read
  first; failing that, the daemons of its peers are
  asked how the step ended (`Outcome`). Every rank answers a step alike, so
  their answer is this rank's. A peer that has not taken the step is asked
  to fence it (`OutcomeRequest.fence`): it fails the step for good, on its
  own rank too, so no round of it completes later, and that failure is the
  answer everywhere.

A peer that may still tell (it did not answer in time: stopped, swapped,
flooded) is asked again, with a growing pause, for up to `wait_s`: guessing
would split the ranks, and a rank waiting here holds its server no longer
than a split would (the model's next collective) before the server's own
watchdog. A peer that can never tell (it restarted, or nothing listens) is
not waited for. Only when no daemon that may tell answers within `wait_s`,
or none can ever tell, does the step fail with its own error on this rank
alone; the SGLang backend's attach tries fall on absolute iterations, so
ranks that fell back apart still come back together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from cpcache import errors
from cpcache.client.wire_errors import error_from, error_info, step_error_from
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import NOT_TAKEN

Recorded = Callable[[int, int], bytes | None]  # the rank's own daemon's outcome ring: (epoch, step) -> OutcomeReply
Resend = Callable[[pb.StepRequest, float], pb.StepReply]  # the rank's own daemon; raises grpc.RpcError
Ask = Callable[[pb.OutcomeRequest, float], pb.OutcomeReply]  # a peer's daemon; raises grpc.RpcError

# Codes of a call the daemon did not answer: its outcome is unknown.
_UNANSWERED = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def unanswered(exc: grpc.RpcError) -> bool:
    """Whether a failed step call says nothing of how the step ended."""
    info = error_info(exc)
    if info is not None:
        return info.reason == errors.EpochEnded.reason  # a new instance of the daemon: not the one that took it
    return exc.code() in _UNANSWERED


def daemon_gone(exc: grpc.RpcError) -> bool:
    """Whether the daemon that took the step can no longer answer it."""
    info = error_info(exc)
    if info is not None:
        return info.reason == errors.EpochEnded.reason
    return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


# Codes of a peer's `Outcome` call that may answer if asked again.
_MAY_TELL_LATER = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
FIRST_PAUSE_S = 0.05
LONGEST_PAUSE_S = 1.0


@dataclass
class _Heard:
    """What the peers said of a step: the answer that decides it, if any, and
    whether a peer that has not decided it may still tell."""

    decided: pb.OutcomeReply | None = None
    may_tell: bool = False


@dataclass
class StepRecovery:
    """Finds the outcome of one step whose call failed unanswered."""

    resend: Resend
    peers: Sequence[Ask]
    timeout_s: float  # each call's deadline
    wait_s: float  # the longest a daemon that may still tell is waited for, none having told
    rank: int | None = None  # this scheduler's rank, named in a fence
    pause: Callable[[float], None] = time.sleep
    recorded: Recorded | None = None

    def outcome(self, request: pb.StepRequest, failure: grpc.RpcError) -> pb.StepReply:
        """The reply every rank gets for `request`, or the typed error every
        rank gets for it (raised)."""
        give_up = time.monotonic() + self.wait_s
        gone = daemon_gone(failure)
        pause_s = FIRST_PAUSE_S
        while True:
            # What this rank's own daemon recorded first (it decided the step
            # with its peers, whatever became of it since); then the peers:
            # they answer as soon as the round is decided, where this rank's
            # stalled daemon may not.
            heard = self._read_record(request) if request.HasField("epoch") else _Heard()
            if heard.decided is None and request.HasField("epoch"):
                heard = self._ask_peers(request, fence=gone, give_up=give_up)
            if heard.decided is not None:
                if heard.decided.HasField("reply"):
                    return heard.decided.reply
                raise step_error_from(heard.decided.error)
            out_of_time = time.monotonic() > give_up
            if out_of_time or (gone and not heard.may_tell):
                cause = error_from(failure)
                why = (f"no daemon of the domain told within {self.wait_s:.0f}s" if out_of_time
                       else "no daemon of the domain can tell")
                raise type(cause)(f"{cause}; {why} how step {request.step} ended") from None
            if gone:
                self.pause(pause_s)
                pause_s = min(2 * pause_s, LONGEST_PAUSE_S)
                continue
            try:
                return self.resend(request, max(0.05, min(self.timeout_s, give_up - time.monotonic())))
            except grpc.RpcError as exc:
                if not unanswered(exc):
                    raise error_from(exc) from None
                failure, gone = exc, daemon_gone(exc)

    def _read_record(self, request: pb.StepRequest) -> _Heard:
        payload = self.recorded(request.epoch, request.step) if self.recorded is not None else None
        if payload is None:
            return _Heard()
        told = pb.OutcomeReply()
        try:
            told.ParseFromString(payload)
        except DecodeError:  # a record that does not read: as if none
            return _Heard()
        if told.HasField("reply") and (told.reply.step, told.reply.epoch) != (request.step, request.epoch):
            return _Heard()  # another step's reply: as if none
        return _Heard(decided=told) if told.HasField("reply") or told.HasField("error") else _Heard()

    def _ask_peers(self, request: pb.StepRequest, fence: bool, give_up: float) -> _Heard:
        """The first peer's answer that decides the step. A peer that has
        not taken it decides it once this rank's daemon is gone, by fencing
        it (a living daemon may still take part in its round with that peer)."""
        ask = pb.OutcomeRequest(epoch=request.epoch, step=request.step, fence=fence)
        if fence and self.rank is not None:
            ask.asking_rank = self.rank
        heard = _Heard()
        for peer in self.peers:
            # No ask outlasts the wait: several stopped peers cost it once, not once each.
            timeout_s = max(0.05, min(self.timeout_s, give_up - time.monotonic()))
            try:
                answer = peer(ask, timeout_s)
            except grpc.RpcError as exc:
                heard.may_tell |= exc.code() in _MAY_TELL_LATER  # stopped or flooded: ask again
                continue
            if answer.HasField("error") and answer.error.metadata.get(NOT_TAKEN):
                heard.may_tell = True  # it may take the step with this rank's daemon yet
                continue
            if answer.HasField("reply") or answer.HasField("error"):
                heard.decided = answer
                return heard
        return heard
