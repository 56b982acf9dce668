"""Storage backends behind one small interface, registered by name.

A backend moves whole pages between storage objects and host-pool memory,
in batches, on the caller's (I/O) thread. Heavy imports happen only when a
backend is chosen: `open_backend("mooncake", ...)` imports
`cpcache.dataplane.storage.mooncake`, which registers itself.

Every backend is opened through this registry: by name with its own
options (`open_backend`, the benches and tests) or by name from a daemon's
settings (`open_configured`, which each backend reads for itself in
`from_settings`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from cpcache.errors import InvalidArgument

if TYPE_CHECKING:
    from cpcache.config import DaemonConfig
    from cpcache.geometry import KVGeometry


def _as_bytes(memory: np.ndarray | memoryview) -> memoryview:
    """One flat run of bytes: a checksum, a length and a readv all count bytes."""
    view = memory.data if isinstance(memory, np.ndarray) else memory
    return view.cast("B")


class PageBuffer:
    """Where one page's bytes live in host memory: one run, or several runs
    whose concatenation is the page (in SGLang's MHA host layouts a page is
    its K half, then its V half, a pool's half apart).

    A mover builds one per page of every batch, so it is a slotted object
    that derives what the backends ask for (each run's address, its bytes,
    the page's size) once, here."""

    __slots__ = ("parts", "views", "addresses", "sizes", "nbytes")

    def __init__(self, address: int, view: np.ndarray | memoryview,
                 rest: Sequence[tuple[int, np.ndarray | memoryview]] = ()) -> None:
        """`view`: the first run's memory (contiguous, any dtype: taken as
        its bytes); `rest`: (address, memory) of the runs after it."""
        self._derive([(address, _as_bytes(view)), *((a, _as_bytes(v)) for a, v in rest)])

    @classmethod
    def of_runs(cls, parts: list[tuple[int, memoryview]]) -> PageBuffer:
        """From (address, bytes) of each run, taken as they are (a pool's own byte views)."""
        page = cls.__new__(cls)
        page._derive(parts)
        return page

    def _derive(self, parts: list[tuple[int, memoryview]]) -> None:
        self.parts = parts
        self.views = [view for _, view in parts]
        self.addresses = [address for address, _ in parts]
        self.sizes = [view.nbytes for view in self.views]
        self.nbytes = sum(self.sizes)

    def __repr__(self) -> str:
        return f"PageBuffer({[(hex(a), v.nbytes) for a, v in self.parts]})"


class StorageBackend(ABC):
    """Every call is blocking and batch-shaped; failures are per page and come
    back as data (a miss), never as an exception that kills an I/O thread."""

    name = ""

    @classmethod
    def from_settings(cls, config: DaemonConfig, geometry: KVGeometry,
                      buffers: list[tuple[int, int]]) -> StorageBackend:
        """The backend a daemon's settings describe, for pages of `geometry`;
        `buffers`: the (address, nbytes) of host memory pages move from and
        into. Only registered backends have one (a wrapper is built around
        one of them)."""
        raise NotImplementedError(f"{cls.__name__} is not opened from a daemon's settings")

    @abstractmethod
    def exists_prefix(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are present."""

    @abstractmethod
    def get_into(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        """Read each key into its page; False where it is missing or invalid."""

    @abstractmethod
    def put_from(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        """Write each page under its key; False where the write failed."""

    def counters(self) -> dict[str, int]:
        """Backend-specific counters for `Stats` (damaged pages deleted, temp
        files swept, ...); names start with `storage_`."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional: most backends hold nothing)
        """Release what the backend holds. Safe to call twice."""


# Backend name -> module that registers it when imported.
BACKEND_MODULES = {
    "file": "cpcache.dataplane.storage.file",
    "mooncake": "cpcache.dataplane.storage.mooncake",
}
_FACTORIES: dict[str, type[StorageBackend]] = {}

BackendT = TypeVar("BackendT", bound=type[StorageBackend])


def register(name: str) -> Callable[[BackendT], BackendT]:
    def decorate(factory: BackendT) -> BackendT:
        _FACTORIES[name] = factory
        factory.name = name
        return factory

    return decorate


def backend_class(name: str) -> type[StorageBackend]:
    if name not in BACKEND_MODULES:
        raise InvalidArgument(f"storage: unknown backend {name!r}; known: {', '.join(sorted(BACKEND_MODULES))}")
    importlib.import_module(BACKEND_MODULES[name])
    return _FACTORIES[name]


def open_backend(name: str, **options: object) -> StorageBackend:
    """Backend `name`, given `options`: its constructor's own, no others."""
    return backend_class(name)(**options)


def open_configured(config: DaemonConfig, geometry: KVGeometry, buffers: list[tuple[int, int]]) -> StorageBackend:
    """The backend `config.storage` names, as the daemon's settings describe it."""
    return backend_class(config.storage).from_settings(config, geometry, buffers)
