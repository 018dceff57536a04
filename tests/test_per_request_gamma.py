"""Per-request γ_i through the whole engine (issue 17): ``nightjar:per-request`` is greedy-exact and its
trace records per-row γ that control-plane replay reproduces."""
from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

from nightjar.actors.step_profile import Profile
from nightjar.kernel.messages import StepPlanned
from nightjar.models import LoadedModel
from nightjar.offline.replay import replay_file
from nightjar.sampling import SamplingParams
from tests.conftest import perturbed
from tests.test_engine import generate_with, prompts_of_mixed_length, run_all


def mixed_pair(tiny_pair):
    """The session's tiny target with a draft far enough off that requests accept differently."""
    target, draft = tiny_pair
    return target, LoadedModel(perturbed(target.model, 0.3, 5), None, "tiny-draft-0.3")


def cheap_draft_profile(path) -> str:
    """A planner profile (the planner's prior model, not a measurement) in which a draft pass costs 2 % of a
    target forward and verified tokens cost time: it makes the per-request planner draft, and mix γ_i, on
    the tiny CPU pair where the draft really costs about what the target does (calibration corrects it
    over time; the tests only need mixed steps to happen)."""
    Bs, qs = [1, 2, 4, 8, 16], [1, 2, 3, 4, 5]
    prof = Profile(name="test:cheap-draft", B=Bs, q=qs, T=[[0.01 + 0.002 * b * q for q in qs] for b in Bs],
                   draft_B=Bs, draft_T=[0.0002] * len(Bs), prefill_s_per_token=1e-5, catchup_c0=1e-4,
                   catchup_per_token=1e-6, offload_s=0.01, reload_s=0.01, draft_bytes=0, num_blocks=64,
                   block_size=8, draft_blocks=0)
    path.write_text(json.dumps(prof.to_json()))
    return str(path)


class ForcedRows:
    """A per-request policy stand-in that cycles through given γ vectors (the engine path under test is
    everything downstream of the planner)."""
    name, uses_draft, elastic_memory, per_request, gamma_max = "forced-rows", True, False, True, 3

    def __init__(self):
        self.combos = itertools.cycle(itertools.product(range(4), repeat=3))

    def decide_rows(self, b, state, req_ids, speculate, lags=None):
        vec = next(self.combos)
        return tuple(vec[i % 3] if sp else 0 for i, sp in enumerate(speculate))

    def observe(self, result):
        pass

    def observe_rows(self, req_ids, gammas, accepted):
        pass

    def snapshot(self):
        return {"policy": self.name}


def test_forced_mixed_gammas_through_the_engine_are_greedy_exact(make_engine, smol_tokenizer, tiny_pair, monkeypatch):
    """Every γ vector over 3 row classes (0..3 each, 64 vectors, cycled) through planner → KV pool → draft →
    verifier → batcher, with catch-up after γ_i = 0 rows and preemption in a small pool."""
    import nightjar.actors.planner as planner_mod

    pair = mixed_pair(tiny_pair)
    prompts = prompts_of_mixed_length(smol_tokenizer, 10)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=pair)
    monkeypatch.setattr(planner_mod, "make_policy", lambda *a, **k: ForcedRows())
    got, stats = generate_with(make_engine, "nightjar", prompts, params, pair=pair, max_num_seqs=8, gamma_max=3)
    assert got == ref and stats.draft_tokens > 0


def test_the_per_request_policy_is_greedy_exact(make_engine, smol_tokenizer, tiny_pair, tmp_path):
    """The real policy end to end (on this CPU pair it drafts little: the draft costs what the target does)."""
    pair = mixed_pair(tiny_pair)
    prompts = prompts_of_mixed_length(smol_tokenizer, 10)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=pair)
    prof = cheap_draft_profile(tmp_path / "prof.json")
    got, stats = generate_with(make_engine, "nightjar:per-request", prompts, params, pair=pair, max_num_seqs=8,
                               planner_profile=prof)
    assert got == ref and stats.draft_tokens > 0


