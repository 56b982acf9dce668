"""The questions the cache asks each round, registered in the one registry
of question kinds, and the encodings of their local answers.

Outcomes are ordered so that MIN gives the agreed one: "pending" while any
rank's I/O is still running, then the worst outcome among the ranks.
"""

from __future__ import annotations

import enum

from cpcache.agreement.kinds import register
from cpcache.values import Reduce

NOT_YET = -1  # a storage lookup that has not answered; MIN keeps the question open


class CopyOutcome(enum.IntEnum):
    """A copy (write-through, load-back) as one rank saw it."""

    PENDING = 0
    FAILED = 1
    OK = 2


class BackupOutcome(enum.IntEnum):
    """A write to storage as one rank saw it. TIMED_OUT: the store did not
    answer in time; the write may still be reading its host pages."""

    PENDING = 0
    TIMED_OUT = 1
    FAILED = 2
    STORED = 3


PREFETCH_HIT = register(10, "prefetch hit", Reduce.MIN)  # pages in storage, from the first
PREFETCH_DONE = register(11, "prefetch done", Reduce.MIN)  # pages fetched, from the first
PREFETCH_MAY_END = register(12, "prefetch may end", Reduce.MIN)  # the policy lets it end (0/1)
WRITE_OUTCOME = register(20, "write outcome", Reduce.MIN)  # CopyOutcome of the device -> host copy
BACKUP_OUTCOME = register(30, "backup outcome", Reduce.MIN)  # BackupOutcome of the host -> storage write
LOAD_OUTCOME = register(40, "load outcome", Reduce.MIN)  # CopyOutcome of the host -> device copy
RECLAIM = register(50, "reclaim", Reduce.MIN)  # no I/O is left on these retired slots (0/1)
