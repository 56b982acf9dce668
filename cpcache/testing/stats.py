"""Percentiles for benchmark samples, and the median of per-block ratios.

This machine is shared and noisy: a figure measured in one minute can move
severalfold the next. So a benchmark measures its candidate and its baseline
alternately in blocks within one run, takes a ratio per block (both sides saw
the same minute), and reports the median over the blocks with its spread."""

from __future__ import annotations

import statistics


def percentiles_us(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 of samples given in seconds, in microseconds."""
    ordered = sorted(seconds)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan")}
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered) * 1e6, 1), "p99": round(p99 * 1e6, 1)}


def quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartiles (inclusive method; one value: itself)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def block_summary(ratios: list[float], digits: int = 3) -> dict:
    """The median of per-block ratios and its spread: min-max and the
    interquartile range, plus the blocks themselves."""
    if not ratios:
        return {"median": float("nan"), "spread": {}, "blocks": []}
    q1, q3 = quartiles(ratios)
    return {
        "median": round(statistics.median(ratios), digits),
        "spread": {"min": round(min(ratios), digits), "max": round(max(ratios), digits),
                   "iqr": [round(q1, digits), round(q3, digits)]},
        "blocks": [round(r, digits) for r in ratios],
    }
