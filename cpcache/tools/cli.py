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
from cpcache.topology import MODES, Topology

if TYPE_CHECKING:
    from cpcache.daemon.launcher import LocalDomain
    from cpcache.daemon.segment_owner import SegmentOwner


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
    # Ctrl-C signals the terminal's whole foreground group; the daemons run
    # in groups of their own (`LocalDomain`), so only this process sees it
    # and each daemon is told once, with a SIGTERM: one drain each. A second
    # signal here means "exit now": each daemon is told again, and a second
    # signal cuts its drain short (exit 130). SIGHUP (the terminal closed)
    # stops them too, since it no longer reaches them.
    stop = asyncio.Event()
    signals = 0
    domains: list[LocalDomain] = []

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            stop.set()
            return
        print("cpcache: second signal: the daemons exit now, without draining", file=sys.stderr, flush=True)
        for started in domains:
            started.force()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    domain = LocalDomain(spec)
    domains.append(domain)
    async with domain:
        print(f"cpcache: {domain.size} ranks serving ({spec.topology.describe()}, {args.mode} mode, lag {args.lag})")
        for rank, socket in enumerate(domain.sockets):
            print(f"rank {rank}: unix:{socket} (pid {domain.procs[rank].pid})")
        if domain.segment_owner is not None:
            print(f"cpcache: the store's memory is held by a segment owner (pid {domain.segment_owner.pid}, "
                  f"{domain.segment_owner.settings.segment_bytes} bytes): the daemons mount none", flush=True)
        print("cpcache: press Ctrl-C to stop", flush=True)
        # A supervisor per rank, as systemd's Restart=always is: a rank that
        # exits is started again, however often and with whatever code (a
        # SIGTERM from outside exits 0 or 4: a restart), and its domain forms
        # again in the next epoch. Settings errors (exit 2) are not retried.
        supervisors = [asyncio.ensure_future(_supervise(domain, rank, args.restart))
                       for rank in range(domain.size)]
        if domain.segment_owner is not None:
            supervisors.append(asyncio.ensure_future(_supervise_owner(domain.segment_owner)))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, *supervisors}, return_when=asyncio.FIRST_COMPLETED)
        for task in (stopped, *supervisors):
            task.cancel()
        await asyncio.gather(stopped, *supervisors, return_exceptions=True)
        codes = await domain.stop()
    print(f"cpcache: stopped; exit codes {codes}", flush=True)
    if signals > 1:
        return 130  # told to exit now: the daemons did not drain
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


async def _supervise_owner(owner: SegmentOwner) -> None:
    """Start the store's segment owner again whenever it exits (what it held
    is gone from the store; the daemons' later writes go to the new one)."""
    while owner.proc is not None:
        code = await asyncio.to_thread(owner.proc.wait)
        print(f"cpcache: the segment owner exited with code {code} (the pages it held left the store); starting "
              "it again", file=sys.stderr, flush=True)
        owner.stop()  # its log read to the end
        await asyncio.to_thread(owner.start)


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


async def _segment_owner(args: argparse.Namespace) -> int:
    """Mooncake's real client holding this host's share of the store, until
    signalled: the daemons (storage_segment_bytes = 0) come and go beside it."""
    from cpcache.config import DaemonConfig
    from cpcache.daemon.segment_owner import OwnerSettings, SegmentOwner

    every_rank, _ = _daemon_settings(args.config)
    config = DaemonConfig.from_settings({"rank": 0, **every_rank})
    owner = SegmentOwner(OwnerSettings.of(config, args.bytes), Path(args.log))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.to_thread(owner.start)
    try:
        print(f"cpcache: holding {args.bytes} bytes of the Mooncake Store at {config.storage_master} "
              f"(pid {owner.pid})", flush=True)
        _notify_systemd(f"READY=1\nSTATUS=holding {args.bytes} bytes of the store")
        exited = asyncio.ensure_future(asyncio.to_thread(owner.proc.wait)) if owner.proc else None
        waits = {asyncio.ensure_future(stop.wait()), *([exited] if exited else [])}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if exited is not None and exited in done:
            print("cpcache: the segment owner exited on its own", file=sys.stderr, flush=True)
            return 1
    finally:
        await asyncio.to_thread(owner.stop)
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


def parser() -> argparse.ArgumentParser:
    """The whole command line, every subcommand's flags included."""
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

    owner = sub.add_parser("segment-owner", help="hold this host's share of a Mooncake Store (a service that "
                           "outlives daemons, whose own segments would leave the store with them)")
    owner.add_argument("--config", required=True, help="the daemons' TOML settings (storage_master, "
                       "storage_metadata_server, storage_local_hostname, storage_protocol)")
    owner.add_argument("--bytes", type=int, required=True, help="memory lent to the store; the daemons then run "
                       "with storage_segment_bytes = 0")
    owner.add_argument("--log", default="/dev/stderr", help="where the owner's own log goes")

    for name, text in (("status", "health, domain, step and open questions of a daemon"),
                       ("stats", "a daemon's counters: tier occupancy, pages moved, hits")):
        query = sub.add_parser(name, help=text)
        query.add_argument("socket", help="the daemon's socket path or host:port")
        query.add_argument("--timeout", type=float, default=5.0)

    from cpcache.tools.bench import commands as bench_commands

    bench_commands.add_parser(sub)

    fuzz = sub.add_parser("fuzz", help="send hostile requests to live daemons and check they stay sound")
    fuzz.add_argument("--per-rpc", type=int, default=10_000, help="hostile requests per RPC")
    fuzz.add_argument("--seed", type=int, default=1)
    fuzz.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="launch a local domain and replay a real trace through it")
    add_topology_flags(demo)
    from cpcache.tools.demo import add_flags as add_demo_flags

    add_demo_flags(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from cpcache.errors import CacheError
    from cpcache.tools.bench import commands as bench_commands

    try:
        if args.command == "launch":
            return asyncio.run(_launch(args))
        if args.command == "store":
            return asyncio.run(_store(args))
        if args.command in ("status", "stats"):
            return asyncio.run(_status(args))
        if args.command == "segment-owner":
            return asyncio.run(_segment_owner(args))
        if args.command == "demo":
            from cpcache.tools import demo as demo_module

            return asyncio.run(demo_module.main(args))
        if args.command == "bench":
            return bench_commands.run(args)
        if args.command == "fuzz":
            from cpcache.testing import fuzz as fuzz_module

            return asyncio.run(fuzz_module.main(args))
    except CacheError as exc:
        print(f"cpcache: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        if not bench_commands.is_sglang_cpu(exc):
            raise
        print(f"cpcache: {args.command} {getattr(args, 'name', '')} runs SGLang on CPU with the test kits of a "
              "source checkout (cpcache/testing/sglang_cpu, set up by `make setup`); a wheel leaves them out",
              file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
