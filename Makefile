# The two commands: `make demo` and `make test`. Both set up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch this project's machines carry; a plain `torch`
# would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
SYSTEM_PACKAGES := libibverbs1

.PHONY: setup demo test bench proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	@if command -v nvidia-smi >/dev/null 2>&1; then extra=mooncake; else extra=mooncake-cpu; fi; \
	  echo "$(PY) -m pip install -q -e '.[dev,$$extra]'"; $(PY) -m pip install -q -e ".[dev,$$extra]"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/cpcache demo --trace ../shared/traces/conversation_trace.jsonl --plot demo.png

test: setup
	$(PY) -m ruff check cpcache tests
	$(PY) -m mypy
	$(PY) -m pytest

bench: setup
	$(VENV)/bin/cpcache bench agreement --json

proto: setup
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
