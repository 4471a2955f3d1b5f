#!/usr/bin/env bash
# The vLLM backend on one GPU: the demo's per-step table with vLLM's suffix speculation on and off
# at T = 1 (the CPU-only refusal does not apply on a GPU), then greedy suffix-vs-plain rounds,
# results in bench_results/. Meant to finish in under 10 minutes once the environment exists.
#
#   tools/gpu-vllm-demo.sh [key=value ...]        (run-config overrides, e.g. rollout.engine.dtype=bfloat16)
#
# Needs nvidia-smi listing a GPU, and an interpreter with vLLM (CUDA) and this repository
# importable: VLLM_PYTHON, else .venv-vllm/bin/python, which `make venv-vllm` creates on a GPU
# machine (it installs vllm==0.32.0 with the CUDA torch it pins: a download of several GB, not
# counted in the 10 minutes, and it needs PyPI).
# Both engines of a comparison share the GPU, so each takes 40% of its memory.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L 2>/dev/null | grep -q GPU || { echo "gpu-vllm-demo: no GPU (nvidia-smi lists none)" >&2; exit 1; }
py=${VLLM_PYTHON:-.venv-vllm/bin/python}
if [ ! -x "$py" ]; then
    make venv-vllm
fi
"$py" -c 'import torch, vllm; assert torch.cuda.is_available(), "torch sees no GPU"' \
    || { echo "gpu-vllm-demo: $py has no CUDA vLLM (rm -rf .venv-vllm; make venv-vllm on this machine)" >&2; exit 1; }
mkdir -p bench_results
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
out=bench_results/vllm_demo_gpu_${gpu}.json
nvidia-smi -L | tee "${out%.json}.log"
PYTHONUNBUFFERED=1 timeout 570 "$py" -m benchmarks.bench_vllm_demo --steps 5 --greedy-rounds 3 --out "$out" \
    rollout.engine.device=cuda trainer.device=cuda rollout.vllm.gpu_memory_utilization=0.4 "$@" \
    2>&1 | tee -a "${out%.json}.log"
