"""Where the daemon listens: its unix socket (private to its owner, or to a
group), and TCP only with mTLS or a token over TLS (a token alone on
loopback). Each listener is a grpc.aio server
built by the caller, so this module knows sockets and credentials, not the
API."""

from __future__ import annotations

import contextlib
import grp
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from cpcache.config import DaemonConfig
from cpcache.daemon.auth import TokenInterceptor
from cpcache.errors import InvalidArgument
from cpcache.values import split_host_port

log = logging.getLogger("cpcached")



class ServerFactory(Protocol):
    def __call__(self, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Server: ...


def keepalive_options(config: DaemonConfig) -> list[tuple[str, int]]:
    """gRPC channel arguments for the TCP listener: ping idle clients, drop
    the ones that do not answer, and allow clients' own keepalive pings down
    to `keepalive_min_ping_interval_s` (gRPC's default refuses pings more
    often than every 5 minutes with GOAWAY)."""
    return [
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.keepalive_min_ping_interval_s * 1000)),
    ]


def is_loopback(host: str) -> bool:
    """Whether a listen host can only be reached from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or empty (every interface): not provably local


def check_tcp_auth(config: DaemonConfig) -> None:
    """TLS alone authenticates no one (anyone may hold the public server
    certificate): TCP needs client certificates (mTLS) or a token over TLS;
    a token over plaintext only on loopback."""
    if config.tls_client_ca and not config.tls_cert:
        raise InvalidArgument("setting tls_client_ca: needs tls_cert and tls_key (mTLS is TLS)")
    if not config.listen_tcp:
        return
    host, _ = split_host_port(config.listen_tcp, "setting listen_tcp")
    if config.tls_cert and not (config.tls_client_ca or config.token_file):
        raise InvalidArgument(
            "setting listen_tcp: TLS alone authenticates no client; set tls_client_ca (mTLS) or token_file")
    if config.token_file and not config.tls_cert and not is_loopback(host):
        raise InvalidArgument(
            f"setting listen_tcp: a token over plaintext may only listen on loopback, not {host or '*'!r}; "
            "set tls_cert and tls_key, or listen on 127.0.0.1")


def check_listener_settings(config: DaemonConfig) -> None:
    """Refuse at start, naming the setting, what the listeners could only
    fail on later or would serve unsafely: a token or TLS file that cannot
    be read, a group that does not exist, TCP that authenticates no one, a
    socket path held by a live daemon or by something that is not a socket."""
    if config.token_file:
        TokenInterceptor.from_file(config.token_file)
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            raise InvalidArgument(f"setting {name}: cannot read {path}")
    if config.socket_group:
        check_socket_group(config.socket_group)
    check_tcp_auth(config)
    check_socket_free(config.socket_path)


def check_socket_group(name: str) -> None:
    """The daemon gives its sockets `socket_group` with chown(2), which an
    unprivileged process may do only for a group it belongs to; without
    that (or CAP_CHOWN) the start would end in a traceback, after binding a
    0660 socket of the wrong group, and systemd would restart it forever."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        raise InvalidArgument(f"setting socket_group: no group named {name!r}") from None
    if gid == os.getegid() or gid in os.getgroups() or has_cap_chown():
        return
    raise InvalidArgument(
        f"setting socket_group: this daemon (uid {os.geteuid()}) is not a member of group {name!r} and lacks "
        f"CAP_CHOWN, so it cannot give its socket that group; under systemd set the unit's Group={name} "
        "(the drop-in services/cpcached/socket-group.conf; docs/operations.md, Under systemd, "
        "\"Sharing the socket with a group\")")


