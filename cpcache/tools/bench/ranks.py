"""`cpcache bench ranks`: what one agreed round costs as the agreement domain
grows (2, 4, 8, 16 ranks by default), against a bare gloo all-reduce of the
same vector on the same ranks, and how many bytes each rank sends and
receives per round.

For each domain size, one run starts three sets of processes, one process
per rank in each: plain gloo ranks (`vector_baseline`), a real local domain
of daemons (`LocalDomain`, `domain` mode), and one scheduler per daemon
(`scheduler`). They stay up for all the blocks of that size. A block is the
baselines (`--steps` bare all-reduces of the round's vector, MIN, then as
many of the daemons' own reduction, an all-to-all exchange and a local MIN,
on a group built as the daemons build theirs), then the schedulers (bare
RPCs, then `--steps` rounds of 1 question each by the `Steps` stream).
Ratios are taken per block and reported as the median over the `--repeat`
blocks with their spread, as `cpcache bench agreement` does.

Bytes per rank per round are given two ways: computed from the vector's
length and the algorithm that moves it (`sizes.expected_bytes`: payload, and
payload plus gloo's message preambles), and measured from the kernel's TCP
counters (`ss -ti`: bytes sent less retransmissions, and bytes received, over
every TCP socket of a process except those to the rendezvous store) around a
block of rounds, divided by the collectives in it. Loopback TCP counts no IP
or TCP headers, so the measured figure is the computed wire figure when the
model is right.

Every rank of every size runs on this one machine: a domain of more ranks
than CPUs is oversubscribed, and the report says so (`oversubscribed`,
`note`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from cpcache.agreement.collective import ALLTOALL_MAX_GROUP, host_store
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.testing.stats import block_summary, percentiles_us
from cpcache.tools.bench.agreement import Workers
from cpcache.tools.bench.scheduler import WARMUP_STEPS
from cpcache.tools.bench.sizes import expected_bytes, parse_ss, per_round, round_vector_length, topology_for
from cpcache.tools.bench.vector_baseline import WARMUP as BASELINE_WARMUP

QUESTIONS = 1  # a round of one question: the smallest step a scheduler sends
BYTE_ROUNDS = 20  # measured rounds (plus warm-up) in the byte-count block
AGREEMENT_TIMEOUT_S = 120.0  # generous: 16 ranks on 2 cores are slow, not lost
START_TIMEOUT_S = 600.0


def tcp_counters(pids: Iterable[int], exclude_port: int) -> dict[int, tuple[int, int]] | None:
    """The TCP byte counters of `pids` now (None where `ss` is missing)."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=60, check=True).stdout
    return parse_ss(out, pids, exclude_port)


# -- the run ------------------------------------------------------------------------------------


class RankWorkers(Workers):
    """Workers whose process ids are known (to read their sockets' counters)."""

    @classmethod
    async def launch(cls, argvs: Sequence[Sequence[str]], what: str) -> RankWorkers:
        workers = await cls.start(argvs, what)
        assert isinstance(workers, RankWorkers)
        return workers

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def oversubscription(ranks: int, cores: int) -> str:
    """A warning where the domain has more ranks than the machine has CPUs
    ("" where it has not)."""
    if ranks <= cores:
        return ""
    return (f"{ranks} ranks on {cores} CPUs ({ranks / cores:g} ranks per CPU; {2 * ranks} busy processes during "
            f"the rounds, a daemon and a scheduler per rank): oversubscribed, a collective cannot run all its "
            f"ranks at once, so these figures measure CPU scheduling as much as the protocol")


