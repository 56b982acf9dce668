"""The `mooncake` backend: Mooncake Store over its transfer engine.

The host pool is registered with the transfer engine once, so batch puts and
gets move bytes straight between host pages and the store.
"""

from __future__ import annotations

import socket

from cpcache.dataplane.storage import PageBuffer, StorageBackend, register
from cpcache.errors import InvalidArgument, Unavailable
from cpcache.values import split_host_port


def _reachable(address: str, timeout_s: float) -> bool:
    try:
        socket.create_connection(split_host_port(address, "storage_master"), timeout_s).close()
        return True
    except (OSError, InvalidArgument):
        return False


@register("mooncake")
class MooncakeBackend(StorageBackend):
    def __init__(
        self,
        master: str,
        metadata_server: str,
        buffers: list[tuple[int, int]],
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        device_name: str = "",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        connect_timeout_s: float = 5.0,
        **_ignored: object,
    ) -> None:
        """`buffers`: (address, nbytes) of host memory to register (the host pool)."""
        from mooncake.store import MooncakeDistributedStore

        if not _reachable(master, connect_timeout_s):
            raise Unavailable(
                f"mooncake: the master at {master} cannot be reached; start mooncake_master "
                f"or fix the setting storage_master"
            )
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, device_name, master
        )
        if rc != 0:
            raise Unavailable(f"mooncake: setup against master {master} failed with code {rc}")
        for address, nbytes in buffers:
            if self._store.register_buffer(address, nbytes) != 0:
                raise InvalidArgument(f"mooncake: cannot register {nbytes} bytes at {address:#x}")
        self._closed = False

    def exists_prefix(self, keys: list[str]) -> int:
        if not keys:
            return 0
        for i, present in enumerate(self._store.batch_is_exist(keys)):
            if present != 1:
                return i
        return len(keys)

    def get_into(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        if not keys:
            return []
        sizes = [p.nbytes for p in pages]
        got = self._store.batch_get_into(keys, [p.address for p in pages], sizes)
        return [n == size for n, size in zip(got, sizes)]

    def put_from(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        if not keys:
            return []
        codes = self._store.batch_put_from(keys, [p.address for p in pages], [p.nbytes for p in pages])
        return [code == 0 for code in codes]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.close()
