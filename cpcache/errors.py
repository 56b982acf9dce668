"""The closed family of errors cpcache raises.

Each kind names exactly one gRPC status code (`status`, by name: this module
imports no gRPC) and a `reason` (the `google.rpc.ErrorInfo` reason sent on
the wire); `metadata()` carries the ranks, steps and operations involved, as
strings. The daemon and the clients translate with these, in one place each,
so a scheduler gets the same typed exception the daemon raised.
"""

from __future__ import annotations

from typing import ClassVar

DOMAIN = "cpcache.dev"  # the ErrorInfo domain


class CacheError(Exception):
    """Base of every error cpcache raises on purpose."""

    status: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "INTERNAL"

    def metadata(self) -> dict[str, str]:
        return {}

    @classmethod
    def from_metadata(cls, message: str, metadata: dict[str, str]) -> CacheError:
        return cls(message)


class InvalidArgument(CacheError):
    """A request or a setting is malformed or out of range."""

    status = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class NotFound(CacheError):
    """An operation id or object that this daemon does not know."""

    status = "NOT_FOUND"
    reason = "NOT_FOUND"


class FailedPrecondition(CacheError):
    """The request is well-formed but the system is not in a state to take it."""

    status = "FAILED_PRECONDITION"
    reason = "FAILED_PRECONDITION"


class Divergence(FailedPrecondition):
    """Ranks of one agreement domain disagree on the question set or state."""

    reason = "DIVERGENCE"

    def __init__(self, message: str, round_number: int = 0) -> None:
        super().__init__(message)
        self.round_number = round_number

    def metadata(self) -> dict[str, str]:
        return {"round": str(self.round_number)}

    @classmethod
    def from_metadata(cls, message: str, metadata: dict[str, str]) -> CacheError:
        return cls(message, int(metadata.get("round", 0)))


class RejectedByPeer(FailedPrecondition):
    """Another rank of the domain rejected this step: nothing of it was opened
    anywhere (docs/design.md rule 6). `peer_status` and `peer_message` are what that
    rank's scheduler was told."""

    reason = "REJECTED_BY_PEER"

    def __init__(self, message: str, rank: int = -1, step: int = 0, peer_status: str = "",
                 peer_message: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.peer_status = peer_status
        self.peer_message = peer_message

    def metadata(self) -> dict[str, str]:
        return {"rank": str(self.rank), "step": str(self.step), "peer_status": self.peer_status,
                "peer_message": self.peer_message[:1000]}

    @classmethod
    def from_metadata(cls, message: str, metadata: dict[str, str]) -> CacheError:
        return cls(message, int(metadata.get("rank", -1)), int(metadata.get("step", 0)),
                   metadata.get("peer_status", ""), metadata.get("peer_message", ""))


class StepOrder(FailedPrecondition):
    """A step number that is neither the next one nor a retry this daemon
    still remembers. It cannot be agreed: the scheduler must resend."""

    reason = "STEP_ORDER"

    def __init__(self, message: str, last_step: int = 0) -> None:
        super().__init__(message)
        self.last_step = last_step

    def metadata(self) -> dict[str, str]:
        return {"last_step": str(self.last_step)}

    @classmethod
    def from_metadata(cls, message: str, metadata: dict[str, str]) -> CacheError:
        return cls(message, int(metadata.get("last_step", 0)))


class PermissionDenied(CacheError):
    """The caller may not make the daemon do this (e.g. open a file by path)."""

    status = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class ResourceExhausted(CacheError):
    """A pool or a batch limit is full."""

    status = "RESOURCE_EXHAUSTED"
    reason = "POOL_FULL"


class Unavailable(CacheError):
    """A peer is lost, storage is down, or the daemon is shutting down."""

    status = "UNAVAILABLE"
    reason = "UNAVAILABLE"


class PeerLost(Unavailable):
    """Some ranks did not take part in a round in time."""

    reason = "PEER_LOST"

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)

    def metadata(self) -> dict[str, str]:
        return {"missing_ranks": ",".join(map(str, self.missing_ranks))}

    @classmethod
    def from_metadata(cls, message: str, metadata: dict[str, str]) -> CacheError:
        ranks = metadata.get("missing_ranks", "")
        return cls(message, tuple(int(r) for r in ranks.split(",") if r))


class EpochEnded(Unavailable):
    """A step of a session whose epoch has ended (its daemon restarted, or
    the domain re-formed): nothing of it is opened, and its outcome, if it
    had one, is known only to the daemons that kept that epoch."""

    reason = "EPOCH_ENDED"


# Every class, most specific first. A client rebuilds the class named by the
# ErrorInfo reason (`BY_REASON`); without one, the base class of the status.
# New kinds go last: a round carries a rejection's status as its index in
# this order (agreement/rounds.py), which every daemon of a domain, old or
# new during an upgrade, must read alike.
FAMILY: tuple[type[CacheError], ...] = (
    InvalidArgument, NotFound, Divergence, RejectedByPeer, StepOrder, FailedPrecondition,
    ResourceExhausted, PeerLost, EpochEnded, Unavailable, PermissionDenied,
)
BY_REASON: dict[str, type[CacheError]] = {kind.reason: kind for kind in FAMILY}
