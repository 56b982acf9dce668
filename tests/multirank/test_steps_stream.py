"""The `Steps` stream is `Step` over one stream per scheduler: the same
agreed replies byte for byte (ranks may mix the two calls), the same agreed
rejection, the same retries by step number."""

import asyncio

import pytest

from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.errors import FailedPrecondition, InvalidArgument, RejectedByPeer
from cpcache.topology import Topology
from cpcache.values import Reduce

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


def votes(step: int, rank: int) -> list[tuple[int, Reduce, int]]:
    return [(op, Reduce.MIN if op % 2 else Reduce.MAX, rank * 100 + op * step) for op in range(1, 4 + step % 70)]


@pytest.mark.parametrize("lag", [0, 1])
async def test_stream_and_unary_steps_agree_reject_and_retry_alike(run_dir, lag):
    spec = DomainSpec(Topology(tp=4, cp=2), run_dir, agreement_lag=lag)
    async with LocalDomain(spec) as domain:
        clients = [AsyncClient(s, timeout_s=30) for s in domain.sockets]
        streams = [c.steps_stream() for c in clients]
        try:
            def send(rank: int, step: int, request):
                # Ranks 0 and 2 use the stream, 1 and 3 the unary call.
                return (streams[rank].step if rank % 2 == 0 else clients[rank].step)(step, request)

            for step in range(1, 30):
                replies = await asyncio.gather(*(send(r, step, votes(step, r)) for r in range(4)))
                assert len({r.wire for r in replies}) == 1, f"step {step}: replies differ"
                if step > lag:
                    assert replies[0].round == step - lag
                    expected = {op: (min if red == Reduce.MIN else max)(v[2] for v in col)
                                for (op, red, _), *col in zip(votes(step - lag, 0),
                                                              *(votes(step - lag, r) for r in range(4)))}
                    assert replies[0].decisions == expected

            # Rank 2 (on its stream) repeats an op id: the step is rejected on every rank alike.
            bad = 30
            results = await asyncio.gather(
                *(send(r, bad, [(1, Reduce.MIN, 0), (1, Reduce.MIN, 0)] if r == 2 else votes(bad, r))
                  for r in range(4)), return_exceptions=True)
            if lag:  # the step that delivers round 30 reports it
                assert not any(isinstance(x, BaseException) for x in results)
                results = await asyncio.gather(*(send(r, bad + 1, votes(bad + 1, r)) for r in range(4)),
                                               return_exceptions=True)
            assert isinstance(results[2], InvalidArgument)
            for r in (0, 1, 3):
                assert isinstance(results[r], RejectedByPeer) and results[r].rank == 2

            # The stream goes on after a failed step (a new one is opened), and a
            # retry by either call gets the reply kept for the step.
            step = bad + 1 + lag
            first = await asyncio.gather(*(send(r, step, votes(step, r)) for r in range(4)))
            again_unary = await clients[0].step(step, votes(step, 0))
            again_stream = await streams[1].step(step, votes(step, 1))
            assert again_unary.wire == first[0].wire and again_stream.wire == first[1].wire
            # An old step number with other content is refused, as by Step.
            with pytest.raises(FailedPrecondition, match="already taken with different content"):
                await streams[0].step(1, votes(2, 0))
            last = await asyncio.gather(*(send(r, step + 1, votes(step + 1, r)) for r in range(4)))
            assert len({r.wire for r in last}) == 1 and last[0].round == step + 1 - lag
        finally:
            for s in streams:
                await s.close()
            for c in clients:
                await c.close()
