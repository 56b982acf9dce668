#!/usr/bin/env bash
# Fills services/gpu-driver/wheels/ (ignored by git) with wheels.txt's
# wheels for a lent GPU host, on a host that reaches a package index; then
# carry that folder with the repo (about 10 MiB, of the 64 MiB allowed).
#   bash services/gpu-driver/fetch-wheels.sh      (GPU_PYTHON=3.12 by default)
set -euo pipefail
cd "$(dirname "$0")"
py="${PYTHON:-python3}"
mkdir -p wheels
"$py" -m pip download --quiet --dest wheels --no-deps --only-binary=:all: \
  --implementation cp --python-version "${GPU_PYTHON:-3.12}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -r wheels.txt
du -sh wheels
