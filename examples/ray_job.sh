#!/usr/bin/env bash
# Run spectail's RL training as a Ray job on a running cluster.
#
# The cluster: `ray start --head` on one node (dashboard on :8265), `ray start --address=HEAD:6379`
# on the others. Then, from a checkout of this repository on any machine that reaches the head:
#
#     RAY_ADDRESS=http://HEAD:8265 examples/ray_job.sh [examples/<config>.yaml] [key=value ...]
#
# Token authentication (Ray >= 2.52; on by default since Ray 2.59 for a cluster whose head finds
# a token when it starts). Every client must send the cluster's token, and Ray's clients only do
# so with RAY_AUTH_MODE=token in their environment; the token comes from RAY_AUTH_TOKEN, else the
# file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token (Ray's docs, "Token authentication in
# Ray": doc/source/ray-security/token-auth.md, "What token does Ray use?" and "Submit a Ray job";
# `ray start` itself turns token mode on when it finds a token: ray/_private/authentication/
# authentication_token_setup.py, maybe_enable_token_auth_if_token_available). So this script:
#   - leaves an RAY_AUTH_MODE you set alone (RAY_AUTH_MODE=disabled for a cluster without auth);
#   - otherwise sets RAY_AUTH_MODE=token when it finds a token the way Ray looks for one.
# On the head node the token is already at ~/.ray/auth_token. From another machine, give it the
# head's token first:   export RAY_AUTH_TOKEN="$(ssh HEAD ray get-auth-token)"
#
# What happens:
#   --working-dir .       uploads this checkout; every worker process imports spectail from it
#                         (so no install is needed on the nodes beyond the runtime env below).
#   --runtime-env-json    pip packages each worker needs on top of the nodes' Python, and
#                         environment variables for the job's processes. Nodes that already have
#                         torch (a CUDA build on GPU nodes) keep it: pip skips what is installed.
#                         SPECTAIL_JOB_PIP (a JSON list) replaces the package list; '[]' installs
#                         nothing (nodes whose Python already has spectail's requirements).
#   -- python -m ...      the job's driver. Inside it, Ray is already connected (RAY_ADDRESS is set
#                         by the job), so RayRolloutBackend uses that connection and starts its
#                         RolloutWorker actors on the cluster: num_workers of them, each asking for
#                         num_cpus_per_worker CPUs and num_gpus_per_worker GPUs (from the config).
#   key=value ...         dotted config overrides, passed to `train` (output.dir: a relative path
#                         is inside the job's copy of the working dir; give an absolute one).
#
# Model checkpoints: a checkpoint *folder* given as the model must exist at that path on every node
# that runs a worker (shared storage); a model built in the driver is put in Ray's object store once
# and every worker reads it from there, as are the weights after each optimizer step.
#
# Follow the logs with `ray job logs --follow <id>`; stop with `ray job stop <id>`.
set -euo pipefail

CONFIG="${1:-examples/grpo_ray.yaml}"   # the training config (python -m rl_integration train reads it)
shift $(( $# > 0 ? 1 : 0 ))
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the cluster, e.g. http://HEAD:8265}"

if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
  if [[ -n "${RAY_AUTH_TOKEN:-}" || -n "${RAY_AUTH_TOKEN_PATH:-}" || -s "${HOME}/.ray/auth_token" ]]; then
    export RAY_AUTH_MODE=token
  else
    echo "ray_job.sh: no Ray auth token found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); submitting" \
         "without one. If the cluster asks for one: export RAY_AUTH_TOKEN=\"\$(ssh HEAD ray get-auth-token)\"" >&2
  fi
fi

PIP="${SPECTAIL_JOB_PIP:-[\"transformers>=4.45\", \"safetensors\", \"pyarrow\", \"pyyaml\", \"tqdm\"]}"
PIP_ENTRY="\"pip\": ${PIP},"
[[ "${PIP// /}" == "[]" ]] && PIP_ENTRY=""
RUNTIME_ENV="{
  ${PIP_ENTRY}
  \"env_vars\": {\"PYTHONUNBUFFERED\": \"1\", \"TOKENIZERS_PARALLELISM\": \"false\"},
  \"excludes\": [\".venv\", \".venv-*\", \".git\", \"bench_results\", \"runs\"]
}"

exec ray job submit \
  --address "$RAY_ADDRESS" \
  --working-dir . \
  --runtime-env-json "$RUNTIME_ENV" \
  -- python -m rl_integration train --config "$CONFIG" "$@"
