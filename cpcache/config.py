"""Typed daemon configuration.

One dataclass for production, one for fault injection (testing only, held as
`DaemonConfig.faults`), one docstring per setting (`help` metadata), checks
that name the setting. The library only takes a `DaemonConfig`; reading
flags, the environment and files happens once, at the edge
(`cpcache.daemon.settings`), by setting name (`SETTINGS`,
`DaemonConfig.from_settings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cpcache.errors import InvalidArgument
from cpcache.topology import MODES, Topology
from cpcache.values import split_host_port

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  # as cpcache.host_layout.LAYOUTS
STORAGES = ("none", "file", "mooncake")
STORAGE_PROTOCOLS = ("tcp", "rdma")
KV_CP_SHARDINGS = ("cp_replicated", "cp_sharded")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

DRAIN_MARGIN_S = 1.0  # a stop's drain outlasts a step's round in flight by this much at least
# A round that fails here waits for a peer's word that it completed it (for
# min(agreement_timeout_s, this); rank/diagnosis.py WITNESS_WAIT_S), then reads
# the peers' records once (up to this; agreement/witness.py READ_S).
WITNESS_WAIT_S = 3.0
WITNESS_READ_S = 2.0


def round_bound_s(agreement_timeout_s: float) -> float:
    """The longest a step's round may take to end, failing included."""
    return agreement_timeout_s + min(agreement_timeout_s, WITNESS_WAIT_S) + WITNESS_READ_S

T = TypeVar("T")


@dataclass(frozen=True)
class CacheConfig:
    prefetch_policy: str = "best_effort"
    # 0: every storage hit is read (docs/benchmarks.md, store-capacity-2026-12-06:
    # no threshold up to 128 tokens changes the trace's hits; 256 lost 2 % of
    # them, and every decode-offloaded answer shorter than 256 tokens).
    prefetch_threshold_tokens: int = 0
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_ki_token_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    prefetch_hold_share: float = 0.5
    prefetch_best_effort_wait_s: float = 0.05
    write_policy: str = "write_through"
    backup_window: int = 64  # backups asked about per round, from the head of the queue

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise InvalidArgument(f"setting prefetch_policy: must be one of {', '.join(PREFETCH_POLICIES)}")
        if self.write_policy not in WRITE_POLICIES:
            raise InvalidArgument(f"setting write_policy: must be one of {', '.join(WRITE_POLICIES)}")
        if self.prefetch_threshold_tokens < 0 or self.backup_window < 1:
            raise InvalidArgument("setting prefetch_threshold_tokens must be >= 0 and backup_window >= 1")
        if not self.prefetch_best_effort_wait_s >= 0.0:
            raise InvalidArgument(f"setting prefetch_best_effort_wait_s: must be >= 0 "
                                  f"(got {self.prefetch_best_effort_wait_s!r})")
        if not 0.0 <= self.prefetch_hold_share < 1.0:  # all of it held, write-throughs would find no room
            raise InvalidArgument(
                f"setting prefetch_hold_share: must be >= 0 and < 1 (got {self.prefetch_hold_share!r})")

    def prefetch_timeout_s(self, tokens: int) -> float:
        return min(
            self.prefetch_timeout_max_s,
            self.prefetch_timeout_base_s + self.prefetch_timeout_per_ki_token_s * tokens / 1024,
        )


_CACHE = CacheConfig()  # the cache settings' defaults: DaemonConfig's are these


def setting(default: T, help: str, **kwargs: object) -> T:
    return field(default=default, metadata={"help": help, **kwargs})


FAULT_PREFIX = "fault_"


