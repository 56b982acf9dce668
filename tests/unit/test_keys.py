"""Page keys: SGLang's get_hash_str bytes, namespaces, tenants, sharding
suffixes and writer election."""

import hashlib
import struct
from dataclasses import replace

import pytest

from cpcache.errors import InvalidArgument
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec, chain, namespace_seed, page_hash, tenant_of


def reference_chain(tokens, page_size, prior_hex):
    """Written from the definition: sha256(prior bytes || uint32 LE tokens)."""
    out = []
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        h = hashlib.sha256()
        if prior_hex:
            h.update(bytes.fromhex(prior_hex))
        h.update(struct.pack(f"<{page_size}I", *tokens[i : i + page_size]))
        prior_hex = h.hexdigest()
        out.append(prior_hex)
    return out


def test_first_page_without_prior_matches_a_fixed_vector():
    # sha256 of the little-endian bytes 01 00 00 00 02 00 00 00 03 00 00 00 04 00 00 00
    expected = hashlib.sha256(bytes.fromhex("01000000020000000300000004000000")).hexdigest()
    assert page_hash([1, 2, 3, 4], None) == expected


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_chains_match_the_reference(page_size):
    tokens = [(i * 7919) % 151936 for i in range(300)]
    seed = namespace_seed("llama-3-8b", "bfloat16", "page_first", page_size)
    assert chain(tokens, page_size, seed) == reference_chain(tokens, page_size, seed)
    assert len(chain(tokens, page_size, seed)) == 300 // page_size


def test_namespaces_keep_models_apart():
    tokens = list(range(64))
    a = chain(tokens, 64, namespace_seed("model-a", "bfloat16", "page_first", 64))
    b = chain(tokens, 64, namespace_seed("model-b", "bfloat16", "page_first", 64))
    c = chain(tokens, 64, namespace_seed("model-a", "float8_e4m3fn", "page_first", 64))
    assert len({a[0], b[0], c[0]}) == 3


def test_suffixes_follow_the_sharding_spec():
    page = "ab" * 32
    assert ShardingSpec(cp="cp_replicated", tp_sharded_heads=True, cp_rank=1, cp_size=2, tp_rank=3, tp_size=4
                        ).storage_key(page) == page + "_tp3_4"
    assert ShardingSpec(cp="cp_sharded", tp_sharded_heads=True, cp_rank=1, cp_size=2, tp_rank=3, tp_size=4
                        ).storage_key(page) == page + "_cp1_2_tp3_4"
    assert ShardingSpec(cp="cp_replicated", tp_sharded_heads=False, cp_rank=1, cp_size=2).storage_key(page) == page
    with pytest.raises(InvalidArgument):
        ShardingSpec(cp="replicated")


def test_one_writer_per_replicated_page_and_balanced():
    pages = chain(list(range(64 * 400)), 64, namespace_seed("m", "bfloat16", "page_first", 64))
    specs = [ShardingSpec(cp="cp_replicated", cp_rank=r, cp_size=4) for r in range(4)]
    writers = [[s.writes(p) for s in specs] for p in pages]
    assert all(sum(w) == 1 for w in writers)
    per_rank = [sum(w[r] for w in writers) for r in range(4)]
    assert min(per_rank) > 0.15 * len(pages)
    sharded = [ShardingSpec(cp="cp_sharded", cp_rank=r, cp_size=4) for r in range(4)]
    assert all(s.writes(pages[0]) for s in sharded)


def test_a_flush_generation_names_pages_that_no_other_generation_names():
    from cpcache.keys import chain, flush_record, generation_pages

    pages = chain(list(range(64)), 16, None)
    assert generation_pages(pages, 0) == pages
    generations = [generation_pages(pages, g) for g in range(4)]
    assert len({page for named in generations for page in named}) == 4 * len(pages)
    assert generation_pages(pages[2:], 3) == generations[3][2:]  # each page on its own: a suffix names alike
    assert len({flush_record(n) for n in range(5)} | set(pages)) == 5 + len(pages)