async def measure(ranks: int, steps: int, repeat: int, byte_rounds: int = BYTE_ROUNDS) -> dict:
    topology = topology_for(ranks)
    length = round_vector_length(QUESTIONS)
    cores = cpus()
    report: dict = {"ranks": ranks, "topology": topology.describe(), "vector_int64s": length,
                    "blocks": repeat, "steps_per_block": steps, "cpus": cores,
                    "oversubscribed": ranks > cores, "ranks_per_cpu": round(ranks / cores, 2),
                    "load_average_before": round(os.getloadavg()[0], 2)}
    if note := oversubscription(ranks, cores):
        report["note"] = note
    samples: dict[str, list[float]] = {}
    per_block: dict[str, list[float]] = {}

    def keep(name: str, values: list[float]) -> float:
        samples.setdefault(name, []).extend(values)
        return p50(values)

    store = host_store()
    baseline = await RankWorkers.launch(
        [["cpcache.tools.bench.vector_baseline", "--rank", str(r), "--tp", str(topology.tp), "--cp",
          str(topology.cp), "--port", str(store.port), "--timeout", str(AGREEMENT_TIMEOUT_S)]
         for r in range(ranks)], f"{ranks}-rank gloo baseline")
    try:
        with tempfile.TemporaryDirectory(prefix="cpc-ranks-") as tmp:
            spec = DomainSpec(topology, Path(tmp) / "domain", agreement_timeout_s=AGREEMENT_TIMEOUT_S)
            async with LocalDomain(spec, start_timeout_s=START_TIMEOUT_S) as domain:
                schedulers = await RankWorkers.launch(
                    [["cpcache.tools.bench.scheduler", "--socket", socket, "--rank", str(rank)]
                     for rank, socket in enumerate(domain.sockets)], f"{ranks}-rank scheduler")
                try:
                    block = json.dumps({"bare_rpc": steps, "counts": [QUESTIONS], "steps": steps,
                                        "transports": ["stream"]})
                    for _ in range(repeat):
                        base = await baseline.block(f"{steps} {length}")
                        allreduce = keep("allreduce", [s for o in base for s in o["allreduce"]])
                        exchange = keep("exchange", [s for o in base for s in o["exchange"]])
                        out = await schedulers.block(block)
                        rpc = keep("bare_rpc", [s for o in out for s in o["bare_rpc"]])
                        step = keep("round", [s for o in out for s in o["steps"][f"stream:{QUESTIONS}"]])
                        for name, value in (("round_over_allreduce", step / allreduce),
                                            ("round_over_exchange", step / exchange),
                                            ("round_over_allreduce_plus_rpc", step / (allreduce + rpc))):
                            per_block.setdefault(name, []).append(value)
                    report["bytes_measured"] = await measure_bytes(domain, schedulers, baseline, store.port,
                                                                   length, byte_rounds)
                finally:
                    await schedulers.stop()
    finally:
        await baseline.stop()
        del store
    report["load_average_after"] = round(os.getloadavg()[0], 2)
    report["round_us"] = percentiles_us(samples["round"])
    report["bare_allreduce_us"] = percentiles_us(samples["allreduce"])
    report["bare_exchange_us"] = percentiles_us(samples["exchange"])
    report["bare_rpc_us"] = percentiles_us(samples["bare_rpc"])
    summaries = {name: block_summary(values, 2) for name, values in per_block.items()}
    report["ratios"] = {name: s["median"] for name, s in summaries.items()}
    report["ratio_spread"] = summaries
    report["bytes_expected"] = expected_bytes(ranks, length, ALLTOALL_MAX_GROUP)
    return report


async def measure_bytes(domain: LocalDomain, schedulers: RankWorkers, baseline: RankWorkers, baseline_port: int,
                        length: int, rounds: int) -> dict:
    """Per-rank TCP bytes of one round, one bare all-reduce and one bare
    exchange, each from a block of its own between two counter snapshots."""
    domain_port = int(domain.config(0).rendezvous.rsplit(":", 1)[1])
    daemons = [p.pid for p in domain.procs]
    before = tcp_counters(daemons, domain_port)
    await schedulers.block(json.dumps({"counts": [QUESTIONS], "steps": rounds, "transports": ["stream"]}))
    out = {"how": "ss -ti: bytes_sent - bytes_retrans and bytes_received over each process's TCP sockets "
                  "except those to the rendezvous store, around a block, per collective; gloo headers included",
           "round": per_round(before, tcp_counters(daemons, domain_port), rounds + WARMUP_STEPS)}
    for which in ("allreduce", "exchange"):
        before = tcp_counters(baseline.pids, baseline_port)
        await baseline.block(f"{rounds} {length} {which}")
        out[which] = per_round(before, tcp_counters(baseline.pids, baseline_port), rounds + BASELINE_WARMUP)
    return out


async def run(sizes: tuple[int, ...], steps: int, repeat: int) -> dict:
    results = []
    for ranks in sizes:
        results.append(await measure(ranks, steps, repeat))
    return {"benchmark": "round cost against the number of ranks", "questions_per_round": QUESTIONS,
            "transport": "Steps stream, agreement_lag 0, domain mode", "cpus": cpus(), "sizes": results}


