"""The continuous-batching engine: each step is plan -> forward -> verify.

plan: each running request gets a row of the step's one forward: a prompt chunk, or its last
    sampled token plus the draft the budget (rollout/budget/budget.py) grants it.
forward: one pass of the model over all rows against the slot KV cache.
verify: the token at response position t is always sample(z_t, seed, t) (rollout/core/sampling.py),
    so a draft token is accepted exactly when it equals that sample; the first mismatch emits the
    sample, a fully accepted draft earns the next one as a bonus. The output never depends on
    drafts, batch composition or chunking.
"""
from __future__ import annotations

import contextlib
import gc
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Optional, Sequence

import torch

from ..budget import budget as budgets
from ..budget import step_cost
from ..config import Completion, EngineConfig, SamplingParams, torch_dtype
from ..kernels import cpu_isa
from ..proposers import make_proposers
from ..proposers.base import Draft, StepResult, Verified
from . import lenient, prompt_share, sampling, slot_order, threads
from .batch import ForwardBatch, bucket, min_bucket_for
from .kept_slots import KeptSlots, check_keys
from .model import CausalLM
from .request import Request, make_requests

# The step-cost profile: cached tokens per row of its long-context forward; timings per forward.
PROFILE_CONTEXT = 512
PROFILE_REPEATS = 2
HOST_ROWS = 16  # synthetic requests of the timed step that gives the host work per row
MODEL_KEYS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size")


@dataclass
class Row:
    """One request's part of a step: `fed` of its pending tokens, then its draft's tokens."""

    req: Request
    fed: int
    draft: Optional[Draft]
    first_logit: Optional[int]  # its first row of the step's logits; None: a prompt chunk short of the end
    offset: int = 0  # its first token in the step's batch
    old: Optional[list[float]] = None  # lenient mode: the draft tokens' old logprobs (rollout/core/lenient.py)
    new: Optional[list[float]] = None  # ... and their logprobs under the current policy

    @property
    def draft_tokens(self) -> list[int]:
        return [] if self.draft is None else self.draft.tokens


@dataclass(frozen=True)
class RunStats:
    """The work of one `run`: target forwards, those without drafts, tokens fed to them."""

    steps: int = 0
    spec_off_steps: int = 0
    fed_tokens: int = 0


