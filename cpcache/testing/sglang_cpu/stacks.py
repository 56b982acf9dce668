"""A cpcache SGLang server over `cpcache launch` daemons, beside a reference
server without cache: one `Shape` (model family, TP, attention CP, prefill
CP, storage) per stack. Used by the SGLang suites (tests/sglang) and
`cpcache bench sglang-soak`.

Copies between the device and the host pools are slowed on every rank
independently (fault injection), and one rank slower than the others, so
steps overlap I/O and ranks end it at different times: the slowest rank's
progress is what every rank is told.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpcache.testing.sglang_cpu.servers import (
    CPCACHE_FLAGS,
    PLAIN_FLAGS,
    ZIGZAG_ENV,
    ZIGZAG_FLAGS,
    Daemons,
    Reply,
    Server,
    family_env,
    same_outputs,
)

PAGE = 16
DEVICE_TOKENS = 1024  # 64 pages: about three documents
HOST_PAGES = 128  # twice the device pool, as HiCache's default: about seven documents
SYSTEM = 64
DOC = 256
DOCS = 10  # more than the host pool holds: the first ones live in storage only
SLOW_RANK = 1  # its copies and storage calls take twice as long as the others'
START_S = 300.0  # for the daemons, starting beside their server (as long as a server's start may take)


@dataclass(frozen=True)
class Shape:
    family: str = "llama"
    tp: int = 2
    cp: int = 1  # attention CP: splits the TP ranks (attention TP = tp / (dp * cp))
    zigzag: bool = False  # prefill CP: a prefill's tokens split over the CP ranks
    storage: str = "file"
    dp: int = 1  # attention DP: DP groups of tp / dp ranks, each its own scheduler and domain

    @property
    def name(self) -> str:
        return f"{self.family}-tp{self.tp}" + (f"-dp{self.dp}" if self.dp > 1 else "") + \
            (f"-cp{self.cp}" if self.cp > 1 else "") + ("-zigzag" if self.zigzag else "") + f"-{self.storage}"

    @property
    def reference_tp(self) -> int:
        # Under attention CP or DP the reference is a tp 1 server: these
        # models' outputs there equal tp 1's (checked here, request by request).
        return 1 if self.cp > 1 or self.dp > 1 else self.tp


def workload(seed: int = 1, docs: int = DOCS) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(SYSTEM)]
    return system, [[rng.randrange(1, 500) for _ in range(DOC)] for _ in range(docs)]


def prompt(system: list[int], doc: list[int], turn: int, question: int) -> list[int]:
    return system + doc + [turn + 1, question + 1]


def reference_server(name: str, model: Path, work: Path, family: str, tp: int) -> Server:
    """A `--disable-radix-cache` server of `model` (not started): what a
    stack's replies are compared with. It sleeps when idle: its loops would
    otherwise spin a core beside the servers under test."""
    return Server(name, model, work, PLAIN_FLAGS, tp=tp, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                  env=family_env(family), sleep_on_idle=True)


class Reference:
    """A reference server and the replies it gave (keyed by the prompt; greedy,
    `Server.generate`'s defaults), of one model family at one TP. Owned by
    whoever started it: a stack shares one it did not start, and neither
    starts nor stops it."""

    def __init__(self, server: Server, family: str, replies: dict[tuple[int, ...], Reply] | None = None) -> None:
        self.server = server
        self.family = family
        self.replies: dict[tuple[int, ...], Reply] = {} if replies is None else replies


class Stack:
    def __init__(self, work: Path, model: Path, shape: Shape, storage_settings: dict | None = None,
                 copy_delay_ms: float = 400.0, storage_delay_ms: float = 200.0,
                 per_rank: dict[int, dict] | None = None, backend: dict | None = None,
                 daemon_settings: dict | None = None, with_reference: bool = True,
                 sleep_on_idle: bool = False, server_flags: list[str] | None = None,
                 reference: Reference | None = None) -> None:
        """`backend`: the SGLang backend's settings over the defaults here;
        `daemon_settings`: more daemon settings for every rank;
        `with_reference`: start the `--disable-radix-cache` server too;
        `sleep_on_idle`: the cpcache server with SGLang's `--sleep-on-idle`
        (the reference server always has it); `server_flags`: more flags for
        the cpcache server; `reference`: a reference server started by
        someone else (of this model, family and reference TP) to use instead
        of one of its own; the stack waits for it to serve, and leaves it
        running."""
        self.work = work
        self.shape = shape
        self.storage = work / "pages"
        storage = storage_settings or dict(storage="file", storage_root=str(self.storage))
        if per_rank is None and shape.tp > 1:
            per_rank = {SLOW_RANK: dict(fault_copy_delay_ms=2 * copy_delay_ms,
                                        fault_storage_delay_ms=2 * storage_delay_ms)}
        self.daemons = Daemons(work / "run", tp=shape.tp, cp=shape.cp, dp=shape.dp, settings=dict(
            **storage, host_pool_pages=HOST_PAGES, prefetch_threshold_tokens=0, prefetch_policy="wait_complete",
            # Every device <-> host copy takes uniform(0, copy_delay_ms) ms, on
            # each rank independently: steps overlap I/O and ranks finish it apart.
            fault_copy_delay_ms=copy_delay_ms,
            # Every storage call is slowed too: prefetches are still open when
            # their request is aborted.
            fault_storage_delay_ms=storage_delay_ms) | (daemon_settings or {}), per_rank=per_rank or {})
        config = work / "sglang-cpcache.json"
        backend = {"socket": str(work / "run" / "rank-{rank}.sock"), "model_id": "tiny",
                   "reattach_after_iterations": 32, "record_decisions": True, **(backend or {})}
        config.write_text(json.dumps(backend))
        self.load_back = backend.get("load_back", "overlapped")
        self.model = model
        # --enable-metrics: SGLang's HiCache gauges read the backend's host pool,
        # and its idle counters (every rank's) tell when its idle checks ran.
        flags = [*CPCACHE_FLAGS, "--enable-metrics", "--enable-metrics-for-all-schedulers",
                 *(ZIGZAG_FLAGS if shape.zigzag else []), *(server_flags or [])]
        env = {"CPCACHE_SGLANG_CONFIG": str(config), **(ZIGZAG_ENV if shape.zigzag else {}),
               **family_env(shape.family)}
        self.cpcache = Server("cpcache", model, work, flags, tp=shape.tp, cp=shape.cp, dp=shape.dp, page_size=PAGE,
                              device_tokens=DEVICE_TOKENS, env=env, sleep_on_idle=sleep_on_idle)
        if reference is not None:
            server = reference.server
            assert (server.model, server.tp, reference.family) == (model, shape.reference_tp, shape.family), \
                f"a reference of {server.model} at tp {server.tp} ({reference.family}) for a stack of {model}, " \
                f"{shape.name}"
        self.owns_reference = reference is None and with_reference
        if self.owns_reference:
            reference = Reference(reference_server("reference", model, work, shape.family, shape.reference_tp),
                                  shape.family)
        self.plain = reference.server if reference is not None else None
        self.expected: dict[tuple[int, ...], Reply] = reference.replies if reference is not None else {}

    def start(self) -> Stack:
        return self.launch().wait_ready()

    def launch(self) -> Stack:
        """Start every process, waiting for none (`wait_ready` does): stacks
        launched together start side by side."""
        self.daemons.launch()
        if self.plain is not None and self.owns_reference:
            self.plain.start()
        self.cpcache.start()
        return self

    def wait_ready(self) -> Stack:
        self.daemons.wait_ready(START_S)
        if self.plain is not None:
            self.plain.wait_ready()
        self.cpcache.wait_ready()
        return self

    def stop(self) -> None:
        self.cpcache.stop()
        if self.plain is not None and self.owns_reference:
            self.plain.stop()
        self.daemons.stop()

    def reference(self, ids: list[int]) -> Reply:
        key = tuple(ids)
        if key not in self.expected:
            assert self.plain is not None, "a stack started without its reference server"
            self.expected[key] = self.plain.generate(ids)
        return self.expected[key]

    def generate(self, ids: list[int], dp_rank: int | None = None) -> Reply:
        """cpcache's reply, as a client gets it (`dp_rank`: the attention DP group to serve it)."""
        return self.cpcache.generate(ids, dp_rank=dp_rank)

    def check(self, ids: list[int], dp_rank: int | None = None) -> Reply:
        """cpcache's reply, asserted equal to the reference server's."""
        got = self.generate(ids, dp_rank)
        want = self.reference(ids)
        assert same_outputs(got, want), f"cpcache answered {got}, a server without cache {want}"
        return got

    @property
    def ranks(self) -> int:
        return self.shape.tp

    def decision_logs(self) -> dict[int, str]:
        """Every rank's decision log digest as of the last flush_cache."""
        logs: dict[int, str] = {}
        for line in self.cpcache.log_lines("decision log:"):
            found = re.search(r"rank (\d+) decision log: (\d+ steps, digest \w+)", line)
            if found:
                logs[int(found[1])] = found[2]
        return logs


@contextlib.contextmanager
def started(work: Path, model: Path, shape: Shape, **options: Any) -> Iterator[Stack]:
    """A started Stack of `shape` (`options`: Stack's); Mooncake Store's master
    runs beside it when asked."""
    with contextlib.ExitStack() as stack:
        storage = None
        if shape.storage == "mooncake":
            from cpcache.testing.mooncake_master import MooncakeMaster

            master = stack.enter_context(MooncakeMaster(work / "mooncake-master.log"))
            storage = dict(storage="mooncake", storage_master=master.master,
                           storage_metadata_server=master.metadata_server, storage_segment_bytes=256 << 20)
        built = Stack(work, model, shape, storage, **options)
        stack.callback(built.stop)
        yield built.start()


def idle_seconds(server: Server) -> dict[str, float]:
    """SGLang's scheduler idle counters, one per rank (--enable-metrics,
    --enable-metrics-for-all-schedulers). A scheduler adds to its counter in
    its idle pass, right before its leak check."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30).read().decode()
    series = (line.rsplit(" ", 1) for line in text.splitlines()
              if line.startswith("sglang:scheduler_idle_seconds_total"))
    return {labels: float(value) for labels, value in series}
