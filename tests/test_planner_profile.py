"""The serving engine's planner can take a measured step-time profile (--planner-profile FILE|auto)."""
from __future__ import annotations

import asyncio
import json

import pytest

from nightjar.actors.step_profile import roofline_profile
from nightjar.sampling import ConfigError, SamplingParams
from tests.test_engine import prompts_of_mixed_length, run_all


def test_an_engine_given_a_profile_plans_with_it_and_stays_greedy_exact(make_engine, smol_tokenizer, tmp_path):
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(roofline_profile("a100", "13b").to_json()))
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    async def run(policy, **kw):
        async with make_engine(policy, **kw) as eng:
            out = await run_all(eng, prompts, params)
            return out, eng

    ref, _ = asyncio.run(run("off"))
    got, eng = asyncio.run(run("nightjar", planner_profile=str(path)))
    assert got == ref
    assert eng.planner.policy.profile is not None and eng.planner.policy.profile.name == "roofline:a100:13b"
    assert eng.trace_header()["planner_profile"]["profile"]["name"] == "roofline:a100:13b"
    _, plain = asyncio.run(run("nightjar"))
    assert plain.planner.policy.profile is None and "planner_profile" not in plain.trace_header()


def test_a_bad_profile_file_is_a_config_error(make_engine, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (str(bad), str(tmp_path / "missing.json")):
        with pytest.raises(ConfigError) as e:
            asyncio.run(make_engine("nightjar", planner_profile=path).start())
        assert e.value.field == "planner_profile"


@pytest.fixture
def fake_measure(monkeypatch, tmp_path):
    """``planner_profile="auto"`` with its cache in tmp_path and a stand-in for the ~30 s measurement that
    writes the A100-13B roofline; returns the list of argv it was called with."""
    from nightjar import profile_cache

    monkeypatch.setenv("NIGHTJAR_CACHE", str(tmp_path))
    runs = []

    def measure(argv):
        runs.append(argv)
        with open(argv[argv.index("--out") + 1], "w") as f:
            json.dump(roofline_profile("a100", "13b").to_json(), f)
    monkeypatch.setattr(profile_cache, "measure", measure)
    return runs


def test_the_auto_profile_is_measured_once_per_model_dtype_quantizations_and_machine(fake_measure, tmp_path):
    from nightjar import profile_cache as prof

    runs = fake_measure
    a = prof.cached_profile("smollm2-135m", "default", "bfloat16", log=lambda s: None)
    b = prof.cached_profile("smollm2-135m", "default", "bfloat16", log=lambda s: None)
    c = prof.cached_profile("smollm2-135m", "default", "float32", log=lambda s: None)
    d = prof.cached_profile("smollm2-135m", "default", "bfloat16", log=lambda s: None, quantization="int4")
    assert a == b != c != d != a and len(runs) == 3 and a.startswith(str(tmp_path))
    assert "--quick" in runs[0] and runs[0][runs[0].index("--dtype") + 1] == "bfloat16"
    assert runs[2][runs[2].index("--quantization") + 1] == "int4"       # measured with the int4 kernels
    flag = lambda run: run[run.index("--draft-quantization") + 1]          # noqa: E731
    assert flag(runs[0]) == "mixed" and flag(runs[2]) == "int4"          # the draft as the engine loads it
    e = prof.cached_profile("smollm2-135m", "default", "bfloat16", log=lambda s: None, draft_quantization="none")
    assert e != a and len(runs) == 4 and flag(runs[3]) == "none"


def test_the_profile_of_a_shipped_drafter_name_is_keyed_by_the_drafter_it_names(monkeypatch, tmp_path):
    import nightjar.models as m
    from nightjar import profile_cache as prof

    monkeypatch.setenv("NIGHTJAR_CACHE", str(tmp_path))
    key = lambda d: prof.cache_path("smollm2-135m", d, "bfloat16")        # noqa: E731
    assert key("default") == key("head") != key("independent") != key("none")
    monkeypatch.setitem(m.NAMED_DRAFTS, "default", m.INDEPENDENT_DRAFT_DIR)    # another default: re-measured
    assert key("default") == key("independent") != key("head")


def test_a_profile_measured_on_the_fused_cpu_ops_is_not_served_without_them(monkeypatch, tmp_path):
    from nightjar import profile_cache as prof
    from nightjar.models import cpu_fused

    fused = cpu_fused.available()                      # built (or found) where the suite builds it
    monkeypatch.setenv("NIGHTJAR_CACHE", str(tmp_path))
    on = prof.cache_path("smollm2-135m", "none", "bfloat16")
    monkeypatch.setenv("NIGHTJAR_CPU_FUSED", "0")
    assert (prof.cache_path("smollm2-135m", "none", "bfloat16") != on) == fused


def test_a_profile_measured_with_amx_tiles_is_not_served_without_them(monkeypatch, tmp_path):
    import torch

    from nightjar import profile_cache as prof
    from nightjar.models import cpu_fused

    if not cpu_fused.available():
        pytest.skip("no fused CPU ops here, so no AMX kernels either")
    monkeypatch.setenv("NIGHTJAR_CACHE", str(tmp_path))
    amx = cpu_fused.uses_amx()
    on = prof.cache_path("smollm2-135m", "none", "bfloat16", quantization="int4")
    try:
        assert torch.ops.nightjar_cpu.use_amx(False) is False and not cpu_fused.uses_amx()
        assert (prof.cache_path("smollm2-135m", "none", "bfloat16", quantization="int4") != on) == amx
    finally:
        torch.ops.nightjar_cpu.use_amx(cpu_fused.amx_enabled())


def test_generate_with_an_auto_profile_measures_then_serves(fake_measure, capsys, smollm2_path):
    from nightjar.cli import main

    measured = fake_measure
    args = ["generate", "hi", "--planner-profile", "auto", "--policy", "off", "--draft", "none",
            "--dtype", "float32", "--max-tokens", "2", "--json"]
    assert main(args) == 0 and main(args) == 0
    assert len(measured) == 1                                   # cached after the first start
    assert "measuring one into" in capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [
    (["serve"], "auto"),                                                # nightjar + the default draft
    (["serve", "--policy", "nightjar-nooffload"], "auto"),
    (["serve", "--policy", "nightjar:per-request"], "auto"),
    (["serve", "--policy", "off"], None),                               # reads no profile: nothing measured
    (["serve", "--policy", "fixed:2"], None),
    (["serve", "--policy", "nightjar-paper"], None),
    (["serve", "--draft", "none"], None),
    (["serve", "--policy", "fixed:9"], None),                           # a bad policy: check_config's to name
    (["serve", "--planner-profile", "none"], None),                     # the generic prior, asked for
    (["serve", "--planner-profile", "p.json"], "p.json"),
    (["generate", "hi"], None),                                         # one request: not worth 30 s
    (["generate", "hi", "--planner-profile", "auto"], "auto"),
    (["generate", "hi", "--planner-profile", "none"], None),
])
def test_a_server_reads_the_auto_profile_by_default_where_its_policy_reads_one(argv, want):
    from nightjar.cli import build_parser
    from nightjar.engine_args import engine_kwargs

    assert engine_kwargs(build_parser().parse_args(argv))["planner_profile"] == want


