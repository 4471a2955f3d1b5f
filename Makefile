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

# The drafter offline benchmark (demo policy: warm start, simulated acceptance, head cost)
.PHONY: bench-drafter
bench-drafter: $(STAMP)
	$(BIN)/python -m drafter.bench --offline
