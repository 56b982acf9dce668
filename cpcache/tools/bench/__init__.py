"""Benchmarks: each prints one JSON object measured in one run, with the
baselines it is compared against measured in that same run."""
