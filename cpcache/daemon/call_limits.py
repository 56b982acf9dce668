"""Shares of a listener's gRPC calls, so that a client that floods the
daemon costs its own calls, not the domain's recovery (docs/security.md,
"Resource budget").

gRPC's own `maximum_concurrent_rpcs` counts every call alike, and on a unix
socket the server cannot tell connections apart (every peer is `unix:`), so
the limits are, per listener:

- per connection, in gRPC itself: HTTP/2 MAX_CONCURRENT_STREAMS
  (`max_calls_per_connection`); a client's calls past it wait in its own
  transport and reach the daemon only as its earlier ones end;
- `control_rpcs` calls kept for Health (Check), Status and Outcome, which
  no other call may take (past them these share the rest);
- `max_concurrent_rpcs` for every other call, of which `max_steps_streams`
  `Steps` streams; a `Steps` stream that waits `steps_idle_s` for its next
  step is closed (`idle_status`, by the servicer), freeing its slot.

A call past its share is answered RESOURCE_EXHAUSTED, with an ErrorInfo of
reason `CALL_LIMIT` naming the setting (`setting`), before its handler runs.
gRPC's own limit stays as a backstop above these shares.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from cpcache.config import DaemonConfig
from cpcache.daemon.status import rich_status
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import CALL_LIMIT, STREAM_IDLE

_SERVICE = pb.DESCRIPTOR.services_by_name["CacheDaemon"].full_name
CONTROL_METHODS = frozenset({"/grpc.health.v1.Health/Check", f"/{_SERVICE}/Status", f"/{_SERVICE}/Outcome"})
STEPS_METHOD = f"/{_SERVICE}/Steps"



class Slot(enum.Enum):
    CONTROL = "control"  # one of the control_rpcs
    GENERAL = "general"  # one of max_concurrent_rpcs
    STEPS = "steps"  # one of max_concurrent_rpcs that is a Steps stream too


@dataclass
class CallCounts:
    """What every listener's limits counted, for `Stats` (one per daemon)."""

    open: dict[Slot, int] = field(default_factory=lambda: dict.fromkeys(Slot, 0))
    refused: dict[str, int] = field(default_factory=dict)  # by the setting that refused
    steps_closed_idle: int = 0

    def counters(self) -> dict[str, int]:
        return {"rpc_control_calls_open": self.open[Slot.CONTROL],
                "rpc_calls_open": self.open[Slot.GENERAL] + self.open[Slot.STEPS],
                "rpc_steps_streams_open": self.open[Slot.STEPS],
                "rpc_steps_streams_closed_idle": self.steps_closed_idle,
                **{f"rpc_refused_{name}": self.refused.get(name, 0)
                   for name in ("max_concurrent_rpcs", "control_rpcs", "max_steps_streams")}}


def idle_status(idle_s: float) -> grpc.Status:
    """How the daemon ends a `Steps` stream that waited `idle_s` for a step."""
    return rich_status(grpc.StatusCode.UNAVAILABLE,
                       f"this Steps stream waited more than {idle_s:g}s for a step and is closed (setting "
                       "steps_idle_timeout_s); open a new one (cpcache's clients do, and send the step again)",
                       STREAM_IDLE, {"setting": "steps_idle_timeout_s"})


def grpc_limit(config: DaemonConfig) -> int:
    """gRPC's own limit, a backstop: every share, and one connection's calls
    on their way to being refused (gRPC counts a call until it has ended)."""
    return config.max_concurrent_rpcs + config.control_rpcs + config.max_calls_per_connection


def grpc_options(config: DaemonConfig) -> list[tuple[str, int]]:
    """The limit per connection, kept by gRPC (HTTP/2 MAX_CONCURRENT_STREAMS)."""
    return [("grpc.max_concurrent_streams", config.max_calls_per_connection)]


class CallLimits(grpc.aio.ServerInterceptor):
    """One listener's shares. Each call takes its slot when its handler
    starts and gives it back when the handler ends, whatever the end (so a
    call gRPC never hands to its handler holds nothing); all on the event
    loop, so no lock."""

    def __init__(self, config: DaemonConfig, counts: CallCounts | None = None) -> None:
        self._config = config
        self._counts = counts if counts is not None else CallCounts()
        self._open = dict.fromkeys(Slot, 0)

    def open_calls(self, slot: Slot) -> int:
        return self._open[slot]

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED itself
            return handler
        method = handler_call_details.method or ""
        for attr in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, attr)
            if behavior is not None:
                return handler._replace(**{attr: self._wrap(behavior, method)})
        return handler

    def _take(self, method: str) -> tuple[Slot | None, str]:
        """A slot for a call of `method`, or None and the setting it is past."""
        config, open_ = self._config, self._open
        general = open_[Slot.GENERAL] + open_[Slot.STEPS]
        if method in CONTROL_METHODS:
            if open_[Slot.CONTROL] < config.control_rpcs:
                slot = Slot.CONTROL
            elif general < config.max_concurrent_rpcs:
                slot = Slot.GENERAL
            else:
                return None, "control_rpcs"
        elif general >= config.max_concurrent_rpcs:
            return None, "max_concurrent_rpcs"
        elif method == STEPS_METHOD:
            if open_[Slot.STEPS] >= config.max_steps_streams:
                return None, "max_steps_streams"
            slot = Slot.STEPS
        else:
            slot = Slot.GENERAL
        open_[slot] += 1
        self._counts.open[slot] += 1
        return slot, ""

    def _give(self, slot: Slot) -> None:
        self._open[slot] -= 1
        self._counts.open[slot] -= 1

    def _refusal(self, method: str, setting: str) -> grpc.Status:
        self._counts.refused[setting] = self._counts.refused.get(setting, 0) + 1
        config = self._config
        if setting == "max_steps_streams":
            what = (f"{config.max_steps_streams} Steps streams are open on this listener, as many as setting "
                    "max_steps_streams allows; raise it, close idle streams, or step by Step")
        elif setting == "control_rpcs":
            what = (f"{config.control_rpcs} Health, Status and Outcome calls and {config.max_concurrent_rpcs} "
                    "other calls are in flight on this listener, as many as settings control_rpcs and "
                    "max_concurrent_rpcs allow; raise control_rpcs")
        else:
            what = (f"{config.max_concurrent_rpcs} calls are in flight on this listener (besides the "
                    f"{config.control_rpcs} kept for Health, Status and Outcome), as many as setting "
                    "max_concurrent_rpcs allows; raise it")
        return rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method.rpartition('/')[2]} refused: {what}",
                           CALL_LIMIT, {"setting": setting})

    @contextlib.contextmanager
    def _slot(self, slot: Slot) -> Iterator[None]:
        try:
            yield
        finally:
            self._give(slot)

    def _wrap(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                slot, setting = self._take(method)
                if slot is None:
                    await context.abort_with_status(self._refusal(method, setting))
                    return
                with self._slot(slot):
                    async for item in behavior(request, context):
                        yield item
            return stream
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # every handler of this daemon is async; a sync one is left as it is

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            slot, setting = self._take(method)
            if slot is None:
                await context.abort_with_status(self._refusal(method, setting))
                return None
            with self._slot(slot):
                return await behavior(request, context)
        return call
