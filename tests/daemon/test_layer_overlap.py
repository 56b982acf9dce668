"""The stand-in forward of `cpcache bench load-back` over a real daemon on
this host: overlapped and blocking load-backs both read, layer by layer,
exactly what was written (the kit checks every block). Its times are the
bench's to report, not this test's to judge."""

import pytest

from cpcache.testing import layer_overlap

pytestmark = pytest.mark.timeout(120)


async def test_the_stand_in_forward_reads_what_was_written_both_ways(run_dir):
    figures = await layer_overlap.measure(run_dir, "cpu", blocks=2, layer_delay_ms=5.0, compute_ms=2.0)
    assert figures["blocks"] == 2 and figures["overlapped_ms"] > 0 and figures["blocking_ms"] > 0
