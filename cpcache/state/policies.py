"""Prefetch and write policies (SGLang's), as small classes chosen by name
once, when the state is built."""

from __future__ import annotations

from cpcache.config import CacheConfig


class PrefetchPolicy:
    """May this rank let a polled prefetch end now?"""

    def may_end(self, complete: bool, elapsed_s: float, tokens: int) -> bool:
        raise NotImplementedError


class BestEffort(PrefetchPolicy):
    """End when polled, but give a read under way up to
    `prefetch_best_effort_wait_s` from its start: a prefetch polled in the
    round after its hit has rarely read anything yet, and ending it then
    throws every read away while the request computes its pages."""

    def __init__(self, config: CacheConfig) -> None:
        self._wait_s = config.prefetch_best_effort_wait_s

    def may_end(self, complete: bool, elapsed_s: float, tokens: int) -> bool:
        return complete or elapsed_s >= self._wait_s


class WaitComplete(PrefetchPolicy):
    def may_end(self, complete: bool, elapsed_s: float, tokens: int) -> bool:
        return complete


class Timeout(PrefetchPolicy):
    def __init__(self, config: CacheConfig) -> None:
        self._config = config

    def may_end(self, complete: bool, elapsed_s: float, tokens: int) -> bool:
        return complete or elapsed_s > self._config.prefetch_timeout_s(tokens)


class WritePolicy:
    """When host pages are written to storage."""

    backup_after_ack = False  # every acknowledged write-through
    backup_when_hot = False  # pages loaded back a second time
    backup_before_evict = False  # only backed-up pages may be evicted


class WriteThrough(WritePolicy):
    backup_after_ack = True


class WriteThroughSelective(WritePolicy):
    backup_when_hot = True


class WriteBack(WritePolicy):
    backup_before_evict = True


def prefetch_policy(config: CacheConfig) -> PrefetchPolicy:
    if config.prefetch_policy == "timeout":
        return Timeout(config)
    if config.prefetch_policy == "best_effort":
        return BestEffort(config)
    return WaitComplete()


_WRITE_POLICY_CLASSES: dict[str, type[WritePolicy]] = {  # keyed by config.WRITE_POLICIES
    "write_through": WriteThrough,
    "write_through_selective": WriteThroughSelective,
    "write_back": WriteBack,
}


def write_policy(config: CacheConfig) -> WritePolicy:
    return _WRITE_POLICY_CLASSES[config.write_policy]()
