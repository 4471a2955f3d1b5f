"""Property-based tests (hypothesis) of the engine's input handling: `Engine.generate` and
`make_requests` on random, often invalid, prompts, token ids, sampling parameters, seeds,
drafts, groups and draft logprobs (tests/rollout/fuzz_inputs.py says what each value is).

Every call returns valid completions -- equal, token for token, to a plain engine's -- or raises
a ValueError naming a bad field; afterwards the engine holds no per-request or per-group state
and a fixed probe call gives the tokens it gave before. The strict xfail tests at the end are
bugs the fuzzing found on main (tests/rollout/fuzz_inputs.py KNOWN_BUGS).
"""
import copy
import math

import pytest
from hypothesis import HealthCheck, given, settings

from benchmarks.soak import leftover_state
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core.request import make_requests
from tests.conftest import tiny_hf_model
from tests.fuzz_counts import count
from tests.rollout.fuzz_inputs import BAD, EITHER, OK, generate_args

VOCAB, MAX_LEN = 40, 20
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def probe(engine):
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6), seeds=[1, 2], drafts=[[7, 8, 9], None],
                           groups=[0, 0])
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def engines():
    hf = tiny_hf_model("llama", vocab=VOCAB, seed=5)
    # fewer slots than prompts (queueing), small forwards (chunked prefill), drafts always offered
    spec = SpecConfig(proposers=("history", "suffix", "lookahead", "ngram"), max_draft_tokens=4, min_draft_prob=0.0)
    eng = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=MAX_LEN, max_num_batched_tokens=16,
                                                  spec=spec))
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=MAX_LEN))
    return eng, plain, probe(eng)


def outcome(call, drawn, test: str):
    """The call's result, or None when it raised a ValueError that the drawn input deserved."""
    try:
        result = call()
    except ValueError as e:
        msg = str(e)
        assert drawn.worst != OK, f"valid input refused: {msg} ({drawn.kwargs!r})"
        names = drawn.names(BAD) + drawn.names(EITHER)
        assert any(n in msg for n in names), f"the error {msg!r} names none of the fields {names}"
        count(test, "ValueError")
        return None
    assert drawn.worst != BAD, f"input with bad fields {drawn.names(BAD)} was accepted: {drawn.kwargs!r}"
    count(test, "completed")
    return result


def check_completions(outs, reqs) -> None:
    assert len(outs) == len(reqs)
    for o, r in zip(outs, reqs):
        n = len(o.token_ids)
        assert 1 <= n == len(o.logprobs)
        assert all(type(t) is int and 0 <= t < VOCAB for t in o.token_ids)
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in o.logprobs), o.logprobs
        assert o.seed == r.seed
        stops = set(r.params.stop_token_ids)
        assert not stops & set(o.token_ids[:-1])
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in stops
        else:
            assert o.finish_reason == "length" and o.token_ids[-1] not in stops
            assert n == r.params.max_tokens or len(r.prompt_ids) + n >= MAX_LEN


@settings(FUZZ, max_examples=80)
@given(drawn=generate_args(VOCAB, MAX_LEN))
def test_generate_completes_or_names_the_bad_field(engines, drawn):
    eng, plain, before = engines
    outs = outcome(lambda: eng.generate(**drawn.kwargs), drawn, "Engine.generate examples")
    if outs is not None:
        reqs = eng.make_requests(**{**drawn.kwargs, "seeds": [o.seed for o in outs]})
        check_completions(outs, reqs)
        ref = plain.generate([r.prompt_ids for r in reqs], [r.params for r in reqs], seeds=[o.seed for o in outs])
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], "drafts changed the tokens"
    assert leftover_state(eng) == {}
    assert probe(eng) == before


