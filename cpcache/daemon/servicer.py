"""The CacheDaemon servicer: a thin translation between protobuf messages and
the coordinator. Validation and decisions live in the core."""

from __future__ import annotations

import grpc

from cpcache.coordinator import Coordinator, StepOutcome
from cpcache.daemon.status import guarded
from cpcache.errors import InvalidArgument
from cpcache.rounds import Questions
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

def votes_from_wire(votes: pb.Votes) -> Questions:
    # The wire's Reduce numbers are the core's (REDUCE_MIN = 1, REDUCE_MAX = 2);
    # anything else is refused by the validation in `Questions.votes`.
    return Questions.votes(votes.op_ids, votes.reduces, votes.values)


def step_reply(outcome: StepOutcome) -> pb.StepReply:
    reply = pb.StepReply(step=outcome.step, round=outcome.round, state_digest=outcome.digest)
    reply.decisions.op_ids.extend(outcome.op_ids.tolist())
    reply.decisions.values.extend(outcome.values.tolist())
    return reply


class CacheDaemonServicer(pb_grpc.CacheDaemonServicer):
    def __init__(self, daemon) -> None:
        """`daemon` is the running `cpcache.daemon.server.Daemon`."""
        self._daemon = daemon

    def _coordinator(self) -> Coordinator:
        return self._daemon.admit_decision()

    @guarded
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        coordinator = self._coordinator()
        if request.step == 0:
            raise InvalidArgument("step must be >= 1")
        with self._daemon.in_flight():
            outcome = await coordinator.step(request.step, votes_from_wire(request.votes))
        return step_reply(outcome)

    @guarded
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return self._daemon.status()

