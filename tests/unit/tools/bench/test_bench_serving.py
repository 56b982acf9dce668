"""The pure parts of `cpcache bench serving` (the servers themselves run in the bench)."""

import argparse

from cpcache.tools.bench import serving


def row(itl: float, decode_only: dict | None) -> dict:
    return {"completed": 10, "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0, "p99_ttft_ms": 300.0, "mean_itl_ms": itl,
            "mean_tpot_ms": itl, "input_throughput": 500.0, "cache": {"cache_hit_rate_pct": 40.0},
            "stored_bytes": None, "cpu_s": 12.0, "daemons_cpu_s": 1.0, "checks_equal": "6/6",
            "decode_only": decode_only}


def test_the_decode_only_itl_stands_beside_the_traces():
    lines = serving.table({"servers": {"radix": row(20.0, {"mean_itl_ms": 12.5}), "old": row(21.0, None)}})
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert header[header.index("ITL mean") + 1] == "decode-only ITL"
    assert cells[header.index("ITL mean")] == "20.0" and cells[header.index("decode-only ITL")] == "12.5"
    assert len(cells) == len(header) == lines[1].count("|") - 1
    # A report from before the burst (no decode_only), or a burst that failed, shows none.
    assert [c.strip() for c in lines[3].strip("|").split("|")][header.index("decode-only ITL")] == "-"
    assert serving.decode_itl(row(20.0, {"error": "bench_serving failed"})) == "-"


def test_the_burst_decodes_more_than_it_prefills_and_arrives_at_once():
    assert serving.DECODE_ONLY["output_len"] >= 2 * serving.DECODE_ONLY["input_len"]
    assert serving.DECODE_ONLY["requests"] > 1


def test_a_burst_that_cannot_run_says_why_and_one_short_of_requests_counts_them(monkeypatch, tmp_path):
    def failing(port, model, out):
        raise RuntimeError("bench serving: sglang.bench_serving failed: connection refused")

    monkeypatch.setattr(serving, "decode_only_client", failing)
    failed = serving.decode_only(1, tmp_path, tmp_path / "out.jsonl")
    assert "connection refused" in failed["error"] and failed["bursts_done"] == 0
    itls = iter([9.0, 30.0, 10.0])
    monkeypatch.setattr(serving, "decode_only_client",
                        lambda port, model, out: {"completed": 6, "mean_itl_ms": next(itls)})
    figures = serving.decode_only(1, tmp_path, tmp_path / "out.jsonl")
    bursts = serving.DECODE_ONLY["bursts"]
    assert bursts == 3 and figures["bursts_mean_itl_ms"] == [9.0, 30.0, 10.0]
    assert figures["mean_itl_ms"] == 10.0  # the median: one slow burst does not make the figure
    assert figures["failed"] == (serving.DECODE_ONLY["requests"] - 6) * bursts


def test_repeated_blocks_rotate_the_order_and_compare_pairs_block_by_block():
    assert [serving.order_of(b, ("A", "B")) for b in range(4)] == [("A", "B"), ("B", "A"), ("B", "A"), ("A", "B")]
    configs = ("cpcache-file", "hicache-file", "radix")
    orders = [serving.order_of(b, configs) for b in range(2 * len(configs))]
    assert all(sorted(o) == sorted(configs) for o in orders)
    assert {o[0] for o in orders} == set(configs)  # none always first
    for first, second in ((0, 1), (2, 3), (4, 5)):  # every pair both ways, every two blocks
        assert orders[second] == orders[first][::-1]

    def at(ttft: float, hit: float, schedulers: float) -> dict:
        return {**row(20.0, {"median_itl_ms": 10.0}), "mean_ttft_ms": ttft, "cache": {"cache_hit_rate_pct": hit},
                "per_request": {"cpu_ms": {"schedulers": schedulers}}}

    blocks = [{"cpcache-file": at(90.0, 40.0, 100.0), "hicache-file": at(100.0, 40.0, 100.0),
               "radix": at(200.0, 10.0, 150.0)},
              {"cpcache-file": at(120.0, 40.0, 110.0), "hicache-file": at(100.0, 40.0, 100.0),
               "radix": at(200.0, 10.0, 150.0)}]
    found = serving.ratios(blocks, configs)
    assert set(found) == {"cpcache-file / hicache-file", "cpcache-file / radix", "hicache-file / radix"}
    pair = found["cpcache-file / hicache-file"]
    assert pair["mean_ttft_ms"]["blocks"] == [0.9, 1.2] and pair["mean_ttft_ms"]["median"] == 1.05
    assert pair["hit_rate_pct"]["median"] == 1.0 and pair["schedulers_cpu_ms"]["blocks"] == [1.0, 1.1]
    assert found["hicache-file / radix"]["hit_rate_pct"]["median"] == 4.0
    lines = serving.ratio_table({"ratios": found})
    assert lines[2].startswith("| cpcache-file / hicache-file | 1.05 [0.90-1.20] |")
    assert serving.ratio_table({"servers": {}}) == []
    # A figure no block has is left out of the ratios, and shown as "-".
    for b in blocks:
        for r in b.values():
            r["decode_only"] = None
    found = serving.ratios(blocks, configs)
    assert "decode_only_itl_ms" not in found["cpcache-file / hicache-file"]
    assert serving.ratio_table({"ratios": found})[2].endswith("| - |")


def test_fewer_than_one_block_is_refused_before_any_server_starts(capsys):
    assert serving.main(argparse.Namespace(json=True, repeat=0)) == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err
