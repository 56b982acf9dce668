"""The radix cache's side of the KV events of the tiers below the device
(tier_events.py): on the rank whose tree records SGLang's own events (one
per DP replica; none without `--kv-events-config`), it names each page
with its tokens as the tree hands it down, follows every agreed reply of
the rank's sessions, and adds what the host pool and storage did to what
SGLang's publisher drains. Events are advisory: a fault in them is counted
and logged once, never a failed step."""

from __future__ import annotations

import logging
from typing import Any

from cpcache.client import SchedulerSession
from cpcache.client.messages import StepResult
from cpcache.integrations.sglang.tier_events import SglangHashes, TierEvents

log = logging.getLogger(__name__)


class TreeEvents:
    def __init__(self, page_size: int, storage: str, dynamo_format: bool, lora_names: Any, rank: int) -> None:
        self.tiers = TierEvents(storage)
        self._hashes = SglangHashes(page_size, dynamo_format, lora_names)
        self._rank = rank
        self.errors = 0

    @classmethod
    def of(cls, params: Any, page_size: int, storage: str, rank: int) -> TreeEvents | None:
        """The tree's events where SGLang's tree records its own (None elsewhere)."""
        if not getattr(params, "enable_kv_cache_events", False):
            return None
        return cls(page_size, storage, bool(getattr(params, "dynamo_kv_event_format", False)),
                   getattr(params, "kv_event_lora_names", None), rank)

    def listen(self, session: SchedulerSession) -> None:
        session.listeners.append(self._follow)

    def _follow(self, reply: StepResult) -> None:
        try:
            self.tiers.follow(reply)
        except Exception:  # noqa: BLE001 - events are advisory: a fault in them never fails a step
            self.errors += 1
            if self.errors == 1:
                log.exception("cpcache: rank %d could not queue the KV events of a reply (counted from now)",
                              self._rank)

    def name_pages(self, key: Any, hashes: list[bytes], first: int, generation: int) -> None:
        """Name the pages `first`... of `key` (`hashes`, its page keys) with
        their tokens, for the events they may enter a tier with."""
        pages = hashes[first:]
        if not pages:
            return
        tokens = list(key.raw_token_ids()[: len(key)])
        events = self._hashes.pages(tokens, getattr(key, "extra_key", None), getattr(key, "cache_salt", None),
                                    first, storage_hashes=hashes if generation == 0 else None)
        self.tiers.name(pages, events)

    def log_counts(self) -> None:
        log.info("cpcache: rank %d KV events of the tiers below: %s (errors %d)", self._rank,
                 " ".join(f"{k}={v}" for k, v in self.tiers.counters().items()), self.errors)
