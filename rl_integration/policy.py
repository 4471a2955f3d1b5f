"""The embedded task's policy: a tiny Llama (or Qwen2), warm-started by supervised training on
worked solutions, cached on disk as a normal Hugging Face checkpoint.

    model, tok, folder = load_or_train_policy(TaskConfig(), PolicyConfig())

The first call trains (1800 steps with the defaults; about a minute on one CPU core) into a
temporary folder beside the cache entry and renames it into place, so an interrupted run leaves
no half-written entry; later calls load `folder` in about a second.
`folder` holds config.json, model.safetensors, the tokenizer files and `spectail_sft.json` (what
training did), and loads with `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained`.

The cache root is `cache_dir`, else $SPECTAIL_CACHE, else ~/.cache/spectail; the entry is
`policy-<hash>` of the policy config and of the task config's problem distribution (its
`num_problems` and `seed` do not change what the policy is trained on, so they are not in it).

Sampled at temperature 1.0 the warm-started policy answers about half of the problems right
(see `evaluate_accuracy`): most short chains, few long ones. It has learnt the format and the
counting, and also the occasional slip its training data carries (`sft_slip_rate`): RL has to
train the slips away, and the longer the chain the more there is to gain.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .task import Problem, TaskConfig, format_solution, make_problems, reward_fn
from .tokenizer import build_tokenizer

CACHE_FORMAT = 2  # bump when the training recipe changes in a way the configs do not show
META_FILE = "spectail_sft.json"
train_count = 0  # how many times this process has trained a policy (tests read it)


@dataclass(frozen=True)
class PolicyConfig:
    """The tiny policy and its supervised warm start.

    arch: "llama" or "qwen2". Prefer llama: transformers 5's AutoTokenizer replaces the tokenizer of
        any qwen2 checkpoint with Qwen2Tokenizer (load_policy sidesteps that, other code may not).
    attention_bias: biases on the llama attention projections (qwen2 always has q/k/v biases).
        They let a head attend by relative position alone from the first step, which this task
        (each line computed from the line above) needs: without them a tiny model learns it far
        more slowly.
    hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings:
        the transformer; embeddings are tied.
    sft_steps: optimizer steps of supervised training (prompt tokens are masked out of the loss).
    sft_tokens_per_batch: tokens (padding included) per step; problems of similar length are batched.
    sft_pool: how many generated problems the steps cycle through.
    sft_slip_rate: the fraction of solution lines in the training data that carry an arithmetic
        slip (see task.format_solution): it sets how often the warm-started policy slips at T=1,
        and so its starting accuracy, robustly (a policy trained to convergence on clean data would
        be right nearly always, one stopped early is erratic from seed to seed).
    lr, weight_decay, warmup_steps: AdamW with linear warm-up then cosine decay to lr / 10.
    seed: seeds the initial weights and the training problems (independent of TaskConfig.seed).
    num_threads: torch threads while training (0 = leave torch's setting alone). One: the matrices
        are too small to split, and on a busy 2-core machine two threads measured ~20x slower.
    """

    arch: str = "llama"
    attention_bias: bool = True
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    sft_steps: int = 1800
    sft_tokens_per_batch: int = 512
    sft_pool: int = 20000
    sft_slip_rate: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    seed: int = 1234
    num_threads: int = 1

    def validate(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"PolicyConfig.arch must be 'llama' or 'qwen2', got {self.arch!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                "PolicyConfig needs hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0, got "
                f"{self.hidden_size}, {self.num_heads}, {self.num_kv_heads}"
            )
        if self.sft_steps < 0:
            raise ValueError(f"PolicyConfig.sft_steps must be >= 0, got {self.sft_steps}")


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

    global train_count
    train_count += 1
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


def load_policy(folder: str):
    """Load a cached (or any local) checkpoint: (model in eval mode, float32; tokenizer)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    # The exact class, not AutoTokenizer: transformers 5 swaps in Qwen2Tokenizer for any qwen2
    # checkpoint whatever tokenizer_config.json says, which would break this tokenizer.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    return model, tokenizer


def load_or_train_policy(task_cfg: TaskConfig, policy_cfg: PolicyConfig, cache_dir: Optional[str] = None,
                         progress: bool = True):
    """(model, tokenizer, folder): the cached warm-started policy, trained first if not cached."""
    policy_cfg.validate()
    task_cfg.validate()
    root = os.fspath(cache_dir) if cache_dir is not None else default_cache_root()
    folder = os.path.join(root, f"policy-{cache_key(task_cfg, policy_cfg)}")
    remove_stale_temporaries(root)
    if not os.path.isfile(os.path.join(folder, META_FILE)):  # written last: its presence means complete
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-policy-")
        try:
            tokenizer = build_tokenizer(tmp)
            model = make_model(policy_cfg, tokenizer)
            info = train_sft(model, tokenizer, sft_examples(task_cfg, policy_cfg), policy_cfg, progress=progress)
            model.save_pretrained(tmp)
            info.update(task=dataclasses.asdict(task_cfg), policy=dataclasses.asdict(policy_cfg))
            with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=2)
            os.chmod(tmp, 0o755)  # mkdtemp made it private; the entry is an ordinary folder
            try:
                os.rename(tmp, folder)
            except OSError:  # another process finished the same entry first: keep theirs
                if not os.path.isfile(os.path.join(folder, META_FILE)):
                    raise
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    model, tokenizer = load_policy(folder)
    return model, tokenizer, folder


STALE_TMP_SECONDS = 6 * 3600.0  # far longer than any warm start: its trainer is gone


def remove_stale_temporaries(root: str) -> None:
    """Delete `.tmp-policy-*` folders that no trainer has touched for STALE_TMP_SECONDS (a
    killed run's leftovers); a fresh one may belong to a trainer still running."""
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            if (entry.name.startswith(".tmp-policy-") and entry.is_dir(follow_symlinks=False)
                    and now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS):
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: Sequence[str], temperature: float = 1.0,
                     max_new_tokens: int = 512, seed: int = 0, batch_size: int = 64) -> list[str]:
    """Plain sampling with the KV cache (no speculation), for measuring a policy; returns texts."""
    gen = torch.Generator().manual_seed(seed)
    # transformers >= 5.x calls the KV cache `cache`, earlier versions `past_key_values`
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[str] = [""] * len(prompts)
    for b in range(0, len(order), batch_size):
        idx = order[b: b + batch_size]
        enc = [tokenizer(prompts[i])["input_ids"] for i in idx]
        width = max(len(e) for e in enc)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])  # left padding
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(e) for e in enc])[:, None]).long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        done = torch.zeros(len(idx), dtype=torch.bool)
        result = [[] for _ in idx]
        past, step_ids = None, ids
        for _ in range(max_new_tokens):
            o = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                      **{cache_kw: past})
            past, logits = getattr(o, cache_kw), o.logits[:, -1, :].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            for r in range(len(idx)):
                if not done[r]:
                    if int(nxt[r]) == eos:
                        done[r] = True
                    else:
                        result[r].append(int(nxt[r]))
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones(len(idx), 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
        for r, i in enumerate(idx):
            out[i] = tokenizer.decode(result[r], skip_special_tokens=True)
    return out


def evaluate_accuracy(model, tokenizer, problems: Sequence[Problem], temperature: float = 1.0,
                      max_new_tokens: int = 512, seed: int = 0) -> float:
    """Mean reward of one sample per problem."""
    texts = sample_responses(model, tokenizer, [p.prompt for p in problems], temperature, max_new_tokens, seed)
    return sum(reward_fn(t, p.answer) for t, p in zip(texts, problems)) / max(1, len(problems))
