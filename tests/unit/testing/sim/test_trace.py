"""Traces in the Mooncake format turn into tokens and page hashes for any
hash ids and lengths: every request of every shipped trace, and hand-written
ones with ids far beyond uint32. No daemons."""

import json
from pathlib import Path

import numpy as np
import pytest

from cpcache.testing.sim.replay import route
from cpcache.testing.sim.trace import (
    BLOCK_TOKENS,
    VOCAB,
    PageHasher,
    Request,
    block_tokens,
    ceiling_hit_rate,
    load,
)

pytestmark = pytest.mark.timeout(60)

TRACES = Path(__file__).resolve().parents[4] / "traces"
SEED = "00" * 32


def shipped_traces() -> list[Path]:
    return sorted(TRACES.glob("*.jsonl"))


def test_the_repository_carries_its_traces():
    assert [p.name for p in shipped_traces()] == ["conversation_trace.jsonl", "synthetic_trace.jsonl"]


@pytest.mark.parametrize("trace", shipped_traces(), ids=lambda p: p.name)
@pytest.mark.parametrize("page_size", [256])
def test_every_request_of_every_trace_synthesizes(trace, page_size):
    requests = load(trace)
    assert requests
    hasher = PageHasher(SEED, page_size)
    for request in requests:
        pages = hasher.pages(request)
        assert len(pages) == min(request.input_tokens // page_size, len(request.blocks) * BLOCK_TOKENS // page_size)
        assert all(len(p) == 32 for p in pages)
    assert 0 < ceiling_hit_rate(requests, page_size) < 1
    biggest = max(b for r in requests for b in r.blocks)
    tokens = block_tokens(biggest)
    assert tokens.dtype == np.uint32 and tokens.shape == (BLOCK_TOKENS,) and int(tokens.max()) < VOCAB


def test_skip_and_limit_keep_trace_positions():
    trace = TRACES / "conversation_trace.jsonl"
    requests = load(trace, limit=30, skip=2100)
    assert [r.index for r in requests] == list(range(2100, 2130))
    hasher = PageHasher(SEED, 256)
    assert all(hasher.pages(r) for r in requests)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


HUGE = [0, 41011, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 + 7, 10**40, 2**512 + 3]


def test_huge_hash_ids_give_valid_distinct_deterministic_tokens(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": len(HUGE) * BLOCK_TOKENS, "output_length": 1, "hash_ids": HUGE},
        {"timestamp": 5, "input_length": 3 * BLOCK_TOKENS + 7, "output_length": 1, "hash_ids": HUGE[:3] + [2**70]},
        {"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [2**100]},  # under one page
        {"timestamp": 9, "input_length": 0, "output_length": 0, "hash_ids": []},
        {"timestamp": 12, "input_length": 99 * BLOCK_TOKENS, "output_length": 3, "hash_ids": [2**40, 2**41]},
    ]
    requests = load(write_trace(tmp_path / "huge.jsonl", rows))
    blocks = {b: block_tokens(b) for b in HUGE}
    for b, tokens in blocks.items():
        assert tokens.dtype == np.uint32 and tokens.shape == (BLOCK_TOKENS,)
        assert int(tokens.max()) < VOCAB
        assert np.array_equal(tokens, block_tokens(b))  # deterministic
    assert len({t.tobytes() for t in blocks.values()}) == len(HUGE)  # ids that agree mod 2**32 differ
    # Values fixed forever: a replay's page keys must not depend on the machine or numpy version.
    assert block_tokens(0)[:4].tolist() == [95375, 117683, 146414, 126968]
    assert block_tokens(2**64 + 7)[:4].tolist() == [33742, 103955, 110302, 86521]

    hasher = PageHasher(SEED, 128)
    pages = [hasher.pages(r) for r in requests]
    per_block = BLOCK_TOKENS // 128
    assert len(pages[0]) == len(HUGE) * per_block
    assert len(pages[1]) == 3 * per_block  # 3 blocks + 7 tokens: no page of the 4th
    assert pages[1] == pages[0][: 3 * per_block]  # same ids at the same positions: same prefix
    assert pages[2] == [] and pages[3] == []
    assert len(pages[4]) == 2 * per_block  # longer than its blocks: cut where they run out
    assert len({p for ps in pages for p in ps}) == sum(map(len, pages)) - len(pages[1])
    # A fresh hasher (no memo) gives the same chains.
    assert [PageHasher(SEED, 128).pages(r) for r in requests] == pages
    assert ceiling_hit_rate(requests, 128) == pytest.approx(len(pages[1]) / sum(map(len, pages)))


def test_a_hash_id_is_a_position_in_a_chain_not_a_page():
    hasher = PageHasher(SEED, 256)
    a = hasher.pages(Request(0, 0, 2 * BLOCK_TOKENS, (2**80, 7)))
    b = hasher.pages(Request(1, 0, 2 * BLOCK_TOKENS, (8, 7)))
    assert a[2:] != b[2:]  # block 7 after different prefixes hashes differently


@pytest.mark.parametrize(
    "row, message",
    [
        ({"timestamp": 0, "input_length": 512, "hash_ids": [-1]}, "hash id"),
        ({"timestamp": 0, "input_length": 512, "hash_ids": [1.5]}, "hash id"),
        ({"timestamp": 0, "input_length": 512, "hash_ids": [True]}, "hash id"),
        ({"timestamp": 0, "input_length": -3, "hash_ids": [1]}, "input_length"),
        ({"timestamp": 0, "input_length": 512, "hash_ids": 4}, "hash_ids"),
        ({"timestamp": 0, "hash_ids": [1]}, "not a trace request"),
    ],
)
def test_malformed_rows_are_refused_with_their_line(tmp_path, row, message):
    path = write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 1, "hash_ids": [1]}, row])
    with pytest.raises(ValueError, match=message) as info:
        load(path)
    assert "bad.jsonl:2" in str(info.value)


def test_requests_route_round_robin_by_trace_position():
    requests = [Request(i, 0, 512, (i,)) for i in range(10, 20)]
    assert [route(r, 2) for r in requests] == [0, 1] * 5
    assert [route(r, 1) for r in requests] == [0] * 10
    assert {route(r, 3) for r in requests} == {0, 1, 2}
