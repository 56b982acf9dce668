"""The `cpcache` command: launch a local domain, query a daemon, run the
benchmarks and the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import cpcache
from cpcache.config import WRITE_POLICIES
from cpcache.topology import MODES, Topology

if TYPE_CHECKING:
    from cpcache.daemon.launcher import LocalDomain


def add_topology_flags(p: argparse.ArgumentParser, tp: int = 4, cp: int = 2) -> None:
    p.add_argument("--tp", type=int, default=tp, help="tensor-parallel size (the world is tp x pp ranks)")
    p.add_argument("--cp", type=int, default=cp, help="attention context-parallel size (splits the TP ranks)")
    p.add_argument("--dp", type=int, default=1, help="attention data-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--mode", choices=MODES, default="domain", help="how rounds reduce over the domain")
    p.add_argument("--lag", type=int, default=0, help="agreement lag in steps (0: synchronous)")


def topology_of(args: argparse.Namespace) -> Topology:
    return Topology(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp)


def _daemon_settings(path: str | None) -> tuple[dict, dict[int, dict]]:
    """`domain_file_settings`, a bad file stopping the launcher with its reason."""
    from cpcache.domain_file import domain_file_settings
    from cpcache.errors import InvalidArgument

    try:
        return domain_file_settings(path)
    except InvalidArgument as exc:
        raise SystemExit(f"cpcache launch: {exc}") from None


async def _launch(args: argparse.Namespace) -> int:
    from cpcache.daemon.launcher import DomainSpec, LocalDomain

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="cpcache-"))
    every_rank, per_rank = _daemon_settings(args.config)
    topology = topology_of(args)
    if any(rank >= topology.world_size for rank in per_rank):
        raise SystemExit(f"cpcache launch: {args.config}: [rank.N] tables for ranks {sorted(per_rank)}, but the "
                         f"world has {topology.world_size} ranks")
    spec = DomainSpec(
        topology, run_dir, mode=args.mode, agreement_lag=args.lag,
        agreement_timeout_s=args.agreement_timeout, fault_delay_ms=args.fault_delay_ms,
        extra=every_rank, per_rank=per_rank,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LocalDomain(spec) as domain:
        print(f"cpcache: {domain.size} ranks serving ({spec.topology.describe()}, {args.mode} mode, lag {args.lag})")
        for rank, socket in enumerate(domain.sockets):
            print(f"rank {rank}: unix:{socket} (pid {domain.procs[rank].pid})")
        print("cpcache: press Ctrl-C to stop", flush=True)
        # A supervisor per rank, as systemd's Restart=always is: a rank that
        # exits is started again, however often and with whatever code (a
        # SIGTERM from outside exits 0 or 4: a restart), and its domain forms
        # again in the next epoch. Settings errors (exit 2) are not retried.
        supervisors = [asyncio.ensure_future(_supervise(domain, rank, args.restart))
                       for rank in range(domain.size)]
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, *supervisors}, return_when=asyncio.FIRST_COMPLETED)
        for task in (stopped, *supervisors):
            task.cancel()
        await asyncio.gather(stopped, *supervisors, return_exceptions=True)
        codes = await domain.stop()
    print(f"cpcache: stopped; exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


async def _supervise(domain: LocalDomain, rank: int, restart: bool) -> None:
    """Watch one rank for as long as the launcher runs, starting it again
    however often it exits or fails to serve; returns (ending the launch)
    only when it may not be started again (exit 2: its settings)."""
    from cpcache.errors import CacheError

    while True:
        code = await asyncio.shield(domain.exited(rank))
        if code == 2 or not restart:
            print(f"cpcache: rank {rank} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
            return
        seen = time.monotonic()
        print(f"cpcache: rank {rank} exited with code {code}; starting it again", file=sys.stderr, flush=True)
        domain.respawn(rank)
        try:
            await domain.wait_serving(rank)
        except CacheError as exc:
            if not domain.exited(rank).done():
                # Not serving, not gone (stopping on its own, or stuck): it is
                # given its own exit, then killed; either way it starts again.
                print(f"cpcache: rank {rank} is not serving ({exc}); starting it again once it exits",
                      file=sys.stderr, flush=True)
                try:
                    await asyncio.wait_for(asyncio.shield(domain.exited(rank)), domain.start_timeout_s)
                except TimeoutError:
                    domain.signal(rank, signal.SIGKILL)
            continue  # its exit is seen like any other death
        print(f"cpcache: rank {rank} is back (pid {domain.procs[rank].pid}, serving "
              f"{time.monotonic() - seen:.2f}s after its exit was seen)", flush=True)


async def _store(args: argparse.Namespace) -> int:
    """The rendezvous store on its own, as a service: every daemon's restart
    (rank 0's included) finds it where it was."""
    from cpcache.values import split_host_port

    if args.probe:  # a healthcheck: stay light (no torch import)
        import socket as socket_module

        try:
            socket_module.create_connection(split_host_port(args.probe, "--probe"), timeout=3.0).close()
        except OSError as exc:
            print(f"cpcache: no store at {args.probe}: {exc}", file=sys.stderr)
            return 1
        return 0
    from cpcache.agreement.collective import host_store

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = split_host_port(args.listen, "--listen")
    store = host_store(host or "127.0.0.1", port)
    print(f"cpcache: rendezvous store on {host or '127.0.0.1'}:{store.port}", flush=True)
    _notify_systemd(f"READY=1\nSTATUS=serving the rendezvous store on port {store.port}")
    await stop.wait()
    del store
    return 0


def _notify_systemd(message: str) -> None:
    import os
    import socket as socket_module

    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)


