"""Building the `cpcache` radix cache from SGLang's build context: check the
server's flags, share the device pool, attach it to the rank's daemon
(agreed by every rank, topology checked by the daemon), and hand the tree a
scheduler-side session."""

from __future__ import annotations

import logging
from typing import Any

from cpcache.client import Client, DecisionLog, SchedulerSession
from cpcache.client.daemon_process import HeldDaemon
from cpcache.client.pools import take_host_pool
from cpcache.errors import CacheError
from cpcache.geometry import KVGeometry
from cpcache.integrations.sglang import server_flags
from cpcache.integrations.sglang.flush_records import Publisher
from cpcache.integrations.sglang.layer_loads import STOP_WAIT_S, LayerLoads
from cpcache.integrations.sglang.orphan_loads import OrphanLoads
from cpcache.integrations.sglang.pool import SharedPool, check_in_place, layer_buffers, share_device_pool
from cpcache.integrations.sglang.settings import Settings
from cpcache.keys import tenant_of
from cpcache.load_signals import SLOTS, LoadSignals
from cpcache.topology import Topology

log = logging.getLogger(__name__)
SERVING = 1  # grpc.health.v1's HealthCheckResponse.SERVING
CUDA_SLOTS = 16  # on CUDA hosts each slot is an IPC event per layer: fewer of them


def _world_rank(tp_rank: int) -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return tp_rank


def default_model_id(server_args: Any) -> str:
    """SGLang's served model name and weight version: pages computed by other
    weights are another tenant's."""
    name = getattr(server_args, "served_model_name", None) or server_args.model_path
    version = getattr(server_args, "weight_version", None) or "default"
    return f"{name}@{version}"


def model_dtype_of(context: Any) -> str:
    """The dtype the model computes in: SGLang's --dtype as its model config
    resolved it ("auto" becomes the checkpoint's), with the weights'
    quantization after a "+" when they have one ("bfloat16+fp8"). Two
    servers of one model id and KV dtype compute other KV in other dtypes:
    the daemon makes it part of the tenant (SGLang's own storage keys hold
    neither it nor the KV dtype)."""
    config = getattr(context, "model_config", None)
    dtype = getattr(config, "dtype", None) or getattr(context.server_args, "dtype", "") or ""
    name = str(dtype).removeprefix("torch.")
    quantization = getattr(config, "quantization", None) or getattr(context.server_args, "quantization", None)
    return f"{name}+{quantization}" if quantization else name


def scheduler_topology(server_args: Any, tp_size: int) -> Topology:
    """The deployment as SGLang lays it out: CP and attention DP split the TP
    ranks of a pipeline stage, exactly as the daemons' topology does. The
    attention DP width is the scheduler's runtime one: under attention DP a
    scheduler's own server arguments carry a width of 1 (its DP group's)."""
    attn_dp = _runtime_attention_dp()
    if attn_dp is None:  # outside SGLang's scheduler: its arguments
        attn_dp = getattr(server_args, "attn_dp_size", None) or 1
        if attn_dp == 1 and getattr(server_args, "enable_dp_attention", False):  # the deprecated spelling
            attn_dp = getattr(server_args, "dp_size", 1) or 1
    return Topology(tp=tp_size, cp=getattr(server_args, "attn_cp_size", 1) or 1, dp=attn_dp,
                    pp=getattr(server_args, "pp_size", 1) or 1)


def _runtime_attention_dp() -> int | None:
    """SGLang's published attention DP width in this scheduler, if any."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_dp_size)
    except Exception:  # noqa: BLE001 - not published (or another SGLang): the server arguments say
        return None


def tree_components() -> tuple[Any, ...]:
    """What SGLang's own builder gives a full-attention model's tree."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return (ComponentType.FULL,)


def _model_runner_pool(context: Any, kv_pool: Any) -> Any:
    """The KV pool the model runner's forward (and its CUDA graphs) reads."""
    runner = getattr(getattr(context, "tp_worker", None), "model_runner", None)
    return getattr(runner, "token_to_kv_pool", None) or kv_pool


