"""Seconds from a test stack's start to its server serving (`cpcache
launch` daemons and an SGLang server at tp 2, attention CP 2, prefill CP,
a tiny Qwen3 on files; no reference server), several times: what each of
the suite's stacks pays before its first request. The environment is the
servers' (`TORCHDYNAMO_DISABLE=0` turns torch.compile back on,
`SGLANG_DISABLED_MODEL_ARCHS=none` has every model module imported):

    PYTHONPATH=$PWD .venv/bin/python scripts/time_stack_start.py [--times 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cpcache.testing.sglang_cpu.servers import make_tiny_model
from cpcache.testing.sglang_cpu.stacks import Shape, started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cpc-stack-start-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", "qwen3")
        for n in range(args.times):
            (work / str(n)).mkdir()
            began = time.monotonic()
            with started(work / str(n), model, Shape("qwen3", tp=2, cp=2, zigzag=True), with_reference=False):
                print(f"stack {n}: serving in {time.monotonic() - began:.1f} s", flush=True)


if __name__ == "__main__":
    main()
