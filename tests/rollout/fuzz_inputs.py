"""Hypothesis strategies for the engine's inputs, each drawn value tagged with what the contract
says of it: OK (must be accepted), BAD (must be refused with a ValueError naming its field) or
EITHER (the contract leaves it open: a ValueError naming the field, or valid completions).

KNOWN_BUGS names input classes that break the contract on main today; they are left out of
the draws so the fuzz tests keep guarding everything else, and each has a strict xfail test in
test_fuzz_engine.py. When one is fixed, its xfail test passes (and fails as strict): remove the
name here and the xfail mark there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from rollout import SamplingParams

OK, EITHER, BAD = 0, 1, 2

KNOWN_BUGS = frozenset()


@dataclass
class Drawn:
    """A call's arguments and the status of each field, by the name its error must carry."""

    kwargs: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)

    def mark(self, name: str, status: int) -> None:
        self.status[name] = max(self.status.get(name, OK), status)

    def names(self, status: int) -> list[str]:
        return [n for n, s in self.status.items() if s == status]

    @property
    def worst(self) -> int:
        return max(self.status.values(), default=OK)


def token(vocab: int, bugs=KNOWN_BUGS, stop_ids: bool = False):
    """(value, status) of one token id (of a prompt or draft, or with stop_ids of a stop token)."""
    opts = [st.integers(0, vocab - 1).map(lambda v: (v, OK)),
            st.integers(0, vocab - 1).map(lambda v: (np.int64(v), OK)),
            st.integers(vocab, 2**70).map(lambda v: (v, BAD)),
            st.integers(-2**70, -1).map(lambda v: (v, BAD)),
            st.booleans().map(lambda v: (v, EITHER)),  # Python's bools are ints
            st.integers(0, vocab - 1).map(lambda v: (float(v), EITHER))]
    if not (stop_ids and "param_types" in bugs):  # (SamplingParams.validate: int(t) raises TypeError on these)
        opts.append(st.sampled_from([math.nan, "x", None, [1], 1j]).map(lambda v: (v, BAD)))
    if "inf_ids" not in bugs:
        opts.append(st.sampled_from([math.inf, -math.inf]).map(lambda v: (v, BAD)))
    if "lossy_ids" not in bugs:
        opts.append(st.floats(0.01, vocab - 0.01).filter(lambda v: v != int(v)).map(lambda v: (v, BAD)))
        opts.append(st.integers(0, vocab - 1).map(lambda v: (str(v), BAD)))
        opts.append(st.integers(0, vocab - 1).map(lambda v: (str(v).encode(), BAD)))
    return st.one_of(opts)


@st.composite
def token_list(draw, vocab: int, min_size: int = 0, max_size: int = 8, bugs=KNOWN_BUGS, stop_ids: bool = False):
    """(list, status): mostly clean lists of valid ids, sometimes with any token value in them."""
    if draw(st.integers(0, 9)) < 8:
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size))
        return ids, OK
    pairs = draw(st.lists(token(vocab, bugs, stop_ids), min_size=min_size, max_size=max_size))
    return [v for v, _ in pairs], max((s for _, s in pairs), default=OK)


@st.composite
def id_sequence(draw, vocab: int, min_size: int, max_size: int, bugs=KNOWN_BUGS):
    """(value, status) of a sequence of ids: a list, a numpy array, or something that is none."""
    ids, status = draw(token_list(vocab, min_size, max_size, bugs))
    kind = draw(st.integers(0, 19))
    if kind == 0 and status == OK:
        return np.array(ids, dtype=np.int64), OK
    if kind == 1:
        return draw(st.sampled_from([None, 5, 2.5, "abc"])), BAD
    return ids, status


@st.composite
def _float(draw, ok, bad, either=(), ok_in_10: int = 5):
    """(value, status): valid ok_in_10 times in ten, else at the contract's edges (either) or out
    of it (bad), as often as each other."""
    k = draw(st.integers(0, 9))
    split = (10 + ok_in_10) // 2
    if k < ok_in_10 or (k < split and not either):
        return draw(st.one_of(ok)), OK
    if k < split:
        return draw(st.one_of(either)), EITHER
    return draw(st.one_of(bad)), BAD


def temperature(bugs):
    either = [st.floats(1e-3, 1e-2, exclude_max=True), st.floats(1e4, 1e30)]
    if "extreme_temperature" not in bugs:
        either += [st.floats(5e-324, 1e-3), st.floats(1e30, 1e308), st.just(math.inf)]
    bad = [st.floats(-1e9, -1e-9), st.just(math.nan)]
    if "param_types" not in bugs:
        bad += [st.sampled_from(["1.0", None])]
    return _float([st.just(0.0), st.floats(0.05, 5.0)], bad, either)


