"""A scheduler-side API with the shape of SGLang's HiRadixCache calls, over
the blocking client, so an SGLang-style scheduler can adopt cpcache with
small changes.

The one change in habit: calls made during a scheduler iteration are
collected and sent together by `flush()`, once per iteration (one Step, one
agreement round). Checks (`check_prefetch_progress`, `writing_check`,
`loading_check`) answer from agreed decisions already received, so every
rank's scheduler sees the same answers at the same iteration, by
construction, and no call issues a collective of its own.

Each HiRadixCache call and its counterpart here: docs/sglang.md (the call table).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from cpcache.client.core import Client, Ops, StepResult


@dataclass
class _Pending:
    prefetches: list = field(default_factory=list)
    polls: list = field(default_factory=list)
    revokes: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    loads: list = field(default_factory=list)

    def ops(self) -> Ops:
        return Ops(tuple(self.prefetches), tuple(self.polls), tuple(self.revokes), tuple(self.writes),
                   tuple(self.loads))


class HiCacheSession:
    def __init__(self, client: Client, first_step: int = 1) -> None:
        self._client = client
        self._step = first_step - 1
        self._ids = itertools.count(1)
        self._pending = _Pending()
        self._prefetch_of: dict[str, int] = {}  # request id -> open prefetch op
        self._ended: dict[str, int] = {}  # request id -> pages prefetched (0 if revoked)
        self._acked: list[int] = []
        self._write_failed: list[int] = []
        self._loaded: list[int] = []
        self._load_failed: list[int] = []

    # -- prefetch ------------------------------------------------------------------

    def prefetch_from_storage(self, rid: str, pages: list[bytes], tokens: int, parent: bytes | None = None) -> int:
        """A new prefetch for `rid` replaces any earlier one (revoked if open)."""
        if rid in self._prefetch_of:
            self.release_aborted_request(rid)
        self._ended.pop(rid, None)
        op_id = next(self._ids)
        self._pending.prefetches.append((op_id, pages, tokens, parent or b""))
        self._prefetch_of[rid] = op_id
        return op_id

    def check_prefetch_progress(self, rid: str) -> bool:
        """True once the prefetch of `rid` has ended (agreed); otherwise asks
        the next flush whether it may end now."""
        if rid in self._ended:
            return True
        op_id = self._prefetch_of.get(rid)
        if op_id is None:
            return True  # nothing was prefetched for this request
        if op_id not in self._pending.polls and all(p[0] != op_id for p in self._pending.prefetches):
            self._pending.polls.append(op_id)
        return False

    def prefetch_open(self, rid: str) -> bool:
        """Whether a prefetch for `rid` is asked for or open, not yet ended."""
        return rid in self._prefetch_of

    def prefetched_pages(self, rid: str) -> int:
        return self._ended.get(rid, 0)

    def take_prefetched(self, rid: str) -> int:
        """Pages the ended prefetch of `rid` brought, forgetting it."""
        return self._ended.pop(rid, 0)

    def release_aborted_request(self, rid: str) -> None:
        op_id = self._prefetch_of.pop(rid, None)
        self._ended.pop(rid, None)
        if op_id is None:
            return
        unsent = [p for p in self._pending.prefetches if p[0] == op_id]
        if unsent:  # never sent: nothing to revoke
            self._pending.prefetches.remove(unsent[0])
        else:
            self._pending.polls = [p for p in self._pending.polls if p != op_id]
            self._pending.revokes.append(op_id)

    # -- write-through and load-back ---------------------------------------------------

    def write_backup(self, pages: list[bytes], device_pages: list[int], parent: bytes | None = None) -> int:
        op_id = next(self._ids)
        self._pending.writes.append((op_id, pages, device_pages, parent or b""))
        return op_id

    def hold_writes(self) -> list:
        """Take the write-throughs not sent yet out of the next flush (their
        KV may still be being computed): -> what `release_writes` puts back."""
        held, self._pending.writes = self._pending.writes, []
        return held

    def release_writes(self, held: list) -> None:
        self._pending.writes = held + self._pending.writes

    def cancel_unsent_writes(self) -> list[int]:
        """Drop the write-throughs no flush has sent yet (their device pages
        are about to be freed): -> their op ids. Sent ones are decided by the
        daemon and must be waited for."""
        cancelled = [w[0] for w in self._pending.writes]
        self._pending.writes = []
        return cancelled

    def writing_check(self) -> list[int]:
        acked, self._acked = self._acked, []
        return acked

    def write_failures_check(self) -> list[int]:
        """Write-throughs that failed on some rank (agreed): nothing of them
        entered the host pool."""
        failed, self._write_failed = self._write_failed, []
        return failed

    def load_back(self, pages: list[bytes], device_pages: list[int]) -> int:
        op_id = next(self._ids)
        self._pending.loads.append((op_id, pages, device_pages))
        return op_id

    def loading_check(self) -> list[int]:
        loaded, self._loaded = self._loaded, []
        return loaded

    def load_failures_check(self) -> list[int]:
        """Load-backs that failed on some rank (agreed): their device pages
        hold no agreed data."""
        failed, self._load_failed = self._load_failed, []
        return failed

    def has_pending(self) -> bool:
        """Calls made since the last flush, which the next flush sends."""
        p = self._pending
        return bool(p.prefetches or p.polls or p.revokes or p.writes or p.loads)

    def open_prefetches(self) -> int:
        return len(self._prefetch_of)

    def wait_loads(self, op_ids: list[int], timeout_s: float = 30.0) -> None:
        """Block until this rank's copies have reached the device (local)."""
        self._client.wait_loads(op_ids, timeout_s)

    def match_prefix(self, pages: list[bytes]) -> tuple[int, int]:
        reply = self._client.match(pages)
        return reply.host_pages, reply.storage_pages

    # -- the iteration boundary --------------------------------------------------------

    def flush(self) -> StepResult:
        """Send everything this iteration asked for as one step."""
        return self.send()()

    def send(self) -> Callable[[], StepResult]:
        """`flush` in two halves: send the step now, -> what waits for its
        reply and takes its decisions (called before anything else is sent)."""
        self._step += 1
        ops, self._pending = self._pending.ops(), _Pending()
        waiting = self._client.step_later(self._step, ops=ops)
        return lambda: self._take(waiting())

    def _take(self, reply: StepResult) -> StepResult:
        by_op = {op: rid for rid, op in self._prefetch_of.items()}
        for op_id, pages in reply.prefetch_done.items():
            if op_id in by_op:
                self._ended[by_op[op_id]] = pages
                del self._prefetch_of[by_op[op_id]]
        for op_id in reply.prefetch_revoked:
            if op_id in by_op:
                self._ended[by_op[op_id]] = 0
                del self._prefetch_of[by_op[op_id]]
        self._acked += reply.write_acks
        self._write_failed += reply.write_failures
        self._loaded += list(reply.loads)
        self._load_failed += reply.load_failures
        return reply
