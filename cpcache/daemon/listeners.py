"""Where the daemon listens: its unix socket (private to its owner, or to a
group), and TCP only with a token or TLS. Each listener is a grpc.aio server
built by the caller, so this module knows sockets and credentials, not the
API."""

from __future__ import annotations

import contextlib
import grp
import logging
import os
from collections.abc import Callable, Sequence

import grpc

from cpcache.config import DaemonConfig
from cpcache.daemon.auth import TokenInterceptor
from cpcache.errors import InvalidArgument

log = logging.getLogger("cpcached")

ServerFactory = Callable[[Sequence[grpc.aio.ServerInterceptor]], grpc.aio.Server]


def check_listener_settings(config: DaemonConfig) -> None:
    """Refuse at start, naming the setting, what the listeners could only
    fail on later: a token or TLS file that cannot be read, a group that
    does not exist."""
    if config.token_file:
        TokenInterceptor.from_file(config.token_file)
    for name in ("tls_cert", "tls_key"):
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            raise InvalidArgument(f"setting {name}: cannot read {path}")
    if config.socket_group:
        try:
            grp.getgrnam(config.socket_group)
        except KeyError:
            raise InvalidArgument(f"setting socket_group: no group named {config.socket_group!r}") from None


async def start_unix(config: DaemonConfig, new_server: ServerFactory) -> grpc.aio.Server:
    """Serve on the unix socket, born 0600 (0660 with `socket_group`): the
    mode comes from the umask at bind, so no chmod by path can be redirected
    through a symlink planted in the socket's directory."""
    server = new_server(())
    path = config.socket_path
    os.makedirs(os.path.dirname(path) or ".", mode=0o750, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket from a previous run
    old_umask = os.umask(0o117 if config.socket_group else 0o177)
    try:
        server.add_insecure_port("unix:" + path)
        await server.start()
    finally:
        os.umask(old_umask)
    if config.socket_group:
        os.chown(path, -1, grp.getgrnam(config.socket_group).gr_gid, follow_symlinks=False)
    log.info("listening on unix:%s", path)
    return server


async def start_tcp(config: DaemonConfig, new_server: ServerFactory) -> grpc.aio.Server:
    """Serve on `listen_tcp`, behind the shared token and/or TLS."""
    interceptors = [TokenInterceptor.from_file(config.token_file)] if config.token_file else []
    server = new_server(interceptors)
    if config.tls_cert:
        with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as chain:
            credentials = grpc.ssl_server_credentials([(key.read(), chain.read())])
        port = server.add_secure_port(config.listen_tcp, credentials)
    else:
        port = server.add_insecure_port(config.listen_tcp)
    await server.start()
    log.info("also listening on tcp port %d", port)
    return server


async def start_listeners(config: DaemonConfig, new_server: ServerFactory) -> list[grpc.aio.Server]:
    servers = [await start_unix(config, new_server)]
    if config.listen_tcp:
        servers.append(await start_tcp(config, new_server))
    return servers
