"""Tenants through a real daemon: pages stored by a model attached with one
model dtype are not found when the same model id attaches with another (the
same KV geometry, so only the model dtype tells them apart), nor by a client
that sends none; attached again with the first dtype, they are found again,
under the storage key `tenant_of` names."""

import pytest

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.keys import chain, tenant_of
from cpcache.topology import Topology

pytestmark = pytest.mark.timeout(90)

GEOMETRY = KVGeometry(layers=1, kv_kind="mla", heads=1, head_dim=32, dtype="bfloat16", page_size=16)
DEVICE_PAGES = 16


def attach(client: Client, model_dtype: str = "", model_id: str = "m") -> str:
    """A fresh device pool (as a restarted scheduler's), attached: -> the key seed."""
    pool = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
    return client.attach(model_id, GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, model_dtype=model_dtype).key_seed


async def test_another_model_dtype_of_the_same_model_id_and_kv_geometry_is_another_tenant(run_dir):
    root = run_dir / "pages"
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(storage="file", storage_root=str(root), host_pool_pages=8,
                                                          prefetch_threshold_tokens=0))
    async with LocalDomain(spec) as domain:
        with Client(domain.sockets[0], timeout_s=30) as client:
            seed = attach(client, "float32")
            pages = [bytes.fromhex(h) for h in chain(list(range(64)), 16, seed)]
            session = SchedulerSession(client)
            acked: list[bool] = []
            session.write_through(pages[:3], [0, 1, 2], done=acked.append)
            for _ in range(500):  # until the write is agreed and backed up to storage
                session.flush()
                if acked and client.match(pages).storage_pages == 3:
                    break
            assert acked == [True] and client.match(pages).storage_pages == 3
            tenant = tenant_of("m", GEOMETRY.fingerprint(), "float32")
            stored = sorted(p.name for p in root.rglob("*.*"))
            assert len(stored) == 3 and all(name.startswith(f"{tenant}.") for name in stored), stored

            # The same model id and KV geometry, computed in another dtype: nothing.
            assert attach(client, "bfloat16") == seed  # the same chains: only the tenant keeps them apart
            assert (client.match(pages).host_pages, client.match(pages).storage_pages) == (0, 0)
            # A client that sends no model dtype is a tenant of its own too.
            attach(client, "")
            assert client.match(pages).storage_pages == 0
            # Another model id with the first dtype: nothing either.
            attach(client, "float32", model_id="m2")
            assert client.match(pages).storage_pages == 0
            # The first again: its pages are there.
            attach(client, "float32")
            assert client.match(pages).storage_pages == 3
