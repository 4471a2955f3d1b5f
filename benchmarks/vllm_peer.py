"""The vLLM side of the engine benchmark (benchmarks/bench_vllm.py): one vLLM engine kept alive in
its own process and environment (.venv-vllm), driven over a pipe.

Started by the benchmark as
    .venv-vllm/bin/python -c "import torch, runpy; runpy.run_module('benchmarks.vllm_peer', ...)" OPTIONS_JSON
(torch first, so importing spectail leaves OpenMP's wait policy to vLLM, as a vLLM user has it).
OPTIONS_JSON: {"folder", "dtype", "threads", "speculation", "max_batch", "max_model_len", "compile"}.
Then one JSON object per line on stdin, one answer per line on the original stdout (vLLM's own
logging goes to stdout, so it is moved to stderr first):
    {"cmd": "generate", "prompts": [[ids]], "max_tokens": [n], "seeds": [s], "temperature": T}
        -> {"seconds", "lengths", "proposed", "accepted"}
    ... "as_a_user": true: the same through vLLM's own LLM.generate without per-request seeds
    {"cmd": "exit"}
The first answer, after a warm-up generate, is {"ready": true, "startup_seconds", "warmup_seconds"}
or {"error": "..."}.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _channel():
    """A private copy of stdout for answers; fd 1 then points at stderr for everything else."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return answers


def _generate(backend, msg: dict) -> dict:
    from rollout import SamplingParams

    params = [SamplingParams(temperature=float(msg.get("temperature", 1.0)), max_tokens=int(n))
              for n in msg["max_tokens"]]
    outs = backend.generate(msg["prompts"], params, seeds=msg["seeds"])
    proposed = sum(sum(o.stats["proposed"].values()) for o in outs)
    accepted = sum(sum(o.stats["accepted"].values()) for o in outs)
    return {"seconds": backend.metrics()["rollout_seconds"], "lengths": [len(o.token_ids) for o in outs],
            "proposed": proposed, "accepted": accepted}


def _generate_as_a_user(backend, msg: dict) -> dict:
    """The same requests straight through vLLM's LLM.generate, as an RL user runs it: no
    per-request seed (vLLM's sampler then draws from its one generator), the sampled tokens'
    logprobs returned (a trainer needs them), forced lengths."""
    import vllm
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in msg["prompts"]]
    params = [vllm.SamplingParams(temperature=float(msg.get("temperature", 1.0)), max_tokens=int(n), ignore_eos=True,
                                  logprobs=0, detokenize=False) for n in msg["max_tokens"]]
    start = time.perf_counter()
    outs = backend.llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "lengths": [len(o.outputs[0].token_ids) for o in outs], "proposed": 0, "accepted": 0}


def serve(opts: dict, commands, answers) -> int:
    from rollout import EngineConfig
    from rollout.vllm_backend import VllmBackend
    from rollout.vllm_backend.config import VllmConfig

    def answer(obj):
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    try:
        cfg = EngineConfig(max_batch_size=opts["max_batch"], max_model_len=opts["max_model_len"],
                           dtype=opts["dtype"], num_threads=opts["threads"])
        backend = VllmBackend(opts["folder"], cfg, VllmConfig(speculation=opts.get("speculation"),
                                                            compile=opts.get("compile", True)))
    except Exception as e:
        traceback.print_exc()
        answer({"error": f"{type(e).__name__}: {e}"})
        return 1
    start = time.perf_counter()
    _generate(backend, {"prompts": [[5, 6, 7]] * 2, "max_tokens": [4, 4], "seeds": [0, 1]})  # warm-up, as spectail's
    answer({"ready": True, "startup_seconds": backend.startup_seconds, "warmup_seconds": time.perf_counter() - start})
    try:
        for line in commands:
            msg = json.loads(line)
            if msg.get("cmd") == "exit":
                break
            try:
                answer((_generate_as_a_user if msg.get("as_a_user") else _generate)(backend, msg))
            except Exception as e:
                traceback.print_exc()
                answer({"error": f"{type(e).__name__}: {e}"})
    finally:
        backend.shutdown()
    return 0


def main() -> int:
    answers = _channel()
    return serve(json.loads(sys.argv[1]), sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(main())
