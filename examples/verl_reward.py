"""A scorer in verl's convention for the embedded addition task (examples/grpo_verl.yaml):
`spectail train` calls it as verl's reward manager does,
compute_score(data_source=, solution_str=, ground_truth=, extra_info=), and takes the "score" of
the dict it returns (verl logs the other keys). The same file works as verl's
reward.custom_reward_function.path."""
from __future__ import annotations

from rl_integration.demo.task import extract_answer, reward_fn


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    if data_source != "spectail/addition":
        raise ValueError(f"this scorer knows the data source 'spectail/addition', not {data_source!r}")
    return {"score": reward_fn(solution_str, ground_truth),
            "answered": float(extract_answer(solution_str) is not None)}