def top_p(bugs):
    bad = [st.sampled_from([0.0, -0.5, 1.5, math.nan, math.inf])]
    if "param_types" not in bugs:
        bad += [st.sampled_from(["0.5", None])]
    return _float([st.floats(0.05, 1.0)], bad, [st.floats(5e-324, 1e-30)])


def int_field(ok, bad_ints, bugs, float_is_bug: bool = False):
    bad = [bad_ints, st.sampled_from([2.5, -1.5])]
    either = [] if float_is_bug and "float_max_tokens" in bugs else [st.sampled_from([2.0, True])]
    if "param_types" not in bugs:
        bad += [st.sampled_from([math.nan, math.inf, "3", None])]
    return _float([ok], bad, either)


@st.composite
def sampling_params(draw, vocab: int, bugs=KNOWN_BUGS) -> tuple[object, dict]:
    """(SamplingParams, {field: status})."""
    values, status = {}, {}
    for name, strat in (("temperature", temperature(bugs)), ("top_p", top_p(bugs)),
                        ("top_k", int_field(st.integers(0, 2 * vocab), st.integers(-100, -1), bugs)),
                        ("max_tokens", int_field(st.integers(1, 12), st.integers(-5, 0), bugs, float_is_bug=True))):
        if draw(st.integers(0, 3)) == 0:
            values[name], status[name] = draw(strat)
    if draw(st.booleans()):
        ids, s = draw(token_list(vocab, 0, 3, bugs, stop_ids=True))
        if "param_types" not in bugs and draw(st.integers(0, 9)) == 0:
            ids, s = draw(st.sampled_from([None, 3])), BAD
        values["stop_token_ids"], status["stop_token_ids"] = ids, s
    values.setdefault("max_tokens", draw(st.integers(1, 12)))
    return SamplingParams(**values), status


@st.composite
def generate_args(draw, vocab: int, max_len: int, bugs=KNOWN_BUGS, outputs: bool = False) -> Drawn:
    """Arguments of Engine.generate (and of make_requests with outputs=True), with their status:
    half the time all valid, half the time with anything in any field."""
    if draw(st.booleans()):
        return draw(valid_args(vocab, max_len, outputs))
    d = Drawn()
    n = draw(st.integers(1, 4))
    prompts = []
    for i in range(n):
        size = draw(st.sampled_from([0, max_len - 1, max_len])) if draw(st.integers(0, 9)) == 0 else None
        p, s = draw(id_sequence(vocab, 1 if size is None else size, 8 if size is None else size, bugs))
        if s != BAD and hasattr(p, "__len__") and not 0 < len(p) < max_len:
            s = BAD  # empty, or no room left to generate
        prompts.append(p)
        d.mark(f"prompt {i}", s)
    d.kwargs["prompt_token_ids"] = prompts
    _params(draw, d, vocab, n, bugs)
    _seeds(draw, d, n, bugs)
    drafts = _per_prompt_ids(draw, d, "drafts", vocab, n, bugs)
    _draft_logprobs(draw, d, drafts, n, bugs)
    _groups(draw, d, n, bugs)
    if outputs:
        _per_prompt_ids(draw, d, "outputs", vocab, n, bugs)
    return d


def _count(draw, n: int) -> int:
    """How many per-prompt entries to give: n, or (rarely) a wrong number."""
    return n if draw(st.integers(0, 14)) else draw(st.sampled_from([0, n + 1, max(0, n - 1)]))


def _params(draw, d: Drawn, vocab: int, n: int, bugs) -> None:
    kind = draw(st.integers(0, 9))
    if kind < 6:
        p, status = draw(sampling_params(vocab, bugs))
        d.kwargs["sampling_params"] = p
    else:
        drawn = [draw(sampling_params(vocab, bugs)) for _ in range(_count(draw, n))]
        d.kwargs["sampling_params"] = [p for p, _ in drawn]
        status = {}
        for _, s in drawn:
            for k, v in s.items():
                status[k] = max(status.get(k, OK), v)
        if len(drawn) != n:
            d.mark("sampling_params", BAD)
        if kind == 9 and drawn:
            d.kwargs["sampling_params"][0] = draw(st.sampled_from([None, {"temperature": 1.0}, 1.0]))
            d.mark("sampling_params", BAD)
    for k, v in status.items():
        d.mark(k, v)


def _seeds(draw, d: Drawn, n: int, bugs) -> None:
    kind = draw(st.integers(0, 9))
    if kind < 3:
        return
    if kind == 3 and "non_sequences" not in bugs:
        d.kwargs["seeds"], _ = draw(st.sampled_from([5, 2.5])), d.mark("seeds", BAD)
        return
    seeds = []
    for _ in range(_count(draw, n)):
        v, s = draw(_float([st.integers(0, 2**63 - 1)], [st.sampled_from([-1, 2**63, 2**64, 1.0, math.nan, "7", None])],
                           [st.sampled_from([np.int64(3), True])], ok_in_10=8))
        seeds.append(v)
        d.mark("seeds", s)
    if len(seeds) != n:
        d.mark("seeds", BAD)
    d.kwargs["seeds"] = seeds


