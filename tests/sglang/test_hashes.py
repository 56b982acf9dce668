"""cpcache's page keys against SGLang's own `get_hash_str` and
`storage_namespace_seed`, computed by the installed SGLang wheel."""

import json
import subprocess
from pathlib import Path

import pytest

from cpcache.keys import chain, request_namespace_seed
from tests.sglang.test_backend import SGLANG_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is not built; `make setup` builds it"),
]


def test_page_hashes_equal_sglangs_for_page_sizes_and_namespaces():
    script = Path(__file__).resolve().parent / "vectors.py"
    out = subprocess.run([str(SGLANG_PYTHON), str(script)], check=True, capture_output=True, timeout=100)
    vectors = json.loads(out.stdout)
    assert len(vectors["cases"]) == 6
    for case in vectors["cases"]:
        seed = request_namespace_seed(case["extra_key"], case["cache_salt"])
        assert seed == case["seed"], case
        assert chain(vectors["tokens"], case["page_size"], seed) == case["hashes"], case
        assert case["hashes"], case