@dataclass(frozen=True)
class FaultInjection:
    """For testing only: faults a daemon injects into its own rounds,
    storage calls and copies, so that tests and soaks show the ranks still
    agree under them; all off by default. Each is the setting `fault_` + its
    field name (flag `--fault-...`, `CPCACHE_FAULT_...`), the only settings
    that may differ between the ranks of one domain."""

    delay_ms: float = setting(0.0, "Fault injection: each round waits uniform(0, this) ms first.")
    storage_delay_ms: float = setting(0.0, "Fault injection: each storage batch waits uniform(0, this) ms.")
    storage_fail_rate: float = setting(0.0, "Fault injection: probability that a page's storage I/O fails.")
    storage_truncate_rate: float = setting(0.0, "Fault injection: probability that a storage batch stops early.")
    copy_delay_ms: float = setting(0.0, "Fault injection: each device <-> host copy waits uniform(0, this) ms.")
    copy_fail_rate: float = setting(0.0, "Fault injection: probability that a device <-> host copy fails.")
    copy_layer_delay_ms: float = setting(0.0, "Fault injection: each layer of a load-back waits this many ms before "
                                         "its copy (a slow copy, layer by layer).")
    load_fail_layer: int = setting(-1, "Fault injection: every load-back fails at this layer, the layers before it "
                                   "copied (-1: never).")
    exit_after_round: int = setting(0, "Fault injection: the daemon dies (exits at once, as if killed) once the "
                                    "round of this step is applied, before the step is answered (0: never).")
    exit_after_attach: int = setting(0, "Fault injection: the daemon dies (exits at once, as if killed) when the "
                                     "Attach of this number in its process is agreed, before answering it (a "
                                     "restarted daemon counts from 1 again; 0: never).")
    stall_after_attach_ms: float = setting(0.0, "Fault injection: the daemon's event loop stalls this long once "
                                           "each Attach is agreed, before answering it (a frozen daemon).")
    round_lost_after_complete: int = setting(0, "Fault injection: this rank's round of this step completes and is "
                                             "then reported as timed out (a rank at the very edge of the "
                                             "agreement timeout while its peers completed the round; 0: never).")
    seed: int = setting(0, "Seed of the fault injection.")

    def __post_init__(self) -> None:
        for name in ("storage_fail_rate", "storage_truncate_rate", "copy_fail_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidArgument(f"setting {FAULT_PREFIX}{name}: must be between 0 and 1 "
                                      f"(got {getattr(self, name)!r})")


