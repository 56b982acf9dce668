"""The daemon's resource budget, per listener: what any client, hostile or
not, can make it hold. docs/security.md, "Resource budget" states it; the
unit's LimitNOFILE= covers it; tests/daemon/test_floods.py floods each listener
and reads the daemon's descriptors and threads from /proc.
"""

from __future__ import annotations

import resource

# gRPC, per listener (the unix socket, and `listen_tcp` when set).
GRPC_CONNECTIONS = 4096  # more are closed as they arrive (grpc.max_allowed_incoming_connections)
GRPC_HANDSHAKE_S = 2.0  # a connection that sends no HTTP/2 preface (or TLS hello) in this long is closed
GRPC_IDLE_S = 30.0  # a connection with no call for this long is sent GOAWAY (clients reconnect)

# `<socket>.pools`: handover of device pools by descriptor.
POOLS_SERVED = 16  # connections served at once; more wait in the listen backlog
POOLS_SERVED_PER_UID = 4  # of those, by one uid; more from it are closed unread
POOLS_BACKLOG = 256  # connections waiting to be accepted (kernel memory, no descriptor)
POOLS_DEADLINE_S = 2.0  # the whole exchange of one connection
POOLS_FDS_PER_MESSAGE = 253  # read in full (SCM_MAX_FD), so the kernel drops, so closes, none; a pool is one
POOLS_TICKETS_PER_UID = 8  # descriptors held for Attach, per uid
POOLS_TICKETS = 64  # ... and in total
POOLS_TICKET_TTL_S = 60.0  # an unused ticket's descriptor is closed after this long (on a timer)
POOLS_PENDING_CLOSES_PER_UID = 8  # batches of a uid's descriptors waiting to be closed; above it, that uid is refused
POOLS_CLOSERS = 2  # threads that close them (a close may block in the kernel)

# Metrics (`metrics_address`).
METRICS_CONNECTIONS = 8  # at once; a new one closes the oldest idle one, or itself
METRICS_BACKLOG = 128
METRICS_READ_S = 5.0  # a request head not read in full in this long: the connection is closed
METRICS_REQUEST_BYTES = 8192  # a longer request head is refused
METRICS_PER_SOURCE = 2  # connections from one address; a new one closes its oldest idle one, or itself
METRICS_CACHE_S = 1.0  # a formatted exposition answers every scrape for this long

# Descriptors the daemon needs beyond its listeners' (storage, gloo, the
# event loop, logs, CUDA), counted generously.
BASE_FILES = 512


def files(grpc_listeners: int) -> int:
    """Descriptors the daemon may hold with every listener at its limits."""
    # Pending closes: one uid's share (a uid whose closes block), one message each.
    pools = (POOLS_SERVED * (1 + POOLS_FDS_PER_MESSAGE) + POOLS_TICKETS
             + POOLS_PENDING_CLOSES_PER_UID * POOLS_FDS_PER_MESSAGE + 2)
    return BASE_FILES + grpc_listeners * (GRPC_CONNECTIONS + 1) + pools + METRICS_CONNECTIONS + 1


def handover_threads() -> int:
    """Threads of the pool handover at most: acceptor, expirer, closers, servers."""
    return 2 + POOLS_CLOSERS + POOLS_SERVED


def raise_file_limit(grpc_listeners: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to what the budget needs, as far as the
    hard limit allows (systemd's default soft limit is 1,024; the unit sets
    LimitNOFILE=). Returns (the soft limit now, the budget)."""
    need = files(grpc_listeners)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft, need


def grpc_options() -> list[tuple[str, int]]:
    """The gRPC listener's share: connections, and how long one may stay
    without a handshake or without a call."""
    return [("grpc.max_allowed_incoming_connections", GRPC_CONNECTIONS),
            ("grpc.server_handshake_timeout_ms", int(GRPC_HANDSHAKE_S * 1000)),
            ("grpc.max_connection_idle_ms", int(GRPC_IDLE_S * 1000))]


# Threads beyond the listeners' own: gRPC's event engine, the agreement
# engine, storage I/O (io_threads), torch; counted generously.
BASE_THREADS = 64


def threads() -> int:
    """Threads the daemon may run with every listener at its limits (the
    gRPC listeners' share is in BASE_THREADS: gRPC serves every connection
    on its event engine's pool)."""
    return BASE_THREADS + handover_threads() + 1  # + the metrics formatter
