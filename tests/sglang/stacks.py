"""The SGLang suites' own checks over a `cpcache.testing.sglang_cpu.stacks`
Stack: the session's tiny models and reference servers, a module's stack of
one shape, SGLang's idle leak check waited for, pages planted in storage,
and a daemon killed mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from cpcache import errors
from cpcache.client import Client
from cpcache.dataplane.storage import framing
from cpcache.keys import chain, generation_pages
from cpcache.testing.sglang_cpu.servers import (
    CPU_HOST,
    Reply,
    Server,
    make_tiny_model,
    same_outputs,
    sglang_interpreter,
)
from cpcache.testing.sglang_cpu.stacks import (
    DOCS,
    PAGE,
    Reference,
    Shape,
    Stack,
    idle_seconds,
    prompt,
    reference_server,
    started,
    workload,
)
from cpcache.topology import Topology

ROOT = Path(__file__).resolve().parents[2]


def run_sglang_worker(worker: Path, env: dict[str, str] | None = None, timeout_s: float = 240.0) -> dict:
    """Run `worker` in SGLang's environment (this checkout's cpcache and the
    CPU stand-ins on its path): -> the JSON object of its last output line."""
    path = os.pathsep.join([str(CPU_HOST), str(ROOT)])
    done = subprocess.run([sglang_interpreter(), str(worker)], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


IDLE_KEPT = 3  # idle reference servers kept up: one per family the suite compares with (about 2 GiB each)


class References:
    """The session's tiny models (one per family: seeded, so every one of a
    family is the same) and its reference servers, one per family and
    reference TP, shared by the stacks that compare with it: a server
    without cache answers a prompt the same whoever asked before, and its
    replies are kept for the next stack of that model.

    An idle reference costs memory, not CPU: no stack using it, it is
    paused (SIGSTOP; asleep, an idle SGLang server still polls), and it is
    resumed when one asks for it again. So up to IDLE_KEPT idle ones stay
    up for the next module that wants one (the suite's modules take turns
    between families: each started once); past that, asking for another
    kind stops the least recently used idle ones. One in use is never
    stopped. A reference found exited is started again (its replies kept)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.models: dict[str, Path] = {}
        self.running: dict[tuple[str, int], Reference] = {}
        self.users: dict[tuple[str, int], int] = {}
        self.replies: dict[tuple[str, int], dict] = {}

    def model(self, family: str) -> Path:
        if family not in self.models:
            self.models[family] = make_tiny_model(self.work / family, family)
        return self.models[family]

    @contextlib.contextmanager
    def use(self, shape: Shape) -> Iterator[Reference]:
        """The reference for stacks of `shape` (started, perhaps not yet
        serving: `Stack.start` waits for it), held while the block runs."""
        key = (shape.family, shape.reference_tp)
        self._stop_idle(IDLE_KEPT - 1, but=key)  # room for this one when it is idle again
        reference = self.running.pop(key, None)  # put back last: the most recently asked for
        process = reference.server.process if reference is not None else None
        if reference is None or process is None or process.proc.poll() is not None:
            if reference is not None:
                reference.server.stop()
            family, tp = key
            server = reference_server(f"reference-{family}-tp{tp}", self.model(family), self.work, family, tp)
            reference = Reference(server.start(), family, self.replies.setdefault(key, {}))
        elif not self.users.get(key):
            process.resume()
        self.running[key] = reference
        self.users[key] = self.users.get(key, 0) + 1
        try:
            yield reference
        finally:
            self.users[key] -= 1
            if not self.users[key] and reference.server.process is not None:
                reference.server.process.pause()
            self._stop_idle(IDLE_KEPT)

    def _stop_idle(self, keep: int, but: tuple[str, int] | None = None) -> None:
        """Stop the idle references past the `keep` most recently asked for (`but` aside)."""
        idle = [k for k in self.running if k != but and not self.users.get(k)]  # least recently asked first
        for key in idle[: max(0, len(idle) - keep)]:
            self.running.pop(key).server.stop()

    def stop(self) -> None:
        for reference in self.running.values():
            reference.server.stop()
        self.running.clear()


