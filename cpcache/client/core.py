"""Scheduler-side clients of one rank's daemon: `AsyncClient` for asyncio
schedulers, `Client` for synchronous scheduler loops.

One core serves both: `calls.py` builds each call and reads its reply
(`Call`), and `error_from` rebuilds the typed error the daemon raised from
the `google.rpc.ErrorInfo` in its status, so a scheduler handles `PeerLost`
or `Divergence` without knowing gRPC. The
two faces differ only in how they send a `Call`: each public call is defined
once, on `_Face`, as an `_Rpc` over its builder, and is typed for each face
(`Client.step(...) -> StepResult`, `AsyncClient.step(...) ->
Awaitable[StepResult]`).

Every call has a deadline (`timeout_s`, 30 s unless told); a call that
passes it raises `Unavailable`. How a client reaches its daemon (the target,
the channel's options, the least deadline): `connection.py`; the `Steps`
stream an `AsyncClient` hands out: `step_stream.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cpcache import errors
from cpcache.client.calls import (
    Call,
    attach_call,
    health_call,
    match_call,
    outcome_call,
    stats_call,
    status_call,
    step_call,
    wait_loads_call,
)
from cpcache.client.connection import CHANNEL_OPTIONS, DEFAULT_TIMEOUT_S, check_deadline, metadata_of, target_of
from cpcache.client.daemon_process import HeldDaemon
from cpcache.client.messages import StepResult
from cpcache.client.recovery import StepRecovery, unanswered
from cpcache.client.step_stream import AsyncStepStream
from cpcache.client.wire_errors import error_from
from cpcache.requests import CacheRequests
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc
from cpcache.values import MAX_MESSAGE_BYTES, Reduce

T = TypeVar("T")
P = ParamSpec("P")

KEEPER_RETRY_S = 1.0  # how often an ended event keeper is opened again (`Client._keep_event_thread`)

# The longest a step whose daemon gave no answer waits for a daemon that may
# still tell how it ended (a stopped peer): within SGLang's watchdog (300 s).
OUTCOME_WAIT_S = 120.0


# -- the two faces ----------------------------------------------------------------------


class _Rpc(Generic[P, T]):
    """A public call of both faces, defined once by the function that builds
    its `Call`: read on a `Client` it sends the call and returns its value;
    on an `AsyncClient`, it returns an awaitable of it."""

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self._build = build
        functools.update_wrapper(self, build)  # its signature and docs, for help() and inspect
        self._name = build.__name__
        # The signature a face's call shows: the builder's, returning what the face does.
        self._signature = inspect.signature(build).replace(return_annotation=inspect.Signature.empty)

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, face: None, owner: type) -> _Rpc[P, T]: ...

    @overload
    def __get__(self, face: Client, owner: type) -> Callable[P, T]: ...

    @overload
    def __get__(self, face: AsyncClient, owner: type) -> Callable[P, Awaitable[T]]: ...

    def __get__(self, face: _Face | None, owner: type) -> Any:
        if face is None:
            return self
        build = self._build
        send: Callable[..., Any]
        if isinstance(face, AsyncClient):
            async def send(*args: P.args, **kwargs: P.kwargs) -> Any:
                # Built when awaited, as a coroutine method would: a bad
                # argument raises where the call is awaited.
                return await face._send(build(*args, **kwargs))
        else:
            def send(*args: P.args, **kwargs: P.kwargs) -> Any:
                return face._send(build(*args, **kwargs))
        functools.update_wrapper(send, build)
        send.__name__ = send.__qualname__ = self._name
        send.__signature__ = self._signature  # type: ignore[union-attr]
        face.__dict__[self._name] = send  # made once per client: later reads find it first
        return send

    def __call__(self, face: _Face, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Called on the class (`Client.step(client, ...)`), as a method would be."""
        send: Callable[..., Any] = self.__get__(face, type(face))  # type: ignore[call-overload]  # either face
        return send(*args, **kwargs)


