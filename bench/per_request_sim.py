"""Per-request γ_i (issue 17) in the simulator: a mixed workload, half high-acceptance and half low.

  python bench/per_request_sim.py [--seeds 5] [--profiles cpu,cpu-quiet,cpu-amx,a100,FILE.json] [--n 1,4,16,64]
                                  [--mix '0.5:0.9;0.5:0.1']

The full control plane (real planner, batcher, KV pool) on the simulator, closed loop with N clients, per-request
acceptance drawn per request from the classes of ``--mix`` (synthetic acceptance, labelled as such: each drafting
row accepts position i with its class's rate). Profiles: the two CPU profiles measured on the project's first box,
an AMD EPYC (``cpu``: tests/actors/data/profile_cpu_bf16.json, 2026-11-30, cores shared with other jobs;
``cpu-quiet``: profile_cpu_bf16_quiet.json, 2026-12-02, head-major KV cache, quiet box), the profile of the box
that replaced it (``cpu-amx``: profile_cpu_bf16_amx.json, 2026-12-06, an Intel Xeon with AMX), the A100-13B
roofline (``a100``) or any profile file (a path ending in ``.json``, e.g. ``--planner-profile auto``'s cached one).
Every policy sees the same requests and classes (same seed). Prints, per profile and N, the median over seeds (and
min) of throughput and mean-E2E ratios of ``nightjar:per-request`` against batch-level ``nightjar`` and against the
best fixed γ (best by median throughput), and the share of decode rows per γ_i.

``--class-oracle`` adds a ceiling: every static split that gives each request class its own γ (class read from
the simulator's draw, not learned; all (Γmax+1)^classes splits, the best by median throughput) against
batch-level ``nightjar``. A learned per-request planner is not expected to beat it by much.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
from pathlib import Path

from nightjar.actors.step_profile import Profile, roofline_profile
from nightjar.offline.sim.executors import AcceptanceMix
from nightjar.offline.sim.workload import make_workload
from nightjar.offline.simulate import SimConfig, Simulation

DATA = Path(__file__).resolve().parent.parent / "tests" / "actors" / "data"
CPU_PROFILES = {"cpu": DATA / "profile_cpu_bf16.json", "cpu-quiet": DATA / "profile_cpu_bf16_quiet.json",
                "cpu-amx": DATA / "profile_cpu_bf16_amx.json"}
FIXED = ("fixed:1", "fixed:2", "fixed:3", "fixed:4")
BATCH, PER_ROW = "nightjar", "nightjar:per-request"


def profiles(names: list[str]) -> dict[str, Profile]:
    """Each name's profile: a CPU profile of ``CPU_PROFILES``, ``a100`` (the roofline) or a profile file."""
    def one(n: str) -> Profile:
        if n == "a100":
            return roofline_profile("a100", "13b")
        return Profile.load(str(CPU_PROFILES.get(n, n)))
    return {n: one(n) for n in names}


def unknown_profile(names: list[str]) -> str | None:
    """The first name that is no known profile and no existing ``.json`` file, else None."""
    return next((n for n in names if n not in (*CPU_PROFILES, "a100")
                 and not (n.endswith(".json") and Path(n).is_file())), None)


def run_cell(prof: Profile, n: int, seed: int, mix: AcceptanceMix, policies) -> dict[str, tuple[float, float, dict]]:
    wl = make_workload("poisson:1", seed=seed, num_requests=max(8, 6 * n), prompt_mean=64, output_mean=96,
                       sigma=0.5, max_len=512)
    cfg = SimConfig(gamma_max=4, seed=seed, closed_loop=n, max_num_seqs=64, max_model_len=512)
    res = {}
    for p in policies:
        r = Simulation(prof, wl, p, cfg, mix).run()
        res[p] = (r.throughput, r.mean_e2e_s, r.extra["row_gamma"])
    return res


@contextlib.contextmanager
def class_split(mix: AcceptanceMix, seed: int, gammas: tuple[int, ...]):
    """``nightjar:per-request`` with its decision replaced by a static γ per request class (gammas[c] for
    class c, the class from the simulator's own draw for this seed): an oracle for the ceiling, never a policy."""
    from nightjar.actors.policy_model import ModelNightjarPolicy
    orig = ModelNightjarPolicy.decide_rows
    drawn = AcceptanceMix(mix.classes, seed, 4)           # what SimExecutor draws (same seed, Γmax = 4)
    split = {v: g for (_, v), g in zip(drawn.classes, gammas)}
    mix = drawn

    def decide_rows(self, b, state, req_ids, speculate, row_lags=None):
        if not state.draft_resident or b <= 0:
            return (0,) * b
        return tuple(split[mix.vector_for(r)] if sp else 0 for r, sp in zip(req_ids, speculate))

    ModelNightjarPolicy.decide_rows = decide_rows
    try:
        yield
    finally:
        ModelNightjarPolicy.decide_rows = orig


