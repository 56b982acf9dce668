"""The numbers that cross the API: ids, step numbers and how answers reduce.

Op ids and step numbers travel as uint64 on the wire but as int64 inside
rounds, so every one is checked to lie in [0, 2**63) before it reaches
shared state.
"""

from __future__ import annotations

import enum

from cpcache.errors import InvalidArgument

INT64_MAX = (1 << 63) - 1
ID_LIMIT = 1 << 63
# The largest request or reply either side sends: a step of many prefetches
# (a 128k-token prompt at page size 1 is 4.5 MB of page hashes) fits many
# times over; gRPC's default of 4 MiB does not. Larger requests are refused
# with INVALID_ARGUMENT by the client before sending, and by the daemon.
MAX_MESSAGE_BYTES = 64 << 20
# In an `Outcome`'s StepError: the daemon answering has not taken the step
# (its round cannot complete without it), rather than a round that failed.
NOT_TAKEN = "not_taken"
# ErrorInfo reasons of the daemon's call limits (cpcache/daemon/call_limits.py),
# each with metadata `setting`: a call past its share (RESOURCE_EXHAUSTED),
# and a Steps stream closed after waiting too long for a step (UNAVAILABLE).
# Neither took the call's step: a client may send it again, by either call.
CALL_LIMIT = "CALL_LIMIT"
STREAM_IDLE = "STREAM_IDLE"


class Reduce(enum.IntEnum):
    """How the domain combines the local answers of one question."""

    MIN = 1
    MAX = 2


def split_host_port(address: str, what: str = "address") -> tuple[str, int]:
    """`host:port` (the host may be empty or a bracketed IPv6 address)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"{what} must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def check_id(value: int, what: str) -> int:
    """`value` if it lies in [0, 2**63), else `InvalidArgument` naming `what`."""
    if not 0 <= value < ID_LIMIT:
        raise InvalidArgument(f"{what} {value} is outside [0, 2**63)")
    return value
