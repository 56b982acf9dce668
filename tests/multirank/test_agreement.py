"""Four real daemons (attention TP 2 x CP 2) driven by four scheduler
clients: every rank's reply is byte-identical at every step, and correct."""

import asyncio
import random

import pytest

from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology
from cpcache.values import Reduce

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]

STEPS = 25


def random_workload(seed: int, ranks: int):
    """Per step: the same questions on every rank, different local answers."""
    rng = random.Random(seed)
    next_op = 1
    for step in range(1, STEPS + 1):
        count = rng.choice([0, 1, 3, 17, 80])  # 80 > 64: capacity must grow
        ops = [(next_op + i, rng.choice([Reduce.MIN, Reduce.MAX])) for i in range(count)]
        next_op += count + rng.randint(0, 5)
        values = [[rng.randint(-(2**40), 2**40) for _ in ops] for _ in range(ranks)]
        yield step * 3, ops, values  # step numbers need only increase


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("mode", ["domain", "grid"])
async def test_replies_are_identical_on_every_rank(run_dir, mode, lag):
    spec = DomainSpec(Topology(tp=4, cp=2), run_dir, mode=mode, agreement_lag=lag, fault_delay_ms=4, seed=11)
    async with LocalDomain(spec) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        expected_by_step = {}
        sent = []
        for step, ops, values in random_workload(seed=10 * lag + len(mode), ranks=domain.size):
            expected_by_step[step] = {
                op: (min if reduce is Reduce.MIN else max)(values[r][i] for r in range(domain.size))
                for i, (op, reduce) in enumerate(ops)
            }
            sent.append(step)
            order = list(range(domain.size))
            random.Random(step).shuffle(order)  # ranks reach the round in a different order each step
            calls = {
                r: asyncio.ensure_future(
                    clients[r].step(step, [(op, red, values[r][i]) for i, (op, red) in enumerate(ops)])
                )
                for r in order
            }
            replies = [await calls[r] for r in range(domain.size)]
            assert len({reply.wire for reply in replies}) == 1, f"step {step}: replies differ"
            reply = replies[0]
            assert reply.step == step
            if len(sent) <= lag:
                assert reply.round == 0 and reply.decisions == {}
            else:
                assert reply.round == sent[-1 - lag]
                assert reply.decisions == expected_by_step[reply.round]
        statuses = [await c.status() for c in clients]
        assert {s.last_step for s in statuses} == {sent[-1]}
        assert all(STEPS - lag <= s.rounds_completed <= STEPS for s in statuses)
        for c in clients:
            await c.close()
        assert await domain.stop() == [0] * domain.size