@contextlib.contextmanager
def stack_of(shape: Shape, work: Path, references: References, **options: object) -> Iterator[Stack]:
    """A started stack of `shape` over the session's tiny model of its
    family and its reference server, in `work` (a module's fixture; `options`:
    Stack's); prints how long the stack took to serve."""
    begun = time.monotonic()
    with references.use(shape) as reference, \
            started(work, references.model(shape.family), shape, reference=reference, **options) as stack:
        print(f"{shape.name}: servers ready in {time.monotonic() - begun:.1f} s")
        yield stack


def wait_idle_checks(server: Server, ranks: int, idle_s: float, attempts: int = 100_000) -> None:
    """Until every rank's scheduler has been idle `idle_s` seconds more (its
    idle pass, leak check included, ran again and again), or the server exited."""
    start = idle_seconds(server)
    assert len(start) >= ranks, f"idle counters of {len(start)} schedulers, not {ranks}: {start}"
    for _ in range(attempts):
        assert server.process is not None and server.process.proc.poll() is None, \
            f"the server exited:\n{server.process.tail() if server.process else ''}"
        now = idle_seconds(server)
        if all(now.get(rank, 0.0) >= seconds + idle_s for rank, seconds in start.items()):
            return
    raise AssertionError(f"the schedulers were not idle {idle_s} s within {attempts} looks")


def stored_pages(stack: Stack, tokens: list[int]) -> list[Path]:
    # Every flush (a weight update's too) names the pages anew.
    generation = len(stack.cpcache.log_lines("cpcache: rank 0 flushed its cache"))
    hashes = generation_pages(chain(tokens, PAGE, None), generation)
    # A page's object is `tenant.hash`, then its shard's suffix where the
    # page differs per rank (none for a replicated MLA latent).
    # Temp files of writes in flight are hidden (a leading dot): not pages.
    return sorted(p for h in hashes for p in stack.storage.glob(f"*/*.{h}*") if not p.name.startswith("."))


def plant_wrong_page(path: Path) -> None:
    """Rewrite a stored page with other KV in a valid frame (checksum and
    all): what anyone who may write the storage root could do."""
    raw = path.read_bytes()
    header, payload = raw[: framing.HEADER.size], raw[framing.HEADER.size :]
    _, _, _, geometry, _, _ = framing.HEADER.unpack(header)
    wrong = (np.frombuffer(payload, dtype=np.float32) * -8.0 + 3.0).astype(np.float32).tobytes()
    path.write_bytes(framing.pack_header(geometry, wrong) + wrong)


def in_background(work: Callable[[], Reply]) -> tuple[threading.Thread, list[Reply]]:
    answer: list[Reply] = []
    thread = threading.Thread(target=lambda: answer.append(work()), daemon=True)
    thread.start()
    return thread, answer


def open_operations_on(stack: Stack, rank: int, until: Callable[[dict[str, int]], bool],
                       running: Callable[[], bool]) -> dict[str, int]:
    """Polls `rank`'s daemon until its open operations satisfy `until` (or
    nothing runs any more): -> the last counts."""
    kinds = ("open_loads", "open_writes", "open_prefetches", "open_backups")
    with Client(stack.daemons.socket(rank), timeout_s=10) as daemon:
        ops = {kind: 0 for kind in kinds}
        while True:
            try:
                counters = dict(daemon.stats())
            except errors.Unavailable:  # a loaded host: the daemon may be slow to take the connection
                counters = {}
            ops = {kind: counters.get(kind, 0) for kind in kinds} if counters else ops
            if until(ops) or not running():
                return ops


def wait_no_io(stack: Stack, rank: int) -> None:
    """Until `rank`'s daemon has no I/O in flight (its host slots all idle)."""
    with Client(stack.daemons.socket(rank), timeout_s=10) as daemon:
        while dict(daemon.stats()).get("in_flight_slots", 0):
            pass