def test_a_backups_share_is_the_pages_this_rank_writes_under_their_keys():
    pages = [bytes.fromhex(page_hash([i], None)) for i in range(40)]
    slots = list(range(100, 140))
    for spec in (ShardingSpec(), ShardingSpec(cp_rank=1, cp_size=2, tp_rank=1, tp_size=2, tenant="t"),
                 ShardingSpec(cp="cp_replicated", tp_sharded_heads=False, cp_rank=1, cp_size=2, tp_rank=0, tp_size=2)):
        keys, mine = spec.share(pages, slots)
        expected = [(spec.storage_key(p.hex()), s) for p, s in zip(pages, slots) if spec.writes(p.hex())]
        assert list(zip(keys, mine)) == expected
        assert spec.storage_keys(pages) == tuple(spec.storage_key(p.hex()) for p in pages)


GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=16, dtype="float32", page_size=16)


def test_a_tenant_without_a_model_dtype_is_the_one_older_clients_had():
    # An Attach without model_dtype (a client from before the field) keys its
    # pages as it always did: what it stored stays reachable.
    old = hashlib.sha256(f"cpcache-tenant:m:{GEOMETRY.fingerprint()}".encode()).hexdigest()[:16]
    assert tenant_of("m", GEOMETRY.fingerprint()) == tenant_of("m", GEOMETRY.fingerprint(), "") == old


@pytest.mark.parametrize("other", [
    dict(model_id="m2"),
    dict(model_dtype="bfloat16"),  # the same KV dtype, computed by a model in another dtype
    dict(model_dtype="float32+fp8"),  # weights quantized on the fly
    dict(model_dtype=""),  # a client that does not say
    dict(geometry=replace(GEOMETRY, dtype="bfloat16")),  # the KV dtype (SGLang's own keys omit it)
    dict(geometry=replace(GEOMETRY, page_size=32)),
    dict(geometry=replace(GEOMETRY, heads=1)),  # another attention TP: heads per rank
    dict(geometry=replace(GEOMETRY, layers=3)),
    dict(geometry=replace(GEOMETRY, head_dim=32)),
    dict(geometry=KVGeometry(layers=2, kv_kind="mla", heads=1, head_dim=16, dtype="float32", page_size=16)),
])
def test_whatever_makes_pages_incompatible_makes_another_tenant(other):
    base = dict(model_id="m", model_dtype="float32", geometry=GEOMETRY)

    def key(model_id, model_dtype, geometry):
        tenant = tenant_of(model_id, geometry.fingerprint(), model_dtype)
        return ShardingSpec(tp_rank=0, tp_size=1, tenant=tenant).storage_key("ab" * 32)

    assert key(**base) == key(**dict(base))
    assert key(**base) != key(**{**base, **other})


def test_the_host_layout_is_not_in_a_storage_key_and_sharding_is():
    # Stored pages are in one order whatever the host layout (HostPool), so a
    # key holds none; attention TP and CP sharding are in its suffix.
    tenant = tenant_of("m", GEOMETRY.fingerprint(), "float32")
    page = "cd" * 32
    # Attention TP 1 under CP 2 (a replicated page) and a plain TP 1 rank: one key.
    cp_rank = ShardingSpec(cp="cp_replicated", cp_rank=1, cp_size=2, tp_rank=0, tp_size=1, tenant=tenant)
    tp1 = ShardingSpec(tenant=tenant)
    assert cp_rank.storage_key(page) == tp1.storage_key(page) == f"{tenant}.{page}_tp0_1"
    assert ShardingSpec(tp_rank=0, tp_size=2, tenant=tenant).storage_key(page) != tp1.storage_key(page)
    assert ShardingSpec(cp="cp_sharded", cp_rank=0, cp_size=2, tenant=tenant).storage_key(page) != \
        tp1.storage_key(page)


def test_a_token_outside_four_unsigned_bytes_is_refused_and_arrays_hash_as_lists():
    for bad in (-1, 2**32):
        with pytest.raises(OverflowError):
            page_hash([1, bad], None)
        with pytest.raises(OverflowError):
            chain([1, 2, bad, 4], 2, None)
    tokens = [(i * 7919) % 151936 for i in range(40)]
    assert chain(tuple(tokens), 8, None) == chain(tokens, 8, None) == reference_chain(tokens, 8, None)
