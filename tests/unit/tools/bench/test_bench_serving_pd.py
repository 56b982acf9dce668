"""The pure parts of `cpcache bench serving-pd` (the pairs themselves run in the bench)."""

import pytest

from cpcache.tools.bench import serving_pd, serving_pd_report
from cpcache.tools.bench.commands import BENCHES


def test_a_requests_turn_is_its_place_in_its_session():
    # Two sessions of three turns, in bench_serving's order: session by session.
    ttfts = [1.0, 2.0, 4.0, 3.0, 2.0, 6.0]
    figures = serving_pd.turn_ttfts(ttfts, rounds=3)
    assert figures["ttft_first_mean_ms"] == pytest.approx(2000.0)
    assert figures["ttft_later_mean_ms"] == pytest.approx(3500.0)
    assert figures["ttft_later_median_ms"] == pytest.approx(3000.0)
    assert "ttft_later_mean_ms" not in serving_pd.turn_ttfts([1.0, 2.0], rounds=1)


def test_every_pair_leads_a_block_in_turn_and_runs_both_ways():
    configs = serving_pd.CONFIGS
    orders = [serving_pd.order_of(i, configs) for i in range(2 * len(configs))]
    assert {o[0] for o in orders} == set(configs)  # none always first
    assert all(sorted(o) == sorted(configs) for o in orders)
    assert orders[1] == orders[0][::-1]  # every pair both ways in the first two blocks


def test_cpcache_is_compared_with_hicache_on_the_same_store_and_each_with_radix():
    block = {c: {"ttft_later_mean_ms": 2.0, "ttft_first_mean_ms": 1.0, "mean_itl_ms": 1.0, "mean_tpot_ms": 1.0,
                 "request_throughput": 1.0, "cpu_s": 1.0, "hit_rate_pct": 1.0} for c in serving_pd.CONFIGS}
    block["cpcache-file"]["ttft_later_mean_ms"] = 1.0
    report = serving_pd_report.summarize([block, block], serving_pd.CONFIGS, [], {})
    assert report["ratios"]["cpcache-file / hicache-file"]["ttft_later_mean_ms"]["median"] == pytest.approx(0.5)
    assert "cpcache-mooncake / hicache-mooncake" in report["ratios"] and "hicache-file / radix" in report["ratios"]
    lines = serving_pd_report.table(report)
    # Each pair a row of figures and one of its cost per request; each ratio a row.
    assert all(sum(line.startswith(f"| {c} |") for line in lines) == 2 for c in serving_pd.CONFIGS)
    assert all(sum(line.startswith(f"| {r} |") for line in lines) == 1 for r in report["ratios"])


def test_the_bench_is_a_subcommand():
    assert BENCHES["serving-pd"].module == "cpcache.tools.bench.serving_pd"


def test_the_run_record_has_a_row_per_pair_and_per_ratio():
    block = {c: {"ttft_later_mean_ms": 2.0, "ttft_first_mean_ms": 1.0, "mean_itl_ms": 1.0, "mean_tpot_ms": 1.0,
                 "request_throughput": 1.0, "cpu_s": 1.0, "hit_rate_pct": 1.0, "completed": 10,
                 "daemons_cpu_ms_per_request": 5.0} for c in ("cpcache-file", "hicache-file")}
    report = serving_pd_report.summarize([block], ("cpcache-file", "hicache-file"), [], {})
    pairs, ratios, cost = serving_pd_report.run_tables(report)
    assert [r[0] for r in pairs["rows"]] == ["cpcache-file", "hicache-file"]
    assert all(len(r) == len(pairs["columns"]) for r in pairs["rows"])
    assert [r[0] for r in ratios["rows"]] == ["cpcache-file / hicache-file"]
    assert cost["rows"][0][2] == "5" and cost["rows"][0][3] == "-"


def test_a_failed_request_counts_in_no_turn():
    ttfts, errors = [1.0, 0.0, 3.0, 4.0], ["", "timed out", "", ""]
    figures = serving_pd.turn_ttfts(ttfts, rounds=2, errors=errors)
    assert figures["ttft_first_mean_ms"] == pytest.approx(2000.0)
    assert figures["ttft_later_mean_ms"] == pytest.approx(4000.0)


def test_figures_only_some_pairs_have_are_summarized_and_ratios_skip_blocks_without_them():
    blocks = [{"radix": {"ttft_later_mean_ms": 2.0, "hit_rate_pct": None},
               "cpcache-file": {"ttft_later_mean_ms": 1.0, "backend_ms_per_request": 0.25, "hit_rate_pct": 3.0}},
              {"radix": {"ttft_later_mean_ms": 4.0, "hit_rate_pct": 1.0},
               "cpcache-file": {"ttft_later_mean_ms": 1.0, "backend_ms_per_request": 0.75, "hit_rate_pct": 2.0}}]
    report = serving_pd_report.summarize(blocks, ("radix", "cpcache-file"), [], {})
    assert report["configs"]["cpcache-file"]["backend_ms_per_request"]["median"] == pytest.approx(0.5)
    assert "backend_ms_per_request" not in report["configs"]["radix"]
    ratios = report["ratios"]["cpcache-file / radix"]
    assert ratios["ttft_later_mean_ms"]["blocks"] == [0.5, 0.25]
    assert ratios["hit_rate_pct"]["blocks"] == [2.0]  # the block where radix had none is left out
    assert ratios["mean_itl_ms"]["blocks"] == []


def test_a_file_store_holds_the_bytes_of_its_files(tmp_path):
    from cpcache.tools.bench.serving import stored_bytes

    assert stored_bytes(None, tmp_path / "absent") == 0 and stored_bytes(None, None) == 0
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "page").write_bytes(b"x" * 100)
    (tmp_path / "page").write_bytes(b"y" * 28)
    assert stored_bytes(None, tmp_path) == 128


def test_hicache_gets_as_many_host_pages_as_cpcache():
    from cpcache.testing.sglang_cpu.hicache import HICACHE_FLAGS, hicache_host_flags

    flags = hicache_host_flags(host_pages=96, page_size=16, device_tokens=1024)
    assert flags[flags.index("--hicache-ratio") + 1] == "1.5"
    assert len(flags) == len(HICACHE_FLAGS) and HICACHE_FLAGS[HICACHE_FLAGS.index("--hicache-ratio") + 1] == "2"


def test_the_decode_batch_is_the_mean_of_the_decode_servers_log_lines():
    lines = ["[2026-12-07 06:00:01] Decode batch, #running-req: 3, #token: 96, token usage: 0.01, ",
             "[2026-12-07 06:00:02] Prefill batch, #new-seq: 1, #new-token: 16",
             "[2026-12-07 06:00:03] Decode batch [812], #running-req: 6, #token: 190, token usage: 0.02, "]
    assert serving_pd.decode_batch_mean(lines) == pytest.approx(4.5)
    assert serving_pd.decode_batch_mean(lines[1:2]) is None
