"""The chaos bench's reading of what the ranks recorded (`chaos.py`): every
iteration's outcomes compared across the ranks (a divergence, with its
cause and the faults before it), each fault with the iterations the ranks
fell back and attached again at, and the report as text."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cpcache.testing.chaos_rank import ChaosRank, Entry


def with_episodes(rows: list[dict[str, Any]], fallbacks: dict[str, list[int]],
                  reattaches: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Each fault with the iterations each rank fell back at, from the
    fault's iteration until the next fault's, and attached again at after
    each of those (-1: not by the end); and whether it landed while some rank
    was without tiers."""

    def back(rank: str, fell: int) -> int:
        return next((i for i in reattaches[rank] if i > fell), -1)

    for k, row in enumerate(rows):
        lo, hi = row["iteration"], rows[k + 1]["iteration"] if k + 1 < len(rows) else 1 << 62
        fell = {r: [i for i in its if lo <= i < hi] for r, its in fallbacks.items()}
        came = {r: [back(r, i) for i in its] for r, its in fell.items()}
        row["fallback_iterations"] = {r: its for r, its in fell.items() if its}
        row["reattach_iterations"] = {r: its for r, its in came.items() if its}
        row["fallback_differs"] = len({tuple(its) for its in fell.values()}) > 1
        row["reattach_differs"] = len({tuple(its) for its in came.values()}) > 1
        row["during_fallback"] = any(i < lo and (back(r, i) == -1 or back(r, i) > lo)
                                     for r, its in fallbacks.items() for i in its)
    return rows