def _per_prompt_ids(draw, d: Drawn, name: str, vocab: int, n: int, bugs):
    """drafts / outputs: None, or one entry (None or ids) per prompt."""
    kind = draw(st.integers(0, 9))
    if kind < 3:
        return None
    if kind == 3 and "non_sequences" not in bugs:
        d.kwargs[name] = 5
        d.mark(name, BAD)
        return None
    entries = []
    for i in range(_count(draw, n)):
        if draw(st.booleans()):
            entries.append(None)
            continue
        ids, s = draw(id_sequence(vocab, 0, 12, bugs))
        entries.append(ids)
        d.mark(f"{name}[{i}]", OK if ids is None else s)  # (None: no draft / no output, which is fine)
    if len(entries) != n:
        d.mark(name, BAD)
    d.kwargs[name] = entries
    return entries


def _draft_logprobs(draw, d: Drawn, drafts, n: int, bugs) -> None:
    if drafts is None or len(drafts) != n or draw(st.integers(0, 2)) == 0:
        return
    out = []
    for i, dr in enumerate(drafts):
        name = f"draft_logprobs[{i}]"
        if draw(st.integers(0, 3)) == 0 or (dr is None and draw(st.integers(0, 9))):
            out.append(None)
            continue
        size = len(dr) if dr is not None and hasattr(dr, "__len__") else 0
        if draw(st.integers(0, 9)) == 0:
            size += 1
        values = [draw(st.one_of(st.floats(-30, 0), st.sampled_from([math.nan, -math.inf, 0.5, math.inf])))
                  for _ in range(size)]
        if "logprob_types" not in bugs and draw(st.integers(0, 9)) == 0:
            values = draw(st.sampled_from([[None] * max(size, 1), ["x"] * max(size, 1), 5]))
            d.mark(name, BAD)
        out.append(values)
        if dr is None or not hasattr(dr, "__len__") or not isinstance(values, list) or len(values) != len(dr):
            d.mark(name, BAD)
        else:
            d.mark(name, OK)  # NaN / inf logprobs are "unknown": the engine copes, they only guide drafting
    d.kwargs["draft_logprobs"] = out


def _groups(draw, d: Drawn, n: int, bugs) -> None:
    kind = draw(st.integers(0, 9))
    if kind < 3:
        return
    groups = []
    for _ in range(_count(draw, n)):
        choices = [st.none().map(lambda v: (v, OK)), st.integers(-3, 3).map(lambda v: (v, OK)),
                   st.sampled_from(["a", 2.5, math.nan]).map(lambda v: (v, EITHER))]
        if "group_types" not in bugs:
            choices.append(st.sampled_from([[1], {"a": 1}]).map(lambda v: (v, BAD)))
        v, s = draw(st.one_of(choices)) if draw(st.integers(0, 4)) == 0 else (draw(st.integers(0, 3)), OK)
        groups.append(v)
        d.mark("groups", s)
    if len(groups) != n:
        d.mark("groups", BAD)
    d.kwargs["groups"] = groups


@st.composite
def valid_args(draw, vocab: int, max_len: int, outputs: bool = False) -> Drawn:
    """Arguments the contract accepts, every field OK."""
    n = draw(st.integers(1, 4))
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8)
    maybe_ids = st.one_of(st.none(), st.lists(st.integers(0, vocab - 1), max_size=12))
    params = st.builds(SamplingParams, temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
                       top_p=st.floats(0.05, 1.0), top_k=st.integers(0, 2 * vocab), max_tokens=st.integers(1, 12),
                       stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=3).map(tuple))
    kwargs = {"prompt_token_ids": draw(st.lists(ids, min_size=n, max_size=n)),
              "sampling_params": draw(st.one_of(params, st.lists(params, min_size=n, max_size=n))),
              "seeds": draw(st.one_of(st.none(), st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n))),
              "groups": draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=n,
                                                           max_size=n)))}
    drafts = draw(st.one_of(st.none(), st.lists(maybe_ids, min_size=n, max_size=n)))
    kwargs["drafts"] = drafts
    if drafts is not None and draw(st.booleans()):
        kwargs["draft_logprobs"] = [None if dr is None else draw(st.lists(st.floats(-30, 0), min_size=len(dr),
                                                                          max_size=len(dr))) for dr in drafts]
    if outputs:
        kwargs["outputs"] = draw(st.one_of(st.none(), st.lists(maybe_ids, min_size=n, max_size=n)))
    return Drawn(kwargs=kwargs, status={"prompt 0": OK})
