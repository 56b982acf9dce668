"""What the fuzz sends and what may answer: the RPCs, the documented
statuses, the domain's small geometry, and one rank's untyped channel (so
raw bytes go out as they are)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from cpcache.client.wire_errors import error_info
from cpcache.geometry import KVGeometry
from cpcache.v1 import daemon_pb2 as pb

SERVICE = "/cpcache.v1.CacheDaemon/"
DECISIONS = ("Step",)
LOCALS = ("Attach", "WaitLoads", "Match", "Stats", "Status")
RPCS = ("Attach", "Step", "WaitLoads", "Match", "Stats", "Status")
REQUEST_TYPES: dict[str, type[Message]] = {
    "Attach": pb.AttachRequest, "Step": pb.StepRequest, "WaitLoads": pb.WaitLoadsRequest,
    "Match": pb.MatchRequest, "Stats": pb.StatsRequest, "Status": pb.StatusRequest,
}
DOCUMENTED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"}
ALLOWED = {rpc: DOCUMENTED | ({"UNAVAILABLE"} if rpc == "WaitLoads" else set()) for rpc in RPCS}

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
DEVICE_PAGES = 8
HOST_PAGES = 16
MAX_STEP = 2**63 - 1
DEADLINE_S = 10.0
AGREEMENT_TIMEOUT_S = 5.0
CONCURRENCY = 32


@dataclass
class CallOutcome:
    """One call's answer: its status code, error reason and message, or the reply's bytes."""

    code: str
    reason: str = ""
    message: str = ""
    reply: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def short(message: object) -> str:
    """A message on one line, cut to a length a report can hold."""
    text = str(message).replace("\n", " ")
    return text if len(text) < 600 else text[:600] + "..."


def parse(rpc: str, data: bytes) -> Message | None:
    """The request `data` decodes to, or None when it does not decode."""
    try:
        return REQUEST_TYPES[rpc].FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return None


class RankChannel:
    """One rank's CacheDaemon methods, bytes in and bytes out."""

    def __init__(self, socket: str) -> None:
        self.channel = grpc.aio.insecure_channel(
            "unix:" + socket, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        self.methods = {rpc: self.channel.unary_unary(SERVICE + rpc, request_serializer=None,
                                                      response_deserializer=None) for rpc in RPCS}

    async def call(self, rpc: str, data: bytes, deadline_s: float = DEADLINE_S) -> CallOutcome:
        try:
            reply = await self.methods[rpc](data, timeout=deadline_s)
        except grpc.aio.AioRpcError as exc:
            info = error_info(exc)
            return CallOutcome(exc.code().name, info.reason if info is not None else "", exc.details() or "")
        return CallOutcome("OK", reply=reply)

    async def close(self) -> None:
        await self.channel.close()
