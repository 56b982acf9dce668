"""`cpcache bench NAME`: one subcommand per bench, each with its own flags
and help (`cpcache bench NAME --help`). The flags several benches take
(`--json`, `--repeat`, `--steps`, `--work-dir`, `--seed`, `--layer-delay-ms`,
`--trace-requests`) are defined once, as parent parsers; each bench's
module is imported only when it runs."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from cpcache.config import WRITE_POLICIES
from cpcache.tools.bench.sizes import DEFAULT_RANKS, parse_ranks

Flags = Callable[[argparse.ArgumentParser], None]


def _parent(flags: Flags) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    flags(parent)
    return parent


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _repeat(default: int) -> Flags:
    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--repeat", type=int, default=default,
                       help="blocks, each measuring candidate and baseline one after the other; ratios are the "
                            f"median over the blocks (default {default})")
    return flags


def _steps(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="measured steps per case and block (default 40)")


def _work_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work-dir", help="where the model, logs and daemons go (kept; default: a temp dir, removed "
                   "after a run that succeeded)")


def _seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=1, help="seed of the injected faults (default 1)")


def _layer_delay(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layer-delay-ms", type=float, default=20.0,
                   help="each layer of every load-back's copy takes this long (injected; default 20)")


def _trace_requests(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-requests", type=int, help="requests of the scaled trace (default 400)")


# -- each bench's own flags ---------------------------------------------------

def _ranks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=parse_ranks, default=DEFAULT_RANKS, metavar="N,N,...",
                   help="domain sizes to measure, one after the other (default: 2,4,8,16)")
    p.add_argument("--plot", metavar="FILE", help="write a plot of round cost and bytes against ranks (PNG or SVG, "
                   "by the file's extension)")


def _soak(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decisions", type=int, default=1_000_000, help="agreed decisions to reach")


def _sglang(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=4, help="concurrent requests per wave")
    p.add_argument("--waves", type=int, default=2, help="waves of requests per server and block")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens each request generates")


def _sglang_pd(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=4, help="conversations run at once, a thread each")
    p.add_argument("--turns", type=int, default=4, help="turns of each conversation")


def _load_back(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sglang", action="store_true",
                   help="through two SGLang servers (TTFT of host hits) instead of a stand-in forward, which "
                   "computes --layer-delay-ms per layer")


def _serving(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", help="which servers, comma-separated (default: all, in their order)")
    p.add_argument("--prefetch-policy", choices=["best_effort", "wait_complete", "timeout"],
                   help="how a storage prefetch ends, on both stacks (default wait_complete; timeout: SGLang's "
                   "default budget, given to both)")
    p.add_argument("--spin-when-idle", action="store_true",
                   help="leave SGLang's idle schedulers spinning (its default) instead of --sleep-on-idle on every "
                   "measured server; their CPU seconds then count the spin")
    p.add_argument("--slowdown", type=float,
                   help="the trace's arrival intervals times this (default 1.5; higher: less queueing)")


def _serving_pd(p: argparse.ArgumentParser) -> None:
    from cpcache.tools.bench.serving_pd import CONFIGS, ROUNDS, SESSIONS, SLOWDOWN

    p.add_argument("--configs", help=f"which pairs, comma-separated (default: {','.join(CONFIGS)})")
    p.add_argument("--sessions", type=int, default=SESSIONS, help=f"sessions of the trace (default {SESSIONS})")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"turns per session (default {ROUNDS})")
    p.add_argument("--slowdown", type=float, default=SLOWDOWN,
                   help=f"the trace's arrival intervals times this (default {SLOWDOWN:g})")


def _routing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", help="which arms, comma-separated (default: events,events-x2,approx,approx-x2,"
                   "round-robin)")
    p.add_argument("--gateway-warmup", action="store_true",
                   help="leave the gateway's warm-up slice on (its default: misses and one hit in eight diverted "
                   "to a worker it finds new or thin); off otherwise, so every decision is its routing index's")


def _movers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store")
    p.add_argument("--against", choices=["sglang"],
                   help="also SGLang's own HiCacheFile on the same pages (in SGLang's environment)")
    p.add_argument("--device-only", action="store_true", help="device <-> host alone, for every host layout "
                   "(no storage)")
    p.add_argument("--mooncake-only", action="store_true", help="host <-> Mooncake Store alone (no device copies, "
                   "no files)")


def _state(p: argparse.ArgumentParser) -> None:
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through",
                   help="the write policy the state machine runs")


SGLANG_CPU = "cpcache.testing.sglang_cpu"


def is_sglang_cpu(exc: ModuleNotFoundError) -> bool:
    """The error of a module of SGLang's CPU kits, which only a source
    checkout carries (a wheel leaves them out)."""
    return (exc.name or "").startswith(SGLANG_CPU)


def _sglang_soak(p: argparse.ArgumentParser) -> None:
    """The SGLang soak's own flags, where its kits exist (a source checkout)."""
    try:
        from cpcache.testing.sglang_soak import add_flags
    except ModuleNotFoundError as exc:
        if not is_sglang_cpu(exc):
            raise
        return
    add_flags(p)


