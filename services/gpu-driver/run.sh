#!/usr/bin/env bash
# The GPU check, for a GPU host as it is lent: about 8 minutes, no network,
# the repo (plus carried wheels) only. From anywhere:
#   bash services/gpu-driver/run.sh OUT_DIR      (or OUT=OUT_DIR bash ...)
# Writes OUT_DIR/gpu-summary.json; exit 0 when every check passed, 3 without
# a CUDA device, 4 when a package is missing or too old (services/gpu-driver/README.md).
# PYTHON picks the interpreter (default: .venv/bin/python if there, else python3).
# The whole GPU stack (master, one daemon per GPU, this driver), from the repo root:
#   docker compose --profile gpu up --build --abort-on-container-exit --exit-code-from driver
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
fi
command -v "$py" >/dev/null || { echo "FAIL (exit 4): no Python interpreter '$py'" >&2; exit 4; }
exec "$py" services/gpu-driver/driver.py "$@"
