"""The continuous-batching engine: admit, prefill, decode and verify drafts, all in one loop.

Each step packs every running request into one forward: a prompt chunk for a request still
prefilling, otherwise its last sampled token plus the draft a proposer offers. The token at
response position t is always sample(z_t, seed, t) -- the coupled Gumbel-max draw -- so a
draft token is accepted exactly when it equals that sample and the output never depends on
drafts, batch composition or chunking. A finished request frees its slot for the next one at
once.
"""
from __future__ import annotations

import gc
import heapq
import math
from collections import deque
from typing import Optional, Sequence

import torch

from . import sampling, threads
from .batch import ForwardBatch, min_bucket_for
from .config import Completion, EngineConfig, SamplingParams, torch_dtype
from .controller import AdaptiveController, default_min_draft_prob, expected_run, rates_from
from .model import CausalLM
from .proposers import make_proposers
from .request import Lookahead, Request
from .requests import make_requests


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig):
        config.validate()
        self.model, self.config = model, config
        self.device = torch.device(config.device)
        self.min_bucket = min_bucket_for(self.device, config.max_model_len)
        self.cache = model.new_cache(config.max_batch_size, config.max_model_len)
        self.proposers = make_proposers(config.spec)
        # the samples past a rejected draft token are kept only when a proposer reads them
        self.keeps_lookahead = any(p.name == "lookahead" for p in self.proposers)
        threshold = config.spec.min_draft_prob if config.spec else 0.0
        self.controller = AdaptiveController(default_min_draft_prob(self.device) if threshold is None else threshold)
        self.steps = self.spec_off_steps = 0  # forwards of the last run(), and those without drafts
        self.num_threads = None  # on an accelerator torch's CPU threads are not the engine's business
        if self.device.type == "cpu":
            per_token = sum(p.numel() for p in model.model.layers.parameters()) + model.lm_head.weight.numel()
            self.num_threads = threads.engine_threads(config.num_threads, per_token)
            threads.announce(f"engine uses {self.num_threads} torch thread(s) for a model of "
                             f"{per_token / 1e6:.1f}M parameters per token")

    @classmethod
    def from_pretrained(cls, model_or_path, config: EngineConfig = EngineConfig()) -> Engine:
        config.validate()
        model = CausalLM.from_pretrained(model_or_path, torch_dtype(config.dtype), config.device)
        return cls(model, config)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def update_weights(self, weights) -> int:
        """A state dict, (name, tensor) pairs or a torch module, with Hugging Face names.
        Validated as a whole before anything is copied; returns the number of tensors loaded."""
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        if isinstance(weights, dict):
            weights = weights.items()
        return self.model.load_weights(list(weights))

    # ---- the public entry point --------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seeds: Optional[Sequence[int]] = None,
                 drafts: Optional[Sequence[Optional[Sequence[int]]]] = None,
                 groups: Optional[Sequence[Optional[int]]] = None,
                 draft_logprobs: Optional[Sequence[Optional[Sequence[float]]]] = None) -> list[Completion]:
        """Complete every prompt. seeds default to fresh random ones (returned in Completion.seed);
        drafts are previous responses for the "history" proposer; groups tie GRPO siblings
        together for the "suffix" proposer; draft_logprobs (the drafts' old logprobs) tell the
        budget how sure the old policy was of each token (and the lenient mode compares them)."""
        requests = self.make_requests(prompt_token_ids, sampling_params, seeds, drafts, groups,
                                      draft_logprobs=draft_logprobs)
        try:
            self.run(requests)
        finally:
            self.release_groups({r.group for r in requests if r.group is not None})
        return [to_completion(r) for r in requests]

    def release_groups(self, groups) -> None:
        """Forget what proposers hold for these groups, so a later call may reuse the ids."""
        for p in self.proposers:
            if hasattr(p, "drop_group"):
                for g in groups:
                    p.drop_group(g)

    def make_requests(self, prompt_token_ids, sampling_params=SamplingParams(), seeds=None,
                      drafts=None, groups=None, outputs=None, draft_logprobs=None) -> list[Request]:
        """Validated Requests (see rollout/requests.py); nothing of the engine changes."""
        return make_requests(self.vocab_size, self.config.max_model_len, prompt_token_ids, sampling_params,
                             seeds, drafts, groups, outputs, draft_logprobs)

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, requests: list[Request], max_new_tokens: Optional[int] = None,
            on_finish=None) -> list[Request]:
        """Run requests until each finishes, or has produced max_new_tokens more tokens in this
        call (then it is returned unfinished, to be continued anywhere: divided rollout)."""
        waiting = deque(r for r in requests if r.finish_reason is None)
        self.controller.new_run()
        self.steps = self.spec_off_steps = 0
        for r in waiting:
            r.num_cached, r.slot = 0, -1
            r.budget_end = len(r.output_ids) + max_new_tokens if max_new_tokens else None
            self._finish_if_done(r)
        # Longest expected first (LPT): a request's old response predicts its length, and a long
        # request admitted late is what stretches a rollout's tail. Requests without one keep their
        # order, ahead of the rest (they may be long). Order never changes a token.
        waiting = deque(sorted((r for r in waiting if r.finish_reason is None),
                               key=lambda r: -len(r.history) if r.history else -math.inf))
        free = list(range(self.config.max_batch_size))
        running: list[Request] = []
        progress = _progress(len(waiting)) if self.config.show_progress else None
        gc_was_on = gc.isenabled()
        # The loop allocates many small lists and tuples per step and makes no reference cycles;
        # with the collector on, every few hundred steps it would also scan the caller's whole
        # heap (a trainer's is large): about 15% of a spectail step's host time on the demo.
        gc.disable()
        try:
            with threads.using(self.num_threads):
                self._loop(waiting, running, free, on_finish, progress)
        finally:
            if gc_was_on:
                gc.enable()
            if progress is not None:
                progress.close()
        return requests

    def _loop(self, waiting: deque, running: list[Request], free: list[int], on_finish, progress) -> None:
        while waiting or running:
            while waiting and free:
                req = waiting.popleft()
                req.slot = heapq.heappop(free)  # lowest slot first keeps the attention grid small
                running.append(req)
            self._step(running)
            for req in [r for r in running if r.finish_reason or r.paused]:
                running.remove(req)
                heapq.heappush(free, req.slot)
                req.slot = -1
                for p in self.proposers:  # finished or paused: it leaves this engine
                    p.finish(req)
                if req.finish_reason and on_finish is not None:
                    on_finish(req)
                if progress is not None:
                    progress.update(1)

    def _step(self, running: list[Request]) -> None:
        cfg = self.config
        spec = cfg.spec is not None and (cfg.spec.max_batch_for_spec is None
                                         or len(running) <= cfg.spec.max_batch_for_spec)
        budget = cfg.max_num_batched_tokens
        self.steps += 1
        self.spec_off_steps += not spec
        # Requests that are decoding go first (one token each), then prompt chunks fill the rest.
        order = sorted(running, key=lambda r: r.num_tokens - r.num_cached > 1)
        load = len(running) / cfg.max_batch_size
        tables = []  # (proposer, its rate table, its best rate, the most draft tokens that earns now)
        for p in self.proposers if spec else ():
            table = self.controller.table(p)
            top = max(map(max, table))
            tables.append((p, table, top, self.controller.draft_len(top, cfg.spec.max_draft_tokens, load)))
        rows, plan = [], []  # plan: (request, n_fed, draft, (proposer, evidence, confidence), first logit index)
        n_tokens, logit_rows = 0, []
        for req in order:
            if budget <= 0:
                break
            pending = req.pending()
            fed = pending[:budget]
            draft, source = [], (None, 0, None)
            if len(fed) == len(pending) and spec:
                room = min(cfg.spec.max_draft_tokens, budget - len(fed), req.remaining - 1,
                           cfg.max_model_len - req.num_tokens, req.chunk_left - 1)
                if room > 0:
                    draft, source = self._propose(req, room, load, tables)
            tokens = fed + draft
            rows.append((req.slot, req.num_cached, tokens))
            first = None
            if len(fed) == len(pending):
                first = len(logit_rows)
                logit_rows.extend(range(n_tokens + len(fed) - 1, n_tokens + len(tokens)))
            plan.append((req, len(fed), draft, source, first))
            n_tokens += len(tokens)
            budget -= len(tokens)

        batch = ForwardBatch.build(rows, logit_rows, self.device, self.min_bucket)
        logits, _ = self.model(batch, self.cache)
        tokens, logprobs, draft_lps = self._sample(logits, plan)

        for req, n_fed, draft, (chosen, evidence, confidence), first in plan:
            was_prefill = req.num_tokens - req.num_cached > 1
            req.num_cached += n_fed
            if first is None:
                continue  # a prompt chunk that did not reach the end of the prompt
            if not was_prefill:
                req.forward_passes += 1
            ys = tokens[first:first + len(draft) + 1]
            lps = logprobs[first:first + len(draft) + 1]
            accepted = 0
            while accepted < len(draft):
                if draft[accepted] != ys[accepted]:
                    if not self._lenient_ok(req, chosen, accepted, draft, draft_lps.get(first + accepted)):
                        break
                    ys[accepted], lps[accepted] = draft[accepted], draft_lps[first + accepted]
                    req.lenient += 1
                accepted += 1
            req.num_cached += accepted  # accepted drafts are already in the cache
            if req.lenient and self._history_continues(req, chosen, accepted, draft):
                # Lenient runs follow the old response through chunk boundaries: drop the bonus
                # sample and re-feed the last draft token (rolled back one) to verify the next chunk.
                ys, lps = ys[:accepted], lps[:accepted]
                req.num_cached -= 1
            if chosen is not None:
                self.controller.record(req, chosen.name, evidence, len(draft), accepted, confidence)
            emitted = self._emit(req, ys[:accepted + 1], lps[:accepted + 1])
            req.lookahead = None
            if (self.keeps_lookahead and accepted + 1 < len(ys) and len(emitted) == accepted + 1
                    and not req.finish_reason):
                req.lookahead = Lookahead(len(req.output_ids), ys[accepted + 1:],
                                          [math.exp(lp) for lp in lps[accepted + 1:]])
            for p in self.proposers:
                mine = draft if p is chosen else []
                p.observe(req, mine, accepted if p is chosen else 0, emitted)

    def _propose(self, req: Request, k: int, load: float, tables):
        """Ask every proposer for a draft, cut each where the adaptive budget stops granting
        tokens (by the evidence behind it, its tokens' confidence and this load), and take the
        one with the longest expected accepted run. tables: (proposer, its rate table, its best
        rate, the draft tokens that rate earns): a proposer is asked for no more than that, and
        not at all when even its best could not beat the draft in hand.
        Returns (draft, (proposer, evidence, confidence))."""
        ctl = self.controller
        best, best_value, best_source = [], 0.0, (None, 0, None)
        for p, table, top, most in tables:
            cap = min(most, k)  # draft_len(top, k) = min(draft_len(top, K), k) for k <= K
            if cap == 0 or expected_run(top, cap) <= best_value:
                continue
            draft = p.propose(req, cap)
            if not draft:
                continue
            evidence = p.evidence(req) if hasattr(p, "evidence") else 0
            confidence = p.confidence(req) if hasattr(p, "confidence") else None
            n, value = ctl.cut(rates_from(table, evidence, confidence, min(cap, len(draft))), load)
            if value > best_value:
                best, best_value = list(draft[:n]), value
                best_source = (p, evidence, None if confidence is None else list(confidence[:n]))
        return best, best_source

    def _sample(self, logits: torch.Tensor, plan) -> tuple[list[int], list[float], dict]:
        """The exact sample at every logit row; with lenience on, also the new logprob of each
        history draft token (keyed by logit row)."""
        seeds, positions, params, lenient_rows, lenient_tokens = [], [], [], [], []
        lenient = self.config.spec is not None and self.config.spec.lenience is not None
        for req, _, draft, (chosen, _, _), first in plan:
            if first is None:
                continue
            t, n = len(req.output_ids), len(draft) + 1
            seeds.extend([req.seed] * n)
            positions.extend(range(t, t + n))
            params.extend([req.params] * n)
            if lenient and chosen is not None and chosen.name == "history":
                lenient_rows.extend(range(first, first + len(draft)))
                lenient_tokens.extend(draft)
        if not seeds:
            return [], [], {}
        dev = logits.device
        temperature, top_k, top_p = sampling.sampling_tensors(params, dev)
        tokens, logprobs = sampling.sample(
            logits, torch.tensor(seeds, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev), temperature, top_k, top_p)
        draft_lps = {}
        if lenient_rows:
            rows = torch.tensor(lenient_rows, device=dev)
            lps = sampling.token_logprobs(logits[rows], temperature[rows], top_k[rows], top_p[rows],
                                          torch.tensor(lenient_tokens, device=dev))
            draft_lps = dict(zip(lenient_rows, lps.tolist()))
        return tokens.tolist(), logprobs.tolist(), draft_lps

    @staticmethod
    def _history_continues(req: Request, chosen, accepted: int, draft: list[int]) -> bool:
        t = len(req.output_ids) + accepted
        return (chosen is not None and chosen.name == "history" and accepted == len(draft) > 0
                and req.history_logprobs is not None and t < len(req.history))

    def _lenient_ok(self, req: Request, chosen, i: int, draft: list[int], new_lp) -> bool:
        """SPEC-RL's lenience (biased, off by default): keep history token d at response position
        t if p_new(d) >= p_old(d) / l. Only while the draft is aligned with the old response,
        where the old logprob of d is known."""
        spec = self.config.spec
        if new_lp is None or spec.lenience is None or chosen is None or chosen.name != "history":
            return False
        t = len(req.output_ids) + i
        old = req.history_logprobs
        if old is None or t >= len(old) or req.history[t] != draft[i]:
            return False
        return new_lp >= old[t] - math.log(spec.lenience)

    def _emit(self, req: Request, ys: list[int], lps: list[float]) -> list[int]:
        """Append sampled tokens until a stop token, max_tokens or max_model_len ends the request."""
        emitted = []
        for y, lp in zip(ys, lps):
            req.output_ids.append(y)
            req.logprobs.append(lp)
            emitted.append(y)
            if self._finish_if_done(req) or req.paused:
                break
        return emitted

    def _finish_if_done(self, req: Request) -> bool:
        if req.output_ids and req.output_ids[-1] in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.finish_reason = "length"
        return req.finish_reason is not None


def to_completion(req: Request) -> Completion:
    stats = {"forward_passes": req.forward_passes, "proposed": dict(req.proposed),
             "accepted": dict(req.accepted), "lenient": req.lenient}
    return Completion(list(req.output_ids), list(req.logprobs), req.finish_reason or "length",
                      req.seed, stats)


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="rollout", unit="req", leave=False)
