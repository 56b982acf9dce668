"""The `Steps` stream is guarded as `Step` is (`status.guarded`): a body
that does not decode, a refused step and a bug each end the stream with the
status `Step` would answer, and nothing is written for it."""

import contextlib

import grpc
import pytest

from cpcache import errors
from cpcache.daemon.servicer import CacheDaemonServicer
from cpcache.daemon.status import Undecodable
from cpcache.v1 import daemon_pb2 as pb


class Rank:
    def __init__(self, raised: Exception) -> None:
        self.raised = raised
        self.steps: list[int] = []

    async def step(self, step, votes, requests, **kwargs):
        self.steps.append(step)
        raise self.raised


class Daemon:
    def __init__(self, raised: Exception) -> None:
        self.rank = Rank(raised)

    def in_flight(self):
        return contextlib.nullcontext()


class StreamContext:
    """One stream's server side: the requests to read, then EOF."""

    def __init__(self, *requests) -> None:
        self.requests = [*requests, grpc.aio.EOF]
        self.written: list = []
        self.status: grpc.Status | None = None

    async def read(self):
        return self.requests.pop(0)

    async def write(self, message) -> None:
        self.written.append(message)

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.status = status
        raise grpc.aio.AbortError()


async def steps(raised: Exception, *requests) -> tuple[StreamContext, Daemon]:
    daemon = Daemon(raised)
    context = StreamContext(*requests)
    with pytest.raises(grpc.aio.AbortError):
        await CacheDaemonServicer(daemon).Steps(None, context)
    assert context.written == []
    return context, daemon


async def test_an_undecodable_body_ends_the_stream_invalid_argument():
    context, daemon = await steps(AssertionError("never stepped"), Undecodable(ValueError("truncated")))
    assert context.status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request body does not decode: truncated" in context.status.details
    assert daemon.rank.steps == []


async def test_a_refused_step_ends_the_stream_with_its_status():
    context, daemon = await steps(errors.StepOrder("steps must strictly increase", last_step=9),
                                  pb.StepRequest(step=3))
    assert context.status.code == grpc.StatusCode.FAILED_PRECONDITION
    assert context.status.details == "steps must strictly increase"
    assert daemon.rank.steps == [3]


async def test_a_bug_ends_the_stream_internal_and_is_logged(caplog):
    context, _ = await steps(KeyError("boom"), pb.StepRequest(step=1))
    assert context.status.code == grpc.StatusCode.INTERNAL
    assert "KeyError" in context.status.details
    assert "bug in Steps" in caplog.text
