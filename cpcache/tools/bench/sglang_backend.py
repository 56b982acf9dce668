"""The cpcache backend's own time on the scheduler thread in `cpcache bench
sglang`: the line each rank logs at `/flush_cache` (`SchedulerTime`,
cumulative), read back; two lines around a block give the block's figures.

An iteration is idle when its hook neither took a reply nor sent a step (no
step open, nothing to send): what the backend costs a decode iteration with
nothing to say. The others took a reply or sent a step."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable

from cpcache.testing.stats import block_summary

BACKEND_LINE = re.compile(
    r"cpcache: rank (?P<rank>\d+) backend: (?P<iterations>\d+) iterations, mean [\d.]+ us per iteration on the "
    r"scheduler thread \(hook (?P<hook_s>[\d.]+) s, other calls (?P<calls_s>[\d.]+) s\), (?P<steps>\d+) steps, "
    r"(?P<step_s>[\d.]+) s in steps( \([\d.]+ s waiting for replies\))?"
    r"(; (?P<idle>\d+) idle iterations \(no step taken or sent\), "
    r"(?P<idle_s>[\d.]+) s in their hook)?")
FIGURES = ("iterations", "hook_s", "calls_s", "steps", "step_s", "idle", "idle_s")
BACKEND_NOTE = ("the cpcache backend's own time on each rank's scheduler thread between /flush_cache calls "
                "around a block: us_per_iteration over every scheduler loop (idle ones included), "
                "us_per_decode_iteration over the block's {decode_iterations} decode iterations "
                "(waves x (new tokens - 1)), share_of_block of the block's wall time; "
                "us_per_idle_iteration: the hook's time in an iteration with no step open and none sent "
                "(idle_iterations of them), us_per_stepping_iteration: in one that took a reply or sent a "
                "step; both per block (the mean over its iterations of that kind), median and p90 over "
                "the blocks")


def backend_lines(lines: Iterable[str]) -> dict[int, dict]:
    """The last backend line of every rank among `lines`: rank -> figures."""
    out: dict[int, dict] = {}
    for line in lines:
        m = BACKEND_LINE.search(line)
        if m:
            out[int(m["rank"])] = {"iterations": int(m["iterations"]), "hook_s": float(m["hook_s"]),
                                   "calls_s": float(m["calls_s"]), "steps": int(m["steps"]),
                                   "step_s": float(m["step_s"]),
                                   # a backend that logs no idle count: none counted apart
                                   "idle": int(m["idle"] or 0), "idle_s": float(m["idle_s"] or 0.0)}
    return out


def backend_delta(before: dict, after: dict) -> dict:
    """One rank's backend figures between two of its lines."""
    d = {k: after[k] - before[k] for k in FIGURES}
    d["total_s"] = d["hook_s"] + d["calls_s"]
    d["us_per_iteration"] = d["total_s"] / d["iterations"] * 1e6 if d["iterations"] else 0.0
    # The hook's iterations in two kinds: idle (no step open, none sent: what an
    # iteration with nothing to say costs) and the others (a reply taken or a step sent).
    d["stepping"] = d["iterations"] - d["idle"]
    d["us_per_idle_iteration"] = d["idle_s"] / d["idle"] * 1e6 if d["idle"] else float("nan")
    d["us_per_stepping_iteration"] = ((d["hook_s"] - d["idle_s"]) / d["stepping"] * 1e6 if d["stepping"]
                                      else float("nan"))
    return d


def p90(values: list[float]) -> float:
    """The 90th percentile (inclusive method; one value: itself)."""
    values = [v for v in values if v == v]  # NaN: a block without that kind of iteration
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def with_p90(values: list[float]) -> dict:
    summary = block_summary([v for v in values if v == v], digits=2)
    summary["p90"] = round(p90(values), 2)
    return summary


def backend_summary(blocks: list[dict[str, dict]], decode_iterations: int) -> dict[int, dict]:
    """Per rank, the backend's figures over the blocks: median and spread."""
    out: dict[int, dict] = {}
    for rank in sorted(blocks[0]["cpcache"].get("backend", {})):
        per = [b["cpcache"]["backend"][rank] for b in blocks]
        out[rank] = {
            "us_per_iteration": block_summary([p["us_per_iteration"] for p in per], digits=2),
            "iterations": block_summary([p["iterations"] for p in per], digits=0),
            "ms_per_block": block_summary([p["total_s"] * 1e3 for p in per], digits=3),
            "us_per_decode_iteration": block_summary([p["total_s"] / decode_iterations * 1e6 for p in per],
                                                     digits=2),
            "share_of_block": block_summary([p["total_s"] / b["cpcache"]["seconds"] for p, b in zip(per, blocks)],
                                            digits=5),
            "steps": block_summary([p["steps"] for p in per], digits=0),
            "ms_in_steps_per_block": block_summary([p["step_s"] * 1e3 for p in per], digits=3),
            "idle_iterations": block_summary([p["idle"] for p in per], digits=0),
            "stepping_iterations": block_summary([p["stepping"] for p in per], digits=0),
            "us_per_idle_iteration": with_p90([p["us_per_idle_iteration"] for p in per]),
            "us_per_stepping_iteration": with_p90([p["us_per_stepping_iteration"] for p in per]),
        }
    return out