def _held(pool: SharedPool, runner_pool: Any) -> list[tuple[int, ...]]:
    return [tuple(b.data_ptr() for b in layer) for layer in layer_buffers(runner_pool, pool.geometry)]


def log_in_place(rank: int, before: list[tuple[int, ...]], after: list[tuple[int, ...]]) -> None:
    """Where each layer's KV lies, before the attach and after it (the same
    addresses: nothing was moved); a test of the server reads it."""
    def hexes(addresses: list[tuple[int, ...]]) -> str:
        return ",".join("/".join(f"{a:x}" for a in layer) for layer in addresses)

    log.info("cpcache: rank %d KV in place: before attach %s; after attach %s", rank, hexes(before), hexes(after))


def build_cache(context: Any, settings: Settings | None = None) -> Any:
    from cpcache.integrations.sglang.radix_cache import CpcacheRadixCache, NotServingYet

    server_flags.check(context)
    settings = settings or Settings.load()
    params = context.params
    params.tree_components = tree_components()
    rank = _world_rank(context.tp_rank)
    topology = scheduler_topology(context.server_args, context.tp_size)
    socket = settings.socket_for(rank, context.tp_rank)
    model_id = settings.model_id or default_model_id(context.server_args)
    model = (model_id, model_dtype_of(context))
    kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
    pool = share_device_pool(kv_pool, params.page_size)
    runner_pool = _model_runner_pool(context, kv_pool)
    check_in_place(pool, runner_pool)  # what the daemon will write is what the forward reads
    before = pool.addresses()
    layer_loads = _layer_loads(context, pool, runner_pool, kv_pool, settings)
    client = Client(socket, token=settings.token(), timeout_s=settings.timeout_s,
                    peers=peer_sockets(settings, topology, rank), rank=rank, outcome_wait_s=settings.outcome_wait_s)
    try:
        # A daemon busy at the server's start (a loaded host) is waited for, not a failed start.
        client.wait_serving(settings.start_timeout_s)
        status = client.status()
        try:
            client.check_deadline(status.agreement_timeout_s)
        except CacheError as exc:
            raise server_flags.UnsupportedServer(f"cpcache: the backend's timeout_s does not fit the daemon at "
                                                 f"{socket}: {exc}") from None
        lag = status.agreement_lag
        if lag != 0:
            raise server_flags.UnsupportedServer(
                f"cpcache: the daemon at {socket} runs with agreement_lag {lag}; the SGLang backend needs 0 (its "
                "host matches follow the host pool step by step); start the daemons with --lag 0")
        attached = _attach(client, model, pool, (topology, rank), layer_loads)
        first_step = attached.last_step + 1
        first_epoch = attached.epoch
    except BaseException:
        client.close()
        raise
    check_in_place(pool, runner_pool)
    log.info("cpcache: rank %d attached %r (model dtype %s, KV %s) to %s (%d device pages in %d per-layer regions, "
             "%d host pages, storage %s)", rank, model_id, model[1], pool.geometry.dtype, socket, pool.device_pages,
             len(pool.regions), attached.host_pages, attached.storage)
    log_in_place(rank, before, _held(pool, runner_pool))

    decisions = DecisionLog() if settings.record_decisions else None  # one log across attaches

    def connect(step: int, epoch: int) -> SchedulerSession:
        return SchedulerSession(client, first_step=step, decision_timeout_s=settings.timeout_s, decisions=decisions,
                                epoch=epoch)

    held = [hold_daemon(client, attached)]  # this rank's daemon process (its pidfd), as last attached
    daemon = [orphan_loads(socket, attached, pool, held[0])]  # and its host pool
    if layer_loads is not None:
        layer_loads.orphans = daemon[0]

    peers = peer_sockets(settings, topology, rank)

    def attach_again() -> SchedulerSession:
        # An Attach needs every rank of the domain: while a daemon is not
        # serving (restarting, its domain re-forming) the try would fail
        # after holding the scheduler for up to agreement_timeout_s. Skipping
        # it fails it at once (no rank can attach without this one).
        not_serving = first_not_serving([socket, *peers], settings.token())
        if not_serving:
            raise NotServingYet(f"the daemon at {not_serving} is not serving yet")
        check_in_place(pool, runner_pool)
        # A fresh board: copies of the ended session may still publish into
        # the old one. Both the board and the daemon's process (its pidfd)
        # are swapped only once the attach succeeded: until then the old ones
        # are what a flush needs to make sure the old daemon writes no more.
        board = LoadSignals.create(layer_loads.signals.slots) if layer_loads is not None else None
        again = _attach(client, model, pool, (topology, rank), layer_loads, board)
        # Agreed: every rank's daemon began the new session. But a daemon
        # that died before answering leaves its rank counting the try failed
        # while its peers were told it succeeded, and a rank left unattached
        # beside attached peers admits other requests than they do. So the
        # session's first step, an empty one, is taken now: its round
        # completes only with every rank's daemon and scheduler in it, and
        # a reply lost after the round is asked of the peers (docs/design.md
        # rule 12). Its outcome, the try's, is every rank's.
        session = connect(int(again.last_step) + 1, again.epoch)
        session.flush()
        if decisions is not None:
            decisions.begin_session()  # after the step that decided the try: on every rank alike
        # Nothing from here may fail on this rank alone (the host pool's
        # handover, the one call left to the daemon, only warns). A daemon
        # lost from here fails the session's next step, on every rank alike.
        old_held, held[0] = held[0], hold_daemon(client, again)
        old, daemon[0] = daemon[0], orphan_loads(socket, again, pool, held[0])
        if layer_loads is not None and board is not None:
            layer_loads.rebind(board, daemon[0])  # closes the old one
        elif old is not None:
            old.close()
        if old_held is not None:
            old_held.close()
        return session

    def daemon_quiet(epoch: int | None) -> bool:
        """Whether the daemon of the session of `epoch` writes nothing more
        into the device pool: it is in a later epoch (it left the earlier
        one only once that session's copies ended), or its process has
        exited, if need be killed here (a daemon that does not answer, or
        still in that epoch)."""
        try:
            status = client.status()
            if epoch is not None and status.epoch > epoch:
                return True  # it left that epoch, which it does only once its copies ended
        except CacheError:
            pass
        process = held[0]
        if process is None:
            return False
        if not process.process.gone():
            log.error("cpcache: killing this rank's daemon: it did not answer while its writes into the device "
                      "pool had to be known ended (its service manager restarts it)")
        return process.process.stop(STOP_WAIT_S)

    return CpcacheRadixCache(params, daemon_session=connect(first_step, first_epoch), pool=pool,
                             attach_again=attach_again,
                             reattach_after=settings.reattach_after_iterations,
                             storage_prefetch=server_flags.storage_prefetch_enabled(context.server_args), rank=rank,
                             host_pages=attached.host_pages, decisions=decisions, layer_loads=layer_loads,
                             daemon_quiet=daemon_quiet, storage=attached.storage,
                             flushes=flush_publisher(context.server_args, settings, rank, attached.storage, model,
                                                     pool.geometry))


