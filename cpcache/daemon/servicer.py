"""The CacheDaemon servicer: a thin translation between protobuf messages and
the coordinator. Validation and decisions live in the core."""

from __future__ import annotations

import grpc

from cpcache.coordinator import Coordinator, StepOutcome, Vote
from cpcache.daemon.status import guarded
from cpcache.errors import InvalidArgument
from cpcache.rounds import Reduce
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

_REDUCE_FROM_WIRE = {pb.REDUCE_MIN: Reduce.MIN, pb.REDUCE_MAX: Reduce.MAX}


def votes_from_wire(votes: pb.Votes) -> list[Vote]:
    n = len(votes.op_ids)
    if len(votes.reduces) != n or len(votes.values) != n:
        raise InvalidArgument(
            f"votes: op_ids, reduces and values must have equal lengths, got "
            f"{n}, {len(votes.reduces)}, {len(votes.values)}"
        )
    out = []
    for op_id, reduce, value in zip(votes.op_ids, votes.reduces, votes.values):
        if reduce not in _REDUCE_FROM_WIRE:
            raise InvalidArgument(f"votes: operation {op_id} has no valid reduce (REDUCE_MIN or REDUCE_MAX)")
        out.append(Vote(op_id, _REDUCE_FROM_WIRE[reduce], value))
    return out


def step_reply(outcome: StepOutcome) -> pb.StepReply:
    reply = pb.StepReply(step=outcome.step, round=outcome.round, state_digest=outcome.digest)
    if outcome.decisions:
        op_ids, values = zip(*outcome.decisions)
        reply.decisions.op_ids.extend(op_ids)
        reply.decisions.values.extend(values)
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

