#!/usr/bin/env bash
# The GPU tests and the device <-> host benchmark, on one GPU, in under
# 5 minutes. Run inside the compose driver, or on any CUDA host:
#   bash services/gpu-driver/run.sh [OUT_DIR]
# The whole GPU stack (master, one daemon per GPU, this driver), from the repo root:
#   docker compose --profile gpu up --build --abort-on-container-exit --exit-code-from driver
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-gpu-results}}"
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
timeout 240 $py -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$out/gpu-tests.xml" | tee "$out/gpu-tests.txt"
timeout 120 $py -m cpcache.tools.cli bench movers --json --no-mooncake > "$out/bench-movers.json"
echo "results in $out"
