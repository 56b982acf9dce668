"""Shared-token authentication for the TCP listener (the unix socket relies
on file permissions instead)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

from cpcache.errors import InvalidArgument

TOKEN_HEADER = "authorization"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose `authorization: Bearer <token>` does not match."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    @classmethod
    def from_file(cls, path: str) -> TokenInterceptor:
        try:
            with open(path) as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise InvalidArgument(f"setting token_file: cannot read {path}: {exc}") from None
        if not token:
            raise InvalidArgument(f"setting token_file: {path} is empty")
        return cls(token)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_HEADER and hmac.compare_digest(str(value).encode(), self._expected):
                return await continuation(handler_call_details)
        return self._deny
