"""`cpcache bench ranks`, one short run on 2 real ranks: the TCP bytes they
measure must be the ones computed (the arithmetic is tested in
tests/unit/tools/bench/test_bench_ranks.py)."""

import asyncio
import shutil

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to read TCP counters")
def test_two_real_ranks_measure_the_bytes_they_were_computed_to_send():
    from cpcache.tools.bench.ranks import measure

    report = asyncio.run(measure(2, steps=2, repeat=1, byte_rounds=2))
    assert not report["oversubscribed"] or report["cpus"] < 2
    for what in ("round", "allreduce", "exchange"):
        assert report["bytes_measured"][what] is not None, what
    expected = report["bytes_expected"]
    assert report["bytes_measured"]["round"]["sent"] == expected["round"]["wire_sent"] == 712
    assert report["bytes_measured"]["exchange"]["sent"] == expected["round"]["wire_sent"]
    assert report["bytes_measured"]["allreduce"]["sent"] == expected["allreduce"]["wire_sent"]
    assert report["round_us"]["p50"] > 0 and report["ratios"]["round_over_allreduce"] > 0
