"""`AsyncClient.step` over one `Steps` stream, the scheduler's fast path:
the stream is opened on first use, reopened after it ended, and a step it
cannot carry goes by `Step`. Kept apart from the client's two faces
(`core.py`), which hand a stream out (`AsyncClient.steps_stream`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import grpc

from cpcache import errors
from cpcache.client.calls import Call, step_call
from cpcache.client.messages import StepResult
from cpcache.client.wire_errors import error_from, error_info
from cpcache.requests import CacheRequests
from cpcache.values import CALL_LIMIT, STREAM_IDLE, Reduce

T = TypeVar("T")


class StreamingClient(Protocol):
    """What a stream needs of its `AsyncClient`: its stub, how it sends a
    call (`Step`, when the stream cannot carry a step) and the stub method
    and keyword arguments of a call (its deadline and metadata)."""

    _stub: Any

    def _method_for(self, call: Call[T]) -> tuple[Callable[..., Any], dict[str, Any]]: ...

    async def _send(self, call: Call[T]) -> T: ...


class AsyncStepStream:
    """`AsyncClient.step` over one `Steps` stream: the scheduler's fast path.
    One step at a time, in order; each reply (or typed error) is exactly what
    `step` would give. A failed step ends the stream; the next step opens a
    new one. Each step has the client's deadline: past it the stream is
    cancelled and the step raises `Unavailable` (its outcome is kept by the
    daemon: send the same request again, by either call, to get it).

    Two ends of a stream take no step and are not errors: the daemon closed
    it while it waited for a step (`steps_idle_timeout_s`): the step goes
    again on a new stream; the daemon has no stream to spare
    (`max_steps_streams`): the step goes by `Step`."""

    def __init__(self, client: StreamingClient) -> None:
        self._client = client
        self._call: Any = None
        self._lock: asyncio.Lock | None = None  # made on first use, inside the loop

    async def step(self, step: int, votes: Iterable[tuple[int, Reduce, int]] = (),
                   requests: CacheRequests | None = None, epoch: int | None = None) -> StepResult:
        """One scheduler iteration, as `AsyncClient.step`: -> StepResult."""
        call = step_call(step, votes, requests, epoch)
        _, kwargs = self._client._method_for(call)  # refuses an oversized request, unsent
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            for again in (False, True):
                try:
                    return await self._exchange(call, step, kwargs)
                except grpc.aio.AioRpcError as exc:
                    info = error_info(exc)
                    reason = info.reason if info is not None else ""
                    if reason == STREAM_IDLE and not again:
                        continue  # closed while it waited: the step was not taken
                    if reason == CALL_LIMIT and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        return await self._client._send(call)  # refused before it read the step
                    raise error_from(exc) from None
            raise AssertionError("unreachable")

    async def _exchange(self, call: Call[StepResult], step: int, kwargs: dict[str, Any]) -> StepResult:
        """The step on the stream, opened if there is none."""
        if self._call is None:
            self._call = self._client._stub.Steps(metadata=kwargs["metadata"])
        stream = self._call
        timer = None
        timed_out = False
        if kwargs["timeout"] is not None:
            def expire() -> None:
                nonlocal timed_out
                timed_out = True
                stream.cancel()
            timer = asyncio.get_running_loop().call_later(kwargs["timeout"], expire)
        try:
            await stream.write(call.request)
            reply = await stream.read()
        except grpc.aio.AioRpcError:
            self._call = None
            raise
        except asyncio.InvalidStateError:  # the stream had ended before the write: raise how it ended
            self._call = None
            code = await stream.code()
            if code == grpc.StatusCode.OK:
                raise errors.Unavailable("the daemon ended the step stream before the step") from None
            raise grpc.aio.AioRpcError(code, await stream.initial_metadata(), await stream.trailing_metadata(),
                                       await stream.details()) from None
        except asyncio.CancelledError:
            self._call = None
            stream.cancel()
            if timed_out:
                raise errors.Unavailable(f"DEADLINE_EXCEEDED: step {step} had no reply within "
                                         f"{kwargs['timeout']}s") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if reply is grpc.aio.EOF:
            self._call = None
            raise errors.Unavailable("the daemon ended the step stream without a reply")
        return call.read(reply)

    async def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.done_writing()
            call.cancel()
