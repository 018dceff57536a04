"""Simulator vs reality: run one short phased workload through a real Engine (recording a trace) and
through the simulator with a measured profile of this machine (acceptance fitted from that trace), and
compare throughput, mean TTFT, mean E2E and mean γ.

  .venv/bin/python -m nightjar.offline.sim.validate --profile prof.json [--policy fixed:2] [--phases '[[6,2],[6,6]]']
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nightjar.actors.step_profile import Profile
from nightjar.offline.sim.workload import Phase, Workload, lengths, phase_times


@dataclass
class Measured:
    throughput: float
    mean_ttft_s: float
    mean_e2e_s: float
    mean_gamma: float
    finished: int


def phased_workload(phases: list[tuple[float, float]], seed: int = 0, prompt_mean: float = 24,
                    output_mean: float = 24, sigma: float = 0.4) -> Workload:
    import numpy as np
    rng = np.random.default_rng(seed)
    ph = [Phase(d, r) for d, r in phases]
    times = phase_times(ph, rng)
    n = len(times)
    return Workload("phased", times, lengths(rng, n, prompt_mean, 4, 256, sigma),
                    lengths(rng, n, output_mean, 2, 256, sigma), ph)


def run_engine(make_engine, wl: Workload, trace: str) -> Measured:
    """Send the workload's requests at their arrival times (prompt = token 7 repeated, eos ignored)."""
    from nightjar.sampling import SamplingParams

    async def main():
        async with make_engine(trace=trace) as eng:
            t0 = time.perf_counter()
            stamps = []

            async def one(i):
                await asyncio.sleep(max(0.0, float(wl.times[i]) - (time.perf_counter() - t0)))
                sent, first = time.perf_counter(), None
                sp = SamplingParams(max_tokens=int(wl.output_lens[i]), ignore_eos=True)
                async for out in eng.generate([7] * int(wl.prompt_lens[i]), sp):
                    if first is None and out.token_ids:
                        first = time.perf_counter()
                stamps.append((sent, first, time.perf_counter(), int(wl.output_lens[i])))
            await asyncio.gather(*[one(i) for i in range(len(wl))])
            s = eng.stats
            gamma = [0]
            return stamps, t0, s, gamma
    stamps, t0, stats, _ = asyncio.run(main())
    end = max(d for _, _, d, _ in stamps)
    toks = sum(n for *_, n in stamps)
    return Measured(toks / (end - t0 - float(wl.times[0])), sum(f - s for s, f, _, _ in stamps) / len(stamps),
                    sum(d - s for s, _, d, _ in stamps) / len(stamps), _trace_mean_gamma(trace), len(stamps))


def _trace_mean_gamma(trace: str) -> float:
    from nightjar.kernel.messages import StepTimed
    from nightjar.kernel.trace import TraceReader
    g = [e.msg.gamma for e in TraceReader(trace, allow_schema_drift=True)
         if isinstance(e.msg, StepTimed) and e.msg.batch_size]
    return sum(g) / len(g) if g else 0.0


def run_sim(profile: Profile, wl: Workload, policy: str, trace: str, **cfg) -> Measured:
    from nightjar.kernel.messages import StepTimed
    from nightjar.kernel.trace import TraceReader
    from nightjar.offline.sim.executors import fit_acceptance
    from nightjar.offline.simulate import SimConfig, simulate

    c = SimConfig(**cfg)
    steps = [e.msg for e in TraceReader(trace, allow_schema_drift=True) if isinstance(e.msg, StepTimed)]
    r = simulate(profile, wl, policy, c, fit_acceptance(steps, c.gamma_max))
    return Measured(r.throughput, r.mean_ttft_s, r.mean_e2e_s, r.mean_gamma, r.finished)


def compare(make_engine, profile: Profile, wl: Workload, policy: str, **cfg) -> tuple[Measured, Measured]:
    with tempfile.TemporaryDirectory() as d:
        trace = str(Path(d) / "real.njtrace")
        real = run_engine(make_engine, wl, trace)
        sim = run_sim(profile, wl, policy, trace, **cfg)
    return real, sim


def format_compare(real: Measured, sim: Measured) -> str:
    rows = [("output tok/s", real.throughput, sim.throughput), ("mean TTFT s", real.mean_ttft_s, sim.mean_ttft_s),
            ("mean E2E s", real.mean_e2e_s, sim.mean_e2e_s), ("mean γ", real.mean_gamma, sim.mean_gamma)]
    lines = [f"{'metric':<14} {'real':>10} {'sim':>10} {'sim/real':>9}"]
    for name, a, b in rows:
        ratio = f"{b / a:9.2f}" if a else "        -"
        lines.append(f"{name:<14} {a:>10.4f} {b:>10.4f} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nightjar.offline.sim.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policy", default="fixed:2")
    p.add_argument("--phases", default="[[8, 1.0], [8, 3.0]]", help="JSON list of [duration_s, rate]")
    p.add_argument("--prompt-len", type=float, default=64)
    p.add_argument("--output-len", type=float, default=48)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--gamma-max", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from nightjar.engine import Engine
    from nightjar.kernel.threads import on_fresh_thread
    from nightjar.models import load_draft, load_model

    prof = Profile.load(a.profile)
    # loaded on a thread that exits, so the engine's compute thread is alone (kernel/threads.py), as in serving
    target = on_fresh_thread(load_model, a.model, a.dtype)
    draft = on_fresh_thread(load_draft, a.draft, target.config, a.dtype)
    wl = phased_workload([tuple(x) for x in json.loads(a.phases)], a.seed, a.prompt_len, a.output_len)

    def make(**kw):
        return Engine(a.model, a.draft, a.policy, loaded=(target, draft), dtype=a.dtype, gamma_max=a.gamma_max,
                      block_size=prof.block_size, num_blocks=prof.num_blocks, max_num_seqs=a.max_num_seqs, **kw)
    real, sim = compare(make, prof, wl, a.policy, gamma_max=a.gamma_max, max_num_seqs=a.max_num_seqs,
                        max_model_len=2048, num_blocks=prof.num_blocks, elastic_memory=False)
    print(f"{len(wl)} requests, policy {a.policy}, profile {prof.name}")
    print(format_compare(real, sim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
