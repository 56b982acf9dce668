"""SGLang prefill/decode (PD) disaggregation on a host without CUDA: a
prefill `sglang.launch_server` (any TP and attention CP, any more flags:
cpcache's among them), a decode one (TP 1), and SGLang's router
(`sglang_router.launch_router --pd-disaggregation --mini-lb`) in front of
both, the way SGLang's own PD fixture
(sglang/test/server_fixtures/disaggregation_fixture.py) deploys them.

The KV of each prefill goes to the decode server through Mooncake's transfer
engine over TCP (`--disaggregation-transfer-backend mooncake_tcp`: mooncake
with MC_FORCE_TCP=1, no RDMA device looked up), on loopback: every server
listens on --host 127.0.0.1 (its bootstrap server too), and SGLANG_HOST_IP
is the address each one publishes for itself (its transfer engine's name
and handshake, what the prefill ranks register with the bootstrap server);
without it Mooncake's engines are named by, and their handshakes listen
on, the host's NIC address. MC_TCP_BIND_ADDRESS is Mooncake's own choice of
that address: SGLang names it, so with Mooncake 0.3.13 it changes nothing
seen; it is set for builds that read it. (Mooncake's data and handshake
ports still listen on every address, as torch's rendezvous on --nccl-port
does; every address published or connected to is 127.0.0.1.)

What else SGLang's PD path needs on the CPU (PD_ENV, PD_DECODE_FLAGS):

- cpu_host/pd_cpu.py (CPCACHE_TEST_PD_CPU=1): the prefill's send path with
  the CPU's events for CUDA's, and without pinned memory;
- `--disaggregation-decode-retraction-backup cpu_tensor` on the decode
  server: its default backup of retracted requests' KV is a HiCache host
  pool, pinned with cudaHostRegister; `cpu_tensor` keeps each retracted
  request's KV in a plain CPU tensor.

The router (--mini-lb) sends each request to both servers and answers with
the decode server's reply (the prefill server's own is dropped, its input
logprobs merged in). The prefill server's cached tokens per tier reach the
decode server with the KV (SGLang's metadata buffers: cached, device, host,
storage) and are in that reply's meta_info: `cached_tokens`, and
`cached_tokens_details` ({"device", "host"}, "storage" only when above 0, as
the decode server has no storage backend of its own; null when nothing was
cached), so `generate` reads them as Server.generate does. Its
`output_token_logprobs` hold every output token, the first one (sampled on
the prefill server) included.

Every wait is on an event (servers.py): each server's own readiness line,
the router's uvicorn line, then one GET of its /health.
"""

from __future__ import annotations

import functools
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpcache.integrations.sglang.server_flags import STORAGE_EXTRA_CONFIG
from cpcache.testing.ports import free_port
from cpcache.testing.sglang_cpu.hicache import HICACHE_ENV
from cpcache.testing.sglang_cpu.servers import (
    CPCACHE_FLAGS,
    READY,
    Daemons,
    Reply,
    Server,
    Watched,
    bind_failed,
    sglang_interpreter,
)

# On both servers: loopback only, and the CPU patches of SGLang's PD path.
PD_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MC_TCP_BIND_ADDRESS": "127.0.0.1", "CPCACHE_TEST_PD_CPU": "1"}
TRANSFER_FLAGS = ["--disaggregation-transfer-backend", "mooncake_tcp"]
PD_DECODE_FLAGS = ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
ROUTER_READY = "Uvicorn running on"


def _settled(process: Watched) -> bool:
    """Whether a starting server serves, failed to bind a port, or exited."""
    return READY in process.text() or bind_failed(process.text()) or process.exited.is_set()


