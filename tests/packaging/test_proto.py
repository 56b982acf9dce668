"""The generated code in cpcache/v1 is what proto/ generates today."""

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", REPO / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path)
    assert fresh, "proto/generate.py produced nothing"
    for path in fresh:
        checked_in = REPO / "cpcache" / "v1" / path.name
        assert checked_in.exists(), f"{checked_in} is missing: run python proto/generate.py"
        assert checked_in.read_bytes() == path.read_bytes(), f"{checked_in} is stale: run python proto/generate.py"
