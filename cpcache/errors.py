"""The closed family of errors cpcache raises.

Each kind maps to exactly one gRPC status code, in one table in
`cpcache.daemon.status`. Nothing else is allowed to escape a handler.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error cpcache raises on purpose."""


class InvalidArgument(CacheError):
    """A request or a setting is malformed or out of range."""


class NotFound(CacheError):
    """An operation id or object that this daemon does not know."""


class FailedPrecondition(CacheError):
    """The request is well-formed but the system is not in a state to take it:
    steps out of order, or ranks that diverged."""


class Divergence(FailedPrecondition):
    """Ranks of one agreement domain disagree on the question set or state."""


class ResourceExhausted(CacheError):
    """A pool or a batch limit is full."""


class Unavailable(CacheError):
    """A peer is lost, storage is down, or the daemon is shutting down."""


class PeerLost(Unavailable):
    """Some ranks did not take part in a round in time."""

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