def test_a_per_request_trace_replays_with_zero_divergence(make_engine, smol_tokenizer, tiny_pair, tmp_path):
    pair = mixed_pair(tiny_pair)
    path = tmp_path / "per_request.njtrace"
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    prof = cheap_draft_profile(tmp_path / "prof.json")

    async def main():
        async with make_engine("nightjar:per-request", pair=pair, trace=str(path), num_blocks=40, block_size=8,
                               max_num_seqs=4, gamma_max=3, planner_profile=prof) as eng:
            await run_all(eng, prompts, SamplingParams(max_tokens=24, ignore_eos=True))

    asyncio.run(main())
    res = replay_file(str(path))
    assert res.ok, res.summary()


def test_a_simulated_mixed_workload_records_per_row_gammas_that_replay_reproduces(tmp_path):
    """Synthetic per-request acceptance (two classes) on the CPU profile: the trace holds steps with
    different γ_i, and replaying the control plane reproduces every StepPlanned exactly."""
    from nightjar.kernel.trace import TraceReader
    from nightjar.offline.sim.executors import AcceptanceMix
    from nightjar.offline.sim.workload import make_workload
    from nightjar.offline.simulate import SimConfig, simulate

    path = tmp_path / "sim.njtrace"
    wl = make_workload("poisson:1", seed=0, num_requests=40, prompt_mean=64, output_mean=48, sigma=0.5, max_len=512)
    prof = Profile.load(str(Path(__file__).parent / "actors" / "data" / "profile_cpu_bf16.json"))
    r = simulate(prof, wl, "nightjar:per-request",
                 SimConfig(gamma_max=4, closed_loop=16, max_model_len=512), AcceptanceMix.parse("0.5:0.9;0.5:0.1"),
                 trace=str(path))
    assert r.finished == 40 and len([k for k, n in r.extra["row_gamma"].items() if n]) >= 3
    planned = [e.msg for e in TraceReader(str(path)) if isinstance(e.msg, StepPlanned)]
    assert sum(1 for m in planned if m.gammas and len(set(m.gammas)) > 1) >= 10
    res = replay_file(str(path))
    assert res.ok, res.summary()


def test_a_simulated_harmonic_run_replays_with_zero_divergence(tmp_path):
    """``nightjar:harmonic`` reads per-request acceptance learned from StepVerified: replay rebuilds it."""
    from nightjar.actors.step_profile import roofline_profile
    from nightjar.offline.sim.executors import AcceptanceMix
    from nightjar.offline.sim.workload import make_workload
    from nightjar.offline.simulate import SimConfig, simulate

    path = tmp_path / "harmonic.njtrace"
    wl = make_workload("poisson:1", seed=0, num_requests=40, prompt_mean=64, output_mean=48, sigma=0.5, max_len=512)
    r = simulate(roofline_profile("a100", "13b"), wl, "nightjar:harmonic",
                 SimConfig(gamma_max=4, closed_loop=16, max_model_len=512), AcceptanceMix.parse("0.5:0.9;0.5:0.1"),
                 trace=str(path))
    assert r.finished == 40 and r.mean_gamma > 0
    res = replay_file(str(path))
    assert res.ok, res.summary()


def test_per_request_acceptance_fitted_from_a_trace_recovers_the_request_classes(tmp_path):
    """A simulated run with two synthetic classes, recorded; AcceptanceMix.from_trace (what
    ``nightjar simulate --acceptance-mix trace:FILE`` uses) finds each request's class again."""
    from nightjar.actors.step_profile import roofline_profile
    from nightjar.kernel.messages import StepVerified
    from nightjar.kernel.trace import TraceReader
    from nightjar.offline.sim.executors import AcceptanceMix
    from nightjar.offline.sim.workload import make_workload
    from nightjar.offline.simulate import SimConfig, simulate

    path = tmp_path / "sim.njtrace"
    mix = AcceptanceMix.parse("0.5:0.9;0.5:0.1")
    wl = make_workload("poisson:1", seed=1, num_requests=30, prompt_mean=64, output_mean=96, sigma=0.3, max_len=512)
    simulate(roofline_profile("a100", "13b"), wl, "fixed:3", SimConfig(gamma_max=4, closed_loop=8, max_model_len=512),
             mix, trace=str(path))
    steps = [e.msg for e in TraceReader(str(path)) if isinstance(e.msg, StepVerified)]
    fitted = AcceptanceMix.from_trace(steps, 4)
    firsts = sorted(v[0] for _, v in fitted.classes)
    assert len(firsts) == 30
    assert all(x < 0.3 or x > 0.7 for x in firsts) and firsts[0] < 0.3 < 0.7 < firsts[-1]