def flush_publisher(server_args: Any, settings: Settings, rank: int, storage: str, model: tuple[str, str],
                    geometry: KVGeometry) -> Publisher | None:
    """A prefill server's rank 0 publishes its flush generation where the
    decode servers' offload reads it (flush_records.py), in the store the
    backend's `daemon_config` names; generation 0 at once."""
    if rank != 0 or storage == "none" or getattr(server_args, "disaggregation_mode", "null") != "prefill":
        return None
    if not settings.daemon_config:
        log.warning("cpcache: no daemon_config in the backend's settings: a decode server's offload cannot follow "
                    "this prefill server's flushes (its pages are misses after the first)")
        return None
    from cpcache.integrations.sglang.store_pages import client_config, open_flush_records

    tenant = tenant_of(model[0], geometry.fingerprint(), model[1])
    publisher = Publisher(lambda: open_flush_records(client_config(settings.daemon_config, settings.store_hostname),
                                                     geometry, tenant))
    publisher.publish(0)
    return publisher


def peer_sockets(settings: Settings, topology: Topology, rank: int) -> list[str]:
    """The sockets of the other daemons of this rank's domain, where its
    client asks how a step ended when its own daemon died before answering
    (none when the socket setting names no rank: every rank would be one)."""
    if "{rank}" not in settings.socket and "{tp_rank}" not in settings.socket:
        return []
    peers = [r for r in topology.domain(rank).ranks if r != rank]
    return [settings.socket_for(peer, peer % topology.tp) for peer in peers]


