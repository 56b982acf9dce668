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
    assert lru == {"pages": 6, "memory": 0, "storage": 0}  # B's pages pushed A's out
    assert replay(requests, capacity=2, admit=None, memory_pages=0)["storage"] == 2  # kept A's: used next
    # Only first pages admitted: A's first page outlives B's, and A hits it again.
    assert replay(requests, capacity=2, admit=lambda keys, depth: depth < 1, memory_pages=0)["storage"] == 1


def test_a_hit_is_the_run_of_first_pages_memory_then_the_store():
    requests = [A, B, A, [b"a1", b"x2"]]
    hits = replay(requests, capacity=0, admit=lambda keys, depth: True, memory_pages=2)
    # A again: A's pages left memory for B's, found in the store; a1 then from memory (A was read back).
    assert hits == {"pages": 8, "memory": 1, "storage": 2}


def test_a_prompt_is_split_as_the_bench_tokenizer_splits_it():
    tokens = prompt_tokens([0, 14])
    assert tokens[:6] == ["user", ":", "Round", "1", ":", "0"]
    # The last block's last "hi" runs into "Tell": one word, as the tokenizer sees it (unknown to it).
    assert tokens.count("hi") == 255 and "hiTell" in tokens and tokens[-2:] == ["context", "."]
    assert tokens[5 + 129 : 5 + 131] == ["1", "4"]  # the second block's id, digit by digit


def test_the_bench_reports_every_policy_against_lru_at_a_cp_ranks_share():
    out = subprocess.run([sys.executable, "-m", "cpcache.tools.cli", "bench", "store-policies", "--trace-requests",
                          "60", "--json"], capture_output=True, text=True, timeout=100, check=True).stdout
    rows = json.loads(out)["rows"]
    share = next(r for r in rows if r["policy"] == "lru" and r["store"] == "a CP rank's share of it")
    assert share["hit_rate_vs_lru_at_a_share"] == 1.0
    for store in ("the bound", "a CP rank's share of it"):
        optimum = next(r for r in rows if r["policy"] == "offline optimum" and r["store"] == store)
        assert all(r["hit_rate"] <= optimum["hit_rate"] for r in rows if r["store"] == store)