class _Face:
    """Every public call, once: each builds its `Call` and hands it to the
    face's `_send`, which returns the value (`Client`) or an awaitable of it
    (`AsyncClient`)."""

    _grpc: Any  # grpc or grpc.aio: where the channel comes from

    def __init__(self, address: str, token: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        """`timeout_s`: the deadline of every call (None: none)."""
        target = target_of(address)
        self._address = target
        if credentials is not None:
            self._channel = self._grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = self._grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CacheDaemonStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = metadata_of(token)
        self._timeout_s = timeout_s

    def _method_for(self, call: Call[T]) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The stub method to send `call` with, and its keyword arguments.
        A request over the message limit is refused here, unsent."""
        size = call.request.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise errors.InvalidArgument(f"{call.rpc}: the request holds {size} bytes, more than the "
                                         f"{MAX_MESSAGE_BYTES} a request may carry; split it over several steps")
        stub = self._stub if call.service == "daemon" else self._health
        timeout = call.timeout_s if call.timeout_s is not None else self._timeout_s
        return getattr(stub, call.rpc), dict(timeout=timeout, metadata=self._metadata)

    def _send(self, call: Call[Any]) -> Any:
        raise NotImplementedError

    step = _Rpc(step_call)
    outcome = _Rpc(outcome_call)
    attach = _Rpc(attach_call)
    wait_loads = _Rpc(wait_loads_call)
    match = _Rpc(match_call)
    stats = _Rpc(stats_call)
    status = _Rpc(status_call)
    health = _Rpc(health_call)

    def check_deadline(self, agreement_timeout_s: float) -> None:
        """Refuse a call deadline that a living daemon may miss: a round
        waits up to `agreement_timeout_s` for peers, so a step given up on
        sooner may be one its peers are told the answer of."""
        check_deadline(self._timeout_s, agreement_timeout_s)


class AsyncClient(_Face):
    """For asyncio schedulers: every call is awaited."""

    _grpc = grpc.aio

    async def _send(self, call: Call[T]) -> T:
        if call.prepare is not None:  # blocking: off the event loop
            call = dataclasses.replace(call, request=await asyncio.to_thread(call.prepare, self._address))
        method, kwargs = self._method_for(call)
        try:
            reply = await method(call.request, **kwargs)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc) from None
        return call.read(reply)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def steps_stream(self) -> AsyncStepStream:
        """The `Steps` stream's face: `await stream.step(...)` as `step`."""
        return AsyncStepStream(self)

    async def wait_serving(self, timeout_s: float) -> None:
        """Wait until the daemon reports SERVING: waits for the socket to
        appear and for the health status to change, without polling."""
        call = self._health.Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True, metadata=self._metadata
        )
        try:
            async for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc) from None
        finally:
            call.cancel()
        raise errors.Unavailable("the daemon closed its health stream before serving")


