"""The "drafter" proposer: the draft head inside the engine (registered in rollout/proposers).

Each step's result hands it the policy's final hidden states of the rows whose context was
correct, kept per slot in a feature store beside the engine's KV cache. `propose` drafts for all
requests asked at once (drafter/draft.py), each with its own seed, position and sampling params:
coupled samples of the head's distribution. The budget decides which requests to ask and how many
positions pay for what one costs (`position_cost`, profiled when a head of a new shape is set).

Per request: its slot, positions with features, head rows written from them (rows past that came
from drafts and are rewritten: rollback is free) and the run of accepted drafter tokens (the
evidence). A token's confidence comes from the margin between the two best perturbed head scores.
A request that leaves takes its tokens and features to the training buffer (drafter/buffer.py).
A head that does not fit the policy is refused by `set_head`, and switches the drafter off with a
warning when loaded from a folder or a published state: an absent drafter changes no token.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.budget import step_cost
from rollout.config import DrafterSpec
from rollout.core.kv_cache import move_slots
from rollout.core.request import Request
from rollout.proposers.base import Draft, Proposer, StepResult

from .buffer import FeatureBuffer
from .draft import Chain, ChainDraft, draft_chains
from .export import from_state, load
from .features import SavedRollout
from .head import DraftHead


@dataclass
class _State:
    slot: int  # where its features and head rows are kept
    known: int = 0  # sequence positions 0 .. known - 1 have features in the store
    written: int = 0  # head rows 0 .. written - 1 hold keys made from those features ...
    made: Optional[tuple[int, int]] = None  # ... under this (head generation, policy version)
    run: int = 0  # drafter tokens accepted since its last rejected one


class DrafterProposer(Proposer):
    name = "drafter"
    prior = 0.3  # a head is only as good as its training: a fresh one earns its place in the budget

    def __init__(self, model, spec: DrafterSpec, num_slots: int, max_len: int, max_positions: int):
        self.model, self.spec = model, spec
        self.num_slots, self.max_len, self.max_positions = num_slots, max_len, max_positions
        self.head: Optional[DraftHead] = None
        self.head_version, self.cache = 0, None
        self.gen = 0  # bumped whenever what the head's cached rows mean changes
        self.store: Optional[torch.Tensor] = None  # [slots, max_len, d] features
        self.buffer = FeatureBuffer(spec.buffer_tokens) if spec.collect else None
        self.cost: dict = {"requests": [1], "seconds": [0.0]}  # seconds per draft position by requests (`_profile`)
        self.requests: dict[int, Request] = {}  # id -> a request with state here
        self.stats = {"seconds": 0.0, "positions": 0, "chains": 0, "steps": 0, "tokens": 0, "compared": 0}

    @classmethod
    def from_config(cls, spec, model=None, engine_config=None) -> DrafterProposer:
        if model is None:
            raise ValueError("the drafter proposer needs the engine's model (its head reads the policy's "
                             "embeddings and lm_head)")
        d = spec.drafter
        slots = engine_config.max_batch_size if engine_config is not None else 64
        max_len = engine_config.max_model_len if engine_config is not None else 2048
        p = cls(model, d, slots, max_len, spec.max_draft_tokens)
        if d.path is not None:
            p.load(d.path, version=0)
        return p

    @classmethod
    def of(cls, engine) -> Optional[DrafterProposer]:
        """The engine's drafter proposer, if its SpecConfig names one."""
        return next((p for p in engine.proposers if isinstance(p, cls)), None)

    @property
    def wants_hidden(self) -> bool:
        return self.head is not None or self.buffer is not None

    @property
    def policy_version(self) -> int:
        return self.model.weights_version

    def set_head(self, head: DraftHead, version: int) -> None:
        """Draft with this head (not copied: a trainer may go on training it and set it again).
        ValueError, changing nothing, for a head of another policy shape or with NaN / Inf weights."""
        if not isinstance(head, DraftHead):
            raise ValueError(f"set_head needs a drafter.head.DraftHead, got {type(head).__name__}")
        head.check_policy(self.model)
        bad = [n for n, t in head.state_dict().items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise ValueError(f"draft head weight {bad[0]!r} contains NaN or Inf")
        device = self.model.lm_head.weight.device
        if head.fc.weight.device != device:
            head = head.to(device)
        fresh = self.cache is None or self.head is None or self.head.cfg != head.cfg
        if fresh:
            self.cache = head.new_cache(self.num_slots, self.max_len, self.max_positions)
        self.head, self.head_version = head.eval(), int(version)
        self.gen += 1
        if fresh:
            self.cost = self._profile()

    def _profile(self) -> dict:
        """Seconds per draft position for one request and a full batch, cached (step_cost.cached).
        It writes rows from 0, which every request rewrites after a new head."""
        w = self.model.lm_head.weight
        key = {"drafter": repr(self.head.cfg), "policy": repr(self.model.cfg), "dtype": str(w.dtype),
               "device": str(w.device), "machine": step_cost.machine(), "threads": torch.get_num_threads(),
               "slots": self.num_slots, "positions": self.max_positions}
        sizes = sorted({1, self.num_slots})
        cost = step_cost.cached(key, lambda: {"requests": sizes, "seconds": [self._time_chains(n) for n in sizes]})
        self.gen += 1
        return cost

    def _time_chains(self, n: int) -> float:
        d, w = self.model.cfg.hidden_size, self.model.lm_head.weight
        k = max(1, min(3, self.max_positions, self.max_len - 1))
        chains = [Chain(slot=i, start=0, tokens=[0], feats=torch.zeros(1, d, dtype=w.dtype, device=w.device),
                        seed=i, position=0, k=k) for i in range(n)]
        best = math.inf
        for i in range(3):
            begin = time.perf_counter()
            draft_chains(self.head, self.model, self.cache, chains)
            if i:
                best = min(best, (time.perf_counter() - begin) / k)
        return best

    def position_cost(self, n: int) -> float:
        """Seconds of one draft position for n requests: linear between the profiled sizes."""
        if self.head is None:
            return 0.0
        return step_cost.StepCost(tuple(self.cost["requests"]), tuple(self.cost["seconds"])).table(n)

    def load(self, source, version: int) -> bool:
        """A head from an export folder or a published state, else the drafter off; whether it loaded."""
        try:
            head = load(source, self.model) if isinstance(source, str) else from_state(source, self.model)
            self.set_head(head, version)
            return True
        except ValueError as e:
            self.switch_off(f"draft head version {version} does not load: {e}")
            return False

    def switch_off(self, reason: str) -> None:
        warnings.warn(f"drafter switched off: {reason}", stacklevel=2)
        self.head, self.cache = None, None
        self.gen += 1

    def propose(self, requests: list[Request], k: int) -> list[Optional[Draft]]:
        """Draft up to k positions for every request at once (fewer where the head's cache ends)."""
        drafts: list[Optional[Draft]] = [None] * len(requests)
        start = time.perf_counter()
        if self.head is None or k < 1:
            return drafts
        try:
            self._follow()
            chains, asked = [], []
            for i in sorted(range(len(requests)), key=lambda i: requests[i].slot):  # the head reads its cache in place
                st = requests[i].proposer_state.get(self.name)
                chain = self._chain(requests[i], st, k) if st is not None else None
                if chain is not None:
                    chains.append(chain)
                    asked.append((i, st))
            if chains:
                made = draft_chains(self.head, self.model, self.cache, chains, margins=True)
                for c, (i, st), d in zip(chains, asked, made):
                    st.written = c.start + len(c.tokens)
                    conf = [1.0 - math.exp(-m) for m in d.margins]
                    drafts[i] = Draft(d.tokens, self, evidence=st.run, confidence=conf)
                self._count(made)
        finally:  # (a figure for reports: no budget reads it)
            self.stats["seconds"] += time.perf_counter() - start
        return drafts

    def _count(self, drafts: list[ChainDraft]) -> None:
        """The step's figures (its seconds are counted by `propose`, look-ups included)."""
        for key, n in (("positions", max(len(d.tokens) for d in drafts)), ("chains", len(drafts)), ("steps", 1),
                       ("tokens", sum(len(d.tokens) for d in drafts))):
            self.stats[key] += n

    def _chain(self, req: Request, st: _State, most: int) -> Optional[Chain]:
        q = req.num_tokens - 1  # the pending token's position: features up to q - 1 are needed
        k = min(most, self.max_positions, self.max_len - 1 - q)  # (what the head's cache holds)
        if k < 1 or st.known < q or req.slot < 0 or q < 1:  # (q < 1: no row to start from)
            return None
        if st.made != (self.gen, self.policy_version):
            st.written, st.made = 0, (self.gen, self.policy_version)
        start = min(st.written, q - 1)
        window = self.head.cfg.window if self.head is not None else None
        if window is not None:  # the chain's first query sees rows q - window .. q - 1: none below is ever read
            start = max(start, q - window)
        p = len(req.prompt_ids)
        ids = req.prompt_ids[start + 1:] + req.output_ids if start + 1 < p else req.output_ids[start + 1 - p:]
        return Chain(slot=req.slot, start=start, tokens=ids, feats=self.store[req.slot, start:q],
                     seed=req.seed, position=len(req.output_ids), k=k, temperature=req.params.temperature,
                     top_k=req.params.top_k, top_p=req.params.top_p, stop=req.params.stop_token_ids)

    def on_step(self, result: StepResult) -> tuple:
        """Its drafts' runs, the step's features, and the requests that leave (to the buffer)."""
        self._follow()
        for req, draft, accepted, emitted, _, _ in result.rows:
            st = req.proposer_state.get(self.name)
            if st is not None and draft is not None and draft.proposer is self:
                # a token past the request's end is neither accepted nor rejected (the engine's rule)
                rejected = accepted < min(len(draft.tokens), len(emitted))
                self.stats["compared"] += accepted + rejected
                st.run = 0 if rejected else st.run + accepted
        if result.shared and self.store is not None:
            self._adopt(result.shared)
        if result.spans and self.wants_hidden:
            self._keep(result.spans, result.hidden)
        for req in result.left:
            st = req.proposer_state.pop(self.name, None)
            self.requests.pop(id(req), None)
            if st is not None and self.buffer is not None and req.slot >= 0 and (req.finish_reason or req.paused):
                self._collect(req, st)
        return ()

    def _adopt(self, shared) -> None:
        """A request that took its prompt from a donor (rollout/core/prompt_share.py) takes the
        donor's features of it too, so its own spans go on from there."""
        for req, donor, n in shared:
            have = donor.proposer_state.get(self.name)
            if have is None or have.known < n or req.slot < 0:
                continue  # (the donor's features do not cover it: the request drafts nothing)
            st = req.proposer_state[self.name] = _State(req.slot, known=n)
            self.requests[id(req)] = req
            self.store[st.slot, :n] = self.store[have.slot, :n]

    def _keep(self, spans, hidden: torch.Tensor) -> None:
        """Keep each span's features at [slot, position] of the store: one copy per step."""
        store = self._store(hidden)
        length = store.shape[1]
        dst, src = [], []
        for req, start, offset, count in spans:
            st = req.proposer_state.get(self.name)
            if st is None:
                st = req.proposer_state[self.name] = _State(req.slot)
                self.requests[id(req)] = req
            if start < st.known:  # the request is re-fed from an earlier position
                st.written = min(st.written, start)
            elif start > st.known:
                continue  # a gap (cannot happen with the engine's spans): draft nothing for it
            base = req.slot * length + start
            dst.extend(range(base, base + count))
            src.extend(range(offset, offset + count))
            st.known = start + count
        if dst:
            index = torch.tensor(dst, device=store.device)
            rows = hidden if src == list(range(hidden.shape[0])) else hidden[torch.tensor(src, device=hidden.device)]
            store.view(-1, store.shape[-1]).index_copy_(0, index, rows.to(store.dtype))

    def _follow(self) -> None:
        """Features and head rows follow requests the engine moved between slots."""
        moved = [(st, req.slot) for req in self.requests.values()
                 if (st := req.proposer_state[self.name]).slot != req.slot and req.slot >= 0]
        if moved:
            self._move([st.slot for st, _ in moved], [slot for _, slot in moved])
            for st, slot in moved:
                st.slot = slot

    def _move(self, src: list[int], dst: list[int]) -> None:
        """Whole slots: head rows may run past the context; a windowed head's ring is shorter."""
        if self.store is not None:
            move_slots(self.store, src, dst)
        if self.cache is not None:
            move_slots(self.cache.k, src, dst)
            move_slots(self.cache.v, src, dst)

    def _collect(self, req: Request, st: _State) -> None:
        """The request's tokens and features into the buffer (the last, never trained on, may be zero)."""
        n = req.num_tokens
        rows = min(st.known, n)
        if rows < n - 1 or not req.output_ids or n > self.buffer.max_tokens:
            return
        feats = self.store[req.slot, :rows].clone()
        if rows < n:
            feats = torch.cat([feats, torch.zeros_like(feats[:1])])
        p = req.params
        sample = SavedRollout(list(req.prompt_ids), list(req.output_ids), req.seed, p.temperature, p.top_k, p.top_p)
        try:
            self.buffer.add(sample, feats, self.policy_version, finished=req.finish_reason is not None, key=req.seed)
        except ValueError:
            pass  # non-finite features (a diverged policy): not worth training on

    def _store(self, hidden: torch.Tensor) -> torch.Tensor:
        d = hidden.shape[-1]
        if self.store is None or self.store.dtype != hidden.dtype or self.store.device != hidden.device:
            self.store = torch.zeros(self.num_slots, self.max_len, d, dtype=hidden.dtype, device=hidden.device)
        return self.store

    def state_sizes(self) -> dict[str, int]:
        return {"requests": len(self.requests)}
