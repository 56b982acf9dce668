# The two commands: `make demo` and `make test`. Both set up first.
# Two jobs at once: `setup` builds the two environments side by side (each
# install is mostly one pip process on one core).
MAKEFLAGS += --jobs=2
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch this project's machines carry; a plain `torch`
# would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
SYSTEM_PACKAGES := libibverbs1
# SGLang's own environment, for the tests that run its radix cache on the CPU
# (tests/sglang). SGLang 0.5.23 cannot be pip-installed without CUDA: its wheel
# goes in without dependencies, beside the light packages its cache code
# imports; a constraint keeps torch at the local CPU build.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PIN ?= sglang==0.5.23
# The server's own (sglang.launch_server: HTTP, grammar, metrics) come after
# the cache code's; then what its prefill/decode disaggregation needs
# (tests/sglang/test_pd.py): SGLang's router, and Mooncake's transfer engine,
# its CPU build where there is no GPU (as $(STAMP) picks it for .venv); and
# Shepherd Model Gateway with the servicer of SGLang's --smg-grpc-mode, for a
# fleet behind a KV-aware gateway (tests/sglang/test_routing.py, `cpcache bench routing`).
MOONCAKE_TE := $(if $(shell command -v nvidia-smi 2>/dev/null),mooncake-transfer-engine,mooncake-transfer-engine-non-cuda)
SGLANG_PACKAGES := numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
	ipython aiohttp triton apache-tvm-ffi transformers dill sentencepiece compressed-tensors gguf openai \
	partial-json-parser datasets \
	jsonschema xgrammar soundfile fastapi uvicorn uvloop setproctitle python-multipart prometheus-client \
	interegular einops xxhash sglang-router $(MOONCAKE_TE) smg==1.13.0 smg-grpc-servicer==0.14.1 smg-grpc-proto==0.4.28

.PHONY: setup setup-sglang demo test test-fast test-sglang compose-test bench proto clean

# `make demo` needs only the project's environment; `make test` builds
# SGLang's too, for the suites that run SGLang (tests/sglang).
setup: $(STAMP) $(SGLANG_STAMP)

setup-sglang: $(SGLANG_STAMP)

$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	@if command -v nvidia-smi >/dev/null 2>&1; then extra=mooncake; else extra=mooncake-cpu; fi; \
	  echo "$(PY) -m pip install -q -e '.[daemon,dev,$$extra]'"; $(PY) -m pip install -q -e ".[daemon,dev,$$extra]"
	@touch $(STAMP)

# The base cpcache package (client and integrations, no torch pin) goes into
# SGLang's environment as an operator would install it.
$(SGLANG_STAMP): pyproject.toml Makefile
	@[ -x $(SGLANG_PY) ] || $(PYTHON) -m venv $(SGLANG_VENV)
	@$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PY) -m pip install -q "$(TORCH_PIN)"
	@echo "$(TORCH_PIN)" > $(SGLANG_VENV)/constraints.txt
	@$(SGLANG_PY) -c "import sglang" 2>/dev/null || $(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG_PIN)"
	$(SGLANG_PY) -m pip install -q -c $(SGLANG_VENV)/constraints.txt $(SGLANG_PACKAGES) pytest
	$(SGLANG_PY) -m pip install -q -c $(SGLANG_VENV)/constraints.txt -e .
	@touch $(SGLANG_STAMP)

demo: $(STAMP)
	$(VENV)/bin/cpcache demo --trace traces/conversation_trace.jsonl --plot demo.png

test: setup
	$(PY) -m ruff check cpcache tests services/gpu-driver
	$(PY) -m mypy
	$(PY) -m pytest --durations=25  # the slowest, to keep the suite's time in view

# The in-process tests (tests/unit: no daemon process, no SGLang server), for
# the edit-test loop: about half a minute.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -q

# compose.yaml's cpu profile, one container per daemon (podman; installed and
# configured when run as root): docs/operations.md, Compose tests. Not part of `test`.
compose-test: $(STAMP)
	scripts/compose-test.sh

# Real SGLang servers (sglang.launch_server) over cpcache daemons; also part of `test`.
test-sglang: setup
	$(PY) -m pytest -m sglang tests/sglang

bench: $(STAMP)
	$(VENV)/bin/cpcache bench agreement --json

proto: setup
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info
