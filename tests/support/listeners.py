"""The sockets a process listens on, read from /proc (no psutil here)."""

import os
import socket
import struct

LISTENING = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}  # TCP_LISTEN; UDP bound, unconnected


def _address(field: str) -> tuple[str, int]:
    ip, port = field.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *struct.unpack("<4I", raw))), int(port, 16)


def listeners(pid: int) -> list[tuple[str, str, int]]:
    """(kind, address, port) of every inet socket `pid` listens on (TCP) or
    has bound unconnected (UDP)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for kind, state in LISTENING.items():
        with open(f"/proc/{pid}/net/{kind}") as table:
            next(table)
            for line in table:
                fields = line.split()
                if fields[9] in inodes and fields[3] == state:
                    found.append((kind, *_address(fields[1])))
    return found
