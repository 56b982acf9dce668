"""Run in SGLang's environment by test_decode_store.py: `CpcacheStore` over a
real Mooncake Store (a master on loopback, a segment held by a process of
its own, as a prefill daemon holds one) whose master is then stopped
(SIGSTOP). A backup thread's writes and lookups must come back, as misses,
while the master stays stopped; once it runs again, writes land again.
Prints one JSON line of outcomes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from sglang.srt import runtime_context

from cpcache.integrations.sglang import storage
from cpcache.testing.mooncake_master import MooncakeMaster
from tests.sglang.decode_store_worker import config, host_pool

HOLD_SEGMENT = """
import sys
from cpcache.dataplane.storage import open_backend
store = open_backend("mooncake", master=sys.argv[1], metadata_server=sys.argv[2], buffers=[],
                     global_segment_size=64 << 20, local_buffer_size=16 << 20)
print("ready", flush=True)
sys.stdin.readline()
store.close()
"""


def keys(tag: str) -> list[str]:
    return [tag * 64, (tag + "f") * 32]


def backup_thread(store: storage.CpcacheStore) -> dict[str, object]:
    """Two writes and a lookup from a thread of their own, as SGLang's backup
    thread makes them: -> their answers, and whether the thread finished."""
    answers: dict[str, object] = {}

    def run() -> None:
        answers["first write"] = store.batch_set_v1(keys("b"), torch.arange(8, 16))
        answers["second write"] = store.batch_set_v1(keys("c"), torch.arange(16, 24))
        answers["lookup"] = store.batch_exists(keys("a"))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)  # the test's own bound: a stalled thread fails it, never hangs it
    return {"finished": not thread.is_alive(), **answers}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="cpc-stall-") as tmp, MooncakeMaster(Path(tmp) / "master.log") as master:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_SEGMENT, master.master, master.metadata_server],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert holder.stdout.readline().strip() == "ready"
            Path(tmp, "daemons.toml").write_text(
                f'storage = "mooncake"\nstorage_master = "{master.master}"\n'
                f'storage_metadata_server = "{master.metadata_server}"\nstorage_timeout_s = 2.0\n')
            Path(tmp, "backend.json").write_text(json.dumps({"model_id": "tiny", "daemon_config": "daemons.toml"}))
            os.environ["CPCACHE_SGLANG_CONFIG"] = str(Path(tmp, "backend.json"))
            runtime_context.get_server_args = lambda: SimpleNamespace(disaggregation_mode="decode")
            storage._served_model = lambda: ("tiny", "float32")
            store = storage.CpcacheStore(config())
            store.register_mem_pool_host(host_pool())
            out: dict[str, object] = {"before": store.batch_set_v1(keys("a"), torch.arange(0, 8))}
            assert master.proc is not None
            os.kill(master.proc.pid, signal.SIGSTOP)
            try:
                out["stopped"] = backup_thread(store)
                out["counts while stopped"] = {"timed_out": store.calls.timed_out, "skipped": store.calls.skipped}
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            out["answered again"] = store.calls.wait_answered(120)
            out["after"] = store.batch_set_v1(keys("d"), torch.arange(24, 32))
            out["found after"] = store.batch_exists(keys("d"))
            store.close()
        finally:
            holder.stdin.close()
            holder.wait(60)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