async def _status(args: argparse.Namespace) -> int:
    """Health, domain membership, current step, open questions and, with
    --stats or `cpcache stats`, every counter including tier occupancy."""
    from google.protobuf import json_format
    from grpc_health.v1 import health_pb2

    from cpcache.client import AsyncClient

    async with AsyncClient(args.socket, timeout_s=args.timeout) as client:
        health = health_pb2.HealthCheckResponse.ServingStatus.Name(await client.health())
        reply = json_format.MessageToDict(await client.status(), always_print_fields_with_no_presence=True,
                                          preserving_proto_field_name=True)
        stats = await client.stats() if args.command == "stats" else None
    if stats is not None:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(json.dumps({"health": health, **reply}, indent=2))
    return 0 if health == "SERVING" else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpcache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {cpcache.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="run one daemon per rank on this machine until Ctrl-C")
    add_topology_flags(launch, tp=4, cp=1)
    launch.add_argument("--config", help="TOML file of cpcached settings for every rank (storage, host pool, "
                        "policies; see `cpcached --help`), and for single ranks in [rank.N] tables")
    launch.add_argument("--run-dir", help="where sockets and logs go (default: a new temp dir)")
    launch.add_argument("--agreement-timeout", type=float, default=10.0, help="seconds before a peer counts as lost")
    launch.add_argument("--fault-delay-ms", type=float, default=0.0, help="inject up to this delay into each round")
    launch.add_argument("--no-restart", dest="restart", action="store_false",
                        help="stop every rank when one exits, instead of starting it again")

    store = sub.add_parser("store", help="serve the rendezvous store on its own (a service that outlives daemons)")
    store.add_argument("--listen", default="127.0.0.1:29500", help="HOST:PORT to listen on (binds only there)")
    store.add_argument("--probe", metavar="HOST:PORT", help="exit 0 if a store accepts connections there, else 1 "
                       "(a healthcheck)")

    for name, text in (("status", "health, domain, step and open questions of a daemon"),
                       ("stats", "a daemon's counters: tier occupancy, pages moved, hits")):
        query = sub.add_parser(name, help=text)
        query.add_argument("socket", help="the daemon's socket path or host:port")
        query.add_argument("--timeout", type=float, default=5.0)

    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench.add_argument("name", choices=["agreement", "chaos", "load-back", "movers", "ranks", "serving", "sglang",
                                        "sglang-chaos", "sglang-pd", "sglang-soak", "soak", "state", "store-policies"])
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--steps", type=int, default=40,
                       help="agreement, ranks, state: measured steps per case and block")
    bench.add_argument("--repeat", type=int, default=None,
                       help="agreement, load-back, movers, ranks, sglang, sglang-pd: blocks, each measuring "
                            "candidate and baseline one after the other; ratios are the median over the blocks "
                            "(default 5; sglang-pd: 2)")
    from cpcache.tools.bench.sizes import DEFAULT_RANKS, parse_ranks

    bench.add_argument("--ranks", type=parse_ranks, default=DEFAULT_RANKS, metavar="N,N,...",
                       help="ranks: domain sizes to measure, one after the other (default: 2,4,8,16)")
    bench.add_argument("--plot", metavar="FILE", help="ranks: write a plot of round cost and bytes against ranks "
                       "(PNG or SVG, by the file's extension)")
    bench.add_argument("--no-mooncake", action="store_true", help="movers: skip Mooncake Store")
    bench.add_argument("--against", choices=["sglang"],
                       help="movers: also SGLang's own HiCacheFile on the same pages (in SGLang's environment)")
    bench.add_argument("--device-only", action="store_true",
                       help="movers: device <-> host alone, for every host layout (no storage)")
    bench.add_argument("--decisions", type=int, default=1_000_000, help="soak: agreed decisions to reach")
    bench.add_argument("--seed", type=int, default=1, help="soak, sglang-chaos: seed of the injected faults")
    bench.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through",
                       help="state: the write policy the state machine runs")
    bench.add_argument("--requests", type=int, default=4, help="sglang: concurrent requests per wave")
    bench.add_argument("--waves", type=int, default=2, help="sglang: waves of requests per server and block")
    bench.add_argument("--new-tokens", type=int, default=32, help="sglang: tokens each request generates")
    bench.add_argument("--conversations", type=int, default=4,
                       help="sglang-pd: conversations run at once, a thread each")
    bench.add_argument("--turns", type=int, default=4, help="sglang-pd: turns of each conversation")
    bench.add_argument("--layer-delay-ms", type=float, default=20.0,
                       help="load-back, sglang-chaos: each layer of every load-back's copy takes this long "
                            "(injected); load-back's stand-in forward computes as long per layer")
    bench.add_argument("--sglang", action="store_true",
                       help="load-back: through two SGLang servers (TTFT of host hits) instead of a stand-in forward")
    bench.add_argument("--configs", help="serving: which servers, comma-separated (default: all, in their order)")
    bench.add_argument("--trace-requests", type=int,
                       help="serving, store-policies: requests of the scaled trace (default 400)")
    bench.add_argument("--prefetch-policy", choices=["best_effort", "wait_complete", "timeout"],
                       help="serving: how a storage prefetch ends, on both stacks (default wait_complete; timeout: "
                       "SGLang's default budget, given to both)")
    bench.add_argument("--spin-when-idle", action="store_true",
                       help="serving: leave SGLang's idle schedulers spinning (its default) instead of "
                       "--sleep-on-idle on every measured server; their CPU seconds then count the spin")
    bench.add_argument("--slowdown", type=float,
                       help="serving: the trace's arrival intervals times this (default 1.5; higher: less queueing)")
    bench.add_argument("--work-dir", help="sglang, sglang-pd, sglang-soak, sglang-chaos, load-back: where the model, "
                       "logs and daemons go (kept; default: a temp dir, removed after a run that succeeded)")
    _add_sglang_cpu_flags(bench)
    from cpcache.testing.chaos import add_flags as add_chaos_flags

    add_chaos_flags(bench)

    fuzz = sub.add_parser("fuzz", help="send hostile requests to live daemons and check they stay sound")
    fuzz.add_argument("--per-rpc", type=int, default=10_000, help="hostile requests per RPC")
    fuzz.add_argument("--seed", type=int, default=1)
    fuzz.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="launch a local domain and replay a real trace through it")
    add_topology_flags(demo)
    from cpcache.tools.demo import add_flags as add_demo_flags

    add_demo_flags(demo)

    args = parser.parse_args(argv)
    if args.command == "bench" and args.repeat is None:
        args.repeat = 2 if args.name == "sglang-pd" else 5
    from cpcache.errors import CacheError

    try:
        if args.command == "launch":
            return asyncio.run(_launch(args))
        if args.command == "store":
            return asyncio.run(_store(args))
        if args.command in ("status", "stats"):
            return asyncio.run(_status(args))
        if args.command == "demo":
            from cpcache.tools import demo as demo_module

            return asyncio.run(demo_module.main(args))
        if args.command == "bench" and args.name == "agreement":
            from cpcache.tools.bench import agreement

            return asyncio.run(agreement.main(args))
        if args.command == "bench" and args.name == "ranks":
            from cpcache.tools.bench import ranks

            return asyncio.run(ranks.main(args))
        if args.command == "bench" and args.name == "chaos":
            from cpcache.testing import chaos

            return chaos.main(args)
        if args.command == "bench" and args.name == "soak":
            from cpcache.testing import soak

            return asyncio.run(soak.main(args))
        if args.command == "fuzz":
            from cpcache.testing import fuzz as fuzz_module

            return asyncio.run(fuzz_module.main(args))
        if args.command == "bench" and args.name == "sglang":
            from cpcache.tools.bench import sglang

            return sglang.main(args)
        if args.command == "bench" and args.name == "sglang-pd":
            from cpcache.tools.bench import sglang_pd

            return sglang_pd.main(args)
        if args.command == "bench" and args.name == "sglang-soak":
            from cpcache.testing import sglang_soak

            return sglang_soak.main(args)
        if args.command == "bench" and args.name == "sglang-chaos":
            from cpcache.testing import sglang_chaos

            return sglang_chaos.main(args)
        if args.command == "bench" and args.name == "load-back":
            from cpcache.testing import load_back

            return load_back.main(args)
        if args.command == "bench" and args.name == "serving":
            from cpcache.tools.bench import serving

            return serving.main(args)
        if args.command == "bench" and args.name == "store-policies":
            from cpcache.tools.bench import store_policies

            return store_policies.main(args)
        if args.command == "bench" and args.name == "movers":
            from cpcache.tools.bench import movers

            return movers.main(args)
        if args.command == "bench" and args.name == "state":
            from cpcache.tools.bench import state

            return state.main(args)
    except CacheError as exc:
        print(f"cpcache: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        if not _is_sglang_cpu(exc):
            raise
        print(f"cpcache: {args.command} {getattr(args, 'name', '')} runs SGLang on CPU with the test kits of a "
              "source checkout (cpcache/testing/sglang_cpu, set up by `make setup`); a wheel leaves them out",
              file=sys.stderr)
        return 2
    return 2


SGLANG_CPU = "cpcache.testing.sglang_cpu"


def _is_sglang_cpu(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").startswith(SGLANG_CPU)


def _add_sglang_cpu_flags(bench: argparse.ArgumentParser) -> None:
    """The SGLang soak's and chaos run's own flags, where their kits exist
    (a source checkout): a wheel leaves SGLang's CPU patches out."""
    try:
        from cpcache.testing.sglang_chaos import add_flags as add_chaos_flags
        from cpcache.testing.sglang_soak import add_flags as add_soak_flags
    except ModuleNotFoundError as exc:
        if not _is_sglang_cpu(exc):
            raise
        return
    add_soak_flags(bench)
    add_chaos_flags(bench)


if __name__ == "__main__":
    sys.exit(main())
