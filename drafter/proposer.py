"""The "drafter" proposer: the draft head inside the engine (registered in rollout/proposers).

Each step the engine hands it the policy's final hidden states of the rows whose context was
correct (`observe_hidden`: prompt rows, the pending token's row, accepted drafts; never a row past
a rejection), which it keeps per slot in a feature store beside the engine's KV cache. Before the
step's drafts are chosen, `prepare` drafts for every decoding request at once (drafter/draft.py:
one batched head forward per draft position, whatever the batch), with each request's own seed,
response position and sampling params, so the drafts are coupled samples of the head's
distribution; `propose` then hands out the request's prepared draft. The engine's budget
(rollout/budget.py) decides how many positions are worth running from what one costs
(`position_cost`: a short profile when a head of a new shape is set, cached on disk like the
engine's step cost; never timed while a rollout runs).

Per request (`req.proposer_state["drafter"]`): how many positions have features, how many head
rows were written from them (rows from there on were written from the head's own drafts and are
rewritten next time: a rollback costs nothing), the current run of accepted drafter tokens (the
draft's evidence) and the prepared draft. A confidence per token comes from the margin between
the best and the second-best perturbed head score.

When a request leaves the engine (finished, or paused at the end of a chunk) its tokens and
features go to the training buffer (drafter/buffer.py), tagged with the policy version: no extra
forward is needed to train on the rollout.

A head that does not fit the policy (another vocabulary or hidden size, NaN weights, a state
that does not load) is refused with a ValueError by `set_head`, and switches the drafter off
with a warning when it comes from a folder or a published state: drafts only ever cost forwards,
so an absent drafter changes no token.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout import step_cost
from rollout.config import DrafterSpec
from rollout.kv_cache import move_slots
from rollout.proposers.base import Draft, HiddenSpan, Proposer
from rollout.request import Request

from .buffer import FeatureBuffer
from .draft import Chain, ChainDraft, draft_chains
from .export import from_state, load
from .features import SavedRollout
from .head import DraftHead


@dataclass
class _State:
    known: int = 0  # sequence positions 0 .. known - 1 have features in the store
    written: int = 0  # head rows 0 .. written - 1 hold keys made from those features ...
    gen: int = -1  # ... under this head generation
    run: int = 0  # drafter tokens accepted since its last rejected one
    draft: Optional[ChainDraft] = None  # prepared this step ...
    draft_at: int = -1  # ... for this response position


class DrafterProposer(Proposer):
    name = "drafter"
    prior = 0.8  # a head is set because it was trained for this policy
    batched = True

    def __init__(self, model, spec: DrafterSpec, num_slots: int, max_len: int, max_positions: int):
        self.model, self.spec = model, spec
        self.num_slots, self.max_len, self.max_positions = num_slots, max_len, max_positions
        self.head: Optional[DraftHead] = None
        self.head_version = 0
        self.cache = None
        self.gen = 0  # bumped whenever what the head's cached rows mean changes
        self.store: Optional[torch.Tensor] = None  # [slots, max_len, d] features
        self.buffer = FeatureBuffer(spec.buffer_tokens) if spec.collect else None
        self.policy_version = 0
        self.cost: dict = {"requests": [1], "seconds": [0.0]}  # seconds per draft position by requests (`_profile`)
        self.active = 0  # requests with state here: none means the engine is between rollouts
        self.stats = {"seconds": 0.0, "positions": 0, "chains": 0, "steps": 0, "tokens": 0, "compared": 0}
        self.off_reason: Optional[str] = None

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

    # ---- the head ----------------------------------------------------------------------------

    def set_head(self, head: DraftHead, version: int) -> None:
        """Draft with this head from now on (used as is, not copied: an in-process trainer may
        keep training it, calling set_head again to say so). ValueError, changing nothing, for a
        head of another policy shape or with NaN / Inf weights."""
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
        self.head, self.head_version, self.off_reason = head.eval(), int(version), None
        self.gen += 1
        if fresh:
            self.cost = self._profile()

    def _profile(self) -> dict:
        """Seconds per draft position for one request and for a full batch: chains of k positions
        timed (the fastest of two, after one untimed), over k; cached on disk for this policy
        shape, head shape, device and thread count (rollout/budget.py `cached`). Rows are written
        from position 0 of the slots: every request rewrites its slot from row 0 after a new head
        (the generation changes)."""
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
        sizes, seconds = self.cost["requests"], self.cost["seconds"]
        if len(sizes) == 1:
            return seconds[0]
        return max(seconds[0] + (seconds[-1] - seconds[0]) * (n - sizes[0]) / (sizes[-1] - sizes[0]), 0.0)

    def load(self, source, version: int) -> bool:
        """A head from an export folder (path) or a published state (drafter.export.head_state).
        One that does not load switches the drafter off with a warning; returns whether it loaded."""
        try:
            head = load(source, self.model) if isinstance(source, str) else from_state(source, self.model)
            self.set_head(head, version)
            return True
        except ValueError as e:
            self.switch_off(f"draft head version {version} does not load: {e}")
            return False

    def switch_off(self, reason: str) -> None:
        warnings.warn(f"drafter switched off: {reason}", stacklevel=2)
        self.head, self.cache, self.off_reason = None, None, reason
        self.gen += 1

    def weights_updated(self, version: int) -> None:
        self.policy_version = version
        self.gen += 1  # the features behind every cached row changed meaning

    # ---- the engine's hooks -------------------------------------------------------------------

    def observe_hidden(self, spans: Sequence[HiddenSpan], hidden: torch.Tensor) -> None:
        """Keep each span's features at [slot, position] of the store: one copy per step."""
        if not spans:
            return
        store = self._store(hidden)
        length = store.shape[1]
        dst, src = [], []
        for sp in spans:
            st = sp.req.proposer_state.get(self.name)
            if st is None:
                st = sp.req.proposer_state[self.name] = _State()
                self.active += 1
            if sp.start < st.known:  # the request is re-fed from an earlier position
                st.written = min(st.written, sp.start)
            elif sp.start > st.known:
                continue  # a gap (cannot happen with the engine's spans): draft nothing for it
            base = sp.req.slot * length + sp.start
            dst.extend(range(base, base + sp.count))
            src.extend(range(sp.offset, sp.offset + sp.count))
            st.known = sp.start + sp.count
        if dst:
            index = torch.tensor(dst, device=store.device)
            rows = hidden if src == list(range(hidden.shape[0])) else hidden[torch.tensor(src, device=hidden.device)]
            store.view(-1, store.shape[-1]).index_copy_(0, index, rows.to(store.dtype))

    def prepare(self, requests: Sequence[Request], k: int) -> None:
        """Draft up to k positions for every decoding request at once (the budget found k worth
        their cost); `propose` hands the drafts out, and the budget cuts each where its tokens
        stop paying."""
        start = time.perf_counter()
        if self.head is None or not requests or k < 1:
            return
        try:
            chains, states = [], []
            for req in sorted(requests, key=lambda r: r.slot):  # slot order: the head reads its cache in place
                st = req.proposer_state.get(self.name)
                chain = self._chain(req, st, k) if st is not None else None
                if chain is not None:
                    chains.append(chain)
                    states.append(st)
            if chains:
                drafts = draft_chains(self.head, self.model, self.cache, chains, margins=True)
                for c, st, d in zip(chains, states, drafts):
                    st.draft, st.draft_at, st.written = d, c.position, c.start + len(c.tokens)
                self._count(drafts)
        finally:  # (a figure for reports: no budget reads it)
            self.stats["seconds"] += time.perf_counter() - start

    def _count(self, drafts: list[ChainDraft]) -> None:
        """The step's figures (its seconds are counted by `prepare`, look-ups included)."""
        positions, tokens = max(len(d.tokens) for d in drafts), sum(len(d.tokens) for d in drafts)
        s = self.stats
        s["positions"] += positions
        s["chains"] += len(drafts)
        s["steps"] += 1
        s["tokens"] += tokens

    def _chain(self, req: Request, st: _State, most: int) -> Optional[Chain]:
        q = req.num_tokens - 1  # the pending token's position: features up to q - 1 are needed
        k = min(most, self.max_positions, req.remaining - 1, req.chunk_left - 1, self.max_len - 1 - q)
        if k < 1 or st.known < q or req.slot < 0:
            return None
        if q < 1:
            return None  # a one-token prompt with no output yet: no row to start from
        if st.gen != self.gen:
            st.written, st.gen = 0, self.gen
        start = min(st.written, q - 1)
        window = self.head.cfg.window if self.head is not None else None
        if window is not None:  # the chain's first query sees rows q - window .. q - 1: none below is ever read
            start = max(start, q - window)
        p = len(req.prompt_ids)
        ids = req.prompt_ids[start + 1:] + req.output_ids if start + 1 < p else req.output_ids[start + 1 - p:]
        return Chain(slot=req.slot, start=start, tokens=ids, feats=self.store[req.slot, start:q],
                     seed=req.seed, position=len(req.output_ids), k=k, temperature=req.params.temperature,
                     top_k=req.params.top_k, top_p=req.params.top_p, stop=req.params.stop_token_ids)

    def propose(self, req: Request, k: int) -> Optional[Draft]:
        st = req.proposer_state.get(self.name)
        if k <= 0 or st is None or st.draft is None or st.draft_at != len(req.output_ids):
            return None
        n = min(k, len(st.draft.tokens))
        conf = [1.0 - math.exp(-m) for m in st.draft.margins[:n]]
        return Draft(st.draft.tokens[:n], self, evidence=st.run, confidence=conf)

    def observe(self, req: Request, draft: Optional[Draft], num_accepted: int, emitted: list[int]) -> None:
        st = req.proposer_state.get(self.name)
        if st is None:
            return
        st.draft = None
        if draft is not None:  # a token past the request's end is neither accepted nor rejected (the engine's rule)
            rejected = num_accepted < min(len(draft.tokens), len(emitted))
            self.stats["compared"] += num_accepted + rejected
            st.run = 0 if rejected else st.run + num_accepted

    def finish(self, req: Request) -> None:
        st = req.proposer_state.get(self.name)
        if st is not None and self.buffer is not None and req.slot >= 0 and (req.finish_reason or req.paused):
            self._collect(req, st)
        if st is not None:
            self.active -= 1
            if self.active <= 0:
                self.active = 0
        super().finish(req)

    def _collect(self, req: Request, st: _State) -> None:
        """The request's tokens and features into the buffer. The last token's own feature is
        never used in training (nothing follows it), so when it was not fed it is left zero."""
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

    def slots_moved(self, src, dst, length: int) -> None:
        """Features and head rows are kept per slot: they move with their requests (a head's rows
        may run a draft past the context, and a windowed head's ring is shorter: whole slots)."""
        if self.store is not None:
            move_slots(self.store, src, dst)
        if self.cache is not None:
            move_slots(self.cache.k, src, dst)
            move_slots(self.cache.v, src, dst)

    def _store(self, hidden: torch.Tensor) -> torch.Tensor:
        d = hidden.shape[-1]
        if self.store is None or self.store.dtype != hidden.dtype or self.store.device != hidden.device:
            self.store = torch.zeros(self.num_slots, self.max_len, d, dtype=hidden.dtype, device=hidden.device)
        return self.store

    def state_sizes(self) -> dict[str, int]:
        return {}
