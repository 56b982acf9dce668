"""A prefill server's flush generation, published in the store
(`flush_records.py`), is what a decode server's offload names its pages by:
after the prefill's flushes, the pages the offload writes are the pages the
prefill's tree names, in a real file store and a real Mooncake Store (a
master on loopback); a restarted prefill server starts the records over."""

from __future__ import annotations

import pytest
import torch

from cpcache.config import DaemonConfig
from cpcache.dataplane.storage import open_backend
from cpcache.geometry import KVGeometry
from cpcache.host_layout import host_shape
from cpcache.integrations.sglang.flush_records import Publisher
from cpcache.integrations.sglang.page_names import PageNames
from cpcache.integrations.sglang.store_pages import StorePages, open_flush_records
from cpcache.keys import ShardingSpec, chain, tenant_of

pytestmark = pytest.mark.timeout(120)

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=4, dtype="float32", page_size=4)
TENANT = tenant_of("m", GEOMETRY.fingerprint(), "float32")
SHARDING = ShardingSpec(tenant=TENANT)  # the decode server's: tp 1, as the prefill's attention TP


class Key:
    """The part of SGLang's RadixKey the tree names pages from."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def raw_token_ids(self) -> list[int]:
        return self.tokens

    def __len__(self) -> int:
        return len(self.tokens)


@pytest.fixture(params=["file", "mooncake"])
def store_config(request, tmp_path) -> DaemonConfig:
    """The domain's store as a process without a daemon reaches it (no
    segment of its own); for Mooncake, a client holding a segment stands in
    for the daemons."""
    if request.param == "file":
        return DaemonConfig.from_settings({"rank": 0, "storage": "file", "storage_root": str(tmp_path / "pages")})
    master = request.getfixturevalue("mooncake_master")
    holder = open_backend("mooncake", master=master.master, metadata_server=master.metadata_server, buffers=[],
                          global_segment_size=32 << 20, local_buffer_size=4 << 20)
    request.addfinalizer(holder.close)
    return DaemonConfig.from_settings({"rank": 0, "storage": "mooncake", "storage_master": master.master,
                                       "storage_metadata_server": master.metadata_server,
                                       "storage_segment_bytes": 0})


def publisher(config: DaemonConfig) -> Publisher:
    return Publisher(lambda: open_flush_records(config, GEOMETRY, TENANT))


def decode_store(config: DaemonConfig) -> StorePages:
    host = torch.randn(host_shape(GEOMETRY, 8, "page_first"))
    return StorePages.open(config, GEOMETRY, SHARDING, host, "page_first")


def stored(store: StorePages, names: list[bytes]) -> int:
    """How many of the prefill tree's page names, from the first, the store holds (its daemons' lookup)."""
    return store.backend.exists_prefix(list(SHARDING.storage_keys(names)))


def test_the_offload_after_prefill_flushes_writes_the_pages_the_prefill_names(store_config):
    prefill = publisher(store_config)
    names = PageNames(prefill)  # the prefill tree's, on its rank 0
    decode = decode_store(store_config)
    try:
        tokens = list(range(3 * GEOMETRY.page_size))
        sglang = chain(tokens, GEOMETRY.page_size, None)  # what SGLang hands the decode server's offload
        prefill.publish(0)  # at start
        assert prefill.wait_published(1, 60)
        assert decode.put(sglang[:1], [0]) == [True]
        assert stored(decode, names.of(Key(tokens), GEOMETRY.page_size)) == 1
        names.flushed()
        names.flushed()  # two flushes: generation 2, its record published off the caller's thread
        assert prefill.wait_published(3, 60) and prefill.published == [0, 1, 2]
        assert stored(decode, names.of(Key(tokens), GEOMETRY.page_size)) == 0  # the first page is an older name
        assert decode.put(sglang, [0, 1, 2]) == [True, True, True]
        assert decode.records.generation == 2
        assert stored(decode, names.of(Key(tokens), GEOMETRY.page_size)) == 3
        assert decode.exists_prefix(sglang) == 3 and decode.get(sglang, [3, 4, 5]) == [True, True, True]
    finally:
        prefill.close()
        decode.close()


def test_a_restarted_prefill_starts_the_records_over(store_config):
    first = publisher(store_config)
    for generation in (0, 1, 2):
        first.publish(generation)
    assert first.wait_published(3, 60)
    first.close()
    decode = decode_store(store_config)
    try:
        assert decode.records.latest() == 2
        restarted = publisher(store_config)
        restarted.publish(0)  # its start: its tree names pages as SGLang hashes them again
        assert restarted.wait_published(1, 60)
        restarted.close()
        sglang = chain(list(range(GEOMETRY.page_size)), GEOMETRY.page_size, None)
        assert decode.put(sglang, [0]) == [True]
        assert decode.records.generation == 0
        assert decode.backend.exists_prefix([SHARDING.storage_key(sglang[0])]) == 1
    finally:
        decode.close()
