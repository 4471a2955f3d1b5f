"""The embedded task's policy: a tiny Llama (or Qwen2), warm-started by supervised training on
worked solutions, cached on disk as a normal Hugging Face checkpoint.

    model, tok, folder = load_or_train_policy(TaskConfig(), PolicyConfig())

The first call trains (about a minute on one CPU core) into a temporary folder renamed into
place, so an interrupted run leaves no half-written entry; later calls load in a second. The
entry is `policy-<hash>` of the policy config and the task's problem distribution under
`cache_dir`, else $SPECTAIL_CACHE, else ~/.cache/spectail. The training data carries slips
(`sft_slip_rate`), so at T = 1 the policy is right on part of the problems, mostly the short
ones: RL has slips to train away, the more the longer the chain.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from typing import Optional, Sequence

import torch

from scheduler.atomic_file import new_folder, remove_stale

from ..config import PolicyConfig, TaskConfig
from ..dataset import Problem
from .task import format_solution, make_problems
from .tokenizer import build_tokenizer

CACHE_FORMAT = 2  # bump when the training recipe changes in a way the configs do not show
META_FILE = "spectail_sft.json"


def make_model(policy_cfg: PolicyConfig, tokenizer):
    """A freshly initialised causal LM of the configured architecture (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if policy_cfg.arch == "llama" else (
        Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=policy_cfg.hidden_size,
        intermediate_size=policy_cfg.intermediate_size,
        num_hidden_layers=policy_cfg.num_layers,
        num_attention_heads=policy_cfg.num_heads,
        num_key_value_heads=policy_cfg.num_kv_heads,
        max_position_embeddings=policy_cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"attention_bias": policy_cfg.attention_bias} if policy_cfg.arch == "llama" else {}),
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(policy_cfg.seed)
        return model_cls(config).float()