def _rss_bytes(pgid: int) -> int:
    """Resident memory of every process in process group `pgid` (Linux /proc)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the name: state, ppid, pgrp, ...
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return total


@dataclass
class PdDeployment:
    """A prefill server, a decode server and the router in front of them."""

    work: Path
    model: Path
    prefill_flags: list[str] = field(default_factory=list)
    prefill_env: dict = field(default_factory=dict)
    prefill_tp: int = 1
    prefill_cp: int = 1  # attention CP of the prefill server (--attn-cp-size); its CP rank 0 sends
    decode_flags: list[str] = field(default_factory=list)
    decode_env: dict = field(default_factory=dict)
    page_size: int = 16  # both servers' (the transfer is in pages)
    device_tokens: int = 1024
    prefill: Server | None = None
    decode: Server | None = None
    router: Watched | None = None
    router_port: int = 0
    bootstrap_port: int = 0
    ready_s: dict[str, float] = field(default_factory=dict)  # seconds from start to serving, per process
    daemons: Daemons | None = None  # cpcache's, beneath the prefill server: started first, stopped last
    server_options: dict = field(default_factory=dict)  # more of Server's, for both (tokenizer, sleep_on_idle)
    _begun: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # when each process started

    def _prefill_flags(self) -> list[str]:
        return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                "--nccl-port", str(free_port()), *TRANSFER_FLAGS, *self.prefill_flags]

    def _decode_flags(self) -> list[str]:
        return ["--disaggregation-mode", "decode", "--nccl-port", str(free_port()), *TRANSFER_FLAGS,
                *PD_DECODE_FLAGS, *self.decode_flags]

    def start(self) -> PdDeployment:
        """Start both servers (their ranks load at once); `wait_ready` starts
        the router once they serve."""
        if self.daemons is not None:
            self.daemons.launch()  # the prefill's schedulers wait for them at their attach
        self.bootstrap_port = free_port()
        self.prefill = Server("prefill", self.model, self.work, self._prefill_flags(), tp=self.prefill_tp,
                              cp=self.prefill_cp, page_size=self.page_size, device_tokens=self.device_tokens,
                              env={**PD_ENV, **self.prefill_env}, **self.server_options)
        self.decode = Server("decode", self.model, self.work, self._decode_flags(), tp=1,
                             page_size=self.page_size, device_tokens=self.device_tokens,
                             env={**PD_ENV, **self.decode_env}, **self.server_options)
        self._begun["prefill"] = time.monotonic()
        self.prefill.start()
        self._begun["decode"] = time.monotonic()
        self.decode.start()
        return self

    def _settle(self, server: Server, flags: Callable[[], list[str]], timeout_s: float, tries: int = 3) -> None:
        """Until `server` serves. A port picked here (HTTP, bootstrap, the
        ranks' rendezvous) can be taken before the server binds it: it starts
        again on fresh ones."""
        for _ in range(tries):
            process = server.process
            assert process is not None
            with process.new_line:
                process.new_line.wait_for(functools.partial(_settled, process), timeout_s)
            if READY in process.text() or not bind_failed(process.text()):
                break
            process.stop()
            if server is self.prefill:
                self.bootstrap_port = free_port()
            server.flags = flags()
            server.port = free_port()
            self._begun[server.name] = time.monotonic()
            server.start()
        assert server.process is not None
        server.process.wait_for(READY, timeout_s)
        self.ready_s[server.name] = time.monotonic() - self._begun[server.name]

    def wait_ready(self, timeout_s: float = 600.0) -> PdDeployment:
        """Until both servers serve, then the router: started, and its
        /health answering. `ready_s` records each one's seconds from its
        start to serving, and the whole deployment's ("all")."""
        assert self.prefill is not None and self.decode is not None
        if self.daemons is not None:
            self.daemons.wait_ready(timeout_s)
        self._settle(self.prefill, self._prefill_flags, timeout_s)
        self._settle(self.decode, self._decode_flags, timeout_s)
        for _ in range(3):
            self.router_port = free_port()
            begun = time.monotonic()
            self.router = Watched([sglang_interpreter(), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                   "--mini-lb", "--prefill", self.url(self.prefill), str(self.bootstrap_port),
                                   "--decode", self.url(self.decode), "--host", "127.0.0.1",
                                   "--port", str(self.router_port)],
                                  self.work / "router.log", [ROUTER_READY])
            self.router.seen[ROUTER_READY].wait(timeout_s)
            if not bind_failed(self.router.text()):
                break
            self.router.stop()
        assert self.router is not None
        self.router.wait_for(ROUTER_READY, timeout_s)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.router_port}/health", timeout=30) as reply:
            assert reply.status == 200, f"the router's /health answered {reply.status}"
        self.ready_s["router"] = time.monotonic() - begun
        self.ready_s["all"] = time.monotonic() - self._begun["prefill"]
        return self

    @staticmethod
    def url(server: Server) -> str:
        return f"http://127.0.0.1:{server.port}"

    @property
    def client(self) -> Server:
        """The router's HTTP client: a Server never started, on the router's
        port, whose post, generate and flush_cache (the router flushes both
        servers) go to the router."""
        return Server("router", self.model, self.work, [], port=self.router_port)

    def generate_raw(self, input_ids: list[int], max_new_tokens: int = 4, timeout_s: float = 120.0) -> dict:
        """The router's reply as it comes: the decode server's, with the
        prefill server's input logprobs merged in."""
        return self.client.post("/generate", {"input_ids": input_ids, "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                  "temperature": 0}}, timeout_s=timeout_s)

    def generate(self, input_ids: list[int], max_new_tokens: int = 4, rid: str | None = None,
                 timeout_s: float = 120.0) -> Reply:
        """Server.generate, through the router: the prefill server's cached
        tokens per tier come back in the decode server's reply."""
        return self.client.generate(input_ids, max_new_tokens, rid, timeout_s)

    def memory_bytes(self) -> dict[str, int]:
        """Resident memory of each server's processes (its process group),
        the router's and the daemons' (`cpcache launch` and its daemons)."""
        processes: dict[str, Watched | None] = {
            "prefill": self.prefill.process if self.prefill else None,
            "decode": self.decode.process if self.decode else None,
            "router": self.router, "daemons": self.daemons.process if self.daemons else None}
        return {name: _rss_bytes(p.proc.pid) for name, p in processes.items() if p is not None}

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for server in (self.decode, self.prefill):
            if server is not None:
                server.stop()
        if self.daemons is not None:
            self.daemons.stop()


# The decode server's KV offload into cpcache's store (docs/sglang.md,
# "Prefill and decode apart"): SGLang's own offload manager, with cpcache's
# store as its storage backend. Its host pool copies run as HiCache's do on
# this CPU host (HICACHE_ENV: plain-torch copies, an unpinned pool).
DECODE_OFFLOAD_FLAGS = ["--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend", "dynamic",
                        "--hicache-storage-backend-extra-config", json.dumps(STORAGE_EXTRA_CONFIG),
                        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]


def over_cpcache(work: Path, model: Path, tp: int = 1, cp: int = 1, host_pages: int = 128,
                 storage: dict | None = None, decode_offload: bool = True, daemon_settings: dict | None = None,
                 backend: dict | None = None, **options: Any) -> PdDeployment:
    """A PdDeployment whose prefill server runs cpcache's backend (CPCACHE_FLAGS:
    host tier and storage prefetch) over `cpcache launch` daemons of its TP and
    attention CP, with `storage` (daemon settings; default: file storage under
    work/pages), as stacks.Stack's; with `decode_offload`, the decode server
    offloads the pages it generates into the same store. `daemon_settings`,
    `backend`: more daemon and backend settings; `options`: PdDeployment's."""
    daemons = Daemons(work / "run", tp=tp, cp=cp, settings=dict(
        **(storage or dict(storage="file", storage_root=str(work / "pages"))), host_pool_pages=host_pages,
        prefetch_threshold_tokens=0, prefetch_policy="wait_complete") | (daemon_settings or {}))
    config = work / "sglang-cpcache.json"
    # One backend file for both servers: the decode server's store is the
    # domain's (daemon_config), under the prefill's model id.
    config.write_text(json.dumps({"socket": str(work / "run" / "rank-{rank}.sock"), "model_id": "tiny",
                                  "reattach_after_iterations": 32, "record_decisions": True,
                                  "daemon_config": str(daemons.config), **(backend or {})}))
    options["prefill_flags"] = [*CPCACHE_FLAGS, *options.get("prefill_flags", [])]
    options["prefill_env"] = {"CPCACHE_SGLANG_CONFIG": str(config), **options.get("prefill_env", {})}
    if decode_offload:
        options["decode_flags"] = [*DECODE_OFFLOAD_FLAGS, *options.get("decode_flags", [])]
        options["decode_env"] = {"CPCACHE_SGLANG_CONFIG": str(config), **HICACHE_ENV, **options.get("decode_env", {})}
    return PdDeployment(work, model, prefill_tp=tp, prefill_cp=cp, daemons=daemons, **options)
