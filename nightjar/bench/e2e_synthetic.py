"""End-to-end engine throughput on random-weight large shapes with SYNTHETIC acceptance.

    python -m nightjar.bench.e2e_synthetic [--target 7b] [--draft 0.5b] [--acceptance 0.7] [--batches 1,8,32,64]
        [--policies off,fixed:1,fixed:3,nightjar] [--tokens 128] [--reps 2] [--profile quick|none] [--detail]

Random weights make real acceptance ~0, so drafts are accepted at a set rate (like vLLM's synthetic
rejection sampler): the figures measure the engine and its kernels, NOT output quality. On a CPU
``--small`` shrinks the shapes to a smoke test. The planner reads a step-time profile of these shapes measured
here first (``--profile quick``, the grid of ``nightjar profile --quick``), as ``nightjar serve`` reads its
cached one (``--planner-profile auto``); ``--profile none`` runs it on the generic prior.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter

import torch

from nightjar.kernel.threads import on_fresh_thread
from nightjar.models import LlamaModel, LoadedModel
from nightjar.models.config import ModelConfig
from nightjar.offline.profile import build_profile

SHAPES = {   # hidden, layers, heads, kv heads, mlp, vocab
    "7b": (4096, 32, 32, 8, 14336, 32000),
    "0.5b": (1024, 24, 16, 4, 2816, 32000),
    "small-target": (512, 8, 8, 4, 1536, 32000),
    "small-draft": (128, 2, 4, 2, 384, 32000),
}


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int) -> LlamaModel:
    h, layers, heads, kv, mlp, vocab = SHAPES[shape]
    cfg = ModelConfig(vocab_size=vocab, hidden_size=h, intermediate_size=mlp, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, head_dim=h // heads, rope_theta=500000.0, max_position=4096, name=shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.select_kernels()
    return model.eval()


class RoundTap:
    """What a timed round did, off the bus (``--detail``): steps per γ, γ switches, draft offloads."""

    def __init__(self) -> None:
        self.gammas: Counter = Counter()
        self.switches = self.offloads = 0
        self._last: int | None = None

    def __call__(self, env) -> None:
        from nightjar.kernel.messages import DraftOffloaded, StepTimed

        m = env.msg
        if isinstance(m, StepTimed):
            self.gammas[m.gamma] += 1
            self.switches += self._last is not None and m.gamma != self._last
            self._last = m.gamma
        elif isinstance(m, DraftOffloaded):
            self.offloads += 1


def _graph_stats(model) -> Counter:
    runner = getattr(model, "graph_runner", None)
    return Counter(runner.stats) if runner is not None else Counter()


def _detail(tap: RoundTap, eng, graphs: Counter, policy: str) -> str:
    """One line: the timed round's γ histogram, switches, offloads and graph replays/captures/eager steps; the
    planner's snapshot (its profile, level, acceptance, catch-up line, per-bucket arms) for a policy that has one."""
    out = (f"#   {policy}: steps by γ {dict(sorted(tap.gammas.items()))}, {tap.switches} switches, "
           f"{tap.offloads} offloads, target graphs {dict(graphs)}")
    snap = eng.planner.policy.snapshot()
    if "contexts" in snap:
        keep = ("profile", "level", "rho", "dwell", "c_switch", "prefill_s_per_token", "contexts")
        out += "\n#   planner " + json.dumps({k: snap.get(k) for k in keep}, default=str)
    return out


def measure_profile(pair, path: str) -> str:
    """Measure the pair's quick step-time profile (``nightjar profile --quick --no-engine``), write it to ``path``
    and say what it holds in one line."""
    t0 = time.perf_counter()
    prof = build_profile(pair[0].model, pair[1].model, name=f"measured:{pair[0].source}", quick=True,
                         log=lambda s: None)
    with open(path, "w") as f:
        json.dump(prof.to_json(), f)
    return (f"# planner profile measured here in {time.perf_counter() - t0:.0f} s (quick grid): target T(1, 1) "
            f"{prof.T[0][0] * 1e3:.2f} ms, T({prof.B[-1]}, {prof.q[-1]}) {prof.T[-1][-1] * 1e3:.2f} ms, "
            f"draft T(1) {prof.draft_T[0] * 1e3:.2f} ms")