def closed_to_group(path: str, gid: int) -> str:
    """The first directory above `path` that members of `gid` cannot
    search by its mode bits ("" if none): neither the group's x bit with
    that group, nor the others' x bit. Their own uid or an ACL may still
    let some members in, so this only warns."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            info = os.stat(directory)
        except OSError:
            return directory
        if not (info.st_mode & stat.S_IXOTH or (info.st_gid == gid and info.st_mode & stat.S_IXGRP)):
            return directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return ""
        directory = parent


def warn_if_closed_to_group(path: str, name: str) -> None:
    gid = grp.getgrnam(name).gr_gid
    closed = closed_to_group(path, gid)
    if closed:
        info = os.stat(closed) if os.path.exists(closed) else None
        what = f"gid {info.st_gid}, mode {stat.S_IMODE(info.st_mode):04o}" if info else "missing"
        log.warning("socket_group %s cannot enter %s (%s): its members cannot reach %s; give the directory "
                    "that group (under systemd: the unit's Group=%s, docs/operations.md)", name, closed, what,
                    path, name)


def has_cap_chown() -> bool:
    """Whether CAP_CHOWN (bit 0) is in this process's effective set."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & 1)
    except OSError:
        pass
    return False


def check_socket_free(path: str) -> None:
    """Refuse a socket path a live daemon serves (a connect succeeds) or
    that names something other than a socket; a stale socket (nobody
    accepts) may be replaced."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise InvalidArgument(f"setting socket: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except OSError:
        return  # refused (or unreachable): stale, nobody serves it
    finally:
        probe.close()
    raise InvalidArgument(f"setting socket: {path} is served by a live daemon; stop it first or choose another socket")


@dataclass(frozen=True)
class SocketClaim:
    """The unix socket this daemon bound, by identity: on stop it unlinks
    that file only, never a successor's socket at the same path."""

    path: str
    dev: int
    ino: int

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == (self.dev, self.ino):
                os.unlink(self.path)
            else:
                log.info("not removing %s: another daemon's socket replaced it", self.path)


_claims: dict[str, SocketClaim] = {}


def release_unix(path: str) -> None:
    """Unlink the socket at `path` if it is the one this process bound."""
    claim = _claims.pop(path, None)
    if claim is not None:
        claim.release()


async def start_unix(config: DaemonConfig, new_server: ServerFactory) -> grpc.aio.Server:
    """Serve on the unix socket, born 0600 (0660 with `socket_group`): the
    mode comes from the umask at bind, so no chmod by path can be redirected
    through a symlink planted in the socket's directory.

    gRPC binds a private name beside the path and unlinks that name when
    it stops; the path itself is a hard link to the same socket, made here
    and removed by `release_unix` only while it is still this socket, so a
    stopping daemon never deletes a successor's socket."""
    server = new_server(())
    path = config.socket_path
    directory, name = os.path.split(path)
    os.makedirs(directory or ".", mode=0o750, exist_ok=True)
    private = os.path.join(directory, f".{name}.{os.getpid()}")
    check_socket_free(path)  # again, right before taking the path over
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket from a previous run
    old_umask = os.umask(0o117 if config.socket_group else 0o177)
    try:
        server.add_insecure_port("unix:" + private)
        await server.start()
    finally:
        os.umask(old_umask)
    try:
        os.link(private, path)
    except FileExistsError:
        await server.stop(None)
        raise InvalidArgument(f"setting socket: {path} was taken by another process while this daemon started") \
            from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private)
    info = os.lstat(path)
    _claims[path] = SocketClaim(path, info.st_dev, info.st_ino)
    if config.socket_group:
        os.chown(path, -1, grp.getgrnam(config.socket_group).gr_gid, follow_symlinks=False)
        warn_if_closed_to_group(path, config.socket_group)
    log.info("listening on unix:%s", path)
    return server


async def start_tcp(config: DaemonConfig, new_server: ServerFactory) -> grpc.aio.Server:
    """Serve on `listen_tcp`, behind client certificates (mTLS) and/or the
    shared token (`check_tcp_auth` says which combinations)."""
    check_tcp_auth(config)
    interceptors = [TokenInterceptor.from_file(config.token_file)] if config.token_file else []
    server = new_server(interceptors, keepalive_options(config))
    if config.tls_cert:
        with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as chain:
            pair = [(key.read(), chain.read())]
        if config.tls_client_ca:
            with open(config.tls_client_ca, "rb") as ca:
                credentials = grpc.ssl_server_credentials(pair, root_certificates=ca.read(),
                                                          require_client_auth=True)
        else:
            credentials = grpc.ssl_server_credentials(pair)
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
