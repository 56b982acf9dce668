"""Replicas sharing one store: SGLang servers over their own `cpcache launch`
daemons and ONE Mooncake Store (one real mooncake_master on loopback).

Server A (`--tp 2 --attn-cp-size 2` over `cpcache launch --tp 2 --cp 2`)
computes documents; server B (`--tp 1` over its own daemon), which never saw
them, gets them as storage hits, its replies equal to a tp 1 server's
without cache: attention TP is 1 in both, so a page's KV, and its key, are
the same. What must stay apart does, on the same store: a request in a
cache-salt namespace gets no hit from un-namespaced pages; a server attached
under another model id gets no hit; one whose KV is another dtype gets none;
and one whose KV dtype is the same but whose model computes in another dtype
(whose KV is other bytes: SGLang's own keys hold neither dtype) gets none.
The other model id answers as a server without cache does; the other dtypes
read no page of the store at all (their daemons' counters), so nothing of
it reaches their KV.

Runs alone with `pytest -m sglang tests/sglang/test_replicas_one_store.py`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.keys import chain
from cpcache.testing.mooncake_master import MooncakeMaster
from cpcache.testing.sglang_cpu.servers import (
    SGLANG_PYTHON,
    Reply,
    Server,
    same_outputs,
)
from cpcache.testing.sglang_cpu.stacks import PAGE, SYSTEM, Shape, Stack, prompt, workload
from tests.sglang.stacks import References

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

DOCS = 3
# The KV in bfloat16 beside a float32 model: SGLang's CPU path takes it.
KV_BF16 = ["--kv-cache-dtype", "bfloat16"]
# The model itself in bfloat16 (its KV then too): the same KV geometry as
# KV_BF16's, other bytes. (CPU_FLAGS say float32; the last --dtype wins.)
MODEL_BF16 = ["--dtype", "bfloat16"]


def generate(server: Server, ids: list[int], **namespace: str) -> Reply:
    """`Server.generate`, with SGLang's namespace fields (`cache_salt`,
    `extra_key`) in the request."""
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            **namespace}
    meta = (out := server.post("/generate", body))["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return Reply(tuple(out.get("output_ids") or ()), tuple(x[0] for x in meta.get("output_token_logprobs") or ()),
                 meta.get("cached_tokens", 0), details.get("device", 0), details.get("host", 0),
                 details.get("storage", 0), (meta.get("finish_reason") or {}).get("type", ""))


@dataclass
class Store:
    """One Mooncake Store, the documents server A put in it, and what a tp 1
    server without cache answers for each."""

    work: Path
    model: Path
    storage: dict
    prompts: list[list[int]]
    expected: list[Reply]
    stacks: contextlib.ExitStack
    replicas: dict[str, Stack] = field(default_factory=dict)
    healthy_s: dict[str, float] = field(default_factory=dict)

    def replica(self, name: str, tp: int = 1, cp: int = 1, flags: list[str] | None = None,
                model_id: str = "tiny") -> Stack:
        """A cpcache server over daemons of its own, on the shared store.
        Its daemons stay up until the module ends (each holds a segment of the
        store, with the pages placed there); stop its server when done."""
        return self.replicas_at_once((name, tp, cp, flags or [], model_id))[0]

    def replicas_at_once(self, *specs: tuple[str, int, int, list[str], str]) -> list[Stack]:
        """`replica` for each (name, tp, cp, flags, model id), all started
        side by side: a replica reads the store only when asked."""
        began, started = time.monotonic(), []
        for name, tp, cp, flags, model_id in specs:
            (self.work / name).mkdir()
            stack = Stack(self.work / name, self.model, Shape("qwen3", tp=tp, cp=cp, storage="mooncake"),
                          self.storage, copy_delay_ms=0.0, storage_delay_ms=0.0, backend={"model_id": model_id},
                          with_reference=False, sleep_on_idle=True)  # one waiting to be asked spins no core
            stack.cpcache.name = name
            stack.cpcache.flags = [*stack.cpcache.flags, *flags]
            self.stacks.callback(stack.stop)
            started.append(stack.launch())
            self.replicas[name] = stack
        for (name, *_), stack in zip(specs, started):
            stack.wait_ready()
            self.healthy_s[name] = time.monotonic() - began
        return started

    def stored(self, name: str) -> list[int]:
        """Per prompt, how many of its pages the store holds under the keys
        of replica `name` (its rank 0's view)."""
        with Client(self.replicas[name].daemons.socket(0), timeout_s=10) as daemon:
            return [daemon.match([bytes.fromhex(h) for h in chain(ids, PAGE, None)]).storage_pages
                    for ids in self.prompts]

    def wait_stored(self, name: str, timeout_s: float = 120.0) -> list[int]:
        """Until every full page of every prompt that replica `name` served is
        in the store (its backups are decided in its rounds): asked of its
        daemon again and again, each answer a real lookup."""
        want = [len(chain(ids, PAGE, None)) for ids in self.prompts]
        deadline = time.monotonic() + timeout_s
        while (got := self.stored(name)) != want:
            assert time.monotonic() < deadline, f"{name}'s pages did not all reach the store: {got} of {want}"
        return got


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, references: References) -> Iterator[Store]:
    work = tmp_path_factory.mktemp("replicas")
    model = references.model("qwen3")  # the session's, and its tp 1 reference
    system, docs = workload(seed=11, docs=DOCS)
    prompts = [prompt(system, doc, 0, d) for d, doc in enumerate(docs)]
    with contextlib.ExitStack() as stacks:
        master = stacks.enter_context(MooncakeMaster(work / "mooncake-master.log"))
        storage = dict(storage="mooncake", storage_master=master.master,
                       storage_metadata_server=master.metadata_server, storage_segment_bytes=64 << 20)
        plain = stacks.enter_context(references.use(Shape("qwen3", tp=1)))
        shared = Store(work, model, storage, prompts, [], stacks)
        a = shared.replica("a", tp=2, cp=2)  # starts while the reference does, if it was not up
        reference = plain.server.wait_ready()
        shared.expected = [reference.generate(ids) for ids in prompts]
        for ids, want in zip(prompts, shared.expected):
            got = a.cpcache.generate(ids)
            assert same_outputs(got, want), f"A answered {got}, a server without cache {want}"
        print(f"A (tp 2, attention CP 2): stored pages per document {shared.wait_stored('a')}")
        a.cpcache.stop()  # its daemons stay: their segments hold pages of the store
        yield shared
        print(f"times to healthy (s): { {k: round(v, 1) for k, v in shared.healthy_s.items()} }")


