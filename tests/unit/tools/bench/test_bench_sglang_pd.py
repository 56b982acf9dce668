"""`cpcache bench sglang-pd`, its pure parts: the conversations' prompts,
the TTFT figures, a block's figures, the output comparison, the rotated
order, the report and the CLI's flags. A whole run starts three PD pairs
twice (6 to 7 minutes each block on this 2-core machine), so it is not run
here; docs/benchmarks.md ("Prefill and decode apart (PD)") has its figures."""

import argparse
import json

import pytest

from cpcache.tools.bench import sglang_pd
from cpcache.tools.bench.sglang_pd import (
    ANSWER,
    CONFIGS,
    SYSTEM,
    USER,
    Conversations,
    figures,
    mismatches,
    order_of,
    summarize,
    table,
    ttft_figures,
    turn_prompt,
)
from cpcache.tools.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)


def test_a_turns_prompt_holds_the_system_prompt_every_earlier_turn_and_its_answer_then_the_new_message():
    system, users = Conversations(count=2, turns=3).messages(block=0)
    assert len(system) == SYSTEM and len(users) == 2 and all(len(u) == USER for c in users for u in c)
    answers = [[1] * ANSWER, [2] * ANSWER]
    assert turn_prompt(system, users[0], []) == system + users[0][0]
    assert turn_prompt(system, users[0], answers) == system + users[0][0] + answers[0] + users[0][1] + answers[1] \
        + users[0][2]
    assert Conversations(2, 3).messages(0) == (system, users)  # seeded by the block
    assert Conversations(2, 3).messages(1)[0] != system


def test_ttft_figures_are_mean_median_and_p90_in_ms():
    f = ttft_figures([0.1 * i for i in range(1, 11)])
    assert f == {"mean_ms": 550.0, "median_ms": 550.0, "p90_ms": pytest.approx(910.0)}
    assert ttft_figures([0.2])["p90_ms"] == 200.0
    assert all(v != v for v in ttft_figures([]).values())  # nan


def turn(c: int, k: int, ttft_s: float, device: int = 0, host: int = 0, storage: int = 0) -> dict:
    return {"conversation": c, "turn": k, "prompt_tokens": 100 * (k + 1), "ttft_s": ttft_s, "output_ids": [k],
            "cached": device + host + storage, "device": device, "host": host, "storage": storage}


def test_a_blocks_figures_split_turn_0_from_the_later_turns_and_sum_the_tiers():
    turns = [turn(0, 0, 1.0), turn(0, 1, 0.2, device=64, host=32), turn(1, 0, 3.0), turn(1, 1, 0.4, storage=16)]
    f = figures(turns, seconds=6.0)
    assert f["prompt_tokens"] == 600 and f["prompt_tok_s"] == 100.0
    assert f["ttft_first_mean_ms"] == 2000.0 and f["ttft_later_median_ms"] == pytest.approx(300.0)
    assert (f["cached"], f["device"], f["host"], f["storage"]) == (112, 64, 32, 16)


def test_outputs_unlike_radixs_are_named_by_config_conversation_and_turn():
    radix = {(0, 0): [1, 2], (0, 1): [3]}
    got = mismatches({"radix": radix, "cpcache": {(0, 0): [1, 2], (0, 1): [4]}, "hicache": dict(radix)})
    assert got == [{"config": "cpcache", "conversation": 0, "turn": 1}]


def test_the_configurations_order_rotates_every_block():
    assert [order_of(i) for i in range(4)] == [CONFIGS, CONFIGS[1:] + CONFIGS[:1], CONFIGS[2:] + CONFIGS[:2], CONFIGS]


def test_the_report_has_every_configuration_and_the_per_block_ratios():
    blocks = []
    for radix, cpcache, hicache in [(1.0, 0.5, 0.8), (1.0, 0.6, 0.6)]:
        blocks.append({name: {**figures([turn(0, 0, 2.0), turn(0, 1, t)], seconds=10 * t), "ready_s": 150.0}
                       for name, t in zip(CONFIGS, (radix, cpcache, hicache))})
    report = summarize(blocks, Conversations(1, 2), [], ["a note"], 900.0)
    json.dumps(report)
    assert set(report["configs"]) == set(CONFIGS)
    assert report["ratios"]["ttft_later_cpcache_over_radix"]["median"] == pytest.approx(0.55)
    assert report["ratios"]["prompt_throughput_cpcache_over_hicache"]["blocks"] == [1.6, 1.0]
    text = "\n".join(table(report))
    assert "cpcache" in text and "note: a note" in text


def test_the_cli_takes_the_benchs_flags(monkeypatch):
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(sglang_pd, "main", lambda args: seen.append(args) or 0)
    assert cli_main(["bench", "sglang-pd", "--conversations", "2", "--turns", "3", "--json"]) == 0
    assert (seen[0].conversations, seen[0].turns, seen[0].repeat, seen[0].json) == (2, 3, 2, True)
    assert cli_main(["bench", "sglang-pd", "--repeat", "4"]) == 0 and seen[1].repeat == 4
