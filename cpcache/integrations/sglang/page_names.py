"""What the tree's pages are called below the device: SGLang's page hashes
(seeded like SGLang seeds a namespaced request's storage chain), renamed at
each flush (a weight update's among them) so that the host pool's and
storage's older pages are never matched. Each hash is renamed on its own
(`keys.generation_pages`), as a decode server's offload can rename the
hashes SGLang hands it, once the generation is published
(`flush_records.py`)."""

from __future__ import annotations

from typing import Any

from cpcache.integrations.sglang.flush_records import Publisher
from cpcache.keys import chain, generation_pages, request_namespace_seed


class PageNames:
    def __init__(self, flushes: Publisher | None = None) -> None:
        self.generation = 0  # flushes since start
        self._flushes = flushes  # publishes it (a prefill server's rank 0)

    def of(self, key: Any, page_size: int) -> list[bytes]:
        """The names of `key`'s full pages."""
        if getattr(key, "is_bigram", False):
            return []  # EAGLE bigram keys are not cached below the device
        tokens = list(key.raw_token_ids()[: len(key)])
        seed = request_namespace_seed(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))
        return [bytes.fromhex(h) for h in generation_pages(chain(tokens, page_size, seed), self.generation)]

    def flushed(self) -> None:
        """A flush: the pages named so far are never matched again."""
        self.generation += 1
        if self._flushes is not None:
            self._flushes.publish(self.generation)
