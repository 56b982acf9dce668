"""The arithmetic of `cpcache bench ranks`, kept free of torch so the CLI
and the tests import it cheaply: which domain sizes to measure, the topology
of each, how long a round's vector is, how many bytes each rank sends and
receives to reduce it (computed from the algorithm), and reading the
kernel's per-socket TCP counters (`ss -tinpH`) to measure the same."""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from cpcache.agreement.rounds import HEADER_SLOTS, next_capacity
from cpcache.topology import Topology

DEFAULT_RANKS = (2, 4, 8, 16)
INT64_BYTES = 8
GLOO_MAX_SEGMENT_BYTES = 1024 * 1024  # gloo's AllreduceOptions::kMaxSegmentSize
GLOO_PREAMBLE_BYTES = 48  # gloo's tcp Op preamble: six size_t


def parse_ranks(text: str) -> tuple[int, ...]:
    """`2,4,8,16` -> (2, 4, 8, 16): domain sizes of at least 2, each once,
    in the order given."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            size = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"ranks: {part!r} is not a whole number") from None
        if size < 2:
            raise argparse.ArgumentTypeError(f"ranks: a domain needs at least 2 ranks, got {size}")
        if size not in sizes:
            sizes.append(size)
    if not sizes:
        raise argparse.ArgumentTypeError("ranks: give at least one domain size, e.g. 2,4,8,16")
    return tuple(sizes)


def topology_for(ranks: int) -> Topology:
    """A one-domain deployment of `ranks` ranks: TP = ranks, attention CP 2
    where it divides (so the domain is an attention TP x CP grid, as in
    `cpcache bench agreement`), else CP 1."""
    cp = 2 if ranks >= 4 and ranks % 2 == 0 else 1
    return Topology(tp=ranks, cp=cp)


def round_vector_length(questions: int) -> int:
    """int64 slots a round of `questions` answers travels in: the header and
    the capacity every rank agreed (a power of two, at least 64)."""
    return HEADER_SLOTS + next_capacity(questions)


@dataclass(frozen=True)
class GlooTraffic:
    """What one rank moves in one collective over gloo's TCP transport:
    payload bytes and point-to-point messages, each way. Every message costs
    three 48-byte preambles (gloo/transport/tcp/pair.h `Op`): the sender's
    send-ready notice and the data's own header go one way, the receiver's
    recv-ready notice the other."""

    payload_sent: int
    payload_received: int
    messages_sent: int
    messages_received: int

    @property
    def wire_sent(self) -> int:
        return self.payload_sent + 2 * GLOO_PREAMBLE_BYTES * self.messages_sent + \
            GLOO_PREAMBLE_BYTES * self.messages_received

    @property
    def wire_received(self) -> int:
        return self.payload_received + 2 * GLOO_PREAMBLE_BYTES * self.messages_received + \
            GLOO_PREAMBLE_BYTES * self.messages_sent


def exchange_traffic(ranks: int, length: int) -> GlooTraffic:
    """One rank's share of the daemons' reduction up to
    `collective.ALLTOALL_MAX_GROUP` ranks (an all-to-all exchange, then a
    local MIN): its whole vector to every other rank, theirs back; its own
    copy never leaves the process."""
    payload = (ranks - 1) * length * INT64_BYTES
    return GlooTraffic(payload, payload, ranks - 1, ranks - 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def ring_allreduce_traffic(ranks: int, length: int, rank: int,
                           max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> GlooTraffic:
    """`rank`'s share of gloo's ring all-reduce of `length` int64s
    (gloo/allreduce.cc `ring`): the buffer is cut into segments (at least 2
    per rank, a multiple of the ranks); reduce-scatter, then all-gather, pass
    segments to the previous rank, one message each. Segments past the
    buffer's end are empty and not sent, so small vectors load ranks
    unevenly. Over all ranks the payload is 2 * (ranks - 1) * the buffer."""
    total = length * INT64_BYTES
    max_segment = INT64_BYTES * max(1, max_segment_bytes // INT64_BYTES)
    segments = _round_up(max(-(-total // max_segment), 2 * ranks), ranks)
    per_rank = segments // ranks
    segment = _round_up(-(-total // segments), INT64_BYTES)
    span = segments * segment

    def size(first: int, i: int) -> int:
        return max(0, min(segment, total - ((first * per_rank + i) * segment) % span))

    sends: list[int] = []
    receives: list[int] = []
    for i in range(segments - per_rank):
        sends += [size(rank + 1, i), size(rank, i)]  # reduce-scatter, then all-gather: to rank - 1
        receives += [size(rank + 2, i), size(rank + 1, i)]  # the same, from rank + 1
    return GlooTraffic(sum(sends), sum(receives), sum(1 for n in sends if n), sum(1 for n in receives if n))


def _summary(traffic: list[GlooTraffic]) -> dict:
    """Mean over the ranks of each figure, with the extremes of wire bytes sent."""
    def mean(values: Iterable[int]) -> float:
        return round(statistics.mean(values), 1)

    wire = [t.wire_sent for t in traffic]
    return {"payload_sent": mean(t.payload_sent for t in traffic),
            "payload_received": mean(t.payload_received for t in traffic),
            "messages_sent": mean(t.messages_sent for t in traffic),
            "wire_sent": mean(wire), "wire_received": mean(t.wire_received for t in traffic),
            "wire_sent_min": min(wire), "wire_sent_max": max(wire)}


def expected_bytes(ranks: int, length: int, alltoall_max_group: int) -> dict:
    """Computed bytes per rank of one round (the daemons' reduction,
    `GroupReducer`: an exchange up to `alltoall_max_group` ranks, gloo's ring
    all-reduce beyond) and of one bare all-reduce of the same vector (ring):
    payload, messages, and wire bytes (payload and gloo's preambles), mean
    over the ranks."""
    ring = _summary([ring_allreduce_traffic(ranks, length, r) for r in range(ranks)])
    if ranks <= alltoall_max_group:
        round_traffic = {"algorithm": "all-to-all exchange + local MIN",
                         **_summary([exchange_traffic(ranks, length)] * ranks)}
    else:
        round_traffic = {"algorithm": "gloo ring all-reduce", **ring}
    return {"vector_bytes": length * INT64_BYTES, "round": round_traffic,
            "allreduce": {"algorithm": "gloo ring all-reduce", **ring}}


# -- measured bytes: the kernel's TCP counters ---------------------------------------------------

_PID = re.compile(r"pid=(\d+),")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_retrans|bytes_received):(\d+)")


def parse_ss(text: str, pids: Iterable[int], exclude_port: int) -> dict[int, tuple[int, int]]:
    """Sum `ss -tinpH` output per process: pid -> (bytes sent less
    retransmitted, bytes received), over its TCP sockets whose local and
    peer ports both differ from `exclude_port` (the rendezvous store)."""
    wanted = set(pids)
    totals = {pid: (0, 0) for pid in wanted}
    owner: int | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # a socket's line; its counters follow, indented
            owner = None
            fields = line.split()
            match = _PID.search(line)
            if len(fields) < 5 or match is None or int(match.group(1)) not in wanted:
                continue
            ports = {fields[3].rsplit(":", 1)[-1], fields[4].rsplit(":", 1)[-1]}
            if str(exclude_port) not in ports:
                owner = int(match.group(1))
        elif owner is not None:
            counters = {k: int(v) for k, v in _COUNTER.findall(line)}
            sent, received = totals[owner]
            totals[owner] = (sent + counters.get("bytes_sent", 0) - counters.get("bytes_retrans", 0),
                             received + counters.get("bytes_received", 0))
            owner = None
    return totals


def per_round(before: dict[int, tuple[int, int]] | None, after: dict[int, tuple[int, int]] | None,
              rounds: int) -> dict | None:
    """Bytes per rank per round between two counter snapshots: mean over the
    ranks, and the extremes."""
    if before is None or after is None:
        return None
    sent = [(after[p][0] - before[p][0]) / rounds for p in before]
    received = [(after[p][1] - before[p][1]) / rounds for p in before]
    return {"sent": round(statistics.mean(sent), 1), "received": round(statistics.mean(received), 1),
            "sent_min": round(min(sent), 1), "sent_max": round(max(sent), 1)}
