"""Where the replay's steps went, from the daemons' own phase counters
(`Stats`: `step_phase_<phase>_us` and `_count`, see `cpcache.rank.phases`),
as milliseconds per step: the mean over the ranks, and for the collective
the fastest and slowest rank (the rank that arrives last waits least: the
fastest rank's `reduce` is about the exchange itself, the rest of the others'
is waiting for it)."""

from __future__ import annotations

# In the order a step goes through them; `reduce` is inside `wait`.
PHASES = ("check", "pack", "submit", "wait", "reduce", "open", "apply", "io", "reply", "handler", "io_after_reply")
CPU_PHASES = ("check", "pack", "submit", "open", "apply", "io", "io_after_reply")


def step_breakdown(stats: list[dict[str, int]]) -> dict:
    """Milliseconds per step, per phase, from every rank's counters."""
    per_rank: list[dict[str, float]] = []
    cpu_per_rank: list[dict[str, float]] = []
    for counters in stats:
        steps = counters.get("step_phase_steps", 0)
        if not steps:
            continue
        per_rank.append({p: counters.get(f"step_phase_{p}_us", 0) / steps / 1000 for p in PHASES})
        cpu_per_rank.append({p: counters.get(f"step_phase_{p}_cpu_us", 0) / steps / 1000 for p in CPU_PHASES})
    if not per_rank:
        return {}
    mean = {p: round(sum(r[p] for r in per_rank) / len(per_rank), 3) for p in PHASES}
    cpu = {p: round(sum(r[p] for r in cpu_per_rank) / len(cpu_per_rank), 3) for p in CPU_PHASES}
    reduce = [r["reduce"] for r in per_rank]
    return {
        "mean_ms": mean,
        # The loop thread's CPU in the phases that never await: what the work
        # costs, without the wait for a core that a shared host adds.
        "cpu_ms": cpu,
        "reduce_ms_fastest_rank": round(min(reduce), 3),
        "reduce_ms_slowest_rank": round(max(reduce), 3),
        # The step's time in the daemon but outside the collective: hand-offs
        # to and from the agreement thread, and the engine's queue. At lag >= 1
        # the collective runs between steps, mostly outside `wait`: None.
        "handoffs_ms": round(mean["wait"] - mean["reduce"], 3) if mean["wait"] >= mean["reduce"] else None,
        "steps": min(c.get("step_phase_steps", 0) for c in stats),
    }


def breakdown_lines(r: dict) -> list[str]:
    """The demo report's lines for `step_breakdown`'s figures."""
    b = r.get("step_phases") or {}
    if not b:
        return []
    m = b["mean_ms"]
    call = r["round_latency_us"]
    mean_call = r.get("round_latency_mean_ms")
    return [
        "  where a Step goes     ms per step, mean over ranks, from the daemons' histograms:",
        f"    check {m['check']:.3f}  pack {m['pack']:.3f}  submit {m['submit']:.3f}  "
        f"wait {m['wait']:.3f} (collective {m['reduce']:.3f}: fastest rank {b['reduce_ms_fastest_rank']:.3f}, "
        f"slowest {b['reduce_ms_slowest_rank']:.3f}; " + (
            f"hand-offs {b['handoffs_ms']:.3f})" if b["handoffs_ms"] is not None
            else "hand-offs not separable: at lag >= 1 the collective runs between steps)"),
        f"    open {m['open']:.3f}  apply {m['apply']:.3f}  io {m['io']:.3f}  reply {m['reply']:.3f}  "
        f"= in the daemon {m['handler']:.3f}; after the reply: io {m['io_after_reply']:.3f}",
        *([f"    CPU of the loop thread: open {c['open']:.3f}  apply {c['apply']:.3f}  io {c['io']:.3f}  "
           f"(open + apply + io {c['open'] + c['apply'] + c['io']:.3f}; check {c['check']:.3f}  pack {c['pack']:.3f}"
           f"  submit {c['submit']:.3f}; after the reply: io {c['io_after_reply']:.3f})"]
          if (c := b.get("cpu_ms")) else []),
        f"    the call as a scheduler sees it: mean {mean_call:.3f}, p50 {call['p50'] / 1000:.3f}"
        if mean_call is not None else f"    the call as a scheduler sees it: p50 {call['p50'] / 1000:.3f}",
    ]
