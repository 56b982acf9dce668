"""What the backend keeps of the host tier between SGLang's calls: a
request's host hit from its match until its load-back, and the host pool as
SGLang's metrics read one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostPoolView:
    """The daemon's host pool in tokens, as SGLang's HiCache metrics read a host pool."""

    logical_size: int
    used: int

    def available_size(self) -> int:
        return self.logical_size - self.used


@dataclass
class HostHit:
    key: Any  # the RadixKey matched
    device_pages: int  # pages already on the device
    pages: list[bytes]  # the host pages that follow them
