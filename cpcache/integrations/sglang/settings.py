"""The backend's settings: a JSON file named by ``CPCACHE_SGLANG_CONFIG``.

    {"socket": "/run/cpcache/rank-{rank}.sock", "model_id": "llama-3-8b",
     "token_file": "", "timeout_s": 30, "record_decisions": false,
     "reattach_after_iterations": 64, "load_back": "overlapped", "start_timeout_s": 120,
     "daemon_config": "", "store_hostname": ""}

`timeout_s` bounds each call to the daemon; it must exceed the daemons'
`agreement_timeout_s` by more than 5 s (refused at start otherwise): a
round waits that long for peers, and a step given up on sooner may be one
the other ranks apply.

`socket` may name `{rank}` (the process's rank in torch.distributed's world,
which is what `cpcache launch` and the systemd units number daemons by) and
`{tp_rank}`. `model_id` defaults to SGLang's served model name: pages are
stored under it, and schedulers attached as another model never see them.
`daemon_config` (relative to this file) and `store_hostname` are for a
decode server with no daemon beneath it, whose KV offload writes the
domain's store (`storage.CpcacheStore`), and for a prefill server's rank 0,
which publishes its flush generation there (`flush_records.py`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from cpcache.deprecations import retired_keys

ENV = "CPCACHE_SGLANG_CONFIG"
LOAD_BACKS = ("overlapped", "blocking")
# Settings that no longer mean anything, accepted with a warning (a file
# written for an older release still starts its server): key -> why.
RETIRED = {"shm_dir": "the pools are handed over by descriptor (sealed memfds), never opened by path"}


@dataclass(frozen=True)
class Settings:
    socket: str = "/run/cpcache/rank-{rank}.sock"
    model_id: str = ""
    token_file: str = ""
    timeout_s: float = 30.0
    # Keep every agreed decision for a report (tests compare ranks by it);
    # grows with the server's life, so off in production.
    record_decisions: bool = False
    # Scheduler iterations after a fallback before the first attach again;
    # each later try waits twice as long (counted in iterations, which every
    # rank runs alike, so every rank tries at the same one).
    reattach_after_iterations: int = 64
    # "overlapped": a host hit's load returns once its round opened it, and
    # each layer of the forward waits for that layer's copy; "blocking": the
    # scheduler waits for the whole load to be decided before the forward.
    load_back: str = "overlapped"
    # How long the server's start waits for its daemon to serve (a daemon
    # still starting, or busy on a loaded host, is waited for).
    start_timeout_s: float = 120.0
    # How long a step whose daemon gave no answer waits for a daemon that
    # may still tell how it ended (a peer's, stopped or flooded): keep it
    # within SGLang's --watchdog-timeout (300 s by default).
    outcome_wait_s: float = 120.0
    # The domain's settings file (the TOML `cpcache launch --config` and the
    # daemons read): where a server without daemons beneath it (a decode
    # server's KV offload, `storage.CpcacheStore`) finds the store it shares.
    daemon_config: str = ""
    # The address this process's Mooncake client gives the store (empty: the
    # domain file's storage_local_hostname), for a decode server on a host
    # other than the daemons'.
    store_hostname: str = ""

    def __post_init__(self) -> None:
        if not self.outcome_wait_s > 0:
            raise ValueError(f"cpcache: outcome_wait_s must be above 0, not {self.outcome_wait_s!r}")
        if self.load_back not in LOAD_BACKS:
            raise ValueError(f"cpcache: load_back must be one of {', '.join(LOAD_BACKS)}, not {self.load_back!r}")

    @staticmethod
    def load(path: str | None = None) -> Settings:
        path = path if path is not None else os.environ.get(ENV, "")
        if not path:
            return Settings()
        with open(path) as fh:
            raw = retired_keys(path, json.load(fh), RETIRED)
        known = {f.name for f in fields(Settings)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"cpcache: {path}: unknown settings {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        if raw.get("daemon_config"):  # relative to the file that names it, not to the server's directory
            raw["daemon_config"] = os.path.join(os.path.dirname(os.path.abspath(path)), raw["daemon_config"])
        return Settings(**raw)

    def socket_for(self, rank: int, tp_rank: int) -> str:
        return self.socket.format(rank=rank, tp_rank=tp_rank)

    def token(self) -> str | None:
        if not self.token_file:
            return None
        with open(self.token_file) as fh:
            return fh.read().strip() or None