def test_a_replica_gets_storage_hits_for_documents_another_replica_computed(store: Store):
    b = store.replica("b", tp=1)
    print(f"B (tp 1) healthy in {store.healthy_s['b']:.1f} s; the store holds {store.stored('b')} pages per "
          "document under its keys")
    # A namespace first (a cache salt; then an extra key): SGLang chains its
    # pages from another seed, so A's un-namespaced pages are not its own.
    # The first request of a namespace hits nothing; the next ones only the
    # system prompt the namespace's own first request computed.
    for d, (ids, want) in enumerate(zip(store.prompts, store.expected)):
        for namespace in ({"cache_salt": "tenant-a"}, {"extra_key": "adapter-7"}):
            got = generate(b.cpcache, ids, **namespace)
            assert got.storage == 0 and got.cached <= (SYSTEM if d else 0), \
                f"a {namespace} request hit un-namespaced pages: {got}"
            assert same_outputs(got, want), f"B answered {got} in {namespace}, a server without cache {want}"
    replies = [b.cpcache.generate(ids) for ids in store.prompts]
    for got, want in zip(replies, store.expected):
        assert same_outputs(got, want), f"B answered {got}, a server without cache {want}"
    storage = [r.storage for r in replies]
    print(f"B: storage/host/device tokens per document {[(r.storage, r.host, r.device) for r in replies]}")
    assert all(s > 0 for s in storage), f"B found a document A computed not in storage: {replies}"
    # The documents' own pages (past the shared system prompt) all came from storage.
    assert sum(storage) >= DOCS * (len(store.prompts[0]) - 64) // PAGE * PAGE, replies
    # A salted request again: B's own salted pages now (its device tree), still correct.
    again = generate(b.cpcache, store.prompts[0], cache_salt="tenant-a")
    assert again.cached > 0 and same_outputs(again, store.expected[0]), again
    b.cpcache.stop()


def test_a_server_attached_under_another_model_id_gets_no_storage_hit(store: Store):
    assert all(store.stored("a")), "A's pages are not in the store any more"
    other = store.replica("other-model", tp=1, model_id="another-model")
    replies = [other.cpcache.generate(ids) for ids in store.prompts]
    print(f"another model id: storage/host/device tokens {[(r.storage, r.host, r.device) for r in replies]}")
    assert all(r.storage == 0 and r.host == 0 for r in replies), replies
    for got, want in zip(replies, store.expected):
        assert same_outputs(got, want), f"answered {got}, a server without cache {want}"
    # Its own pages went to the store beside A's, under its own keys.
    print(f"another model id: stored pages per document {store.wait_stored('other-model')}; A's {store.stored('a')}")
    other.cpcache.stop()


def misses_everything(store: Store, name: str, dtypes: str) -> None:
    """Replica `name` (attached with `dtypes`, its log says) over the
    store: no storage or host hit, and its daemon read no page from the
    store (so every reply is the server's own computation: nothing cached
    under other dtypes reached its KV)."""
    replica = store.replicas[name]
    attached = replica.cpcache.log_lines("cpcache: rank 0 attached")
    assert attached and dtypes in attached[0], attached
    replies = [replica.cpcache.generate(ids) for ids in store.prompts]
    print(f"{name}: storage/host/device tokens {[(r.storage, r.host, r.device) for r in replies]}")
    assert all(r.storage == 0 and r.host == 0 for r in replies), replies
    with Client(replica.daemons.socket(0), timeout_s=10) as daemon:
        stats = dict(daemon.stats())
    read = {k: stats[k] for k in ("pages_moved_storage_to_host", "pages_moved_host_to_device", "storage_hit_pages",
                                  "host_hit_pages")}
    assert not any(read.values()), f"{name}'s daemon read pages of the store: {read}"
    print(f"{name}: stored pages per document {store.wait_stored(name)}")
    replica.cpcache.stop()


def test_another_kv_dtype_then_another_model_dtype_get_no_storage_hit(store: Store):
    """KV in bfloat16 from a float32 model, over the store holding A's
    float32 KV: misses. Then a bfloat16 model (its KV bfloat16 too: the
    same KV geometry as the first's, so only the model dtype in the tenant
    keeps them apart) over the store holding both: misses."""
    # Both start at once; the second is asked only once the first's pages are stored.
    store.replicas_at_once(("kv-bf16", 1, 1, KV_BF16, "tiny"), ("model-bf16", 1, 1, MODEL_BF16, "tiny"))
    assert all(store.stored("a")), "A's pages are not in the store any more"
    misses_everything(store, "kv-bf16", "model dtype float32, KV bfloat16")
    assert all(store.stored("kv-bf16")), "the bfloat16 KV of the float32 model is not in the store any more"
    misses_everything(store, "model-bf16", "model dtype bfloat16, KV bfloat16")
