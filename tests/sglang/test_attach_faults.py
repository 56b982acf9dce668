"""A daemon that dies after its domain agreed an Attach, before it answered:
its rank's try fails unanswered while its peers were told it succeeded.
Through a real `sglang.launch_server` at `--tp 2 --attn-cp-size 2` over
`cpcache launch` daemons: daemon 1 is killed, both ranks fall back, and
daemon 0 dies at the next agreed Attach (`fault_exit_after_attach`), as the
ranks try to attach again. The try's first step, taken before it counts,
fails on the rank whose daemon answered too (its round needs the dead
one): every rank counts the try failed, and every rank attaches at one
later iteration, once the launcher has restarted the daemon. Replies stay
equal to a tp 1 server's without cache throughout, and the ranks'
decisions since the attach are the same.

Runs alone with `pytest -m sglang tests/sglang/test_attach_faults.py`.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON
from cpcache.testing.sglang_cpu.stacks import DOCS, Shape, prompt, workload
from tests.sglang.stacks import References, stack_of

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

SHAPE = Shape("qwen3", tp=2, cp=2, storage="file")
KILLED, DIES_AT_ATTACH = 1, 0  # daemon 0's second agreed Attach is the ranks' first try after the fallback


def iteration_of(line: str) -> str:
    return re.search(r"at iteration (\d+)", line)[1]  # type: ignore[index]


def test_a_daemon_dying_between_an_agreed_attach_and_its_answer_leaves_no_rank_attached_alone(
        tmp_path, references: References):
    dying = {DIES_AT_ATTACH: dict(fault_exit_after_attach=2)}
    with stack_of(SHAPE, tmp_path, references, per_rank=dying, copy_delay_ms=0.0, storage_delay_ms=0.0) as stack:
        server, launcher = stack.cpcache.process, stack.daemons.process
        assert server is not None and launcher is not None
        system, docs = workload(seed=5, docs=DOCS)
        for d, doc in enumerate(docs):
            stack.check(prompt(system, doc, 0, d))
        os.kill(stack.daemons.daemon_pid(KILLED), signal.SIGKILL)
        stack.check(prompt(system, docs[0], 1, 0))  # its steps find the daemon gone
        fell = server.wait_lines("fell back to the device tree at iteration", stack.ranks, timeout_s=120)
        assert len({iteration_of(line) for line in fell}) == 1, fell
        # A try: daemon 0 agrees the Attach and dies before answering it.
        launcher.wait_lines(f"rank {DIES_AT_ATTACH} exited with code", 1, timeout_s=300)
        daemon_log = (stack.daemons.run_dir / f"rank-{DIES_AT_ATTACH}.log").read_text()
        assert "exiting after Attach 2 was agreed, before answering it" in daemon_log
        back = server.wait_lines("attached again at iteration", stack.ranks, timeout_s=300)
        assert len(back) == stack.ranks and len({iteration_of(line) for line in back}) == 1, back
        # The rank whose daemon answered that try took its first step, which
        # failed (its round had no peer): it did not count itself attached.
        answered = 1 - DIES_AT_ATTACH
        failed = [line for line in server.lines_with("could not attach again at iteration")
                  if f"rank {answered} could" in line]
        assert [line for line in failed if re.search(r"round \d+ failed", line)], failed
        assert all(int(iteration_of(line)) < int(iteration_of(back[0])) for line in failed), (failed, back)
        replies = [stack.check(prompt(system, doc, 2, d)) for d, doc in enumerate(docs)]
        assert sum(r.host + r.storage for r in replies) > 0, f"no host or storage hit after attaching again: {replies}"
        assert server.proc.poll() is None
        logged = len(server.lines_with("decision log:"))
        stack.cpcache.flush_cache()
        lines = server.wait_lines("decision log:", logged + stack.ranks, timeout_s=60)[logged:]
        assert len({line.split("since the last attach ")[1] for line in lines}) == 1, lines