class Client(_Face):
    """Blocking client with the same calls, for synchronous scheduler loops.

    A step whose reply does not come (its deadline passed, or the daemon is
    gone) is not given up on: it is sent again, byte for byte, and once the
    daemon is known gone its outcome is asked of the daemons at `peers`, the
    other ranks of its domain (`recovery.py`), so that this rank applies what
    they apply."""

    _grpc = grpc

    def __init__(self, address: str, token: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, peers: Sequence[str] = (), rank: int | None = None,
                 outcome_wait_s: float = OUTCOME_WAIT_S) -> None:
        """`peers`: the addresses of the other daemons of this rank's domain;
        `rank`: this scheduler's, named when a peer fences a step for it;
        `outcome_wait_s`: how long a step whose daemon gave no answer waits
        for a peer's daemon that may still tell how it ended (`recovery.py`)."""
        super().__init__(address, token, credentials, timeout_s)
        self._peer_addresses = tuple(peers)
        self._rank, self._outcome_wait_s = rank, outcome_wait_s
        self._held: HeldDaemon | None = None  # the daemon as last attached: its outcome ring
        self._event_keeper: Any = None  # an open call that keeps the channel's event thread (step_later)
        self._keeper_again_at = 0.0
        self._peer_clients: list[Client] | None = None
        self._token, self._credentials = token, credentials

    def _send(self, call: Call[T]) -> T:
        if call.rpc == "Attach":
            # A deadline the daemons' agreement timeout does not fit is refused
            # first: a step given up on sooner may be one its peers apply.
            self.check_deadline(self.status().agreement_timeout_s)
        if call.prepare is not None:
            call = dataclasses.replace(call, request=call.prepare(self._address))
        method, kwargs = self._method_for(call)
        try:
            reply = method(call.request, **kwargs)
        except grpc.RpcError as exc:
            if call.rpc == "Step" and unanswered(exc):
                return call.read(self._recover(call.request, exc))
            if call.rpc != "Attach" or exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise error_from(exc) from None
            reply = self._attach_again(call, exc)
        if call.rpc == "Attach":
            self.hold_daemon(reply.daemon_instance)  # the instance that attached: its steps are in its ring
        return call.read(reply)

    def _attach_again(self, call: Call[Any], failure: grpc.RpcError) -> Any:
        """An Attach whose answer did not come in time (its daemon stalled)
        is sent again, its pools handed over anew, for up to `outcome_wait_s`:
        the daemon answers the retry of the attach that began its session
        with that attach's answer, so a deadline never decides it."""
        give_up = time.monotonic() + self._outcome_wait_s
        pause_s = 0.05
        while time.monotonic() < give_up:
            if call.prepare is not None:
                try:
                    call = dataclasses.replace(call, request=call.prepare(self._address))
                except (errors.ResourceExhausted, errors.Unavailable):  # tickets of the tries before: they expire
                    time.sleep(pause_s)
                    pause_s = min(2 * pause_s, 1.0)
                    continue
            method, kwargs = self._method_for(call)
            timeout_s = max(0.01, min(kwargs.get("timeout") or DEFAULT_TIMEOUT_S, give_up - time.monotonic()))
            try:
                return method(call.request, **{**kwargs, "timeout": timeout_s})
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise error_from(exc) from None
                failure = exc
        raise error_from(failure) from None

    def hold_daemon(self, instance: int = 0) -> bool:
        """Take the daemon's identity now (its pidfd and step-outcome ring),
        replacing any held: a step whose reply it never gives is then read
        from its ring. Done after every Attach, with the instance that
        answered it (`AttachReply.daemon_instance`; 0: any). -> whether it
        could be had (not over TCP, nor from a daemon that is down or
        restarted since)."""
        try:
            held: HeldDaemon | None = self.identify(instance)
        except errors.CacheError:
            held = None
        old, self._held = self._held, held
        if old is not None:
            old.close()
        self._drop_event_keeper()  # it may be the attached daemon's predecessor's, ended unseen
        return held is not None

    def identify(self, instance: int = 0) -> HeldDaemon:
        """The daemon's process and outcome ring, taken now, for the caller
        to keep (and close): `CacheError` when it cannot be had, or is not
        `instance` (when given)."""
        return HeldDaemon.take(self._address, self._timeout_s or DEFAULT_TIMEOUT_S, instance)

    def wait_serving(self, timeout_s: float) -> None:
        """Wait until the daemon reports SERVING (its socket may not exist
        yet, or it may be too busy to answer at once), without polling."""
        call = self._health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s,
                                  wait_for_ready=True, metadata=self._metadata)
        try:
            for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as exc:
            raise error_from(exc) from None
        finally:
            call.cancel()
        raise errors.Unavailable("the daemon closed its health stream before serving")

    def step_later(self, step: int, votes: Iterable[tuple[int, Reduce, int]] = (),
                   requests: CacheRequests | None = None, epoch: int | None = None) -> Callable[[], StepResult]:
        """Send step `step` now and return at once: -> what waits for its
        reply (raising as `step` would). The round runs meanwhile."""
        call = step_call(step, votes, requests, epoch)
        method, kwargs = self._method_for(call)
        self._keep_event_thread()
        future = method.future(call.request, **kwargs)  # type: ignore[attr-defined]  # a grpc multi-callable

        def reply() -> StepResult:
            try:
                return call.read(future.result())
            except grpc.RpcError as exc:
                if unanswered(exc):
                    return call.read(self._recover(call.request, exc))
                raise error_from(exc) from None

        return reply

    def _keep_event_thread(self) -> None:
        """Keep one call open on the channel while steps go by `step_later`.
        gRPC's blocking channel takes the events of its `future` calls on a
        thread it starts when a call begins with none in flight and ends when
        the last ends: with one step in flight at a time, a new OS thread per
        step, which a loaded host schedules milliseconds late, on the
        scheduler's own thread. A health Watch left open (answered once, then
        quiet until the status changes; one of `max_concurrent_rpcs`) keeps
        that thread. One that ended (the daemon was killed, or refused it) is
        opened again at most every KEEPER_RETRY_S. One the daemon ended at
        its drain does not show as ended (its last messages are never read),
        and keeps the thread all the same; every attach drops it, so the
        daemon attached is the one that holds the next.
        """
        keeper = self._event_keeper
        if keeper is not None and not keeper.done():
            return  # open, or ended by a daemon gone away unseen: `hold_daemon` drops it at the next attach
        now = time.monotonic()
        if now < self._keeper_again_at:
            return
        self._keeper_again_at = now + KEEPER_RETRY_S
        self._event_keeper = self._health.Watch(health_pb2.HealthCheckRequest(service=""), metadata=self._metadata)

    def _drop_event_keeper(self) -> None:
        keeper, self._event_keeper = self._event_keeper, None
        self._keeper_again_at = 0.0
        if keeper is not None:
            keeper.cancel()

    def _recover(self, request: pb.StepRequest, failure: grpc.RpcError) -> pb.StepReply:
        timeout_s = self._timeout_s or DEFAULT_TIMEOUT_S
        asks = [peer._ask_outcome for peer in self._peers()]
        recovery = StepRecovery(self._resend, asks, timeout_s, max(self._outcome_wait_s, timeout_s), self._rank,
                                recorded=self._recorded)
        return recovery.outcome(request, failure)

    def _recorded(self, epoch: int, step: int) -> bytes | None:
        return self._held.recorded(epoch, step) if self._held is not None else None

    def _resend(self, request: pb.StepRequest, timeout_s: float) -> pb.StepReply:
        return self._stub.Step(request, timeout=timeout_s, metadata=self._metadata)

    def _ask_outcome(self, request: pb.OutcomeRequest, timeout_s: float) -> pb.OutcomeReply:
        return self._stub.Outcome(request, timeout=timeout_s, metadata=self._metadata)

    def _peers(self) -> list[Client]:
        if self._peer_clients is None:
            self._peer_clients = [Client(address, self._token, self._credentials, self._timeout_s)
                                  for address in self._peer_addresses]
        return self._peer_clients

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._drop_event_keeper()
        self._channel.close()
        for peer in self._peer_clients or ():
            peer.close()
        if self._held is not None:
            self._held.close()
            self._held = None
