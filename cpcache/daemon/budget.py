"""The daemon's resource budget, per listener: what any client, hostile or
not, can make it hold. README, Security, "Resource budget" states it; the
unit's LimitNOFILE= covers it; tests/test_floods.py floods each listener
and reads the daemon's descriptors and threads from /proc.
"""

from __future__ import annotations

# gRPC, per listener (the unix socket, and `listen_tcp` when set).
GRPC_CONNECTIONS = 512  # more are closed as they arrive (grpc.max_allowed_incoming_connections)
GRPC_HANDSHAKE_S = 5.0  # a connection that sends no HTTP/2 preface (or TLS hello) in this long is closed
GRPC_IDLE_S = 300.0  # a connection with no call for this long is sent GOAWAY (clients reconnect)

# `<socket>.pools`: handover of device pools by descriptor.
POOLS_SERVED = 16  # connections served at once; more wait in the listen backlog
POOLS_SERVED_PER_UID = 4  # of those, by one uid; more from it are closed unread
POOLS_BACKLOG = 64
POOLS_DEADLINE_S = 2.0  # the whole exchange of one connection
POOLS_FDS_PER_MESSAGE = 4  # read at most; a pool is one
POOLS_TICKETS_PER_UID = 8  # descriptors held for Attach, per uid
POOLS_TICKETS = 64  # ... and in total
POOLS_TICKET_TTL_S = 60.0  # an unused ticket's descriptor is closed after this long (on a timer)
POOLS_PENDING_CLOSES = 64  # connections and descriptors waiting to be closed; above it, accepting pauses
POOLS_CLOSERS = 2  # threads that close them (a close may block in the kernel)

# Metrics (`metrics_address`).
METRICS_CONNECTIONS = 8  # more are closed as they arrive
METRICS_READ_S = 5.0  # a request head not read in full in this long: the connection is closed
METRICS_REQUEST_BYTES = 8192  # a longer request head is refused

# Descriptors the daemon needs beyond its listeners' (storage, gloo, the
# event loop, logs, CUDA), counted generously.
BASE_FILES = 512


def files(grpc_listeners: int) -> int:
    """Descriptors the daemon may hold with every listener at its limits."""
    pools = (POOLS_SERVED * (1 + POOLS_FDS_PER_MESSAGE) + POOLS_TICKETS
             + POOLS_PENDING_CLOSES * (1 + POOLS_FDS_PER_MESSAGE) + 2)
    return BASE_FILES + grpc_listeners * (GRPC_CONNECTIONS + 1) + pools + METRICS_CONNECTIONS + 1


def handover_threads() -> int:
    """Threads of the pool handover at most: acceptor, expirer, closers, servers."""
    return 2 + POOLS_CLOSERS + POOLS_SERVED
