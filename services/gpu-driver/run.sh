#!/usr/bin/env bash
# The GPU check, for a GPU host as it is lent: about 8 minutes, no network,
# the repo (plus carried wheels) only. From anywhere:
#   bash services/gpu-driver/run.sh OUT_DIR      (or OUT=OUT_DIR bash ...)
# Writes OUT_DIR/gpu-summary.json; exit 0 when every check passed, 3 without
# a CUDA device, 4 when a package is missing or too old (services/gpu-driver/README.md).
# PYTHON picks the interpreter (default: .venv/bin/python if there, else the
# first of python3 and python that has torch, else python3).
# The whole GPU stack (master, one daemon per GPU, this driver), from the repo root:
#   docker compose --profile gpu up --build --abort-on-container-exit --exit-code-from driver
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then
    py=.venv/bin/python
  else
    # A host's python3 may be a bare system one beside the interpreter that
    # has torch: take the one with torch (preflight reports the rest).
    py=python3
    for candidate in python3 python; do
      if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
        py=$candidate
        break
      fi
    done
  fi
fi
command -v "$py" >/dev/null || { echo "FAIL (exit 4): no Python interpreter '$py'" >&2; exit 4; }
exec "$py" services/gpu-driver/driver.py "$@"