def first_not_serving(sockets: list[str], token: str | None, timeout_s: float = 1.0) -> str:
    """The first of these daemons that does not report SERVING now ("": none)."""
    for address in sockets:
        with Client(address, token=token, timeout_s=timeout_s) as daemon:
            try:
                if daemon.health() == SERVING:
                    continue
            except CacheError:
                pass
        return address
    return ""


def hold_daemon(client: Client, attached: Any) -> HeldDaemon | None:
    """The process of the daemon that answered `attached`, by the pidfd it
    hands over (None: it cannot be had, or restarted since, and a daemon
    that stops answering cannot be made sure of)."""
    try:
        return client.identify(attached.daemon_instance)
    except CacheError as exc:
        log.warning("cpcache: the daemon's identity could not be taken (%s): a flush with a daemon that does not "
                    "answer keeps its slots, and a load it dies in the middle of stops the forward", exc)
        return None


def orphan_loads(socket: str, attached: Any, pool: SharedPool, held: HeldDaemon | None) -> OrphanLoads | None:
    """The daemon's host pool, read-only, to finish loads it dies in the
    middle of (None: it offers none, as on CUDA hosts, or it cannot be had)."""
    if not attached.host_pool_ticket or held is None:
        return None
    try:
        fd, _ = take_host_pool(socket, attached.host_pool_ticket)
        return OrphanLoads(fd, held.process, pool.geometry, attached.host_pages, attached.host_layout, pool.buffers)
    except (CacheError, OSError, ValueError) as exc:  # ValueError: mmap of a pool that is not the size it says
        log.warning("cpcache: the daemon's host pool could not be taken (%s): a load its daemon dies in the "
                    "middle of will stop the forward", exc)
        return None


def _attach(client: Client, model: tuple[str, str], pool: SharedPool, placement: tuple[Topology, int],
            layer_loads: LayerLoads | None, board: LoadSignals | None = None) -> Any:
    """`model`: its id and the dtype it computes in (the tenant, with the
    geometry); `board`: the load-signal board to hand over (default:
    `layer_loads`')."""
    signals = board or (layer_loads.signals if layer_loads is not None else None)
    model_id, model_dtype = model
    try:
        return client.attach(model_id, pool.geometry, pool.device_pages, pool_fd=pool.fd, placement=placement,
                             regions=pool.regions, load_signals=signals,
                             cuda_events=layer_loads.event_handles() if layer_loads is not None else (),
                             model_dtype=model_dtype)
    finally:
        if signals is not None:
            signals.close_fd()  # the daemon holds its own descriptor now; the mapping stays


def _layer_loads(context: Any, pool: SharedPool, runner_pool: Any, kv_pool: Any, settings: Settings
                 ) -> LayerLoads | None:
    """The overlapped load-back's counter, registered where SGLang's forward
    and its scheduler look for a layer-transfer counter (None: blocking)."""
    if settings.load_back != "overlapped":
        return None
    cuda = pool.cuda_device
    layer_loads = LayerLoads(pool.geometry.layers, settings.timeout_s, cuda_device=cuda,
                             slots=CUDA_SLOTS if cuda is not None else SLOTS)
    for kv in {id(runner_pool): runner_pool, id(kv_pool): kv_pool}.values():
        kv.register_layer_transfer_counter(layer_loads)
    worker = getattr(context, "tp_worker", None)
    if worker is not None:
        worker.register_hicache_layer_transfer_counter(layer_loads)
    return layer_loads

