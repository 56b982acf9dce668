"""The one table from cpcache's errors to gRPC status codes (DESIGN
section 8), and the guard that keeps any exception from escaping a handler
as UNKNOWN."""

from __future__ import annotations

import functools
import logging

import grpc

from cpcache import errors

log = logging.getLogger(__name__)

# Most specific first: the first matching class wins.
STATUS_OF: tuple[tuple[type[errors.CacheError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def guarded(handler):
    """Turn every error a handler raises into its status code. An error
    outside the family is a bug: INTERNAL, logged with its traceback."""

    @functools.wraps(handler)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        code = grpc.StatusCode.OK
        try:
            return await handler(self, request, context)
        except errors.CacheError as exc:
            code = status_of(exc)
            await context.abort(code, str(exc))
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("bug in %s", handler.__name__)
            await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.count_rpc(handler.__name__, code.name)

    return wrapper