def fastest(run: Callable[[], object]) -> float:
    """Seconds of the fastest of PROFILE_REPEATS calls of `run`, after one untimed (its set-up)."""
    run()
    best = math.inf
    for _ in range(PROFILE_REPEATS):
        begin = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - begin)
    return best


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig):
        config.validate()
        self.model, self.config = model, config
        self.device = torch.device(config.device)
        cpu_isa.check(model.lm_head.weight.dtype, self.device)
        self.min_bucket = min_bucket_for(self.device, config.max_model_len)
        self.cache = model.new_cache(config.max_batch_size, config.max_model_len)
        self.proposers = make_proposers(config.spec, model, config)
        # torch's attention reads the cache in place only with slots ordered (rollout/core/slot_order.py)
        self.reorders_slots = not model.attends_in_kernel(self.cache)
        # a proposer reading the whole context's hidden states finds none after kept KV
        kept = 0 if any(p.wants_hidden for p in self.proposers) else config.kept_slots
        self.kept = KeptSlots(lambda n: model.new_cache(n, config.max_model_len), kept)
        self.lenience = config.spec.lenience if config.spec else None
        self.budget = budgets.Budget.from_spec(config.spec) if config.spec else None
        self.last_run = RunStats()
        # `cores` watches the cores other programs hold, where the engine chose its thread count
        self.num_threads, self.cores = self._threads(config.num_threads) if self.device.type == "cpu" else (None, None)
        if self.budget is not None and self.budget.priced and self.budget.cost is None:
            # a start-up cost (cached), not the first rollout's
            self.budget.cost = step_cost.StepCost.from_dict(self._step_cost())

    def _threads(self, requested: Optional[int]) -> tuple[int, Optional[threads.CoreWatch]]:
        """Torch threads on the CPU: as requested, else by model size and speed here (rollout/core/threads.py)."""
        per_token = sum(p.numel() for p in self.model.model.layers.parameters()) + self.model.lm_head.weight.numel()
        n, cores, why = threads.engine_threads(requested, per_token), None, ""
        if requested is None and n > 1:
            most, n = n, self._fastest_threads(n)
            cores = threads.CoreWatch.of_this_process() if n > 1 else None
            why = f" ({most} measured slower here)" if n < most else ""
        fewer = ", fewer while other programs keep cores busy" if cores else ""
        threads.announce(f"engine uses {'up to ' if cores else ''}{n} torch thread(s){why} for a model of "
                         f"{per_token / 1e6:.1f}M parameters per token{fewer}")
        return n, cores

    def _fastest_threads(self, most: int) -> int:
        """1 or `most` threads, whichever ran a decode forward faster here (virtual CPUs may share a
        core). It writes slots at position 0, which every request overwrites."""
        rows = min(self.config.max_batch_size, 8)
        batch = ForwardBatch.build([(slot, 0, [0]) for slot in range(rows)], list(range(rows)), self.device,
                                   self.min_bucket)
        best = {1: math.inf, most: math.inf}
        for n in (1, most, 1, most):
            with threads.using(n):
                self.model(batch, self.cache)  # the first call of a thread count pays its set-up
                start = time.perf_counter()
                for _ in range(2):
                    self.model(batch, self.cache)
                best[n] = min(best[n], time.perf_counter() - start)
        return 1 if best[1] < best[most] else most

    @classmethod
    def from_pretrained(cls, model_or_path, config: EngineConfig = EngineConfig()) -> Engine:
        config.validate()
        model = CausalLM.from_pretrained(model_or_path, torch_dtype(config.dtype), config.device)
        return cls(model, config)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def update_weights(self, weights) -> int:
        """A state dict, (name, tensor) pairs or a module, with Hugging Face names, validated as a
        whole before anything is copied (kept KV is dropped). Returns the number of tensors loaded."""
        self.kept.clear()
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        if isinstance(weights, dict):
            weights = weights.items()
        n = self.model.load_weights(list(weights))
        self.model.weights_version += 1
        return n

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seeds: Optional[Sequence[int]] = None,
                 drafts: Optional[Sequence[Optional[Sequence[int]]]] = None,
                 groups: Optional[Sequence[Optional[int]]] = None,
                 draft_logprobs: Optional[Sequence[Optional[Sequence[float]]]] = None,
                 on_finish: Optional[Callable[[Request], None]] = None) -> list[Completion]:
        """Complete every prompt. seeds: fresh random ones by default; drafts: previous responses
        ("history"), draft_logprobs their old logprobs; groups tie GRPO siblings ("suffix");
        on_finish(request) is called as each request finishes."""
        requests = self.make_requests(prompt_token_ids, sampling_params, seeds, drafts, groups,
                                      draft_logprobs=draft_logprobs)
        try:
            self.run(requests, on_finish=on_finish)
        finally:
            self.release_groups({r.group for r in requests if r.group is not None})
        return [r.completion() for r in requests]

    def release_groups(self, groups) -> None:
        """Forget what proposers hold for these groups, so a later call may reuse the ids."""
        self._tell(StepResult(dropped=frozenset(groups)))

    def state_sizes(self) -> dict[str, int]:
        """{"<proposer>.<table>": entries} the proposers hold between calls: every one 0 when idle."""
        return {f"{p.name}.{table}": n for p in self.proposers for table, n in p.state_sizes().items()}

    def make_requests(self, prompt_token_ids, sampling_params=SamplingParams(), seeds=None,
                      drafts=None, groups=None, outputs=None, draft_logprobs=None) -> list[Request]:
        """Validated Requests (see rollout/core/request.py); nothing of the engine changes."""
        return make_requests(self.vocab_size, self.config.max_model_len, prompt_token_ids, sampling_params,
                             seeds, drafts, groups, outputs, draft_logprobs)

    def run(self, requests: list[Request], max_new_tokens: Optional[int] = None,
            on_finish: Optional[Callable[[Request], None]] = None,
            keep: Optional[Sequence[Optional[Hashable]]] = None, max_steps: Optional[int] = None) -> RunStats:
        """Run requests until each finishes or has max_new_tokens more tokens (then it is returned
        unfinished, to be continued anywhere: divided rollout). keep: a key per request (or None)
        under which a paused request keeps its KV here, to resume without prefill
        (rollout/core/kept_slots.py). max_steps: after this many forwards running requests pause and
        those never admitted are returned as they came."""
        waiting = self._admit(requests, max_new_tokens, keep, max_steps)
        if self.budget is not None:
            self.budget.new_run()
        kept = self.kept.begin(requests, keep) if keep is not None else None
        gc_was_on = gc.isenabled()
        # the loop makes no reference cycles; the collector would scan a trainer's whole heap
        gc.disable()
        try:
            with threads.using(self.cores.threads(self.num_threads) if self.cores else self.num_threads):
                self.last_run = self._loop(waiting, on_finish, kept, max_steps)
        except BaseException:
            self._abandon(requests)
            raise
        finally:
            if kept is not None:
                kept.close()
            if gc_was_on:
                gc.enable()
        return self.last_run

    def _admit(self, requests: list[Request], max_new_tokens: Optional[int], keep, max_steps) -> deque:
        """Check run's arguments, reset the requests' run state, and queue the unfinished ones."""
        if keep is not None:
            check_keys(keep, len(requests))
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be None or an integer >= 1, got {max_steps!r}")
        for r in requests:
            if r.finish_reason is None:
                r.num_cached, r.slot = 0, -1
                r.budget_end = len(r.output_ids) + max_new_tokens if max_new_tokens else None
                self._finish_if_done(r)
        # Longest expected first (an old response predicts the length): a long request admitted
        # late stretches the tail. Requests without one go first, in order.
        return deque(sorted((r for r in requests if r.finish_reason is None),
                            key=lambda r: -len(r.history) if r.history else -math.inf))

    def _abandon(self, requests: list[Request]) -> None:
        """A run that raised: every request leaves, so proposers keep nothing of it."""
        for p in self.proposers:
            with contextlib.suppress(Exception):
                p.on_step(StepResult(left=requests))
        for req in requests:
            req.slot = -1

    def _loop(self, waiting: deque, on_finish, kept=None, max_steps: Optional[int] = None) -> RunStats:
        free = list(range(self.config.max_batch_size))
        running: list[Request] = []
        steps = spec_off = fed = 0
        while waiting or running:
            while waiting and free:
                req = waiting.popleft()
                req.slot = heapq.heappop(free)  # lowest slot first keeps the attention grid small
                if kept is not None:
                    kept.admit(req, self.cache)
                running.append(req)
            if self.reorders_slots:
                free = self._arrange(running, free)
            shares = self._share(running)
            result, step_fed, planned = self._step(running, shares)
            steps, spec_off, fed = steps + 1, spec_off + (not planned), fed + step_fed
            if steps == max_steps:  # the run's end: what runs pauses here, what waits is not started
                for req in running:
                    req.budget_end = len(req.output_ids)
                waiting.clear()
            left = [r for r in running if r.finish_reason or r.paused]
            self._tell(replace(result, left=left) if left else result)
            for req in left:
                running.remove(req)
                self._leave(req, free, kept, on_finish)
        return RunStats(steps, spec_off, fed)

    def _arrange(self, running: list[Request], free: list[int]) -> list[int]:
        """Move running requests into slots ordered by context bucket; returns the free slots (a heap)."""
        keys = [bucket(r.num_tokens, self.min_bucket) for r in running]
        moved = [(r, s) for r, s in zip(running, slot_order.arrange([r.slot for r in running], keys))
                 if s != r.slot]
        if not moved:
            return free
        src, dst = [r.slot for r, _ in moved], [s for _, s in moved]
        length = max(r.num_cached for r, _ in moved)
        if length > 0:
            self.cache.move(src, dst, length)
        for r, s in moved:
            r.slot = s
        return list(range(len(running), self.config.max_batch_size))  # sorted: a heap

    def _leave(self, req: Request, free: list, kept, on_finish) -> None:
        """A finished or paused request frees its slot (a paused one's KV may stay kept)."""
        if kept is not None and req.paused:
            kept.pause(req, self.cache)
        heapq.heappush(free, req.slot)
        req.slot = -1
        if req.finish_reason and on_finish is not None:
            on_finish(req)

    def _share(self, running: list[Request]) -> prompt_share.Shares:
        """Requests take their prompt's keys and values from a running sibling (rollout/core/prompt_share.py)."""
        if not self.config.share_prompts:
            return prompt_share.NONE
        shares = prompt_share.plan(running)
        for n in sorted({n for _, _, n in shares.copies}):
            pairs = [(r, d) for r, d, m in shares.copies if m == n]
            self.cache.move([d.slot for _, d in pairs], [r.slot for r, _ in pairs], n)
            for r, _ in pairs:
                r.num_cached = n
        return shares

    def _step(self, running: list[Request], shares: prompt_share.Shares = prompt_share.NONE
              ) -> tuple[StepResult, int, bool]:
        """One forward of every running request but those `shares` holds back: its result, the
        tokens fed, and whether it could draft."""
        plan = None
        if self.budget is not None:
            plan = self.budget.plan_step(self.proposers, len(running), len(running) / self.config.max_batch_size,
                                         context=sum(r.num_tokens for r in running))
        hidden = any(p.wants_hidden for p in self.proposers)
        feeding = [r for r in running if id(r) not in shares.held] if shares.held else running
        rows, batch = self._plan(feeding, plan, hidden)
        logits, states = self.model(batch, self.cache)  # [M, V] float32, M = number of logit rows
        verified, spans = self._verify(rows, logits, hidden)
        drafting = frozenset(o.proposer for o in plan.live) if plan is not None else frozenset()
        return (StepResult(verified, drafting, states, spans, shared=shares.copies), int(batch.token_ids.shape[0]),
                plan is not None)

    def _tell(self, result: StepResult) -> None:
        """Every proposer hears the result; drafts one judged without their being fed are learnt."""
        for p in self.proposers:
            for draft, accepted, judged in p.on_step(result):
                self.budget.learn(draft, accepted, judged)

    def _plan(self, running: list[Request], plan, hidden: bool = False) -> tuple[list[Row], ForwardBatch]:
        """Rows within the step's token budget: decoding requests first, then prompt chunks, then
        drafts for the rows that reach the end of what is known (`_drafts`) from what is left.
        hidden: the forward also returns the final hidden state of every fed token."""
        budget, entries = self.config.max_num_batched_tokens, []
        for req in sorted(running, key=lambda r: r.num_tokens - r.num_cached > 1):
            if budget <= 0:
                break
            pending = req.pending()
            fed = pending[:budget]
            entries.append((req, fed, len(fed) == len(pending)))  # whole: reaches the end of what is known
            budget -= len(fed)
        drafts = self._drafts([e for e in entries if e[2]], plan, budget) if plan is not None else {}
        rows, feed, logit_index, n_tokens = [], [], [], 0
        for req, fed, whole in entries:
            row = Row(req, len(fed), drafts.get(id(req)), len(logit_index) if whole else None, n_tokens)
            tokens = fed + row.draft_tokens
            feed.append((req.slot, req.num_cached, tokens))
            if whole:  # logits at the last fed token and at every draft token
                logit_index.extend(range(n_tokens + len(fed) - 1, n_tokens + len(tokens)))
            rows.append(row)
            n_tokens += len(tokens)
        return rows, ForwardBatch.build(feed, logit_index, self.device, self.min_bucket,
                                        hidden_index=list(range(n_tokens)) if hidden else None)

    def _drafts(self, whole: list, plan, spare: int) -> dict:
        """{id(request): draft} for the rows that emit (`Budget.choose`, `Budget.allocate`), within `spare` tokens."""
        cfg = self.config
        rooms = [max(0, min(cfg.spec.max_draft_tokens, spare, req.remaining - 1, cfg.max_model_len - req.num_tokens,
                            req.chunk_left - 1)) for req, _, _ in whole]
        chosen = self.budget.choose([req for req, _, _ in whole], rooms, plan)
        fed = sum(len(f) for _, f, _ in whole)
        lengths = self.budget.allocate(plan, [c[1] if c is not None else () for c in chosen],
                                       [r.num_tokens for r, _, _ in whole], spare, fed)
        return {id(e[0]): c[0].cut(n) for e, c, n in zip(whole, chosen, lengths) if n > 0}

    def _verify(self, rows: list[Row], logits: torch.Tensor, hidden: bool) -> tuple[list[Verified], list]:
        """Sample every logit row, then accept and emit row by row. hidden: also the spans of rows
        now in the cache (their context was correct; never a row past a rejected draft)."""
        tokens, logprobs = self._sample(rows, logits)
        verified, spans = [], []
        for row in rows:
            req = row.req
            before = req.num_cached
            req.num_cached += row.fed
            if row.first_logit is not None:  # (else a prompt chunk that did not reach the end of the prompt)
                if req.output_ids:  # the forward that ends the prompt is not a verify (a continued one's is)
                    req.forward_passes += 1
                n = len(row.draft_tokens) + 1
                verified.append(self._accept(row, tokens[row.first_logit:row.first_logit + n],
                                             logprobs[row.first_logit:row.first_logit + n]))
            count = min(req.num_cached, req.num_tokens) - before
            if hidden and count > 0:
                spans.append((req, before, row.offset, count))
        return verified, spans

    def _accept(self, row: Row, ys: list[int], lps: list[float]) -> Verified:
        """ys, lps: the exact samples at the row's last fed token and at each draft token."""
        req, draft = row.req, row.draft_tokens
        accepted, lenient_now = lenient.accept(draft, ys, lps, row.old, row.new, self.lenience)
        req.lenient += lenient_now
        req.num_cached += accepted  # accepted drafts are already in the cache
        if lenient.follows_old_response(req, row.old, draft, accepted):
            ys, lps = ys[:accepted], lps[:accepted]
            req.num_cached -= 1  # re-feed the last draft token: the next draft is judged from it
        emitted = self._emit(req, ys[:accepted + 1], lps[:accepted + 1])
        # draft tokens past the request's end count as neither accepted nor rejected
        judged = min(len(row.draft_tokens), len(emitted))
        accepted = min(accepted, judged)
        if row.draft is not None:
            self.budget.record(req, row.draft, accepted, judged)
        return Verified(req, row.draft, accepted, emitted, ys, lps)

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """The exact sample and logprob at every logit row (lenient mode: also sets the rows' old and new)."""
        seeds, positions, params = [], [], []
        for row in rows:
            if row.first_logit is None:
                continue
            t, n = len(row.req.output_ids), len(row.draft_tokens) + 1
            seeds.extend([row.req.seed] * n)
            positions.extend(range(t, t + n))
            params.extend([row.req.params] * n)
        if not seeds:
            return [], []
        dev = logits.device
        temperature, top_k, top_p = sampling.sampling_tensors(params, dev)  # [M] each
        # seeds and positions stay on the host: sampling derives the rows' keys there
        tokens, logprobs = sampling.sample(logits, torch.tensor(seeds, dtype=torch.int64),
                                           torch.tensor(positions, dtype=torch.int64), temperature, top_k, top_p)
        if self.lenience is not None:
            self._score_leniently(rows, logits, temperature, top_k, top_p)
        return tokens.tolist(), logprobs.tolist()

    def _score_leniently(self, rows: list[Row], logits, temperature, top_k, top_p) -> None:
        for r in rows:
            if r.first_logit is not None:
                r.old = lenient.old_logprobs(r.req, r.draft)
        scored = [r for r in rows if r.old is not None]
        index = [r.first_logit + i for r in scored for i in range(len(r.draft_tokens))]
        new = lenient.new_logprobs(logits, index, [t for r in scored for t in r.draft_tokens],
                                   temperature, top_k, top_p)
        for r in scored:
            r.new, new = new[:len(r.draft_tokens)], new[len(r.draft_tokens):]

    def _step_cost(self) -> dict:
        """The step-cost table: the config's, else the one cached for this machine, else measured."""
        cfg, mcfg = self.config, self.model.cfg
        if cfg.spec.step_cost is not None:
            return cfg.spec.step_cost
        most = min(cfg.max_num_batched_tokens, cfg.max_batch_size * min(1 + cfg.spec.max_draft_tokens,
                                                                         cfg.max_model_len))
        depth = min(1 + cfg.spec.max_draft_tokens, cfg.max_model_len - 1)
        rows, context = min(cfg.max_batch_size, 8), min(PROFILE_CONTEXT, cfg.max_model_len - depth)
        key = {"device": str(self.device), "machine": step_cost.machine(),
               "dtype": str(self.model.lm_head.weight.dtype),
               "threads": self.num_threads, "model": {k: getattr(mcfg, k, None) for k in MODEL_KEYS},
               "kernel": self.model.attends_in_kernel(self.cache), "most": most, "rows": rows, "context": context,
               "depth": depth, "proposers": [p.name for p in self.proposers]}
        if self.device.type == "cuda":
            key["name"] = torch.cuda.get_device_name(self.device)
        with threads.using(self.num_threads):
            grid = step_cost.profile_grid(most)
            return step_cost.cached(key, lambda: step_cost.profile(
                self._time_forward, grid, rows, context, depth,
                lambda: self._time_host(min(cfg.max_batch_size, HOST_ROWS), context)))

    def _time_forward(self, fed: int, cached: int, rows: Optional[int] = None) -> float:
        """The fastest of PROFILE_REPEATS forwards (with sampling) of `fed` tokens over `rows` slots
        (None: as many as can run) after `cached` per slot, after one untimed (positions every
        request overwrites)."""
        rows = min(self.config.max_batch_size, fed) if rows is None else rows
        per_row = [fed // rows + (i < fed % rows) for i in range(rows)]
        assert cached + per_row[0] <= self.config.max_model_len, (fed, cached)
        feed = [(slot, cached, [0] * n) for slot, n in enumerate(per_row)]

        def forward():  # the batch's and the sampler's host work is every step's too
            batch = ForwardBatch.build(feed, list(range(fed)), self.device, self.min_bucket)
            params = sampling.sampling_tensors([SamplingParams()] * fed, self.device)
            logits, _ = self.model(batch, self.cache)
            sampling.sample(logits, torch.zeros(fed, dtype=torch.int64), torch.arange(fed), *params)[0].tolist()
        return fastest(forward)

    def _time_host(self, rows: int, context: int) -> float:
        """Seconds per row of a plain step's work around its forward, asking the copy proposers once
        included (a draft head's positions have a cost of their own): the fastest of PROFILE_REPEATS
        steps of `rows` synthetic requests after `context` tokens each, less its forward alone."""
        reqs = [Request(i, [0] * context, SamplingParams(max_tokens=1 << 20), seed=i, slot=i, num_cached=context - 1)
                for i in range(rows)]
        copiers = [p for p in self.proposers if not p.wants_hidden]

        def step():
            planned, batch = self._plan(reqs, None)
            logits, _ = self.model(batch, self.cache)
            result = StepResult(self._verify(planned, logits, False)[0], frozenset(copiers))
            for p in copiers:
                p.propose(reqs, self.config.spec.max_draft_tokens)
                p.on_step(result)
        try:
            best = fastest(step)
        finally:
            for p in copiers:
                p.on_step(StepResult(left=reqs))
        return max(best - self._time_forward(rows, context + PROFILE_REPEATS, rows), 0.0) / rows

    def _emit(self, req: Request, ys: list[int], lps: list[float]) -> list[int]:
        """Append sampled tokens until a stop token, a length or the chunk's end ends the request."""
        if not ys:  # (lenient mode re-feeds a draft token: nothing new to emit)
            return []
        stops = req.params.stop_token_ids
        n = next((i + 1 for i, y in enumerate(ys) if y in stops), len(ys))
        n = max(1, min(n, req.remaining, self.config.max_model_len - req.num_tokens, req.chunk_left))
        emitted = ys[:n]
        req.output_ids.extend(emitted)
        req.logprobs.extend(lps[:n])
        self._finish_if_done(req)
        return emitted

    def _finish_if_done(self, req: Request) -> None:
        if req.output_ids and req.output_ids[-1] in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.finish_reason = "length"