@settings(FUZZ, max_examples=300)
@given(drawn=generate_args(VOCAB, MAX_LEN, outputs=True))
def test_make_requests_builds_what_it_was_given_or_names_the_bad_field(drawn):
    kwargs = drawn.kwargs
    snapshot = repr(kwargs), copy.deepcopy(kwargs)
    reqs = outcome(lambda: make_requests(VOCAB, MAX_LEN, **kwargs), drawn, "make_requests examples")
    assert repr(kwargs) == snapshot[0], "make_requests changed its arguments"
    if reqs is None:
        return
    kw = snapshot[1]
    n = len(kw["prompt_token_ids"])
    assert [r.index for r in reqs] == list(range(n))
    per = {k: kw.get(k) or [None] * n for k in ("seeds", "drafts", "groups", "outputs", "draft_logprobs")}
    params = kw.get("sampling_params", SamplingParams())
    for i, r in enumerate(reqs):
        assert r.prompt_ids == [int(t) for t in kw["prompt_token_ids"][i]]
        assert all(type(t) is int for t in r.prompt_ids + r.output_ids + (r.history or []))
        assert r.params == (params if isinstance(params, SamplingParams) else params[i])
        assert r.seed == per["seeds"][i] if per["seeds"][i] is not None else 0 <= r.seed < 2**63
        assert r.history == (None if per["drafts"][i] is None else [int(t) for t in per["drafts"][i]])
        assert r.group is per["groups"][i] or r.group == per["groups"][i]
        outputs = [] if per["outputs"][i] is None else [int(t) for t in per["outputs"][i]]
        assert r.output_ids == outputs and len(r.logprobs) == len(outputs)
        lps = per["draft_logprobs"][i]
        assert (r.history_logprobs is None) == (lps is None)
        if lps is not None:
            assert len(r.history_logprobs) == len(r.history)


# ---- bugs the fuzzing found on main -----------------------------------------------------------


def refuses(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


def test_refused_infinite_token_id():
    refuses(lambda: make_requests(VOCAB, MAX_LEN, [[1, math.inf]]), "prompt 0")


@pytest.mark.parametrize("tok", [1.5, "5", b"5"])
def test_refused_lossy_token_id(tok):
    refuses(lambda: make_requests(VOCAB, MAX_LEN, [[1, tok]]), "prompt 0")


@pytest.mark.parametrize("field, value", [("temperature", "1.0"), ("temperature", None), ("top_p", None),
                                          ("top_k", math.inf), ("top_k", math.nan), ("max_tokens", math.inf),
                                          ("max_tokens", None), ("stop_token_ids", [math.inf]),
                                          ("stop_token_ids", [math.nan]), ("stop_token_ids", None)])
def test_refused_sampling_param_types(field, value):
    refuses(lambda: make_requests(VOCAB, MAX_LEN, [[1]], SamplingParams(**{field: value})), field)


def test_refused_float_max_tokens(engines):
    eng = engines[0]
    refuses(lambda: eng.generate([[1, 2, 1, 2]], SamplingParams(max_tokens=3.0), drafts=[[1, 2, 3]]), "max_tokens")


def test_refused_unhashable_group(engines):
    refuses(lambda: engines[0].generate([[1, 2]], SamplingParams(max_tokens=3), groups=[[1]]), "groups")


@pytest.mark.parametrize("lps", [[None], ["x"], 5])
def test_refused_draft_logprob_types(lps):
    refuses(lambda: make_requests(VOCAB, MAX_LEN, [[1]], drafts=[[2]], draft_logprobs=[lps]), r"draft_logprobs\[0\]")


@pytest.mark.parametrize("kwargs, name", [({"seeds": 5}, "seeds"), ({"drafts": 5}, "drafts"),
                                          ({"groups": 5}, "groups"), ({"prompt_token_ids": None}, "prompt")])
def test_refused_non_sequence_arguments(kwargs, name):
    kwargs = {"prompt_token_ids": [[1]], **kwargs}
    refuses(lambda: make_requests(VOCAB, MAX_LEN, **kwargs), name)


@pytest.mark.parametrize("temperature", [1e-40, 1e300])
def test_refused_extreme_temperature(engines, temperature):
    eng = engines[0]
    try:
        outs = eng.generate([[1, 2, 3]], SamplingParams(temperature=temperature, max_tokens=4), seeds=[3])
    except ValueError as e:
        assert "temperature" in str(e)
        return
    assert all(math.isfinite(lp) for lp in outs[0].logprobs)


def test_a_failed_run_leaves_no_proposer_state(engines, monkeypatch):
    eng, _, before = engines
    ngram = next(p for p in eng.proposers if p.name == "ngram")
    calls = []

    def fail_on_the_third(requests, k):
        calls.append(k)
        if len(calls) == 3:
            raise RuntimeError("a proposer failed")
        return [None] * len(requests)

    monkeypatch.setattr(ngram, "propose", fail_on_the_third)
    with pytest.raises(RuntimeError):
        eng.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=6), drafts=[[1, 2], None], groups=[3, None])
    monkeypatch.undo()
    try:
        assert leftover_state(eng) == {}
    finally:  # the other tests share this engine: clear what the failed run left
        for p in eng.proposers:
            for value in vars(p).values():
                if isinstance(value, dict):
                    value.clear()
    assert probe(eng) == before
