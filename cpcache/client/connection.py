"""How a client reaches its daemon: the gRPC target an address names, the
channel's options, the bearer token's metadata, and the deadline a call may
have (a deadline a living daemon may miss is refused). Shared by both faces
of the client (`core.py`) and by the kits that open channels of their own."""

from __future__ import annotations

from cpcache import errors
from cpcache.values import MAX_MESSAGE_BYTES

DEFAULT_TIMEOUT_S = 30.0
# A client's deadline must exceed the daemons' agreement timeout by this much:
# the time a living daemon may take past its round's timeout to answer.
DEADLINE_MARGIN_S = 5.0

# Reconnect quickly: the daemon is local and may be restarting.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES),
]


def target_of(address: str) -> str:
    """A socket path, `unix:PATH`, or `host:port`."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.endswith(".sock"):
        return "unix:" + address
    return address


def metadata_of(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries `token` (None: no token)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def check_deadline(timeout_s: float | None, agreement_timeout_s: float) -> None:
    if timeout_s is not None and timeout_s <= agreement_timeout_s + DEADLINE_MARGIN_S:
        raise errors.InvalidArgument(
            f"the client's timeout_s ({timeout_s:g}) must exceed the daemons' agreement_timeout_s "
            f"({agreement_timeout_s:g}) by more than {DEADLINE_MARGIN_S:g} s: a round waits that long for its "
            "peers, and a step given up on sooner may be one the other ranks apply; raise timeout_s or lower "
            "the daemons' --agreement-timeout")
