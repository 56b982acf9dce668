"""Typed errors end to end: what a handler raises under `guarded` is what
the scheduler catches, through a real grpc.aio server on a unix socket, with
both client faces."""

import asyncio

import grpc
import pytest

from cpcache import errors
from cpcache.client import AsyncClient, Client, calls
from cpcache.daemon.metrics import RpcMetrics
from cpcache.daemon.status import guarded
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc


class BrokenMetadata(errors.InvalidArgument):
    def metadata(self) -> dict[str, str]:
        raise RuntimeError("bug in metadata()")


# Step n raises RAISED[n]; then what the client must rebuild: class, code, attributes.
RAISED = {
    1: errors.PeerLost("ranks [2, 5] missed round 8", (2, 5)),
    2: errors.RejectedByPeer("rank 3 rejected step 7", rank=3, step=7, peer_status="INVALID_ARGUMENT",
                             peer_message="op 4 appears twice"),
    3: errors.Divergence("divergence: question sets differ", round_number=4),
    4: errors.StepOrder("steps must strictly increase", last_step=9),
    5: errors.InvalidArgument("step must be >= 1"),
    6: errors.ResourceExhausted("host pool full"),
    7: errors.NotFound("load 12 is not in flight on this rank"),
    8: KeyError("boom"),
    9: BrokenMetadata("broken"),
}
EXPECTED = {
    1: (errors.PeerLost, "UNAVAILABLE", dict(missing_ranks=(2, 5))),
    2: (errors.RejectedByPeer, "FAILED_PRECONDITION",
        dict(rank=3, step=7, peer_status="INVALID_ARGUMENT", peer_message="op 4 appears twice")),
    3: (errors.Divergence, "FAILED_PRECONDITION", dict(round_number=4)),
    4: (errors.StepOrder, "FAILED_PRECONDITION", dict(last_step=9)),
    5: (errors.InvalidArgument, "INVALID_ARGUMENT", {}),
    6: (errors.ResourceExhausted, "RESOURCE_EXHAUSTED", {}),
    7: (errors.NotFound, "NOT_FOUND", {}),
    8: (errors.CacheError, "INTERNAL", {}),
    9: (errors.CacheError, "INTERNAL", {}),
}


class CountingMetrics(RpcMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def _end(self, key: tuple[str, str, str], code: str, start: float) -> None:
        super()._end(key, code, start)
        self.changed.set()


class FakeServicer(pb_grpc.CacheDaemonServicer):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.metrics = CountingMetrics()  # the daemon's per-RPC metrics interceptor

    async def wait_counted(self, method: str, code: str) -> None:
        """The status reaches the client before the handler's `finally` runs."""
        key = ("cpcache.v1.CacheDaemon", method, "unary", code)
        while key not in self.metrics.handled:
            self.metrics.changed.clear()
            await asyncio.wait_for(self.metrics.changed.wait(), 5)

    @guarded
    async def Step(self, request, context):
        raise RAISED[request.step]

    @guarded
    async def Status(self, request, context):  # held until the test releases it
        await self.release.wait()
        return pb.StatusReply()

    @guarded
    async def Match(self, request, context):  # a plain status, without ErrorInfo
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no details here")

    @guarded
    async def Stats(self, request, context):
        return pb.StatsReply(counters={"hits": 3})


@pytest.fixture
async def daemon(run_dir):
    servicer = FakeServicer()
    server = grpc.aio.server(interceptors=[servicer.metrics])
    pb_grpc.add_CacheDaemonServicer_to_server(servicer, server)
    socket = str(run_dir / "d.sock")
    server.add_insecure_port("unix:" + socket)
    await server.start()
    yield socket, servicer
    servicer.release.set()
    await server.stop(None)


class Faces:
    """Both clients behind one awaitable call, the blocking one off the loop
    (the server runs on it)."""

    def __init__(self, kind: str, socket: str, timeout_s: float = 5.0) -> None:
        self.kind = kind
        self.client = (AsyncClient if kind == "async" else Client)(socket, timeout_s=timeout_s)

    async def call(self, method: str, *args):
        if self.kind == "async":
            return await getattr(self.client, method)(*args)
        return await asyncio.to_thread(getattr(self.client, method), *args)

    async def close(self) -> None:
        if self.kind == "async":
            await self.client.close()
        else:
            self.client.close()


@pytest.fixture(params=["async", "blocking"])
async def face(request, daemon):
    f = Faces(request.param, daemon[0])
    yield f
    await f.close()


@pytest.mark.parametrize("step", sorted(RAISED), ids=[type(RAISED[s]).__name__ for s in sorted(RAISED)])
async def test_an_error_comes_back_as_its_type(daemon, face, step):
    kind, code, attributes = EXPECTED[step]
    with pytest.raises(errors.CacheError) as info:
        await face.call("step", step)
    error = info.value
    assert type(error) is kind
    assert str(error).startswith(f"{code}: ")
    for name, value in attributes.items():
        assert getattr(error, name) == value, name
    if kind is not errors.CacheError:
        assert str(error) == f"{code}: {RAISED[step]}"
        assert error.metadata() == RAISED[step].metadata()
    await daemon[1].wait_counted("Step", code)


async def test_a_bug_is_internal_with_its_exception_named_and_logged(daemon, face, caplog):
    with pytest.raises(errors.CacheError, match="INTERNAL: internal error: KeyError: 'boom'"):
        await face.call("step", 8)
    assert "bug in Step" in caplog.text and "KeyError" in caplog.text


async def test_a_status_without_error_info_falls_back_to_its_code(daemon, face):
    with pytest.raises(errors.FailedPrecondition) as info:
        await face.call("match", [b"\0" * 32])
    assert type(info.value) is errors.FailedPrecondition
    assert str(info.value) == "FAILED_PRECONDITION: no details here"


async def test_replies_still_read(daemon, face):
    assert await face.call("stats") == {"hits": 3}


@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_call_past_its_default_deadline_is_unavailable(daemon, kind):
    socket, servicer = daemon
    f = Faces(kind, socket, timeout_s=0.2)
    try:
        with pytest.raises(errors.Unavailable, match="DEADLINE_EXCEEDED"):
            await f.call("status")
    finally:
        await f.close()
    # The server gave up on the handler too, and counted it.
    await servicer.wait_counted("Status", "CANCELLED")


def test_wait_loads_deadline_is_its_own_timeout_plus_a_margin():
    assert calls.wait_loads_call([1], 2.0).timeout_s == 2.0 + calls.WAIT_MARGIN_S
    assert calls.wait_loads_call([1], 0).timeout_s is None  # the client's default
