"""What the state machine tells this rank's data plane to do, and what it
tells the scheduler. Intents are typed values keyed by the operation's
serial (unique for the life of the state, never reused)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Lookup:
    """How many of `keys`, from the first, are in storage."""

    serial: int
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Fetch:
    """Storage -> host, into `slots`."""

    serial: int
    keys: tuple[str, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class CopyToHost:
    """Device -> host (a write-through)."""

    serial: int
    device_pages: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Store:
    """Host -> storage (a backup); `keys` and `slots` are this rank's share."""

    serial: int
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    has_pages: bool  # whether the backup has pages at all (some rank writes them)


@dataclass(frozen=True)
class CopyToDevice:
    """Host -> device (a load-back); `op_id` is the scheduler's, for WaitLoads."""

    serial: int
    op_id: int
    slots: tuple[int, ...]
    device_pages: tuple[int, ...]


Intent = Lookup | Fetch | CopyToHost | Store | CopyToDevice


@dataclass
class Decisions:
    """What the scheduler is told, by its own op ids."""

    prefetch_hits: list[tuple[int, int]] = field(default_factory=list)  # (op, pages in storage)
    prefetch_done: list[tuple[int, int]] = field(default_factory=list)  # (op, pages accepted)
    prefetch_revoked: list[tuple[int, str]] = field(default_factory=list)  # (op, why)
    write_acks: list[int] = field(default_factory=list)
    write_failures: list[int] = field(default_factory=list)  # copies that failed on some rank
    backups: list[tuple[int, bool]] = field(default_factory=list)  # (backup id, stored)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (op, pages loaded)
    load_failures: list[int] = field(default_factory=list)  # copies that failed on some rank
    host_entered: list[bytes] = field(default_factory=list)  # pages now resident in the host pool
    host_left: list[bytes] = field(default_factory=list)  # pages no longer resident

    def merge(self, other: Decisions) -> Decisions:
        for name, values in vars(other).items():
            getattr(self, name).extend(values)
        return self

    def count(self) -> int:
        return sum(len(v) for v in vars(self).values())
