"""`cpcache bench store-policies` replays `bench serving`'s prompts page by
page through memory and a bounded store, under several policies."""

import json
import subprocess
import sys

import pytest

from cpcache.tools.bench.store_policies import prompt_tokens, replay

pytestmark = pytest.mark.timeout(120)

A = [b"a1", b"a2"]
B = [b"b1", b"b2"]


def test_a_store_of_two_pages_keeps_the_last_request_under_lru_and_the_next_one_used_at_the_optimum():
    requests = [A, B, A]
    lru = replay(requests, capacity=2, admit=lambda keys, depth: True, memory_pages=0)
    assert lru == {"pages": 6, "memory": 0, "storage": 0, "below_threshold": 0}  # B's pages pushed A's out
    assert replay(requests, capacity=2, admit=None, memory_pages=0)["storage"] == 2  # kept A's: used next
    # Only first pages admitted: A's first page outlives B's, and A hits it again.
    assert replay(requests, capacity=2, admit=lambda keys, depth: depth < 1, memory_pages=0)["storage"] == 1


def test_a_hit_is_the_run_of_first_pages_memory_then_the_store():
    requests = [A, B, A, [b"a1", b"x2"]]
    hits = replay(requests, capacity=0, admit=lambda keys, depth: True, memory_pages=2)
    # A again: A's pages left memory for B's, found in the store; a1 then from memory (A was read back).
    assert hits == {"pages": 8, "memory": 1, "storage": 2, "below_threshold": 0}


def test_a_storage_run_below_the_threshold_is_computed_and_left_unread():
    requests = [A, B, A]
    # The store keeps all; A's run of 2 pages (32 tokens) is read at a threshold of 32, not at 48.
    assert replay(requests, 0, lambda keys, depth: True, memory_pages=0, threshold_tokens=32)["storage"] == 2
    hits = replay(requests, 0, lambda keys, depth: True, memory_pages=0, threshold_tokens=48)
    assert (hits["storage"], hits["below_threshold"]) == (0, 2)


def test_at_equal_bytes_hicache_holds_a_cp_rank_share_and_never_more_than_cpcache():
    from cpcache.tools.bench.store_policies import CAPACITY_BOUNDS, CP_SIZES, capacity_rows

    pages = [[bytes([r % 7, d]) for d in range(4)] for r in range(40)]
    rows = capacity_rows(pages)
    assert [(r["storage_bytes_pages"], r["cp"]) for r in rows] == [(b, cp) for b in CAPACITY_BOUNDS for cp in CP_SIZES]
    assert all(r["hicache_pages"] == r["cpcache_pages"] // r["cp"] and r["ratio"] >= 1.0 for r in rows)


def test_a_prompt_is_split_as_the_bench_tokenizer_splits_it():
    tokens = prompt_tokens([0, 14])
    assert tokens[:6] == ["user", ":", "Round", "1", ":", "0"]
    # The last block's last "hi" runs into "Tell": one word, as the tokenizer sees it (unknown to it).
    assert tokens.count("hi") == 255 and "hiTell" in tokens and tokens[-2:] == ["context", "."]
    assert tokens[5 + 129 : 5 + 131] == ["1", "4"]  # the second block's id, digit by digit


def test_the_bench_reports_every_policy_against_lru_at_a_cp_ranks_share():
    out = subprocess.run([sys.executable, "-m", "cpcache.tools.cli", "bench", "store-policies", "--trace-requests",
                          "60", "--json"], capture_output=True, text=True, timeout=100, check=True).stdout
    report = json.loads(out)
    rows = report["rows"]
    assert [r["cp"] for r in report["capacity"]][:3] == [2, 4, 8]
    assert {r["threshold_tokens"] for r in report["thresholds"]} == {0, 16, 32, 64, 128, 256}
    share = next(r for r in rows if r["policy"] == "lru" and r["store"] == "a CP rank's share of it")
    assert share["hit_rate_vs_lru_at_a_share"] == 1.0
    for store in ("the bound", "a CP rank's share of it"):
        optimum = next(r for r in rows if r["policy"] == "offline optimum" and r["store"] == store)
        assert all(r["hit_rate"] <= optimum["hit_rate"] for r in rows if r["store"] == store)
