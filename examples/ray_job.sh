#!/usr/bin/env bash
# Run spectail's RL training as a Ray job on a running cluster.
#
# The cluster: `ray start --head` on one node (dashboard on :8265), `ray start --address=HEAD:6379`
# on the others. Then, from a checkout of this repository on any machine that reaches the head:
#
#     RAY_ADDRESS=http://HEAD:8265 examples/ray_job.sh [examples/<config>.yaml]
#
# What happens:
#   --working-dir .       uploads this checkout; every worker process imports spectail from it
#                         (so no install is needed on the nodes beyond the runtime env below).
#   --runtime-env-json    pip packages each worker needs on top of the nodes' Python, and
#                         environment variables for the job's processes. Nodes that already have
#                         torch (a CUDA build on GPU nodes) keep it: pip skips what is installed.
#   -- python -m ...      the job's driver. Inside it, Ray is already connected (RAY_ADDRESS is set
#                         by the job), so RayRolloutBackend uses that connection and starts its
#                         RolloutWorker actors on the cluster: num_workers of them, each asking for
#                         num_cpus_per_worker CPUs and num_gpus_per_worker GPUs (from the config).
#
# Model checkpoints: a checkpoint *folder* given as the model must exist at that path on every node
# that runs a worker (shared storage); a model built in the driver is put in Ray's object store once
# and every worker reads it from there, as are the weights after each optimizer step.
#
# Follow the logs with `ray job logs --follow <id>`; stop with `ray job stop <id>`.
set -euo pipefail

CONFIG="${1:-examples/grpo_ray.yaml}"   # the training config (python -m rl_integration train reads it)
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the cluster, e.g. http://HEAD:8265}"

# (JSON in single quotes: no shell expansion inside)
RUNTIME_ENV='{
  "pip": ["transformers>=4.45", "safetensors", "pyarrow", "pyyaml", "tqdm"],
  "env_vars": {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"},
  "excludes": [".venv", ".git", "bench_results", "runs"]
}'

exec ray job submit \
  --address "$RAY_ADDRESS" \
  --working-dir . \
  --runtime-env-json "$RUNTIME_ENV" \
  -- python -m rl_integration train --config "$CONFIG"
