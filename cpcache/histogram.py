"""Durations in buckets, for metrics: written by one thread, read as a
snapshot by the metrics collector."""

from __future__ import annotations


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds in seconds; one more bucket holds the rest
        self.counts = [0] * (len(bounds) + 1)
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.total_s += seconds
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1
