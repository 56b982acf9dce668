"""Percentiles for benchmark samples."""

from __future__ import annotations

import statistics


def percentiles_us(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 of samples given in seconds, in microseconds."""
    ordered = sorted(seconds)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan")}
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered) * 1e6, 1), "p99": round(p99 * 1e6, 1)}