async def run(pair, policy: str, batch: int, tokens: int, acceptance: float, dtype: str,
              detail: bool = False, profile: str | None = None) -> tuple[float, str]:
    """tok/s of the second of two rounds of ``batch`` concurrent requests on one engine (the first round
    captures the CUDA graphs of this batch's shapes, compiles Triton and starts the planner's learning), and
    with ``detail`` a description of that round (``_detail``). ``profile``: a profile JSON, given to a policy that
    reads one, as ``serve`` gives its cached one (engine_args.py ``reads_profile``)."""
    from nightjar.engine import Engine
    from nightjar.engine_args import reads_profile
    from nightjar.kernel.config import EngineConfig
    from nightjar.sampling import SamplingParams

    prof = profile if profile and reads_profile(policy, EngineConfig().gamma_max) else None
    async with Engine(policy=policy, loaded=pair, dtype=dtype, synthetic_acceptance=acceptance,
                      max_num_seqs=max(batch, 1), num_blocks=batch * 16 + 64, planner_profile=prof) as eng:
        prompt = list(range(100, 228))                                    # 128 tokens
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)

        async def one():
            return sum([len(o.token_ids) async for o in eng.generate(prompt, sp)] or [0])

        async def one_round() -> float:
            t0 = time.perf_counter()
            n = sum(await asyncio.gather(*[one() for _ in range(batch)]))
            return n / (time.perf_counter() - t0)
        await one_round()                                                  # warm-up at this batch
        if not detail:
            return await one_round(), ""
        tap, g0 = RoundTap(), _graph_stats(pair[0].model)                 # only asked for: a tap costs a call
        eng.bus.add_tap(tap)                                               # per envelope in the timed round
        rate = await one_round()
        eng.bus.remove_tap(tap)
        return rate, _detail(tap, eng, _graph_stats(pair[0].model) - g0, policy)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--draft", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--policies", default="off,fixed:1,fixed:3,nightjar")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions (a fresh engine each); the median")
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--profile", choices=("quick", "none"), default="quick",
                    help="the planner's step-time profile: measured here first (as `serve` does), or none (the prior)")
    ap.add_argument("--detail", action="store_true",
                    help="per run: steps by γ, switches, offloads, graph stats and the planner's snapshot")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.small or device == "cpu":
        a.target, a.draft, a.batches = "small-target", "small-draft", "1,4"
    # built on threads that exit, so the engine's compute thread is alone (kernel/threads.py)
    target = LoadedModel(on_fresh_thread(random_model, a.target, device, torch.bfloat16, 0), None, f"random-{a.target}")
    draft = LoadedModel(on_fresh_thread(random_model, a.draft, device, torch.bfloat16, 1), None, f"random-{a.draft}")
    print(f"# SYNTHETIC acceptance {a.acceptance} (drafts accepted at random; not the target's outputs)")
    print(f"# target {a.target} ({target.model.weight_bytes() / 1e9:.2f} GB), draft {a.draft} "
          f"({draft.model.weight_bytes() / 1e9:.2f} GB) on {device}, {a.tokens} tokens per request")
    policies = a.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        profile = None
        if a.profile == "quick":
            try:                                # one shot on a lent GPU: a failed measurement costs the prior only
                print(measure_profile((target, draft), f"{tmp}/profile.json"), flush=True)
                profile = f"{tmp}/profile.json"
            except Exception as e:              # noqa: BLE001 - said on the output, not hidden
                print(f"# planner profile: measuring failed ({type(e).__name__}: {e}); the planner runs on the prior",
                      flush=True)
        return _table(a, (target, draft), policies, profile)


def _table(a: argparse.Namespace, pair, policies: list[str], profile: str | None) -> int:
    """The table: a row per B, the median of ``a.reps`` interleaved runs per policy, adaptive / best static."""
    static = [p for p in policies if p == "off" or p.startswith("fixed:")]
    adaptive = [p for p in policies if p not in static]
    ratios = [f"{p} / best static" for p in adaptive] if static else []
    print(f"# median of {a.reps} interleaved runs; each the second round of B requests on its own engine")
    print("| B | " + " | ".join([f"{p} tok/s" for p in policies] + ratios) + " |\n|---|"
          + "---|" * (len(policies) + len(ratios)))
    for B in (int(x) for x in a.batches.split(",")):
        runs: dict[str, list[float]] = {p: [] for p in policies}
        for _ in range(a.reps):
            for p in policies:
                rate, detail = asyncio.run(run(pair, p, B, a.tokens, a.acceptance, "bfloat16", a.detail, profile))
                runs[p].append(rate)
                if detail:
                    print(f"#   B = {B}, {rate:.1f} tok/s\n{detail}", flush=True)
        med = {p: statistics.median(r) for p, r in runs.items()}
        best = max((med[p] for p in static), default=0.0)
        cells = [f"{med[p]:.1f}" for p in policies] + ([f"{med[p] / best:.2f}" for p in adaptive] if static else [])
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