def test_serve_measures_the_auto_profile_once_and_hands_the_server_its_path(fake_measure, monkeypatch,
                                                                           smollm2_path, tmp_path):
    import nightjar.api.app as app
    from nightjar.cli import main

    served = []
    monkeypatch.setattr(app, "serve", lambda kw, **_: served.append(kw))
    for argv in (["--dtype", "float32"], ["--dtype", "float32"], ["--dtype", "float32", "--policy", "off"]):
        assert main(["serve", *argv]) == 0
    assert len(fake_measure) == 1                                       # cached after the first start
    assert served[0]["planner_profile"] == served[1]["planner_profile"] and \
        served[0]["planner_profile"].startswith(str(tmp_path))
    assert served[2]["planner_profile"] is None


def test_an_embedded_engine_takes_auto_as_the_cli_does(fake_measure, tmp_path, make_engine):
    measured = fake_measure

    async def start():
        async with make_engine("nightjar", planner_profile="auto") as eng:
            return eng
    eng = asyncio.run(start())
    assert len(measured) == 1 and eng.config.planner_profile.startswith(str(tmp_path))
    assert eng.planner.policy.profile.name == "roofline:a100:13b"


def test_the_ngram_drafter_gets_an_auto_profile_of_the_target_alone(fake_measure, tiny_pair, smollm2_path):
    from nightjar.engine import Engine
    from nightjar.offline.profile import _load_pair, build_parser

    async def start():
        async with Engine(policy="nightjar", draft="ngram", loaded=(tiny_pair[0], None), dtype="float32",
                          planner_profile="auto") as eng:
            return eng
    asyncio.run(start())
    argv = fake_measure[0]
    assert argv[argv.index("--draft") + 1] == "ngram"
    a = build_parser().parse_args(["--model", str(smollm2_path), "--draft", "ngram", "--dtype", "float32"])
    target, draft = _load_pair(a)                   # what that measurement loads: no draft passes to time
    assert draft is None and target.config.vocab_size == 49152