def kill_daemon_mid_run_and_come_back(stack: Stack, seed: int, victim: int = 1) -> None:
    """A daemon SIGKILLed while loads, writes and prefetches are in flight
    (slowed copies and storage keep them open), the server then idle long
    enough for SGLang's own idle leak check to run again and again, then more
    requests: the server never exits, replies stay equal to the reference's,
    every rank of the victim's domain falls back at one iteration and
    attaches again at one iteration, and every device slot comes back. Under
    attention DP the requests go to the victim's DP group, and the other
    groups' domains are not the victim's."""
    system, docs = workload(seed=seed, docs=DOCS)
    server = stack.cpcache.process
    assert server is not None
    shape = stack.shape
    topology = Topology(tp=shape.tp, dp=shape.dp, cp=shape.cp)
    domain = set(topology.domain(victim).ranks)
    group = topology.coordinates(victim).dp if shape.dp > 1 else None

    def of_domain(lines: list[str]) -> list[str]:
        return [line for line in lines if int(re.search(r"rank (\d+)", line)[1]) in domain]  # type: ignore[index]
    for d, doc in enumerate(docs):  # documents now in the device, the host pool and storage
        stack.check(prompt(system, doc, 0, d), group)
    # In flight when the daemon dies: a host hit being loaded and written back,
    # a storage prefetch, and new pages being written through. A round whose
    # requests all end before a load opens is checked and sent again (new
    # turns: the documents are back in the host pool and storage by then).
    for attempt in range(4):
        other_system, (new_doc,) = workload(seed + 1 + attempt, docs=1)
        inflight = [prompt(system, docs[d], 1 + attempt, d) for d in (len(docs) - 4, 0, 1)] + \
            [prompt(other_system, new_doc, 0, 0)]
        wanted = [stack.reference(ids) for ids in inflight]
        workers = [in_background(lambda ids=ids: stack.generate(ids, group)) for ids in inflight]
        caught = open_operations_on(stack, victim, until=lambda ops: ops["open_loads"] > 0,
                                    running=lambda workers=workers: any(t.is_alive() for t, _ in workers))
        if caught["open_loads"] > 0:
            break
        for (thread, answer), want in zip(workers, wanted):
            thread.join(300)
            assert answer and same_outputs(answer[0], want), f"answered {answer}, a server without cache {want}"
    landed_first = stack.load_back == "overlapped"
    if landed_first:
        # With the overlapped load-back a forward reads an open load as it
        # lands, and a daemon lost before its copy landed stops the server
        # (docs/sglang.md; tests/sglang/test_load_back.py shows it). So here
        # the server is paused, the victim's copies and storage calls end
        # (its operations stay open: no round decides them), then it dies.
        stack.cpcache.process.pause()
        wait_no_io(stack, victim)
    os.kill(stack.daemons.daemon_pid(victim), signal.SIGKILL)
    if landed_first:
        stack.cpcache.process.resume()
    print(f"daemon {victim} killed with {caught} open (round {attempt + 1}, copies landed first: {landed_first})")
    assert caught["open_loads"] > 0, f"no load was in flight when the daemon died, in {attempt + 1} rounds: {caught}"
    for (thread, answer), want in zip(workers, wanted):
        thread.join(300)
        assert answer and same_outputs(answer[0], want), f"answered {answer}, a server without cache {want}"
    fell = server.wait_lines("fell back to the device tree at iteration", len(domain), timeout_s=120)
    assert len(of_domain(fell)) == len(fell), f"a rank outside the victim's domain fell back: {fell}"
    iterations = {line.split("at iteration ")[1].split(":")[0] for line in fell}
    assert len(iterations) == 1, f"the ranks fell back at different iterations: {fell}"
    wait_idle_checks(stack.cpcache, stack.ranks, idle_s=3.0)  # SGLang's leak check ran while the daemon was dead
    for d in range(4):  # served without the tiers: device only, still correct
        stack.check(prompt(system, docs[d], 8, d), group)
    back = server.wait_lines("attached again at iteration", len(domain), timeout_s=300)
    again = {line.split("at iteration ")[1].split(";")[0] for line in back}
    fell_back = server.lines_with("fell back to the device tree at iteration")
    assert len(fell_back) == len(domain), f"ranks outside the victim's domain fell back: {fell_back}"
    assert len(again) == 1, f"the ranks attached again at different iterations: {back}"
    # The slots of a load left undecided came back on every rank at once, before
    # it said it attached again. (None when the load seen open was decided,
    # and its reply read, just before the kill.)
    given = server.lines_with("device slots of loads its last session left undecided")
    assert len(given) in (0, len(domain)) and len({line.split("gave back ")[1] for line in given}) <= 1, given
    print(f"slots given back at the attach again: {given[0].split('gave back ')[1].strip() if given else 'none'}")
    replies = [stack.check(prompt(system, docs[d], 9, d), group) for d in range(len(docs))]
    assert sum(r.host + r.storage for r in replies) > 0, f"no host or storage hit after attaching again: {replies}"
    wait_idle_checks(stack.cpcache, stack.ranks, idle_s=2.0)
    assert stack.cpcache.process is not None and stack.cpcache.process.proc.poll() is None
    assert not server.lines_with("memory leak detected"), server.lines_with("memory leak detected")
    # Every rank took the same decisions since the attach again. (Before the
    # kill, the dead daemon's rank may lack the reply of the round it died in.)
    logged = len(server.lines_with("decision log:"))
    stack.cpcache.flush_cache()
    lines = of_domain(server.wait_lines("decision log:", logged + stack.ranks, timeout_s=60)[logged:])
    assert len(lines) == len(domain) and len({line.split("since the last attach ")[1] for line in lines}) == 1, lines


