"""The closed family of errors cpcache raises.

Each kind names exactly one gRPC status code (`status`, by name: this
module imports no gRPC); the daemon and the clients translate with it, in
one place each. Nothing else is allowed to escape a handler.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error cpcache raises on purpose."""

    status = "INTERNAL"


class InvalidArgument(CacheError):
    """A request or a setting is malformed or out of range."""

    status = "INVALID_ARGUMENT"


class NotFound(CacheError):
    """An operation id or object that this daemon does not know."""

    status = "NOT_FOUND"


class FailedPrecondition(CacheError):
    """The request is well-formed but the system is not in a state to take it:
    steps out of order, or ranks that diverged."""

    status = "FAILED_PRECONDITION"


class Divergence(FailedPrecondition):
    """Ranks of one agreement domain disagree on the question set or state."""


class ResourceExhausted(CacheError):
    """A pool or a batch limit is full."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(CacheError):
    """A peer is lost, storage is down, or the daemon is shutting down."""

    status = "UNAVAILABLE"


class PeerLost(Unavailable):
    """Some ranks did not take part in a round in time."""

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


# Most specific first: a status code's error on the client side is the first
# class here that names it.
FAMILY: tuple[type[CacheError], ...] = (
    InvalidArgument, NotFound, Divergence, FailedPrecondition, ResourceExhausted, PeerLost, Unavailable,
)
