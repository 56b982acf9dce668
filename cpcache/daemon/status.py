"""The one table from cpcache's errors to gRPC status codes (DESIGN
section 8), and the guard that keeps any exception from escaping a handler
as UNKNOWN."""

from __future__ import annotations

import functools
import logging

import grpc

from cpcache import errors

log = logging.getLogger(__name__)

def status_of(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, errors.CacheError):
        return grpc.StatusCode[error.status]
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
