"""Building the `cpcache` radix cache from SGLang's build context: share the
device pool, attach it to the rank's daemon (agreed by every rank), and hand
the tree a connector."""

from __future__ import annotations

import logging
from typing import Any

from cpcache.client.core import Client
from cpcache.integrations.sglang.connector import Connector
from cpcache.integrations.sglang.pool import share_device_pool
from cpcache.integrations.sglang.settings import Settings

log = logging.getLogger(__name__)


def _world_rank(tp_rank: int) -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return tp_rank


def build_cache(context: Any, settings: Settings | None = None) -> Any:
    from cpcache.integrations.sglang.radix_cache import CpcacheRadixCache

    settings = settings or Settings.load()
    params = context.params
    rank = _world_rank(context.tp_rank)
    socket = settings.socket_for(rank, context.tp_rank)
    model_id = settings.model_id or getattr(context.server_args, "served_model_name", None) \
        or context.server_args.model_path
    kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
    pool = share_device_pool(kv_pool, params.page_size)
    client = Client(socket, token=settings.token(), timeout_s=settings.timeout_s)
    try:
        attached = client.attach(model_id, pool.geometry, pool.device_pages, pool_fd=pool.fd,
                                 cuda_ipc=pool.cuda_ipc)
        first_step = client.status().last_step + 1
    except BaseException:
        client.close()
        pool.close()
        raise
    log.info("cpcache: rank %d attached %r to %s (%d device pages, %d host pages, storage %s)",
             rank, model_id, socket, pool.device_pages, attached.host_pages, attached.storage)
    connector = Connector(client, first_step=first_step, load_timeout_s=settings.timeout_s)
    return CpcacheRadixCache(params, connector=connector, pool=pool)