@dataclass(frozen=True)
class DaemonConfig:
    rank: int = setting(-1, "Global rank of this daemon (required).")
    tp: int = setting(1, "Tensor-parallel size of the deployment.")
    pp: int = setting(1, "Pipeline-parallel size.")
    dp: int = setting(1, "Attention data-parallel size.")
    cp: int = setting(1, "Attention context-parallel size (splits the TP ranks).")
    mode: str = setting("domain", "How rounds reduce: 'domain' (one group) or 'grid' (attn_cp then attn_tp).",
                        choices=MODES)
    agreement_lag: int = setting(0, "Steps between a round and the reply that carries it (0: synchronous).")
    agreement_timeout_s: float = setting(10.0, "Longest a round may wait for peers before they count as lost.")
    rendezvous: str = setting("127.0.0.1:29650", "host:port of the TCPStore where the daemons meet.")
    host_store: bool = setting(False, "Serve the rendezvous store from this daemon (one daemon per deployment).")
    deployment: str = setting("cpcache", "Name that keeps this deployment's store keys apart from others'.")
    epoch: int = setting(0, "Restart generation; a restarted domain must use a new epoch.")
    rendezvous_timeout_s: float = setting(120.0, "Longest start-up may wait for every peer to join.")
    gloo_host: str = setting("127.0.0.1", "Address gloo binds and advertises to peers.")
    socket: str = setting("/run/cpcache/rank-{rank}.sock", "Unix socket path for the gRPC API ({rank} expands).")
    socket_group: str = setting("", "Group that may use the socket and its .pools socket (mode 0660); the daemon "
                                "must have it as a group (systemd: socket-group.conf) and the group must be able to "
                                "enter the socket's directory; empty: owner only (0600).")
    listen_tcp: str = setting("", "Also serve gRPC on host:port; needs mTLS (tls_client_ca) or token_file "
                              "over TLS (a token alone: loopback only).")
    token_file: str = setting("", "File holding the shared token TCP clients must send.")
    tls_cert: str = setting("", "PEM certificate chain for TCP with TLS.")
    tls_key: str = setting("", "PEM private key for TCP with TLS.")
    tls_client_ca: str = setting("", "PEM CA bundle: TCP clients must present a certificate it signed (mTLS).")
    max_concurrent_rpcs: int = setting(1024, "Calls served at once per listener, besides the control_rpcs kept for "
                                       "Health, Status and Outcome; more answer RESOURCE_EXHAUSTED.")
    control_rpcs: int = setting(64, "Calls at once per listener kept for Health (Check), Status and Outcome, which "
                                "no other call may take, so a flood of other calls never stops a peer's recovery or "
                                "a re-attach's health check (past them, these calls share max_concurrent_rpcs).")
    max_calls_per_connection: int = setting(
        100, "Calls one connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS, kept by gRPC itself); "
        "more wait in that client's own transport, taking nothing of the daemon's.")
    max_steps_streams: int = setting(32, "Steps streams open at once per listener; more answer RESOURCE_EXHAUSTED "
                                     "(cpcache's clients then step by Step).")
    steps_idle_timeout_s: float = setting(0.0, "A Steps stream that waits longer than this for its next step is "
                                          "closed (UNAVAILABLE; cpcache's clients reopen it), freeing its slot "
                                          "(0: 3 x agreement_timeout_s).")
    keepalive_time_s: float = setting(30.0, "TCP: ping a client connection idle this long (finds dead clients).")
    keepalive_timeout_s: float = setting(10.0, "TCP: close a connection whose keepalive ping is unanswered this long.")
    keepalive_min_ping_interval_s: float = setting(
        10.0, "TCP: shortest client keepalive interval allowed (faster clients get GOAWAY too_many_pings).")
    heartbeat_interval_s: float = setting(0.1, "How often this daemon publishes its heartbeat.")
    drain_timeout_s: float = setting(0.0, "Longest shutdown waits for the steps taken and the calls in flight "
                                     "(0: the least it may be, agreement_timeout_s + min(agreement_timeout_s, 3) + "
                                     "3: a step's round in flight, failing included, must end before the daemon "
                                     "stops answering).")
    host_pool_pages: int = setting(1024, "Pages in this daemon's host pool (the same on every rank).")
    host_pool_max_bytes: int = setting(64 << 30,
                                       "Largest host pool an Attach may size (pages x the client's page bytes).")
    host_layout: str = setting("page_first_direct", "Host pool layout: layer_first, page_first, page_first_direct.",
                               choices=HOST_LAYOUTS)
    io_threads: int = setting(4, "Threads per I/O lane: load-backs, write-throughs, storage calls (a load never "
                              "queues behind a write).")
    storage: str = setting("none", "Storage backend: none, file or mooncake.", choices=STORAGES)
    storage_root: str = setting("/var/lib/cpcache/pages",
                                "file: root directory (shared by the ranks that share pages).")
    storage_capacity_bytes: int = setting(0, "file: evict least recently used pages above this size (0: no limit).")
    storage_durable: bool = setting(False, "file: sync each page's data, and its directory, before a backup counts "
                                    "as stored, so stored pages survive a power cut (slower). Off, a crash may lose "
                                    "the latest pages, and never leaves a torn one that reads as a page.")
    storage_master: str = setting("127.0.0.1:50051", "mooncake: master address host:port.")
    storage_metadata_server: str = setting("http://127.0.0.1:8080/metadata", "mooncake: metadata server URL.")
    storage_protocol: str = setting("tcp", "mooncake: transfer protocol (tcp, rdma).", choices=STORAGE_PROTOCOLS)
    storage_device: str = setting("", "mooncake: RDMA device names, when the protocol is rdma.")
    storage_local_hostname: str = setting(
        "127.0.0.1", "mooncake: the address other hosts reach this daemon's segment at (its host or container name).")
    storage_segment_bytes: int = setting(256 << 20, "mooncake: memory this rank contributes to the store.")
    storage_timeout_s: float = setting(10.0, "Longest a storage call may take: a lookup is then a miss, a Match "
                                      "UNAVAILABLE; a decode server's offload write (read from the domain's "
                                      "file) a failed backup.")
    kv_cp_sharding: str = setting("cp_replicated", "How CP ranks hold a page: cp_replicated or cp_sharded.",
                                  choices=KV_CP_SHARDINGS)
    prefetch_policy: str = setting(_CACHE.prefetch_policy,
                                   "When a prefetch may end: best_effort, wait_complete, timeout.",
                                   choices=PREFETCH_POLICIES)
    prefetch_threshold_tokens: int = setting(_CACHE.prefetch_threshold_tokens,
                                             "Prefetches whose storage hit is below this are revoked (0: every "
                                             "hit is read, a decode-offloaded answer of one page too).")
    prefetch_timeout_base_s: float = setting(_CACHE.prefetch_timeout_base_s, "timeout policy: base seconds.")
    prefetch_timeout_per_ki_token_s: float = setting(_CACHE.prefetch_timeout_per_ki_token_s,
                                                     "timeout policy: seconds per 1024 tokens.")
    prefetch_timeout_max_s: float = setting(_CACHE.prefetch_timeout_max_s, "timeout policy: upper bound in seconds.")
    prefetch_best_effort_wait_s: float = setting(
        _CACHE.prefetch_best_effort_wait_s, "best_effort policy: longest a polled prefetch waits for reads under way, "
        "from their start (0: it ends when polled, its unread pages read on and thrown away).")
    prefetch_hold_share: float = setting(
        _CACHE.prefetch_hold_share, "Share of the host pool that ended prefetches may keep from eviction until "
        "their request loads them (for a scheduler that asks to hold them); 0: none.")
    write_policy: str = setting(_CACHE.write_policy,
                                "Backups to storage: write_through, write_through_selective, write_back.",
                                choices=WRITE_POLICIES)
    metrics_address: str = setting("", "Serve Prometheus metrics on host:port (port 0: any free port); empty: off.")
    log_level: str = setting("INFO", "Logging level (any case).", choices=LOG_LEVELS)
    faults: FaultInjection = field(default_factory=FaultInjection)  # for testing only: the fault_* settings

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"setting {name}: {why} (got {getattr(self, name)!r})")

        _ = self.topology  # validates the sizes, naming them
        if self.rank < 0:
            raise bad("rank", "is required and must be >= 0")
        self.topology.check_rank(self.rank)
        if self.agreement_lag < 0:
            raise bad("agreement_lag", "must be >= 0")
        for name in ("agreement_timeout_s", "rendezvous_timeout_s", "heartbeat_interval_s", "storage_timeout_s",
                     "keepalive_time_s", "keepalive_timeout_s", "keepalive_min_ping_interval_s"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")
        least = round_bound_s(self.agreement_timeout_s) + DRAIN_MARGIN_S
        if self.drain_timeout_s and not self.drain_timeout_s >= least:
            # A shorter drain stops answering while a step's round may still
            # complete with a late peer: its scheduler would be told
            # otherwise than the peer's (docs/design.md rule 12).
            raise bad("drain_timeout_s", f"must be 0 (the least) or at least {least:g} s: agreement_timeout_s "
                      f"({self.agreement_timeout_s:g}), a failed round's wait for a peer's word "
                      f"({min(self.agreement_timeout_s, WITNESS_WAIT_S):g}) and read of its record "
                      f"({WITNESS_READ_S:g}), + {DRAIN_MARGIN_S:g}: a step's round in flight when the daemon "
                      "is stopped must end before it stops answering")
        if self.heartbeat_interval_s * 3 >= self.agreement_timeout_s:
            raise bad("heartbeat_interval_s", "must be under a third of agreement_timeout_s")
        try:
            host, _ = split_host_port(self.rendezvous)
        except InvalidArgument:
            host = ""
        if not host:
            raise bad("rendezvous", "must be host:port")
        if self.listen_tcp and not (self.token_file or (self.tls_cert and self.tls_key)):
            raise bad("listen_tcp", "TCP needs token_file or both tls_cert and tls_key")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise bad("tls_cert", "tls_cert and tls_key go together")
        if not self.socket:
            raise bad("socket", "must be a path")
        for name in ("max_concurrent_rpcs", "control_rpcs", "max_calls_per_connection", "max_steps_streams"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.steps_idle_timeout_s < 0:
            raise bad("steps_idle_timeout_s", "must be >= 0 (0: 3 x agreement_timeout_s)")
        if self.host_pool_max_bytes < 1:
            raise bad("host_pool_max_bytes", "must be >= 1")
        if self.host_pool_pages < 1 or self.io_threads < 1:
            raise bad("host_pool_pages" if self.host_pool_pages < 1 else "io_threads", "must be >= 1")
        _ = self.cache_config  # validates the policies, naming them
        for f in dataclasses.fields(self):  # every setting with a fixed set of values (mode, storage, ...)
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and (value.upper() if f.name == "log_level" else value) not in choices:
                raise bad(f.name, f"must be one of {', '.join(choices)}")
        if self.write_policy == "write_back" and self.storage == "none":
            raise bad("write_policy", "write_back needs storage (pages could never be evicted); set storage")

    @property
    def topology(self) -> Topology:
        return Topology(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp)

    @property
    def cache_config(self) -> CacheConfig:
        # The cache settings a daemon takes are the CacheConfig fields of the same name.
        return CacheConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CacheConfig)
                              if f.name in PRODUCTION_SETTINGS})

    @property
    def socket_path(self) -> str:
        return self.socket.replace("{rank}", str(self.rank))

    @property
    def steps_idle_s(self) -> float:
        """How long a Steps stream may wait for its next step before the daemon closes it."""
        return self.steps_idle_timeout_s or 3 * self.agreement_timeout_s

    @property
    def drain_s(self) -> float:
        return self.drain_timeout_s or round_bound_s(self.agreement_timeout_s) + DRAIN_MARGIN_S

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> DaemonConfig:
        """The config of settings by name (as flags, the environment, TOML
        files and the launcher name them): the `fault_*` ones make `faults`."""
        faults = {name.removeprefix(FAULT_PREFIX): v for name, v in values.items() if name in FAULT_SETTINGS}
        production = {name: v for name, v in values.items() if name not in FAULT_SETTINGS}
        return cls(**production, faults=FaultInjection(**faults))

    def settings(self) -> dict[str, Any]:
        """Every setting by name: what `from_settings` takes back."""
        faults = {FAULT_PREFIX + f.name: getattr(self.faults, f.name) for f in dataclasses.fields(FaultInjection)}
        return {**{name: getattr(self, name) for name in PRODUCTION_SETTINGS}, **faults}


# Every setting by name, as flags, the environment and files spell it.
PRODUCTION_SETTINGS = {f.name: f for f in dataclasses.fields(DaemonConfig) if f.name != "faults"}
FAULT_SETTINGS = {FAULT_PREFIX + f.name: f for f in dataclasses.fields(FaultInjection)}
SETTINGS = {**PRODUCTION_SETTINGS, **FAULT_SETTINGS}
