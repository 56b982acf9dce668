"""Generate the Python code for proto/cpcache/v1 into cpcache/v1.

    python proto/generate.py            # write cpcache/v1/*_pb2*.py
    python proto/generate.py --out DIR  # write DIR/cpcache/v1/... (tests compare)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO = PROTO_ROOT.parent


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("cpcache/v1/*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "cpcache" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=REPO)
    for path in generate(ap.parse_args().out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
