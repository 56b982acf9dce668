"""The one table from cpcache's errors to gRPC status codes
(docs/design.md §8), and the guard that keeps any exception from escaping
a handler as UNKNOWN.

An error leaves as a rich status: its code, its message, and one
`google.rpc.ErrorInfo` (reason, `errors.DOMAIN`, the error's metadata) that
the clients rebuild the typed exception from."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from cpcache import errors
from cpcache.values import MAX_MESSAGE_BYTES

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]

log = logging.getLogger(__name__)

# The message and each metadata value are cut to these lengths so that a
# status stays well inside gRPC's default 8 KiB limit on trailing metadata
# (the message travels twice: as grpc-message and inside the details).
MAX_MESSAGE = 2000
MAX_METADATA_VALUE = 1000


def status_of(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, errors.CacheError):
        return grpc.StatusCode[error.status]
    return grpc.StatusCode.INTERNAL


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rich_status(code: grpc.StatusCode, message: str, reason: str, metadata: dict[str, str]) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(
        reason=reason, domain=errors.DOMAIN,
        metadata={str(k): _cut(str(v), MAX_METADATA_VALUE) for k, v in metadata.items()},
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=_cut(message, MAX_MESSAGE), details=[detail])
    )


def wire_status(error: BaseException) -> grpc.Status:
    """The status `error` is sent as. An error outside the family is
    INTERNAL with reason INTERNAL; so is an error whose metadata cannot be
    read (a bug in its class, logged)."""
    if isinstance(error, errors.CacheError):
        try:
            return rich_status(status_of(error), str(error), error.reason, error.metadata())
        except Exception:
            log.exception("cannot describe %s", type(error).__name__)
    return rich_status(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}", "INTERNAL", {})


class Undecodable:
    """A request body that did not decode: the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def tolerant(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: gRPC would answer UNKNOWN."""

    def decode_or_report(data: bytes) -> Any:
        if len(data) > MAX_MESSAGE_BYTES:
            return Undecodable(ValueError(f"it holds {len(data)} bytes, more than the {MAX_MESSAGE_BYTES} a request "
                                          "may carry; split it over several steps"))
        try:
            return decode(data)
        except Exception as exc:  # DecodeError, bad UTF-8 in a string field, ...
            return Undecodable(exc)

    return decode_or_report


def decoded(request: Any) -> Any:
    """`request`, unless its body did not decode (`tolerant`): then
    INVALID_ARGUMENT. `guarded` checks a unary call's request; a streaming
    handler checks each request it reads."""
    if isinstance(request, Undecodable):
        raise errors.InvalidArgument(f"the request body does not decode: {request.error}")
    return request


def guarded(handler: Handler) -> Handler:
    """Turn every error a handler raises into its rich status. An error
    outside the family is a bug: INTERNAL, logged with its traceback. Calls
    are counted by outcome at the server (`metrics.RpcMetrics`). A streaming
    handler is guarded whole: its first error ends the stream with that
    status."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            reply = await handler(self, decoded(request), context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            if not isinstance(exc, errors.CacheError):
                log.exception("bug in %s", handler.__name__)
            await context.abort_with_status(wire_status(exc))
        return reply

    return wrapper