def cache_key(task_cfg: TaskConfig, policy_cfg: PolicyConfig) -> str:
    task = {k: v for k, v in dataclasses.asdict(task_cfg).items() if k not in ("num_problems", "seed")}
    blob = json.dumps({"format": CACHE_FORMAT, "task": task, "policy": dataclasses.asdict(policy_cfg)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_root() -> str:
    return os.environ.get("SPECTAIL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spectail")


def sft_examples(task_cfg: TaskConfig, policy_cfg: PolicyConfig) -> list[Problem]:
    """The supervised training set: problems of the task's distribution (seeded by the policy
    config), their solutions carrying slips at `sft_slip_rate` per line."""
    problems = make_problems(dataclasses.replace(task_cfg, num_problems=policy_cfg.sft_pool, seed=policy_cfg.seed))
    rng = random.Random(policy_cfg.seed + 1)
    return [dataclasses.replace(p, solution=format_solution(p.prompt, policy_cfg.sft_slip_rate, rng))
            for p in problems]


def encode_example(tokenizer, problem: Problem) -> tuple[list[int], int]:
    """(ids of <s> prompt solution </s>, number of leading prompt tokens masked out of the loss)."""
    prompt_ids = tokenizer(problem.prompt)["input_ids"]  # starts with <s>
    response_ids = tokenizer(problem.solution, add_special_tokens=False)["input_ids"]
    return prompt_ids + response_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _make_batches(examples, tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Indices of examples grouped by length, each group's padded size within tokens_per_batch."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(examples[i][0])
        if cur and max(cur_max, n) * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _collate(examples, idx, pad_id: int):
    width = max(len(examples[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), width), -100, dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    for row, i in enumerate(idx):
        seq, n_prompt = examples[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, n_prompt: len(seq)] = torch.tensor(seq[n_prompt:])
        mask[row, : len(seq)] = 1
    return ids, labels, mask


def train_sft(model, tokenizer, problems: Sequence[Problem], policy_cfg: PolicyConfig,
              progress: bool = True) -> dict:
    """Supervised training on worked solutions, prompt masked out; returns what it did."""
    from tqdm.auto import tqdm

    old_threads = torch.get_num_threads()
    if policy_cfg.num_threads > 0:
        torch.set_num_threads(policy_cfg.num_threads)
    try:
        rng = random.Random(policy_cfg.seed)
        examples = [encode_example(tokenizer, p) for p in problems]
        batches = _make_batches(examples, policy_cfg.sft_tokens_per_batch, rng)
        opt = torch.optim.AdamW(model.parameters(), lr=policy_cfg.lr, weight_decay=policy_cfg.weight_decay,
                                betas=(0.9, 0.98), fused=True)  # fused: one kernel per step on CPU too
        steps, warm = policy_cfg.sft_steps, max(1, policy_cfg.warmup_steps)

        def lr_at(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            t = (step - warm) / max(1, steps - warm)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        model.train()
        start, loss_ema, tokens = time.time(), None, 0
        bar = tqdm(range(steps), desc="spectail: warm-starting policy", disable=not progress)
        for step in bar:
            ids, labels, mask = _collate(examples, batches[step % len(batches)], tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tokens += int(mask.sum())
            loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
            bar.set_postfix(loss=f"{loss_ema:.3f}")
        model.eval()
        return {"steps": steps, "final_loss": loss_ema, "train_tokens": tokens,
                "seconds": round(time.time() - start, 2), "num_batches": len(batches)}
    finally:
        torch.set_num_threads(old_threads)


def load_checkpoint(folder: str):
    """Load a cached (or any local) checkpoint: (model in eval mode, float32; tokenizer)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    # The exact class, not AutoTokenizer: transformers 5 swaps in Qwen2Tokenizer for any qwen2
    # checkpoint whatever tokenizer_config.json says, which would break this tokenizer.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    return model, tokenizer


def load_folder_or_hub(name: str):
    """(model, tokenizer, local folder) of policy.checkpoint: a local folder, else a hub id
    through transformers' from_pretrained (its own cache and HF_HUB_OFFLINE rules); the folder is
    then the id's snapshot in that cache (Ray workers and the drafter read the weights from it)."""
    if os.path.isdir(name):
        return (*load_checkpoint(name), name)
    try:
        from transformers.utils import cached_file

        model, tokenizer = load_checkpoint(name)
        folder = os.path.dirname(cached_file(name, "config.json"))
    except Exception as e:  # no network, an unknown id, a malformed id: the hub's many kinds
        said = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"policy.checkpoint {name!r} is not a local folder, and loading it as a Hugging Face hub "
                         f"id failed ({type(e).__name__}: {said}): give a local Hugging Face folder (without a "
                         "model hub, `spectail fetch smollm2` writes SmolLM2-135M-Instruct into one)") from None
    return model, tokenizer, folder


def load_or_train_policy(task_cfg: TaskConfig, policy_cfg: PolicyConfig, cache_dir: Optional[str] = None,
                         progress: bool = True):
    """(model, tokenizer, folder): the cached warm-started policy, trained first if not cached."""
    policy_cfg.validate()
    task_cfg.validate()
    root = os.fspath(cache_dir) if cache_dir is not None else default_cache_root()
    folder = os.path.join(root, f"policy-{cache_key(task_cfg, policy_cfg)}")
    remove_stale_temporaries(root)
    done = lambda f: os.path.isfile(os.path.join(f, META_FILE))  # noqa: E731 -- META_FILE is written last
    if not done(folder):
        with new_folder(folder, ".tmp-policy-", done) as tmp:
            tokenizer = build_tokenizer(tmp)
            model = make_model(policy_cfg, tokenizer)
            info = train_sft(model, tokenizer, sft_examples(task_cfg, policy_cfg), policy_cfg, progress=progress)
            model.save_pretrained(tmp)
            info.update(task=dataclasses.asdict(task_cfg), policy=dataclasses.asdict(policy_cfg))
            with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=2)
    model, tokenizer = load_checkpoint(folder)
    return model, tokenizer, folder


STALE_TMP_SECONDS = 6 * 3600.0  # far longer than any warm start: its trainer is gone


def remove_stale_temporaries(root: str, prefix: str = ".tmp-policy-") -> None:
    """Delete `<prefix>*` folders untouched for STALE_TMP_SECONDS (a killed run's leftovers)."""
    remove_stale(root, lambda name: name.startswith(prefix), STALE_TMP_SECONDS)


# ------------------------------------------------------------------------------ the drafter's warm start

DRAFTER_FORMAT = 1  # bump when the head's warm-start recipe changes
DRAFTER_PROMPTS, DRAFTER_SAMPLES, DRAFTER_STEPS, DRAFTER_PASSES = 64, 8, 800, 20.0


def drafter_folder(policy_folder: str, kind: str = "attention", window: Optional[int] = None,
                   layer: Optional[dict] = None) -> str:
    """Where the warm-started draft head of a cached policy lives: beside its weights. layer:
    HeadConfig's intermediate_size / num_heads / num_kv_heads (None or missing: the policy's)."""
    shape = kind if window is None or kind != "attention" else f"{kind}-w{window}"
    sizes = [(tag, (layer or {}).get(key)) for tag, key in (("f", "intermediate_size"), ("h", "num_heads"),
                                                           ("k", "num_kv_heads"))]
    if any(v is not None for _, v in sizes):
        shape += "-" + "".join(f"{tag}{v}" for tag, v in sizes if v is not None)
    return os.path.join(policy_folder, f"drafter-{shape}-v{DRAFTER_FORMAT}")


def load_or_warm_start_drafter(policy_folder: str, task_cfg: TaskConfig, kind: str = "attention",
                               seconds: float = 300.0, progress: bool = True, window: Optional[int] = None,
                               layer: Optional[dict] = None) -> str:
    """The folder of the policy's warm-started draft head (drafter.export format), trained on
    first use: the policy samples DRAFTER_PROMPTS problems x DRAFTER_SAMPLES at T = 1 (problems
    of the task's distribution, drawn apart from the RL prompts) and the head trains on them for
    DRAFTER_STEPS steps (at most DRAFTER_PASSES over their tokens: a small task's policy needs
    fewer) or `seconds`, whichever ends first (drafter.warm_start). Epoch 0 needs a drafter
    most: nothing to copy from yet."""
    from drafter.head import HeadConfig
    from drafter.trainer import TrainConfig
    from drafter.warm_start import load_or_warm_start
    from rollout.core.model import CausalLM

    folder = drafter_folder(policy_folder, kind, window, layer)
    policy = CausalLM.from_pretrained(policy_folder)

    def rollouts():
        if progress:
            print(f"spectail: warm-starting the draft head ({kind}) for {policy_folder}", flush=True)
        return sample_rollouts(policy, policy_folder, task_cfg)

    load_or_warm_start(folder, policy, rollouts, HeadConfig(kind=kind, window=window, **(layer or {})),
                       TrainConfig(decay="cosine"),
                       time_budget_s=seconds, max_steps=DRAFTER_STEPS, max_passes=DRAFTER_PASSES)
    return folder


def sample_rollouts(policy, policy_folder: str, task_cfg: TaskConfig, num_prompts: int = DRAFTER_PROMPTS,
                    samples: int = DRAFTER_SAMPLES, seed: int = 10_007):
    """drafter.features.SavedRollout's of the policy at T = 1 on problems drawn with `seed`."""
    from drafter.features import SavedRollout
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.core.seeds import prompt_key, sample_seed

    tok = load_checkpoint(policy_folder)[1]
    problems = make_problems(dataclasses.replace(task_cfg, num_problems=num_prompts, seed=seed))
    prompts = [tok(p.prompt)["input_ids"] for p in problems for _ in range(samples)]
    seeds = [sample_seed(seed, prompt_key(p), i % samples, None) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=512, stop_token_ids=[tok.eos_token_id])
    engine = Engine(policy, EngineConfig(max_batch_size=64, max_model_len=1024))
    outs = engine.generate(prompts, params, seeds=seeds)
    return [SavedRollout(p, o.token_ids, o.seed, 1.0, 0, 1.0) for p, o in zip(prompts, outs)]
