"""Planner cost per decision (issue 13 budget: <= 20 µs, pure Python): decide() and observe() separately.
``nightjar:per-request`` is timed on decide_rows() (one γ_i per row, B cycling 1..64, mean 32.5 rows);
``nightjar:harmonic`` on decide() with the rows' ids (it reads each row's own acceptance). A ``+lookup`` suffix
(``nightjar+lookup``) feeds the policy steps in which a random share of the drafting rows drafted by prompt lookup
(``StepTimed.lookup_*``), so it learns and prices the lookup's rows apart (policy_model.LookupSplit).

  python bench/planner_cost.py [--calls 20000] [--policies nightjar,nightjar-paper,dsd] [--repeats 3]

Each policy is first warmed on 2,000 simulated steps (CPU profile, weak draft, B cycling 1..64, so every
bucket has data), then decide() is timed over ``--calls`` calls with varied B and planner state, and
observe() over as many recorded step results; repetitions are interleaved across policies and the
median is printed (the box is shared and noisy).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import msgspec

from nightjar.actors.policies import PlannerState
from nightjar.actors.policy_factory import make_policy
from nightjar.actors.step_profile import Profile
from nightjar.offline.sim.planner_env import WEAK, PlannerEnv

PROFILE = Path(__file__).resolve().parent.parent / "tests" / "actors" / "data" / "profile_cpu_bf16.json"


def with_lookup(r, rng: random.Random):
    """``r`` as if a random share of its drafting rows had drafted by prompt lookup (their accepted positions a
    proportional part of the step's)."""
    n = r.num_drafts
    if not r.gamma or not n:
        return r
    k = rng.randint(0, n)
    part = tuple(a * k // n for a in r.accepted_per_pos)
    return msgspec.structs.replace(r, lookup_drafts=k, lookup_accepted_per_pos=part)


def warmed(spec: str, prof: Profile):
    spec, lookup = spec.removesuffix("+lookup"), spec.endswith("+lookup")
    opts = {"profile": prof} if spec.split(":")[0] in ("nightjar", "nightjar-nooffload") else {}
    pol = make_policy(spec, gamma_max=4, seed=0, **opts)
    env, rng = PlannerEnv(prof, WEAK), random.Random(0)
    results = []
    rows = getattr(pol, "per_request", False)
    harmonic = getattr(pol, "harmonic", False)
    for t in range(2000):
        b = 1 + (t * 7) % 64
        ids = tuple((t // 8 + i) % 128 for i in range(b))
        if rows:                 # per-request: per-row γ_i, and per-request acceptance from 128 live ids
            gam = pol.decide_rows(b, PlannerState(True, 0, 1, lag_tokens=0), ids, (True,) * b)
            g = max(gam)
            pol.observe_rows(ids, gam, tuple(min(x, rng.randint(0, 4)) for x in gam))
        elif harmonic:           # one γ, per-request acceptance from the same ids
            g = pol.decide(b, PlannerState(True, 0, 1, lag_tokens=0, req_ids=ids, speculate=(True,) * b))
            pol.observe_rows(ids, (g,) * b, tuple(min(g, rng.randint(0, 4)) for _ in ids))
        else:
            g = pol.decide(b, PlannerState(True, 0, 1, lag_tokens=0))
        r = env.step(b, g, rng)
        if lookup:
            r = with_lookup(r, rng)
        pol.observe(r)
        results.append(r)
    return pol, results


def time_calls(pol, results, calls: int) -> tuple[float, float]:
    states = [PlannerState(True, i % 40, i % 3, lag_tokens=(i % 5) * 30, new_prompt_tokens=(i % 7) * 20,
                           new_prompts=i % 2, num_waiting=i % 3, free_blocks=i % 50, total_blocks=700,
                           draft_blocks=120, max_batch=64) for i in range(64)]
    sizes = [1 + (i * 13) % 64 for i in range(64)]
    if getattr(pol, "harmonic", False):
        states = [replace(st, req_ids=tuple((j * 5 + i) % 128 for i in range(sizes[j])), speculate=(True,) * sizes[j])
                  for j, st in enumerate(states)]
    t0 = time.perf_counter()
    if getattr(pol, "per_request", False):
        ids = [tuple((j * 5 + i) % 128 for i in range(sizes[j])) for j in range(64)]
        spec = [(True,) * sizes[j] for j in range(64)]
        lags = [[(i % 7 == 0) * 3 for i in range(sizes[j])] for j in range(64)]
        t0 = time.perf_counter()
        for i in range(calls):
            j = i & 63
            pol.decide_rows(sizes[j], states[j], ids[j], spec[j], lags[j])
    else:
        for i in range(calls):
            pol.decide(sizes[i & 63], states[i & 63])
    t1 = time.perf_counter()
    n = len(results)
    for i in range(calls):
        pol.observe(results[i % n])
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t1) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policies", default="nightjar,nightjar-paper,dsd")
    a = p.parse_args()
    prof = Profile.load(str(PROFILE))
    pols = {s: warmed(s, prof) for s in a.policies.split(",")}
    dec = {s: [] for s in pols}
    obs = {s: [] for s in pols}
    for _ in range(a.repeats):
        for s, (pol, res) in pols.items():
            d, o = time_calls(pol, res, a.calls)
            dec[s].append(d)
            obs[s].append(o)
    print(f"{'policy':<16} {'decide µs':>10} {'observe µs':>11} {'sum µs':>8}"
          f"   (median of {a.repeats}, {a.calls} calls each)")
    for s in pols:
        d, o = statistics.median(dec[s]), statistics.median(obs[s])
        print(f"{s:<16} {d:>10.2f} {o:>11.2f} {d + o:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