def table(report: dict) -> list[str]:
    """The figures as a Markdown table (docs/benchmarks.md, "What a round and a step cost", shows
    the latest run's, rendered from benchmarks/runs/)."""
    lines = ["| ranks | topology | round p50 ms | bare all-reduce p50 ms | bare exchange p50 ms "
             "| round / all-reduce (min-max) | round / exchange (min-max) "
             "| round: bytes sent per rank, payload / wire / measured "
             "| bare all-reduce: payload / wire / measured |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["sizes"]:
        measured = r["bytes_measured"]
        computed = r["bytes_expected"]
        lines.append(
            f"| {r['ranks']}{' *' if r['oversubscribed'] else ''} | {r['topology']} "
            f"| {r['round_us']['p50'] / 1000:.2f} | {r['bare_allreduce_us']['p50'] / 1000:.2f} "
            f"| {r['bare_exchange_us']['p50'] / 1000:.2f} "
            f"| {_ratio(r, 'round_over_allreduce')} | {_ratio(r, 'round_over_exchange')} "
            f"| {_bytes(computed['round'], measured['round'])} "
            f"| {_bytes(computed['allreduce'], measured['allreduce'])} |")
    return lines


def _ratio(r: dict, name: str) -> str:
    spread = r["ratio_spread"][name]["spread"]
    return f"{r['ratios'][name]:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def _bytes(computed: dict, measured: dict | None) -> str:
    seen = "n/a" if measured is None else f"{measured['sent']:,.0f}"
    return f"{computed['payload_sent']:,.0f} / {computed['wire_sent']:,.0f} / {seen}"


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("cpcache bench ranks: --plot needs matplotlib (pip install 'cpcache[plot]')") from None
    plt.rcParams["svg.fonttype"] = "none"  # an SVG keeps its text as text: small, and diffable
    plt.rcParams["svg.hashsalt"] = "cpcache"  # and the same ids every time
    sizes = report["sizes"]
    ranks = [r["ranks"] for r in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("round_us", "round, 1 question (Steps stream)"),
                       ("bare_allreduce_us", "bare gloo all-reduce, same vector"),
                       ("bare_exchange_us", "bare exchange (the daemons' reduction)")):
        left.plot(ranks, [r[key]["p50"] / 1000 for r in sizes], marker="o", label=label)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(ranks, [str(n) for n in ranks])
    left.set_xlabel("ranks in the domain")
    left.set_ylabel("p50 latency (ms)")
    left.legend(fontsize=8)
    left.set_title("cost of one round")
    for key, label in (("round", "round"), ("allreduce", "bare all-reduce")):
        line, = right.plot(ranks, [r["bytes_expected"][key]["wire_sent"] for r in sizes], marker="o",
                           label=f"{label}: computed, with gloo headers")
        right.plot(ranks, [r["bytes_expected"][key]["payload_sent"] for r in sizes], marker=".", linestyle=":",
                   color=line.get_color(), label=f"{label}: payload alone")
        measured = [r["bytes_measured"][key] for r in sizes]
        if all(m is not None for m in measured):
            right.plot(ranks, [m["sent"] for m in measured], marker="x", linestyle="none", color=line.get_color(),
                       markersize=9, label=f"{label}: measured (TCP)")
    right.set_xscale("log", base=2)
    right.set_xticks(ranks, [str(n) for n in ranks])
    right.set_xlabel("ranks in the domain")
    right.set_ylabel("bytes sent per rank per round")
    right.legend(fontsize=8)
    right.set_title("bytes per rank (received: the same)")
    over = [r["ranks"] for r in sizes if r["oversubscribed"]]
    note = f"; {', '.join(map(str, over))} ranks oversubscribed" if over else ""
    fig.suptitle(f"cpcache rounds against domain size, {report['cpus']} CPUs{note}", fontsize=10)
    fig.tight_layout()
    # No date in the file: the same report gives the same bytes. The format follows the extension.
    fig.savefig(path, dpi=110, metadata={"Date": None} if path.endswith((".svg", ".pdf")) else None)


async def main(args: argparse.Namespace) -> int:
    report = await run(args.ranks, args.steps, args.repeat)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(table(report)))
        for r in report["sizes"]:
            if "note" in r:
                print(f"* {r['note']}")
    return 0