def differences(per_rank: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The iterations in some ranks' lists but not in every rank's: which ranks have them."""
    every = set.intersection(*(set(v) for v in per_rank.values())) if per_rank else set()
    apart = sorted(set().union(*per_rank.values()) - every)
    return [{"iteration": i, "ranks": [int(r) for r, v in per_rank.items() if i in v]} for i in apart][:20]


def compare(ranks: list[ChaosRank], faults: list[dict[str, Any]], began: float, window_s: float) -> dict[str, Any]:
    """Every iteration's outcomes across the ranks that sent a step (or tried
    to attach) at it."""
    iterations = sorted(set().union(*(r.log for r in ranks)))
    divergent: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    for i in iterations:
        entries = {r.rank: r.log[i] for r in ranks if i in r.log}
        sent = {rank: e for rank, e in entries.items() if e.outcome}
        if sent:
            counts["steps"] += 1
            counts["steps_compared"] += len(sent) > 1
            counts["steps_sent_apart"] += len(sent) < len(ranks)
        replies = {e.outcome for e in sent.values() if e.outcome.startswith("reply")}
        failed = sorted(rank for rank, e in sent.items() if e.outcome.startswith("error"))
        tried = {rank: e.attach for rank, e in entries.items() if e.attach and e.attach != "skipped"}
        attached = sorted(rank for rank, a in tried.items() if a == "attached")
        kinds = []
        if replies and (failed or len(replies) > 1):
            kinds.append("step")
        elif replies:
            counts["steps_replied_alike"] += 1
        elif sent:
            counts["steps_failed_alike"] += 1
        if tried:
            counts["attach_tries"] += 1
            if attached and len(attached) < len(tried):
                kinds.append("attach")
            if len(tried) < len(entries):
                counts["attach_tries_apart"] += 1  # some ranks skipped a try their peers made
        if not kinds:
            continue
        at = min(e.at for e in entries.values())
        divergent.append({
            "iteration": i, "kind": "+".join(kinds), "t_s": round(at - began, 2),
            "applied": sorted(rank for rank, e in sent.items() if e.outcome.startswith("reply")), "failed": failed,
            "attached": attached, "not_attached": sorted(set(tried) - set(attached)),
            "outcomes": {str(rank): e.as_dict() for rank, e in sorted(entries.items())},
            "faults_before": [f["n"] for f in faults if f["t_s"] <= at - began + 0.5
                              and f["t_s"] + f["lasted_s"] >= at - began - 4 * window_s][-4:],
        })
        divergent[-1]["cause"] = cause(entries)
        divergent[-1]["scenario"] = scenario(divergent[-1], faults)
    return {"steps": counts["steps"], "steps_compared": counts["steps_compared"],
            "steps_replied_alike": counts["steps_replied_alike"], "steps_failed_alike": counts["steps_failed_alike"],
            "steps_sent_apart": counts["steps_sent_apart"], "attach_tries": counts["attach_tries"],
            "attach_tries_apart": counts["attach_tries_apart"],
            "divergences": len(divergent), "divergences_by_cause": dict(Counter(d["cause"] for d in divergent)),
            "divergent_steps": divergent[:50]}


def cause(entries: dict[int, Entry]) -> str:
    """What the failed ranks' errors say of a split step:
    - `recovery_no_peer`: a rank whose daemon gave no answer found no peer's
      daemon that could tell how the step ended, and failed it alone;
    - `round_split`: the round itself ended apart: some daemons completed
      it while others failed it (a peer lost mid-collective), each rank told
      by its own daemon or by the peer it asked;
    - `other`."""
    details = [e.detail for e in entries.values() if e.outcome.startswith("error")]
    if any("could tell how step" in d for d in details):
        return "recovery_no_peer"
    if details and all(f"round {e.step} failed" in e.detail for e in entries.values()
                       if e.outcome.startswith("error") and e.step is not None):
        return "round_split"
    return "other"


def scenario(divergence: dict[str, Any], faults: list[dict[str, Any]]) -> str:
    """One line: the faults before a divergence, and how each rank ended the step."""
    by_number = {f["n"]: f for f in faults}
    before = "; ".join(f"fault {n} {by_number[n]['kind']} at {by_number[n]['t_s']}s (" +
                       ", ".join(a.split(" ", 1)[1] for a in by_number[n]["actions"]) + ")"
                       for n in divergence["faults_before"])
    ends = ", ".join(f"r{r} {o.get('attach', '') or ''}{' ' if o.get('attach') else ''}"
                     f"{o.get('outcome', '-')}" + (f" (epoch {o['epoch']} step {o['step']})" if "step" in o else "")
                     for r, o in divergence["outcomes"].items())
    return f"after {before or 'no fault'}: iteration {divergence['iteration']} at {divergence['t_s']}s: {ends}"


def text_report(report: dict[str, Any]) -> str:
    lines = ["  #    t_s  iter  kind                   ranks  open / actions"]
    for f in report["fault_list"]:
        opened = " ".join(f"r{r}:{','.join(v)}" for r, v in f["open"].items())
        lines.append(f"{f['n']:3d} {f['t_s']:6.1f} {f['iteration']:5d}  {f['kind']:<22} "
                     f"{','.join(map(str, f['ranks'])):<6} {opened}  fell back {_its(f['fallback_iterations'])}"
                     f"  attached again {_its(f['reattach_iterations'])}"
                     + ("  DIFFERS" if f["fallback_differs"] or f["reattach_differs"] else "")
                     + ("  (during a fallback)" if f["during_fallback"] else ""))
        lines += [f"{'':42}{a}" for a in f["actions"]]
    for d in report["divergent_steps"]:
        lines.append(f"DIVERGENCE at iteration {d['iteration']} ({d['kind']}, {d['cause']}, t={d['t_s']}s, after "
                     f"faults {d['faults_before']}): applied {d['applied']} failed {d['failed']}")
        lines.append(f"    {d['scenario']}")
        lines += [f"    rank {r}: {o}" for r, o in d["outcomes"].items()]
    for h in report["hang_list"]:
        lines.append(f"HANG rank {h['rank']} at iteration {h['iteration']}: {h['what']} ({h['seconds']} s)")
    skip = {"fault_list", "divergent_steps", "hang_list"}
    lines += [f"{key}: {value}" for key, value in report.items() if key not in skip]
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def _its(per_rank: dict[str, list[int]]) -> str:
    """`0-3:987` when every rank listed has the same iterations, else `0:987 1:990`."""
    if not per_rank:
        return "-"
    values = {tuple(v) for v in per_rank.values()}
    if len(values) == 1:
        return f"{','.join(per_rank)}:{','.join(map(str, values.pop()))}"
    return " ".join(f"{r}:{','.join(map(str, v))}" for r, v in per_rank.items())