def flush_with_writes_in_flight_serves_no_wrong_bytes(stack: Stack) -> None:
    """A flush taken right after a request ran (its write-through queued or in
    flight) decides those writes first, and leaves nothing below the device."""
    system, docs = workload(seed=2, docs=3)
    server = stack.cpcache.process
    assert server is not None
    flushes_before = len(stack.cpcache.log_lines("flushed its cache"))
    for d, doc in enumerate(docs):
        ids = prompt(system, doc, 0, d)
        prefills = len(server.lines_with("Prefill batch"))
        thread, answer = in_background(lambda ids=ids: stack.cpcache.generate(ids))
        server.wait_lines("Prefill batch", prefills + 1, timeout_s=120)  # the request runs
        # Taken at the first iteration the request is not running: its
        # write-through was queued at its end, and is queued or in flight now.
        stack.cpcache.flush_cache()
        thread.join(120)
        assert answer and same_outputs(answer[0], stack.reference(ids)), answer
    # Each rank logs its flush as it ends: the last rank's may come after the reply.
    flushes = server.wait_lines("flushed its cache", flushes_before + stack.ranks * len(docs),
                                timeout_s=60)[flushes_before:]
    assert len(flushes) == stack.ranks * len(docs), flushes
    assert [line for line in flushes if "0 queued writes cancelled, 0 in flight" not in line], \
        f"no flush found a write queued or in flight: {flushes}"
    # A flush leaves nothing reachable below the device either (as SGLang's
    # HiCache empties its host pool): the same documents are computed again.
    for d, doc in enumerate(docs):
        again = stack.check(prompt(system, doc, 1, d))
        assert again.host == 0 and again.storage == 0, again


def a_wrong_stored_page_breaks_the_match(stack: Stack) -> None:
    """The negative control: a page planted in storage (a valid frame around
    wrong bytes) is served, and the reply no longer equals the reference."""
    system, docs = workload(seed=4)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    target = docs[0]  # evicted from the device and the host pool since, kept in storage
    files = stored_pages(stack, system + target)
    assert files, "the document's pages are not in storage"
    for path in files[len(files) // 2 :]:
        plant_wrong_page(path)
    ids = prompt(system, target, 5, 0)
    got = stack.cpcache.generate(ids)
    assert got.storage > 0, f"the document did not come from storage: {got}"
    assert not same_outputs(got, stack.reference(ids)), "wrong KV served and the check did not see it"


def requests_aborted_during_their_prefetch_are_revoked_on_every_rank(stack: Stack) -> None:
    system, docs = workload(seed=5)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    server = stack.cpcache.process
    assert server is not None
    for d in (0, 1):  # in storage only by now: each request starts a prefetch
        rid = f"aborted-{d}"
        ids = prompt(system, docs[d], 1, d)
        thread, answer = in_background(lambda ids=ids, rid=rid: stack.cpcache.generate(ids, rid=rid))
        for _ in range(10_000):  # until SGLang has the request: an abort of an unknown rid does nothing
            stack.cpcache.post("/abort_request", {"rid": rid})
            if server.lines_with(f"revoked the prefetch of aborted request {rid}") or not thread.is_alive():
                break
        thread.join(120)
        assert answer and answer[0].finish == "abort", answer
        server.wait_lines(f"revoked the prefetch of aborted request {rid}", stack.ranks, timeout_s=60)
    # The revoked prefetches left nothing wrong behind: the same documents again.
    for d in (0, 1, 2):
        stack.check(prompt(system, docs[d], 2, d))
