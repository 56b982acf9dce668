"""The name `--hicache-storage-backend-extra-config` gives cpcache's storage
tier (see `server_flags`). With ``--radix-cache-backend cpcache`` SGLang
never builds it: the rank's daemon reads and writes storage. SGLang's own
HiCache would build it, and is told why that cannot work."""

from __future__ import annotations

from typing import Any


class DaemonStorage:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("cpcache's storage tier is its daemon, used through --radix-cache-backend cpcache; "
                         "SGLang's own hierarchical cache cannot use it as a storage backend")
