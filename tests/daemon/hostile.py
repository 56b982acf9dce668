"""What a hostile local user runs against a daemon's listeners, as another
uid (`as_hostile`). Stdlib only: it runs on the system's python3 as
`nobody`. Prints one JSON line of what it did, then holds every connection
until its stdin closes."""

import fcntl
import json
import os
import socket
import sys


def connect_unix(path: str, n: int, send: bytes = b"", every: int = 0) -> list[socket.socket]:
    held = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(path)
            if every and i % every == 0:
                s.send(send)  # half a request, never finished
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


def connect_tcp(port: int, n: int, send: bytes = b"", every: int = 0) -> list[socket.socket]:
    held = []
    for i in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
            if every and i % every == 0:
                s.send(send)
        except OSError:
            continue
        held.append(s)
    return held


def tickets(path: str, n: int) -> dict:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    got = {"ticket": 0, "err": 0, "failed": 0}
    for _ in range(n):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5.0)
                s.connect(path)
                socket.send_fds(s, [b"pool"], [fd])
                answer = s.recv(256)
            got["err" if not answer or answer.startswith(b"ERR") else "ticket"] += 1
        except OSError:
            got["failed"] += 1
    return got


def main() -> None:
    mode, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    held: list[socket.socket] = []
    report: dict = {"uid": os.getuid()}
    if mode == "grpc":  # idle connections, and every 4th sends half an HTTP/2 preface
        held = connect_unix(target, n, b"PRI * HTTP/2.0\r\n", every=4)
    elif mode == "pools":  # ticket requests, then idle connections
        report.update(tickets(target, n // 2))
        held = connect_unix(target, n)
    elif mode == "grpc-tcp":
        held = connect_tcp(int(target), n, b"PRI * HTTP/2.0\r\n", every=4)
    elif mode == "metrics":  # idle connections, and every 4th sends half a request
        held = connect_tcp(int(target), n, b"GET /metrics HTTP/1.1\r\n", every=4)
    report["connected"] = len(held)
    print(json.dumps(report), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
