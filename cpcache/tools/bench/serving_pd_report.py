"""`cpcache bench serving-pd`'s report: each pair's figures over the blocks,
the ratios of the pairs it compares (cpcache against HiCache on the same
store, each against radix), and its tables, for the terminal and for
benchmarks/runs/."""

from __future__ import annotations

import math

from cpcache.testing.stats import block_summary
from cpcache.tools.bench.sglang import block_ratios

RATIOS = (("ttft_later_mean_ms", "TTFT later turns, mean"), ("ttft_first_mean_ms", "TTFT first turns, mean"),
          ("mean_itl_ms", "ITL mean"), ("mean_tpot_ms", "TPOT mean"), ("decode_batch_mean", "decode batch"),
          ("request_throughput", "request throughput"), ("cpu_s", "CPU s"), ("hit_rate_pct", "hit rate"))


def ratio(blocks: list[dict[str, dict]], key: str, num: str, den: str) -> dict:
    """block_ratios over the blocks where both pairs have the figure."""
    both = [b for b in blocks if b[num].get(key) is not None and b[den].get(key) is not None]
    return block_ratios(both, key, num, den)


def summarize(blocks: list[dict[str, dict]], configs: tuple[str, ...], notes: list[str], setup: dict) -> dict:
    done = [c for c in configs if all(c in b for b in blocks)]
    numeric = {c: sorted({k for b in blocks for k, v in b[c].items() if isinstance(v, (int, float))}) for c in done}
    pairs = [(f"cpcache-{s}", f"hicache-{s}") for s in ("file", "mooncake")] + [(c, "radix") for c in done
                                                                                if c != "radix"]
    ratios = {f"{num} / {den}": {key: ratio(blocks, key, num, den) for key, _ in RATIOS}
              for num, den in pairs if num in done and den in done}
    return {"bench": "serving-pd", "setup": setup, "notes": notes, "ratios": ratios,
            "configs": {c: {k: block_summary([b[c][k] for b in blocks if b[c].get(k) is not None], digits=2)
                            for k in numeric[c]} for c in done},
            "blocks": blocks}


def table(report: dict) -> list[str]:
    lines = ["| pair | TTFT first mean | later mean | later median | p99 | ITL mean | TPOT mean | decode batch | req/s "
             "| hit % | device | host | storage | stored MB | CPU s | checks |", "|---|" + "---:|" * 16]
    for name, f in report["configs"].items():
        def m(key: str, f: dict = f) -> float:
            return f.get(key, {}).get("median", float("nan"))

        lines.append(f"| {name} | {m('ttft_first_mean_ms'):.0f} | {m('ttft_later_mean_ms'):.0f} | "
                     f"{m('ttft_later_median_ms'):.0f} | {m('p99_ttft_ms'):.0f} | {m('mean_itl_ms'):.1f} | "
                     f"{m('mean_tpot_ms'):.1f} | {m('decode_batch_mean'):.2f} | {m('request_throughput'):.2f} | "
                     f"{m('hit_rate_pct'):.1f} | "
                     f"{m('device_cached_tokens'):.0f} | {m('host_cached_tokens'):.0f} | "
                     f"{m('storage_cached_tokens'):.0f} | {m('stored_bytes') / 1e6:.0f} | {m('cpu_s'):.0f} | "
                     f"{m('checks_equal'):.0f} |")
    lines += ["", "| pair | CPU ms per request | of it the daemons' | backend ms per request on the scheduler "
              "thread | of it waiting on steps |", "|---|---:|---:|---:|---:|"]
    for name, f in report["configs"].items():
        cells = [f.get(k, {}).get("median") for k in ("cpu_ms_per_request", "daemons_cpu_ms_per_request",
                                                       "backend_ms_per_request", "backend_step_ms_per_request")]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:g}" for c in cells) + " |")
    lines += ["", "| ratio (median over blocks) | " + " | ".join(label for _, label in RATIOS) + " |",
              "|---|" + "---:|" * len(RATIOS)]
    for pair, figures in report["ratios"].items():
        lines.append(f"| {pair} | " + " | ".join(f"{figures[k]['median']:.2f}" for k, _ in RATIOS) + " |")
    return lines + [f"note: {n}" for n in report["notes"]]


def run_tables(report: dict) -> list[dict]:
    """The report's tables as benchmarks/runs/ holds them (medians over the blocks)."""
    def m(f: dict, key: str) -> float:
        return f.get(key, {}).get("median", float("nan"))

    pairs = {"name": "pairs", "align": "lrrrrrrrrrrr",
             "columns": ["pair", "TTFT first turns mean ms", "later turns mean ms", "p99 ms", "ITL mean ms",
                         "decode batch", "req/s", "hit %", "cached tokens (device / host / storage)", "stored MB",
                         "CPU s (daemons)", "checks equal"],
             "rows": [[name, f"{m(f, 'ttft_first_mean_ms'):.0f}", f"{m(f, 'ttft_later_mean_ms'):.0f}",
                       f"{m(f, 'p99_ttft_ms'):.0f}", f"{m(f, 'mean_itl_ms'):.0f}", f"{m(f, 'decode_batch_mean'):.2f}",
                       f"{m(f, 'request_throughput'):.2f}",
                       f"{m(f, 'hit_rate_pct'):.1f}",
                       f"{m(f, 'device_cached_tokens'):.0f} / {m(f, 'host_cached_tokens'):.0f} / "
                       f"{m(f, 'storage_cached_tokens'):.0f}", f"{m(f, 'stored_bytes') / 1e6:.0f}",
                       f"{m(f, 'cpu_s'):.0f} ({m(f, 'daemons_cpu_s'):.0f})",
                       f"{m(f, 'checks_equal'):.0f}"] for name, f in report["configs"].items()]}
    ratios = {"name": "ratios", "align": "l" + "r" * len(RATIOS),
              "columns": ["pair, median over blocks (min-max)", *(label for _, label in RATIOS)],
              "rows": [[pair, *(f"{r[k]['median']:.2f} ({r[k]['spread'].get('min', float('nan')):.2f}-"
                                f"{r[k]['spread'].get('max', float('nan')):.2f})" for k, _ in RATIOS)]
                       for pair, r in report["ratios"].items()]}
    cost = {"name": "per request", "align": "lrrrr",
            "columns": ["pair", "CPU ms per request", "of it the daemons'", "backend ms on the scheduler thread",
                        "of it waiting on steps"],
            "rows": [[name, *("-" if math.isnan(m(f, k)) else f"{m(f, k):g}"
                              for k in ("cpu_ms_per_request", "daemons_cpu_ms_per_request", "backend_ms_per_request",
                                        "backend_step_ms_per_request"))] for name, f in report["configs"].items()]}
    return [pairs, ratios, cost]
