"""`cpcache bench serving`'s per-request breakdown, its pure parts: the
backend's line by call (as the SGLang backend writes it) read back, the
difference of two per request, the CPU of each role, and the table. The
servers it reads run in `cpcache bench serving`, not here."""

import subprocess
import sys

import pytest

from cpcache.client.outcomes import Tally
from cpcache.integrations.sglang.timing import SchedulerTime
from cpcache.tools.bench.serving_breakdown import ROLES, backend_by_rank, is_scheduler, per_request, role_cpu, table


def timed(clock: SchedulerTime, kind: str, times: int) -> None:
    for _ in range(times):
        with clock.call(kind):
            pass


def test_each_call_kind_and_the_load_waits_are_logged_and_read_back_per_request():
    clock = SchedulerTime()
    before = backend_by_rank([clock.line(0)])
    assert before[0]["kinds"] == {} and before[0]["load_waits"] == 0  # "calls none"
    timed(clock, "match", 3)
    timed(clock, "load_back", 2)
    with clock.load_wait():
        pass
    with clock.hook():
        pass
    assert clock.calls_s == pytest.approx(sum(seconds for seconds, _ in clock.kinds.values()))
    steps = Tally(steps=4, step_seconds=0.5, reply_wait_seconds=0.25)  # of the steps' time, waiting for replies
    after = backend_by_rank([f"[2026-12-07 13:00:00 TP1] {clock.line(1)}", f"[TP0] {clock.line(0, [steps])}"])
    assert sorted(after) == [0, 1]
    assert {k: calls for k, (_, calls) in after[0]["kinds"].items()} == {"match": 3, "load_back": 2}
    assert after[0]["load_waits"] == 1
    zero = dict.fromkeys(ROLES, 0.0)
    spent = per_request(zero, {**zero, "schedulers": 2.0, "daemons": 0.5}, 100, before, after)
    assert spent["cpu_ms"] == {"schedulers": 20.0, "server_rest": 0.0, "daemons": 5.0, "master": 0.0}
    backend = spent["rank0_backend_ms"]
    assert set(backend) == {"hook", "reply_waits", "match", "load_back", "load_waits"}
    assert backend["reply_waits"] == 2.5
    assert all(ms >= 0 for ms in backend.values())


def test_a_server_without_a_backend_gets_its_cpu_only_and_a_dash_in_the_table():
    zero = dict.fromkeys(ROLES, 0.0)
    row = {"per_request": per_request(zero, {**zero, "server_rest": 1.0}, 0)}  # no request done: no division by 0
    assert row["per_request"]["cpu_ms"]["server_rest"] == 1000.0 and "rank0_backend_ms" not in row["per_request"]
    lines = table({"servers": {"radix": row, "failed-to-start": {}}})
    assert len(lines) == 3 and lines[2].startswith("| radix | 0.00 | 1000.00 |") and lines[2].endswith("| - |")


# Burns a tenth of a second of CPU, says so, then waits for its stdin to close.
BUSY = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.1: pass\nprint(1, flush=True)\n" \
       "sys.stdin.read()"


def busy(title: str | None) -> subprocess.Popen:
    """A process that has spent some CPU and waits, titled `title` (as SGLang titles a scheduler) if given."""
    argv = ["bash", "-c", f'exec -a {title} "$0" -c "$1"', sys.executable, BUSY] if title else \
        [sys.executable, "-c", BUSY]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "1\n"
    return process


def test_the_cpu_of_a_process_tree_is_split_into_schedulers_and_the_rest():
    scheduler, other = busy("sglang::scheduler_TP0"), busy(None)
    try:
        assert is_scheduler(scheduler.pid) and not is_scheduler(other.pid)
        titled = role_cpu(scheduler.pid, None, None)
        assert titled["schedulers"] > 0.0 and titled["server_rest"] == 0.0
        plain = role_cpu(other.pid, None, other.pid)  # a server process, and as the master too
        assert plain["schedulers"] == 0.0 and plain["server_rest"] > 0.0 and plain["master"] == plain["server_rest"]
        assert plain["daemons"] == 0.0
    finally:
        for process in (scheduler, other):
            process.communicate("", timeout=30)
