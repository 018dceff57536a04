"""What the closed-loop protocol reads for a policy exactly as fast as the static policies it is compared with.

    python bench/selection_bias.py [--statics 1,2,3,4] [--sigmas 0.03,0.05] [--reps 3] [--trials 20000]
    python bench/selection_bias.py --from-json out/policies/closed_1.json     (sigma estimated from a run)

The protocol (docs/benchmarks.md, bench/policies.sh) runs k static policies and the adaptive one, R repetitions
each, picks the best static policy by its median throughput and reports the median over repetitions of the
adaptive policy's throughput over that policy's in the same repetition. When the static policies are level
(at concurrency 1 on this box fixed:1..4 are within ~2 %), the pick is the one the noise favoured, so a policy
equal to all of them reads below 1. Here every run's throughput is 1 + sigma * N(0, 1), independent; the
table gives the median reported ratio and how often it is >= 0.97. With ``--from-json`` sigma is estimated
from the paired log-ratios of the run's static policies (each pair's spread about its own mean is sigma * sqrt(2)).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import numpy as np


def reported_ratio(k: int, sigma: float, reps: int, trials: int, seed: int = 0) -> np.ndarray:
    """The protocol's ratio for an adaptive policy equal to k level static ones, per simulated run [trials]."""
    rng = np.random.default_rng(seed)
    statics = 1.0 + sigma * rng.standard_normal((trials, k, reps))                # [trials, k, R]
    adaptive = 1.0 + sigma * rng.standard_normal((trials, reps))                  # [trials, R]
    best = np.median(statics, axis=2).argmax(axis=1)                              # [trials]
    return np.median(adaptive / statics[np.arange(trials), best], axis=1)         # [trials]


def sigma_from_run(path: str) -> float:
    """sigma from the paired log-ratios of a bench compare JSON's static policies (off, fixed:K)."""
    with open(path) as f:
        d = json.load(f)
    runs = {p: {r["rep"]: r["output_throughput"] for r in v["runs"]} for p, v in d["policies"].items()
            if p == "off" or p.startswith("fixed:")}
    ss = dof = 0.0
    for a, b in itertools.combinations(sorted(runs), 2):       # each pair about its own mean (level or not)
        diffs = [math.log(runs[a][r] / runs[b][r]) for r in runs[a] if r in runs[b]]
        if len(diffs) >= 2:
            ss += statistics.variance(diffs) * (len(diffs) - 1)
            dof += len(diffs) - 1
    if not dof:
        raise ValueError(f"{path}: needs two static policies with two repetitions in common")
    return math.sqrt(ss / dof / 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--statics", default="1,2,3,4", help="numbers k of level static policies")
    ap.add_argument("--sigmas", default="0.03,0.05", help="per-run relative noise")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--from-json", help="estimate sigma from a bench compare JSON instead of --sigmas")
    a = ap.parse_args(argv)
    try:
        ks = [int(x) for x in a.statics.split(",")]
        sigmas = [float(x) for x in a.sigmas.split(",")]
    except ValueError:
        ap.error("--statics takes integers and --sigmas numbers, comma-separated")
    if min(ks) < 1 or min(sigmas) < 0 or a.reps < 1 or a.trials < 1:
        ap.error("--statics >= 1, --sigmas >= 0, --reps >= 1, --trials >= 1")
    if a.from_json:
        try:
            sigmas = [sigma_from_run(a.from_json)]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--from-json: {e}")
        print(f"# sigma {sigmas[0]:.4f} from the static policies' paired log-ratios in {a.from_json}")
    print(f"# {a.reps} repetitions, {a.trials} simulated runs per cell, an adaptive policy equal to every static one")
    print("| level static policies | sigma | median reported ratio | share of runs >= 0.97 |\n|---|---|---|---|")
    for k, s in itertools.product(ks, sigmas):
        r = reported_ratio(k, s, a.reps, a.trials)
        print(f"| {k} | {s:.3f} | {np.median(r):.3f} | {np.mean(r >= 0.97):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
