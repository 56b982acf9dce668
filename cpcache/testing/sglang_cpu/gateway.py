"""A fleet behind a real gateway on a host without CUDA: SGLang servers in
gRPC mode (`python -m sglang.launch_server --smg-grpc-mode`, served by
`smg-grpc-servicer`), each over its own `cpcache launch` domain, every
domain on one shared file store, and Shepherd Model Gateway (`smg launch`)
in front, routing `cache_aware` (or any policy it has).

With `--kv-events-config` a server publishes its KV events (the device
tree's and, under cpcache, the host pool's and storage's), and the servicer
relays them to the gateway on `SubscribeKvEvents`: the gateway routes on
them (its event-driven index). Without events (the servicer's publisher
turned off) the gateway routes on its approximate tree of what it sent where.

Two things of the servicer need setting on a tiny model: its start-up
warm-up request carries fixed token ids up to 890 (past a 512-token
vocabulary: the scheduler dies of it), hence `--skip-server-warmup`; and
it turns SGLang's publisher on by itself when no `--kv-events-config` is
given, hence EVENTS_OFF for a server that must publish nothing.

Used by `cpcache bench routing` and tests/sglang/test_routing.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpcache.testing.ports import free_port
from cpcache.testing.sglang_cpu.servers import (
    CPCACHE_FLAGS,
    Daemons,
    Server,
    Watched,
    bind_failed,
    sglang_interpreter,
)

GRPC_FLAGS = ["--smg-grpc-mode", "--skip-server-warmup"]
EVENTS_OFF = {"SMG_SGLANG_SERVICER_KV_EVENTS": "off"}
# The gateway's warm-up slice diverts cache misses, and one cache hit in
# eight, to a worker it finds new or thin: off, so that every decision is its
# routing index's.
INDEX_ONLY = ["--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"]
GATEWAY_READY = "Activated"  # a worker's registration's last step, once per worker
EVENTS_CONNECTED = "KV event stream connected"


def kv_events_flags(port: int) -> list[str]:
    """SGLang's ZMQ publisher on a loopback port: the one switch."""
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"}
    return ["--kv-events-config", json.dumps(config)]


def smg() -> list[str]:
    """The gateway's command: smg's own module in SGLang's interpreter
    (`make setup`; `-P`: not a module of the working directory). Not the
    `smg` script: SGLang's router package installs one of that name too, and
    whichever package went in last owns it."""
    return [sglang_interpreter(), "-P", "-m", "smg"]


@functools.cache
def smg_installed() -> bool:
    """Whether SGLang's environment has the gateway (`make setup` installs it)."""
    probe = subprocess.run([sglang_interpreter(), "-c", "import smg.cli"], capture_output=True, timeout=60,
                           check=False)
    return probe.returncode == 0


@dataclass
class Replica:
    """One server in gRPC mode over its own daemons (tp 1), on the fleet's store."""

    name: str
    server: Server
    daemons: Daemons

    def start(self) -> Replica:
        self.daemons.launch()
        self.server.start()
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> Replica:
        self.daemons.wait_ready(timeout_s)
        self.server.wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        self.server.stop()
        self.daemons.stop()

    def counters(self) -> dict[str, int]:
        """Its daemon's counters (rank 0: the only rank); a loaded host may
        take the daemon many seconds to answer."""
        from cpcache.client import Client

        with Client(self.daemons.socket(0), timeout_s=60) as daemon:
            return dict(daemon.stats())


@dataclass
class Fleet:
    """`size` replicas of `model`, each over its own domain, all on `store`."""

    work: Path
    model: Path
    size: int = 2
    events: bool = True
    device_tokens: int = 1024
    host_pages: int = 256
    page_size: int = 16
    replicas: list[Replica] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = self.work / "pages"
        for i in range(self.size):
            name = f"replica{i}"
            run = self.work / f"{name}-run"
            daemons = Daemons(run, tp=1, settings=dict(
                storage="file", storage_root=str(self.store), host_pool_pages=self.host_pages,
                prefetch_threshold_tokens=0, prefetch_policy="wait_complete"))
            backend = self.work / f"{name}.json"
            backend.write_text(json.dumps({"socket": str(run / "rank-{rank}.sock"), "model_id": "fleet"}))
            env = {"CPCACHE_SGLANG_CONFIG": str(backend), **({} if self.events else EVENTS_OFF)}
            flags = [*CPCACHE_FLAGS, *GRPC_FLAGS, *(kv_events_flags(free_port()) if self.events else [])]
            server = Server(name, self.model, self.work, flags, tp=1, page_size=self.page_size,
                            device_tokens=self.device_tokens, env=env, tokenizer=True, sleep_on_idle=True)
            self.replicas.append(Replica(name, server, daemons))

    def start(self, timeout_s: float = 600.0) -> Fleet:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def urls(self) -> list[str]:
        return [f"grpc://127.0.0.1:{r.server.port}" for r in self.replicas]

    def counters(self) -> list[dict[str, int]]:
        return [r.counters() for r in self.replicas]


@dataclass
class Gateway:
    """`smg launch` in front of `urls`, routing by `policy`."""

    work: Path
    model: Path
    urls: list[str]
    policy: str = "cache_aware"
    name: str = "gateway"
    events: bool = True  # wait for its KV event stream from every worker
    flags: list[str] = field(default_factory=list)  # more of the gateway's own
    port: int = 0
    process: Watched | None = None

    def argv(self) -> list[str]:
        return [*smg(), "launch", "--worker-urls", *self.urls, "--policy", self.policy, "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-port", str(free_port()), "--model-path", str(self.model),
                *self.flags]

    def start(self, timeout_s: float = 180.0, port_tries: int = 3) -> Gateway:
        """Until every worker is registered (and its event stream connected,
        with `events`); on a port taken meanwhile, again on another."""
        for _ in range(port_tries):
            self.port = free_port()
            self.process = Watched(self.argv(), self.work / f"{self.name}.log", [GATEWAY_READY])
            self.process.seen[GATEWAY_READY].wait(timeout_s)
            if not bind_failed(self.process.text()):
                break
            self.process.stop()
        assert self.process is not None
        self.process.wait_lines(GATEWAY_READY, len(self.urls), timeout_s)  # one line per worker
        if self.events:
            self.process.wait_lines(EVENTS_CONNECTED, len(self.urls), timeout_s)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """The gateway and its router: `smg launch` forks the router and
        returns, so the router is stopped through the launcher's process
        group, where it stays."""
        if self.process is None:
            return
        self.process.stop()
        group = self.process.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                os.killpg(group, 0)  # raises once the group is empty
                time.sleep(0.05)  # no event tells a process group's end
            os.killpg(group, signal.SIGKILL)

    def post(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body or {}).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
        return json.loads(raw) if raw.strip()[:1] in (b"{", b"[") else {"text": raw.decode()}

    def flush_cache(self) -> None:
        """Every worker's caches dropped (SGLang's flush: cpcache's tiers name their pages anew)."""
        self.post("/flush_cache")

    def generate(self, input_ids: list[int], max_new_tokens: int = 4) -> dict:
        """Greedy, through the gateway: -> the reply (its `meta_info` has `cached_tokens`)."""
        out = self.post("/generate", {"model": str(self.model), "input_ids": input_ids,
                                      "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
        return out[0] if isinstance(out, list) else out
