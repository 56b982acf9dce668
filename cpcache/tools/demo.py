"""`cpcache demo`: the main job. Launch a local domain (4 ranks: attention
TP 2 x CP 2 by default) on the embedded file storage, replay a slice of a
real request trace through one scheduler per rank, show progress, and end
with a report: decisions, divergences, hit rate per tier against the trace's
infinite-cache ceiling, pages moved, round latency.

With attention DP (`--dp N`) the ranks form N agreement domains; each request
is routed to one of them (round robin by its position in the trace, as
SGLang's DP attention does by default: `cpcache.testing.sim.replay.route`), and
the report gives each domain's figures as well as the totals (`--json`: under
"domains")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cpcache.testing.sim.breakdown import breakdown_lines
from cpcache.testing.sim.restarts import RESTARTS
from cpcache.topology import Topology

if TYPE_CHECKING:
    from cpcache.testing.sim.replay import ReplayConfig


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="a Mooncake-format trace (JSON lines)")
    p.add_argument("--requests", type=int, default=1000, help="how many requests to replay")
    p.add_argument("--skip", type=int, default=0, help="start this many requests into the trace")
    p.add_argument("--passes", type=int, default=1, help="replay the slice this many times")
    p.add_argument("--storage", choices=["file", "mooncake"], default="file")
    p.add_argument("--batch", type=int, default=4, help="requests per step when replaying as fast as possible")
    p.add_argument("--time-scale", type=float, default=0.0, help="trace ms per step ms x this; 0: as fast as possible")
    p.add_argument("--device-pages", type=int, default=1024)
    p.add_argument("--host-pages", type=int, default=4096)
    p.add_argument("--prefetch-policy", default="timeout", choices=["best_effort", "wait_complete", "timeout"])
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--fault-delay-ms", type=float, default=0.0, help="per-rank storage and round delays")
    p.add_argument("--fault-fail-rate", type=float, default=0.0, help="per-rank storage page failure rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", choices=RESTARTS, default="none",
                   help="at --restart-at: restart every scheduler, or SIGKILL (the launcher restarts it) or "
                        "SIGSTOP past the agreement timeout one daemon (--restart-rank)")
    p.add_argument("--restart-at", type=float, default=0.5, help="where in the arrivals (0..1); also where the "
                   "report splits its hit rates in halves")
    p.add_argument("--restart-rank", type=int, default=1)
    p.add_argument("--agreement-timeout", type=float, default=10.0, help="seconds before a silent peer is lost")
    p.add_argument("--plot", help="write a PNG of hit rate and round latency over the replay")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def config_from(args: argparse.Namespace) -> ReplayConfig:
    from cpcache.testing.sim.replay import ReplayConfig

    trace = Path(args.trace)
    if not trace.exists():
        raise SystemExit(f"cpcache demo: trace {trace} not found (give --trace FILE)")
    return ReplayConfig(
        trace=trace, requests=args.requests, skip=args.skip, passes=args.passes,
        topology=Topology(tp=args.tp, cp=args.cp, dp=args.dp, pp=args.pp),
        storage=args.storage, mode=args.mode, lag=args.lag, device_pages=args.device_pages,
        host_pages=args.host_pages, batch=args.batch, time_scale=args.time_scale,
        prefetch_policy=args.prefetch_policy, write_policy=args.write_policy,
        fault_delay_ms=args.fault_delay_ms, fault_fail_rate=args.fault_fail_rate, seed=args.seed,
        restart=args.restart, restart_at=args.restart_at, restart_rank=args.restart_rank,
        agreement_timeout_s=args.agreement_timeout,
    )


def show_progress(p: dict) -> None:
    print(f"  {p['requests']:>6}/{p['of']} requests  {p['steps']:>5} steps  "
          f"hit rate {p['hit_rate']:6.1%}  divergences {p['divergences']}  {p['elapsed_s']:6.1f}s",
          file=sys.stderr, flush=True)


def text_report(r: dict) -> str:
    ok = r["divergences"] == 0 and r["identical_decision_logs"] and r["corrupt_loads"] == 0
    hit = r["hit_rate"]
    lines = [
        "",
        f"cpcache demo: {r['ranks']} ranks ({r['topology']}), {r['mode']} mode, lag {r['lag']}, "
        f"{r['storage']} storage",
        f"  requests              {r['requests']}" + (
            f" ({again} of them run again: in flight when their schedulers restarted)"
            if (again := (r.get("restart") or {}).get("requests_run_again")) else ""),
        f"  steps                 {r['steps']}",
        f"  agreed decisions      {r['decisions']}",
        f"  divergences           {r['divergences']}",
        f"  identical logs        {'yes' if r['identical_decision_logs'] else 'NO'}",
        f"  corrupt loads         {r['corrupt_loads']} of {r['verified_pages']} pages loaded",
        f"  hit rate              device {hit['device']:.1%}  host {hit['host']:.1%}  "
        f"storage {hit['storage']:.1%}  total {hit['total']:.1%}",
        f"  infinite-cache ceiling {r['hit_rate_ceiling']:.1%}",
        f"  prefetches            {r['prefetches']} ({r['prefetch_revoked']} revoked)",
        "  pages moved (rank 0)  " + ", ".join(f"{k} {v}" for k, v in sorted(r["pages_moved_rank0"].items())),
        f"  round latency         p50 {r['round_latency_us']['p50'] / 1000:.1f} ms  "
        f"p99 {r['round_latency_us']['p99'] / 1000:.1f} ms (a Step call, as each scheduler sees it)",
        f"  step latency          p50 {r['step_latency_us']['p50'] / 1000:.1f} ms  "
        f"p99 {r['step_latency_us']['p99'] / 1000:.1f} ms (a whole simulated iteration, {r['ranks']} ranks)",
        *breakdown_lines(r),
        *domain_lines(r),
        *restart_lines(r),
        f"  wall time             {r['wall_s']} s",
        f"  verdict               {'OK' if ok else 'FAILED'}",
    ]
    return "\n".join(lines)


def restart_lines(r: dict) -> list[str]:
    """The two halves of the replay, and the restart between them, if any."""
    halves, restart = r.get("halves") or {}, r.get("restart") or {}
    lines = []
    if restart.get("kind", "none") != "none":
        what = {"schedulers": "every scheduler restarted and attached anew",
                "daemon-kill": f"rank {restart.get('rank')}'s daemon SIGKILLed, restarted by the launcher",
                "daemon-stop": f"rank {restart.get('rank')}'s daemon stopped past the agreement timeout"}
        lines.append(f"  restart               {what[restart['kind']]}; domain in epoch {r.get('epoch')}")
        if "outage_s" in restart:
            lines.append(f"  outage                {restart['outage_s']} s, {restart['outage_steps']} failed steps "
                         "(UNAVAILABLE), then every scheduler attached again")
        if r.get("replies_lost_with_a_daemon"):
            lines.append(f"  replies lost          {r['replies_lost_with_a_daemon']} (lag {r['lag']}: a step's reply "
                         "carries an earlier round, held by the daemon that died or by a peer still exchanging it)")
        lines.append(f"  host pages resumed    {restart.get('resumed_pages', 0)}")
    for name in ("first", "second"):
        if name in halves:
            h = halves[name]
            lines.append(f"  {name} half hit rate  device {h['device']:.1%}  host {h['host']:.1%}  "
                         f"storage {h['storage']:.1%}  total {h['total']:.1%}")
    return lines


def domain_lines(r: dict) -> list[str]:
    """Per-domain figures, when there is more than one domain (attention DP)."""
    if len(r.get("domains", ())) < 2:
        return []
    lines = [f"  domains               {len(r['domains'])}, requests routed {r['routing']}"]
    for d in r["domains"]:
        hit = d["hit_rate"]
        lines += [
            f"    domain {d['domain']} (dp {d['dp']}, ranks {','.join(map(str, d['ranks']))}): "
            f"{d['requests']} requests, {d['decisions']} decisions, {d['divergences']} divergences, "
            f"logs {'identical' if d['identical_decision_logs'] else 'DIFFER'}, "
            f"{d['corrupt_loads']} corrupt loads",
            f"      hit rate device {hit['device']:.1%}  host {hit['host']:.1%}  storage {hit['storage']:.1%}  "
            f"total {hit['total']:.1%}  (ceiling {d['hit_rate_ceiling']:.1%})",
        ]
    return lines


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("cpcache demo: --plot needs matplotlib (pip install matplotlib)") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = range(1, len(report["per_step_hit_rate"]) + 1)
    top.plot(steps, [100 * h for h in report["per_step_hit_rate"]], label="hit rate (all tiers)")
    top.axhline(100 * report["hit_rate_ceiling"], linestyle="--", color="gray", label="infinite-cache ceiling")
    top.set_ylabel("cumulative hit rate (%)")
    top.legend()
    bottom.plot(steps, [1000 * s for s in report["per_step_latency_s"]], linewidth=0.7)
    bottom.set_ylabel("step latency (ms)")
    bottom.set_xlabel("step")
    fig.suptitle(f"cpcache replay: {report['requests']} requests on {report['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args: argparse.Namespace) -> int:
    from cpcache.testing.sim.replay import replay

    report = await replay(config_from(args), progress=None if args.json else show_progress)
    if args.plot:
        plot(report, args.plot)
    for series in ("per_step_latency_s", "per_step_hit_rate"):  # plotted, too long to print
        report.pop(series)
    print(json.dumps(report) if args.json else text_report(report))
    ok = report["divergences"] == 0 and report["identical_decision_logs"] and report["corrupt_loads"] == 0
    return 0 if ok else 1
