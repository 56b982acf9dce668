"""`CpcacheStore`, the decode server's storage backend, as SGLang's storage
factory builds it (in SGLang's environment, with SGLang's storage config):
refused on a server that is not a decode server, without interface_v1, and
under attention CP, and a second part of each page (DSA's indexer keys)
refused; over a file store it writes pages the store then holds, and
SGLang's own loader given the class's old name (`DaemonStorage`) builds
it, with a DeprecationWarning;
over a store that cannot be reached it opens nothing and every call is a
miss, the server unharmed; over a Mooncake Store whose master is stopped
each call comes back by its deadline (a backup thread goes on). The pages' bytes and keys are checked in
tests/unit/integrations/test_store_pages.py; through a real decode server
in test_pd.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON
from tests.sglang.stacks import run_sglang_worker

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]
WORKER = Path(__file__).resolve().parent / "decode_store_worker.py"
STALL_WORKER = WORKER.with_name("decode_store_stall_worker.py")


def run_worker(tmp_path: Path, daemon_toml: str) -> dict:
    (tmp_path / "daemons.toml").write_text(daemon_toml)
    (tmp_path / "sglang-cpcache.json").write_text(json.dumps({"model_id": "tiny", "daemon_config": "daemons.toml"}))
    return run_sglang_worker(WORKER, {"CPCACHE_SGLANG_CONFIG": str(tmp_path / "sglang-cpcache.json")})


def test_the_decode_stores_refusals_its_writes_and_an_unreachable_store(tmp_path: Path):
    out = run_worker(tmp_path, f'storage = "file"\nstorage_root = "{tmp_path / "pages"}"\n')
    assert "--radix-cache-backend cpcache" in out["aggregated"]
    assert "interface_v1" in out["no_interface_v1"]
    assert "--attn-cp-size" in out["attention_cp"]
    assert "indexer beside each page's KV" in out["indexer_part"]
    assert out["store"] == {"written": [True, True], "found": 2, "open": True}
    # The class's old name in the extra config, through SGLang's own loader: the same store, with a warning.
    assert out["old_name"]["class"] == "CpcacheStore" and out["old_name"]["found"] == 2
    (warning,) = out["old_name"]["warnings"]
    assert "storage.DaemonStorage is deprecated; it is now cpcache.integrations.sglang.storage.CpcacheStore" in warning
    assert '"class_name": "CpcacheStore"' in warning
    # daemon_config is read relative to the backend's JSON file: the pages are under tmp_path.
    assert len([p for p in (tmp_path / "pages").rglob("*") if p.is_file()]) == 2


def test_a_store_that_cannot_be_reached_costs_the_offload_not_the_server(tmp_path: Path):
    out = run_worker(tmp_path, 'storage = "mooncake"\nstorage_master = "127.0.0.1:1"\n')
    assert out["store"] == {"written": [False, False], "found": 0, "open": False}


def test_a_stopped_store_costs_the_backup_thread_one_deadline_not_a_stall():
    """The master stopped (SIGSTOP) under an open store: the first write is
    given up at storage_timeout_s, the calls behind it fail at once, and the
    backup thread goes on; once the master runs again, writes land."""
    out = run_sglang_worker(STALL_WORKER, {})
    assert out["before"] == [True, True]
    stopped = out["stopped"]
    assert stopped == {"finished": True, "first write": [False, False], "second write": [False, False],
                       "lookup": 0}, stopped
    assert out["counts while stopped"] == {"timed_out": 1, "skipped": 2}
    assert out["answered again"] is True
    assert out["after"] == [True, True] and out["found after"] == 2