def oracle_ratio(prof: Profile, n: int, seeds: int, mix: AcceptanceMix, batch: list[float]) -> tuple[str, list[float]]:
    """The best static per-class split (by median throughput over seeds): its label and its ratios to batch."""
    best = ("", [0.0])
    for gs in itertools.product(range(5), repeat=len(mix.classes)):
        thr = []
        for s in range(seeds):
            with class_split(mix, s, gs):
                thr.append(run_cell(prof, n, s, mix, (PER_ROW,))[PER_ROW][0])
        r = [x / y for x, y in zip(thr, batch)]
        if statistics.median(r) > statistics.median(best[1]):
            best = ("/".join(map(str, gs)), r)
    return best


def ratio_cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--profiles", default="cpu,a100")
    p.add_argument("--n", default="1,4,16,64")
    p.add_argument("--mix", default="0.5:0.9;0.5:0.1", help="request classes W:R;W:R (see nightjar simulate)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--class-oracle", action="store_true", help="add the best static γ per request class (a ceiling)")
    a = p.parse_args()
    bad = unknown_profile(a.profiles.split(","))
    if bad:
        p.error(f"unknown profile {bad!r}: choose from {', '.join((*CPU_PROFILES, 'a100'))} or a profile .json file")
    try:
        profs = profiles(a.profiles.split(","))
    except (OSError, ValueError, TypeError) as e:       # unreadable, not JSON, or not a profile's fields
        p.error(f"cannot read a profile of {a.profiles!r}: {e}")
    mix = AcceptanceMix.parse(a.mix)
    policies = (*FIXED, BATCH, PER_ROW)
    rows = []
    print(f"mixed workload {a.mix} (synthetic per-request acceptance), closed loop, {a.seeds} seeds; "
          "ratios: median (min) over seeds\n")
    oracle = " class oracle γ per class | thr oracle / nightjar |" if a.class_oracle else ""
    print("| profile | N | best fixed | thr per-req / nightjar | thr per-req / best fixed | thr nightjar / best fixed "
          "| E2E per-req / nightjar | E2E per-req / best fixed | rows γ_i=0..4 (per-req) |" + oracle)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if oracle else ""))
    for pname, prof in profs.items():
        for n in (int(x) for x in a.n.split(",")):
            cells = [run_cell(prof, n, s, mix, policies) for s in range(a.seeds)]
            thr = {q: [c[q][0] for c in cells] for q in policies}
            e2e = {q: [c[q][1] for c in cells] for q in policies}
            best = max(FIXED, key=lambda q: statistics.median(thr[q]))
            hist: dict[int, int] = {}
            for c in cells:
                for k, v in c[PER_ROW][2].items():
                    hist[k] = hist.get(k, 0) + v
            tot = sum(hist.values()) or 1
            share = "/".join(f"{100 * hist.get(k, 0) / tot:.0f}" for k in range(5))
            r = {"profile": pname, "n": n, "best_fixed": best,
                 "thr_vs_batch": [x / y for x, y in zip(thr[PER_ROW], thr[BATCH])],
                 "thr_vs_fixed": [x / y for x, y in zip(thr[PER_ROW], thr[best])],
                 "batch_thr_vs_fixed": [x / y for x, y in zip(thr[BATCH], thr[best])],
                 "e2e_vs_batch": [x / y for x, y in zip(e2e[PER_ROW], e2e[BATCH])],
                 "e2e_vs_fixed": [x / y for x, y in zip(e2e[PER_ROW], e2e[best])], "row_gamma_pct": share}
            extra = ""
            if a.class_oracle:
                split, r["oracle_vs_batch"] = oracle_ratio(prof, n, a.seeds, mix, thr[BATCH])
                r["oracle_split"] = split
                extra = f" {split} | {ratio_cell(r['oracle_vs_batch'])} |"
            rows.append(r)
            print(f"| {pname} | {n} | {best} | {ratio_cell(r['thr_vs_batch'])} | {ratio_cell(r['thr_vs_fixed'])} | "
                  f"{ratio_cell(r['batch_thr_vs_fixed'])} | {ratio_cell(r['e2e_vs_batch'])} | "
                  f"{ratio_cell(r['e2e_vs_fixed'])} | {share} |" + extra, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