def _sglang_chaos(p: argparse.ArgumentParser) -> None:
    """The soak's flags and the chaos run's own, where their kits exist."""
    try:
        from cpcache.testing.sglang_chaos import add_flags
    except ModuleNotFoundError as exc:
        if not is_sglang_cpu(exc):
            raise
        return
    _sglang_soak(p)
    add_flags(p)


def _chaos(p: argparse.ArgumentParser) -> None:
    from cpcache.testing.chaos import add_flags

    add_flags(p)


def _late_prefetches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-delay-ms", type=float, default=20.0,
                   help="each storage call waits uniform(0, this) ms on each rank first (default 20)")


@dataclass(frozen=True)
class Bench:
    help: str
    module: str  # its `main(args)`: -> exit code, or a coroutine of it
    shared: tuple[Flags, ...]
    flags: Flags | None = None


BENCHES = {
    "agreement": Bench("what one agreed round costs on 4 ranks, against its bare parts and SGLang's per-question "
                       "collectives",
                       "cpcache.tools.bench.agreement", (_repeat(5), _steps)),
    "chaos": Bench("real daemons and simulated schedulers under faults at random moments and in combination "
                   "(kills, stops, graceful stops, floods, deaths at exact moments), every rank's outcome compared "
                   "step by step", "cpcache.testing.chaos", (_seed,), _chaos),
    "late-prefetches": Bench("best_effort prefetches that end before their pages are read, with "
                             "prefetch_best_effort_wait_s at 0 and at its default, through real daemons",
                             "cpcache.tools.bench.late_prefetches", (_repeat(2),), _late_prefetches),
    "load-back": Bench("the load-back, overlapped against blocking: a stand-in forward over a real daemon, or "
                       "TTFT of host hits through SGLang", "cpcache.testing.load_back",
                       (_repeat(5), _work_dir, _layer_delay), _load_back),
    "movers": Bench("each mover's throughput (device <-> host, host <-> storage) against the raw operation it is "
                    "built on",
                    "cpcache.tools.bench.movers", (_repeat(5),), _movers),
    "ranks": Bench("a round's cost against the number of ranks", "cpcache.tools.bench.ranks",
                   (_repeat(5), _steps), _ranks),
    "routing": Bench("two SGLang servers over cpcache behind Shepherd Model Gateway: cache_aware on the KV events "
                     "of every tier against its approximate tree and round robin (hits per tier, TTFT)",
                     "cpcache.tools.bench.routing", (_repeat(2), _work_dir), _routing),
    "serving": Bench("SGLang's bench_serving on a scaled Mooncake trace against CP servers: radix, HiCache, "
                     "cpcache",
                     "cpcache.tools.bench.serving", (_repeat(1), _work_dir, _trace_requests), _serving),
    "serving-pd": Bench("SGLang's bench_serving through SGLang's router in front of a PD pair (prefill tp 2 CP 2): "
                        "radix, HiCache and cpcache on files and Mooncake Store, interleaved",
                        "cpcache.tools.bench.serving_pd", (_repeat(2), _work_dir), _serving_pd),
    "sglang": Bench("SGLang servers on the CPU: TPOT with cpcache, HiCache and radix", "cpcache.tools.bench.sglang",
                    (_repeat(5), _work_dir), _sglang),
    "sglang-chaos": Bench("faults through sglang.launch_server: daemon kills, graceful stops, stops, scheduler "
                          "stops", "cpcache.testing.sglang_chaos", (_work_dir, _seed, _layer_delay), _sglang_chaos),
    "sglang-pd": Bench("a PD pair (prefill tp 2 CP 2, decode, router): TTFT and prompt throughput over cpcache, "
                       "radix and HiCache", "cpcache.tools.bench.sglang_pd", (_repeat(2), _work_dir), _sglang_pd),
    "sglang-soak": Bench("a CP SGLang server over daemons under cache-heavy traffic and I/O faults",
                         "cpcache.testing.sglang_soak", (_work_dir, _seed), _sglang_soak),
    "soak": Bench("agreed decisions through four daemons under injected faults, checking every step and every "
                  "page loaded back", "cpcache.testing.soak",
                  (_seed,), _soak),
    "state": Bench("the state machine's CPU per step, in process", "cpcache.tools.bench.state",
                   (_repeat(5), _steps), _state),
    "store-policies": Bench("what a bounded store can give on bench serving's trace, under which policy "
                            "(replayed page by page)", "cpcache.tools.bench.store_policies", (_trace_requests,)),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`bench` and its subcommands, on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="run a benchmark and print its figures",
                           description="Run a benchmark and print its figures; `cpcache bench NAME --help` lists "
                           "its flags.")
    names = bench.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, spec in BENCHES.items():
        parents = [_parent(flags) for flags in (_json, *spec.shared)]
        p = names.add_parser(name, help=spec.help, description=spec.help, parents=parents)
        if spec.flags is not None:
            spec.flags(p)


def run(args: argparse.Namespace) -> int:
    """Run the bench `args.name`: -> its exit code."""
    code = importlib.import_module(BENCHES[args.name].module).main(args)
    if inspect.iscoroutine(code):
        code = asyncio.run(code)
    return int(code)