def test_a_failed_auto_measurement_is_a_config_error(tmp_path):
    from nightjar.profile_cache import measure

    with pytest.raises(ConfigError) as e:
        measure(["--model", str(tmp_path / "missing.gguf"), "--draft", "none", "--quick", "--no-engine",
                 "--out", str(tmp_path / "p.json")])
    assert e.value.field == "planner_profile" and "exit 2" in e.value.message


def test_isotonic_pools_violators_and_keeps_a_sorted_sequence():
    from nightjar.offline.profile import isotonic

    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert isotonic([1.0, 4.0, 2.0, 5.0]) == [1.0, 3.0, 3.0, 5.0]


def test_a_noisy_measured_grid_becomes_monotone_in_q_and_in_b():
    """A grid as measured on the shared box (ms): T(1,1) > T(1,2), T(2,2) < T(2,1), T(4,3) < T(4,2)."""
    from nightjar.offline.profile import monotone_grid

    raw = [[65.1, 40.3, 56.9, 90.0], [51.6, 41.1, 42.1, 54.1], [48.9, 57.4, 50.3, 57.5], [56.0, 63.9, 81.0, 76.3]]
    T = monotone_grid(raw)
    for i in range(4):
        for j in range(4):
            assert (j == 0 or T[i][j] >= T[i][j - 1]) and (i == 0 or T[i][j] >= T[i - 1][j])
    assert sum(map(sum, T)) == pytest.approx(sum(map(sum, raw)), rel=0.1)      # pooled, not inflated


def test_the_quick_profile_covers_the_batch_and_draft_lengths_the_planner_reads(tiny_pair):
    from nightjar.offline.profile import build_profile

    t, d = tiny_pair
    prof = build_profile(t.model, d.model, name="tiny", block_size=8, ctx=16, quick=True, reps=1, log=lambda s: None)
    assert prof.B[-1] == 64 and prof.q[-1] >= 5 and prof.draft_B[-1] == 64
    for row in prof.T:
        assert row == sorted(row)
    assert prof.meta["T_raw"] and prof.draft_T == sorted(prof.draft_T)
    assert prof.ctx_ref == 16 and prof.kv_s_per_ctx_token >= 0.0             # T timed at 16 tokens a row


def test_the_draft_is_timed_right_after_an_untimed_target_forward_as_the_engine_runs_it(monkeypatch):
    """T_draft(B) times each draft forward just after a target forward (the target evicts the draft's
    weights from the caches), and only the draft forward is inside the timer."""
    from nightjar.offline import profile as p

    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(p.time, "perf_counter", lambda: float(next(clock)))
    t = p._quartile_time(lambda: calls.append("draft"), reps=3, before=lambda: calls.append("target"))
    assert calls == ["target", "draft"] * 5                # two warm-up pairs, then one pair per repetition
    assert t == 1.0                                         # two clock reads around the draft alone
