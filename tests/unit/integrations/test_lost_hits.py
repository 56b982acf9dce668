"""The backend's side of the lost hits (cpcache/integrations/sglang/lost_hits.py):
counted by reason, a request fallen back counted once, and the logged line
read back as bench serving reads it."""

import pytest

from cpcache.integrations.sglang.lost_hits import REQUESTS_KEPT, LostHits, parse

pytestmark = pytest.mark.timeout(10)


def test_reasons_add_up_and_a_request_matched_again_while_fallen_back_counts_once():
    lost = LostHits()
    lost.lost("device_full", 3)
    lost.lost("load_failed", 2)
    lost.fell_back("a", 5)
    lost.fell_back("a", 5)  # SGLang matches a waiting request again
    lost.fell_back("b", 1)
    assert lost.pages == {"device_full": 3, "load_failed": 2, "fallback": 6}
    line = lost.line(1)
    assert line == "cpcache: rank 1 lost hits: device_full 3 pages, load_failed 2 pages, fallback 6 pages"
    assert parse(f"[2026-12-06 20:00:00 TP1] {line}") == lost.pages


def test_the_requests_remembered_are_bounded():
    lost = LostHits()
    for i in range(REQUESTS_KEPT + 1):
        lost.fell_back(str(i), 1)
    lost.fell_back("0", 1)  # forgotten: counted again
    assert lost.pages["fallback"] == REQUESTS_KEPT + 2
