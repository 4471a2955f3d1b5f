"""The soak's short version, and proof that its checks can fail."""
import json

from benchmarks.soak import PROPOSERS, SoakConfig, growth, growth_failures, leftover_state, main, run_soak
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.proposers.base import StepResult
from rollout.proposers.suffix import SuffixIndex
from tests.conftest import tiny_hf_model


def test_short_soak_passes_and_writes_its_curve(tmp_path):
    out = tmp_path / "soak.json"
    report = main(["--requests", "240", "--prompts-per-wave", "10", "--pool-size", "20", "--max-len", "24",
                   "--out", str(out)])
    print(f"soak: {report['requests']} requests, rss {report['rss_mib_warm']:.1f} -> "
          f"{report['rss_mib_peak_after_warmup']:.1f} MiB ({100 * report['rss_mib_growth']:+.2f}%), "
          f"{report['gc_objects_per_request']:+.4f} objects per request")
    assert report["passed"], report["failures"]
    assert report["waves"] == 6 and report["warmup_waves"] == 3
    saved = json.loads(out.read_text())
    assert len(saved["samples"]) == 6 and saved["checked_waves"] == [4, 5]
    assert out.with_suffix(".png").stat().st_size > 1000
    # the workload exercises speculation: drafts were offered and accepted, some requests stopped
    assert sum(s["accepted"] for s in saved["samples"]) > 0
    assert sum(s["stopped"] for s in saved["samples"]) > 0


def test_leftover_state_sees_tables_a_request_left_behind():
    eng = Engine.from_pretrained(tiny_hf_model("llama", vocab=32),
                                 EngineConfig(max_batch_size=2, max_model_len=32, spec=SpecConfig(proposers=PROPOSERS)))
    eng.generate([[1, 2, 1, 2], [3, 4]], SamplingParams(max_tokens=6), seeds=[1, 2], drafts=[[1, 2], None],
                 groups=[7, None])
    assert leftover_state(eng) == {}
    req = eng.make_requests([[1, 2, 1, 2, 1]], SamplingParams(max_tokens=4), seeds=[3], drafts=[[2, 1, 2]],
                            groups=[5])[0]
    for p in eng.proposers:  # proposed for, never finished, group never released
        p.propose([req], 4)
    assert leftover_state(eng) == {"suffix.groups": 1}  # the group's index, until it is released
    assert set(req.proposer_state) == {"history", "suffix"}  # the request's own state goes with it
    for p in eng.proposers:
        p.on_step(StepResult(left=[req]))
    assert req.proposer_state == {}
    eng.release_groups({5})
    assert leftover_state(eng) == {}


def test_growth_is_judged_after_the_warm_up():
    samples = [{"requests": 100 * (i + 1), "rss_mib": m, "gc_objects": o}
               for i, (m, o) in enumerate([(300, 1000), (350, 1500), (351, 1500), (352, 1510)])]
    report = growth(samples, warmup=2)
    assert report["rss_mib_warm"] == 350 and abs(report["rss_mib_growth"] - 2 / 350) < 1e-12
    assert report["gc_objects_per_request"] == 10 / 200
    assert growth_failures(report, 0.05, 0.05) == []
    failures = growth_failures(report, 0.005, 0.01)
    assert len(failures) == 2 and "resident memory grew by 0.6%" in failures[0] and "0.050 per request" in failures[1]


def test_a_leaking_engine_fails_the_soak(monkeypatch):
    kept = []
    original = Engine.generate

    def leaky(self, *args, **kwargs):
        outs = original(self, *args, **kwargs)
        kept.extend([list(o.token_ids) * 20 for o in outs])  # something the engine would hold on to
        suffix = next(p for p in self.proposers if p.name == "suffix")
        suffix._groups[("group", object())] = SuffixIndex()  # a group never released
        return outs

    monkeypatch.setattr(Engine, "generate", leaky)
    report = run_soak(SoakConfig(requests=80, prompts_per_wave=5, pool_size=5, max_len=8, check_waves=0),
                      echo=lambda _: None)
    assert not report["passed"]
    assert any("state left behind" in f and "suffix.groups" in f for f in report["failures"])
    assert any("objects tracked by the garbage collector grew" in f for f in report["failures"])
