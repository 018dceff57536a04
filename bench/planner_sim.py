"""Planner v2 figures from the simulator (issue 13): regret, closed loop, the A100-13B phased trace.

  python bench/planner_sim.py [--sections regret,closed,phased,closed-noprofile] [--seeds 10] [--json out.json]
                              [--cpu-profile shared|quiet]

``--cpu-profile`` picks one of the two CPU profiles measured on this box and committed in tests/actors/data:
``shared`` (profile_cpu_bf16.json, 2026-11-30, measured while other jobs shared the cores) or ``quiet``
(profile_cpu_bf16_quiet.json, 2026-12-02, the head-major KV cache, nothing else running).

* regret -- planner only, known cost model (the measured CPU profile of tests/actors/data and the A100-13B
  roofline), synthetic per-position acceptance from 0.38 to 0.8, B changing every 50 steps over 1..64,
  600 decode steps: cumulative regret vs the per-step oracle (expected s/token) over steps 0-200 and
  200-600, per policy (``--seeds`` seeds; max and mean over seeds).
* closed -- the closed-loop stand-in: the full control plane on the simulator, measured CPU profile,
  concurrency 1/4/16/64, weak (0.38, 0.39, 0.49, 0.53) and good (0.8, 0.76, 0.72, 0.7) draft,
  5 seeds: each adaptive policy's throughput / the best static policy's (median over seeds picks the
  best static; median and minimum of the per-seed ratios), over the whole run and over the time
  nightjar needed for its first 200 decode steps.
* closed-noprofile -- the same closed loop with ``nightjar`` given no profile (the generic prior the
  serving engine runs without --planner-profile).
* phased -- A100-13B roofline (its own 40 GB device-memory plan: 551 KV blocks, the draft worth 211),
  phased Poisson arrivals 2 -> 20 -> 2 req/s (30 s each), good draft, 3 workload seeds: output
  throughput and mean E2E per policy, and ratios against the best fixed γ (by throughput).
Acceptance is synthetic and labelled; step times come from the profiles, never invented per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from nightjar.actors.policy_factory import make_policy
from nightjar.actors.step_profile import Profile, roofline_profile
from nightjar.offline.sim.planner_env import (
    ACCEPTANCE_VECTORS,
    GOOD,
    WEAK,
    PlannerEnv,
    batch_schedule,
    run_planner,
)
from nightjar.offline.sim.workload import make_workload
from nightjar.offline.simulate import SimConfig, Simulation

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "actors" / "data"
CPU_PROFILES = {"shared": DATA / "profile_cpu_bf16.json", "quiet": DATA / "profile_cpu_bf16_quiet.json"}
A100 = roofline_profile("a100", "13b")
STATIC = ("off", "fixed:1", "fixed:2", "fixed:3", "fixed:4")


def regret(seeds: int, cpu: Profile) -> list[dict]:
    rows = []
    print("\n## Regret vs the per-step oracle (600 decode steps, B over 1..64)\n")
    print("| profile | acceptance | policy | regret 0-200 max / mean | regret 200-600 max / mean |")
    print("|---|---|---|---|---|")
    for pname, prof in (("cpu", cpu), ("a100-13b", A100)):
        for acc in ACCEPTANCE_VECTORS:
            env = PlannerEnv(prof, acc)
            for spec in ("nightjar", "nightjar-paper", "dsd", "banditspec"):
                a, b = [], []
                for seed in range(seeds):
                    opts = {"profile": prof} if spec == "nightjar" else {}
                    pol = make_policy(spec, gamma_max=4, seed=seed, **opts)
                    s = batch_schedule(seed, 600)
                    run = run_planner(pol, lambda t: env, s.__getitem__, 600, seed)
                    a.append(run.regret(0, 200))
                    b.append(run.regret(200, 600))
                row = {"profile": pname, "acceptance": acc[0], "policy": spec, "first200_max": max(a),
                       "first200_mean": statistics.mean(a), "later_max": max(b), "later_mean": statistics.mean(b)}
                rows.append(row)
                print(f"| {pname} | {acc[0]} | {spec} | {max(a):.3f} / {statistics.mean(a):.3f} | "
                      f"{max(b):.3f} / {statistics.mean(b):.3f} |", flush=True)
    return rows


def closed(cpu: Profile, seeds: int = 5, profile: bool = True) -> list[dict]:
    rows = []
    adaptive = ("nightjar", "nightjar-nooffload", "nightjar-paper", "dsd", "banditspec") if profile else ("nightjar",)
    print("\n## Closed loop in the simulator (measured CPU profile), adaptive / best static"
          + ("" if profile else "; the planner without the profile (generic prior)") + "\n")
    print("| N | draft | best static | " + " | ".join(f"{p} median (min)" for p in adaptive)
          + " | nightjar first 200 steps median (min) |")
    print("|---|---|---|" + "---|" * (len(adaptive) + 1))
    for n in (1, 4, 16, 64):
        for name, acc in (("weak", WEAK), ("good", GOOD)):
            thr = {p: [] for p in (*STATIC, *adaptive)}
            early = {p: [] for p in thr}
            for seed in range(seeds):
                per = 3 if acc is WEAK else 7
                wl = make_workload("poisson:1", seed=seed, num_requests=max(8, per * n), prompt_mean=64,
                                   output_mean=96, sigma=0.5, max_len=512)
                cfg = SimConfig(gamma_max=4, seed=seed, closed_loop=n, max_num_seqs=64, max_model_len=512,
                                planner_profile=profile)
                sims = {p: Simulation(cpu, wl, p, cfg, acc) for p in thr}
                res = {p: s.run() for p, s in sims.items()}
                t200 = res["nightjar"].extra["early_t"] or res["nightjar"].sim_time_s
                for p, s in sims.items():
                    thr[p].append(res[p].throughput)
                    early[p].append(s.tokens_by(t200) / t200)
            best = max(STATIC, key=lambda p: statistics.median(thr[p]))
            best_e = max(STATIC, key=lambda p: statistics.median(early[p]))
            row = {"n": n, "draft": name, "best_static": best}
            cells = []
            for p in adaptive:
                r = [a / b for a, b in zip(thr[p], thr[best])]
                row[p] = (statistics.median(r), min(r))
                cells.append(f"{statistics.median(r):.3f} ({min(r):.3f})")
            r = [a / b for a, b in zip(early["nightjar"], early[best_e])]
            row["nightjar_first200"] = (statistics.median(r), min(r))
            rows.append(row)
            print(f"| {n} | {name} | {best} | " + " | ".join(cells)
                  + f" | {statistics.median(r):.3f} ({min(r):.3f}) vs {best_e} |", flush=True)
    return rows


def phased(seeds: int = 3) -> list[dict]:
    pols = (*STATIC, "dsd", "nightjar-paper", "nightjar", "nightjar-nooffload")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"phases": [{"duration_s": 30, "rate": 2.0}, {"duration_s": 30, "rate": 20.0},
                              {"duration_s": 30, "rate": 2.0}]}, f)
    res = {p: [] for p in pols}
    for seed in range(seeds):
        wl = make_workload(f.name, seed=seed)
        for p in pols:
            r = Simulation(A100, wl, p, SimConfig(gamma_max=4, seed=seed), GOOD).run()
            res[p].append(r)
    Path(f.name).unlink()
    thr = {p: statistics.mean(r.throughput for r in rs) for p, rs in res.items()}
    e2e = {p: statistics.mean(r.mean_e2e_s for r in rs) for p, rs in res.items()}
    best = max(STATIC[1:], key=thr.get)
    print(f"\n## A100-13B roofline, phased 2 -> 20 -> 2 req/s (30 s each), good draft, {seeds} seeds (means)\n")
    print("| policy | out tok/s | mean E2E s | mean γ | offloads | throughput / best fixed | E2E / best fixed |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for p in pols:
        g = statistics.mean(r.mean_gamma for r in res[p])
        off = sum(r.offloads for r in res[p])
        rows.append({"policy": p, "throughput": thr[p], "e2e": e2e[p], "vs_best_fixed": thr[p] / thr[best],
                     "e2e_vs_best_fixed": e2e[p] / e2e[best], "best_fixed": best})
        print(f"| {p} | {thr[p]:.1f} | {e2e[p]:.2f} | {g:.2f} | {off} | {thr[p] / thr[best]:.3f} | "
              f"{e2e[p] / e2e[best]:.3f} |")
    print(f"\nbest fixed γ by throughput: {best}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="regret,closed,phased")
    p.add_argument("--seeds", type=int, default=10, help="seeds of the regret section")
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-profile", choices=sorted(CPU_PROFILES), default="shared",
                   help="which measured CPU profile the regret and closed sections use")
    a = p.parse_args()
    cpu = Profile.load(str(CPU_PROFILES[a.cpu_profile]))
    sections = {"regret": lambda: regret(a.seeds, cpu), "closed": lambda: closed(cpu), "phased": phased,
                "closed-noprofile": lambda: closed(cpu, profile=False)}
    bad = [sec for sec in a.sections.split(",") if sec not in sections]
    if bad:
        p.error(f"unknown section {bad[0]!r}: choose from {', '.join(sections)}")
    out = {sec: sections[sec]() for sec in a.sections.split(",")}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
