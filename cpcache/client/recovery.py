"""How a step ended when its daemon gave no answer (docs/design.md rule 12: every
rank's scheduler applies the same decisions at the same step, whatever
happens to a daemon and whenever).

A daemon that lives answers every step within its agreement timeout: the
round completes or fails by then. A reply can still fail to come:

- the call's deadline passed (the scheduler, or the daemon's loop, stalled
  longer than the deadline): the same request is sent again, byte for byte,
  and the daemon answers it with the outcome it kept for that step;
- the daemon is gone (nothing listens on its socket, or a new instance that
  serves a later epoch answers `EpochEnded`): the daemons of its peers are
  asked how the step ended (`Outcome`). Every rank answers a step alike, so
  their answer is this rank's. A peer that has not taken the step answers
  that it failed: its round cannot complete without that peer.

A peer that cannot tell (it restarted too, or is unreachable) is skipped.
Only when no daemon can tell does the step fail with its own error, on this
rank alone; the SGLang backend's attach tries fall on absolute iterations,
so ranks that fell back apart still come back together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from cpcache import errors
from cpcache.client.wire_errors import error_from, error_info, step_error_from
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import NOT_TAKEN

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


@dataclass
class StepRecovery:
    """Finds the outcome of one step whose call failed unanswered."""

    resend: Resend
    peers: Sequence[Ask]
    timeout_s: float  # each call's deadline
    give_up_s: float  # the longest a stalled daemon is waited for, peers undecided

    def outcome(self, request: pb.StepRequest, failure: grpc.RpcError) -> pb.StepReply:
        """The reply every rank gets for `request`, or the typed error every
        rank gets for it (raised)."""
        give_up = time.monotonic() + self.give_up_s
        gone = daemon_gone(failure)
        while True:
            # The peers first: they answer as soon as the round is decided,
            # where this rank's stalled daemon may not.
            if request.HasField("epoch"):
                decided = self._ask_peers(request, final_if_not_taken=gone)
                if decided is not None:
                    if decided.HasField("reply"):
                        return decided.reply
                    raise step_error_from(decided.error)
            if gone or time.monotonic() > give_up:
                cause = error_from(failure)
                raise type(cause)(f"{cause}; no daemon of the domain could tell how step {request.step} "
                                  "ended") from None
            try:
                return self.resend(request, self.timeout_s)
            except grpc.RpcError as exc:
                if not unanswered(exc):
                    raise error_from(exc) from None
                failure, gone = exc, daemon_gone(exc)

    def _ask_peers(self, request: pb.StepRequest, final_if_not_taken: bool) -> pb.OutcomeReply | None:
        """The first peer's answer that decides the step; a peer that has not
        taken it decides it only once this rank's daemon is gone (a living one
        may still take part in its round with that peer)."""
        ask = pb.OutcomeRequest(epoch=request.epoch, step=request.step)
        for peer in self.peers:
            try:
                answer = peer(ask, self.timeout_s)
            except grpc.RpcError:
                continue  # this peer cannot tell
            if answer.HasField("error") and answer.error.metadata.get(NOT_TAKEN) and not final_if_not_taken:
                continue
            if answer.HasField("reply") or answer.HasField("error"):
                return answer
        return None
