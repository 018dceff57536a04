"""Draft quality for a target and one or more drafts: acceptance, cost and single-stream speed (greedy).

    python bench/acceptance.py [--draft default,nightjar/models/drafts/smollm2-135m-head] [--gamma 4]
                               [--max-tokens 64] [--prompts heldout] [--repeats 2] [--speed-prompts 12]
    python bench/acceptance.py --temperature 0.8 --skip-speed    # sampled: Gumbel coupling vs rejection
    python bench/acceptance.py --quantization int4 --draft default@none,default@int4 --skip-speed   # quantized
    python bench/acceptance.py --gamma 3 --draft-tree 1,3      # a head's draft tree beside its chain

A draft is an independent model (``independent``: the shipped small Llama draft, or any checkpoint), a
draft head directory (models/eagle.py; ``default``: the shipped head) or the n-gram drafter (``ngram[:MIN-MAX]``,
actors/draft_ngram.py). For each draft, on the same prompts (``heldout``: the held-out
split of nightjar/data/prompts.jsonl, never trained on):
- acceptance at fixed γ: per draft position (conditional on reaching it) and mean accepted tokens per
  step incl. the bonus token;
- cost inside the engine at B=1 (single stream), from the step's own timings: one draft pass
  (draft time / γ, the first pass's catch-up excluded) against the target's verify forward;
- for a head, the γ=0 overhead: the time spent capturing and storing the target's features per step
  (executor and verifier timed in place) against the step (``fixed:0`` with the head loaded);
- single-stream tokens/s of ``off``, ``fixed:1..γ`` and ``nightjar`` with each draft, all runs
  interleaved (order rotated per repetition) so a noisy machine slows them alike; medians.
- with ``--draft-tree K,..`` (heads): the share of drafting rows that took a runner-up first draft at fixed γ
  and tokens per step with it, and the speed runs again with each tree width.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from nightjar.actors.draft_ngram import parse_ngram
from nightjar.config_check import MAX_TREE
from nightjar.engine import Engine
from nightjar.kernel.messages import StepDrafted, StepTimed
from nightjar.kernel.threads import on_fresh_thread
from nightjar.models.eagle import is_head
from nightjar.models.quant import draft_mode, load_quantized
from nightjar.sampling import SamplingParams


def read_prompts(spec: str, limit: int | None, categories: str = "") -> list[str]:
    if spec == "heldout":
        from nightjar.data import load_prompts

        rows = load_prompts(split="heldout")
    else:
        rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
    if categories:
        rows = [r for r in rows if r.get("category") in categories.split(",")]
    return [r["prompt"] for r in rows][:limit]


class StepLog:
    """Per-step timings from the bus: draft pass time (excl. catch-up) and the target's verify time."""

    def __init__(self) -> None:
        self.drafted: dict[int, StepDrafted] = {}
        self.draft_pass: list[float] = []
        self.verify: list[float] = []

    def __call__(self, env) -> None:
        m = env.msg
        if isinstance(m, StepDrafted):
            self.drafted[m.step] = m
        elif isinstance(m, StepTimed) and m.batch_size == 1:
            d = self.drafted.pop(m.step, None)
            dt = d.draft_time_s if d else 0.0
            self.verify.append(m.step_time_s - dt)          # step_time_s = verify + draft (catch-up apart)
            if d and m.gamma:
                self.draft_pass.append(dt / m.gamma)


async def run_policy(pair, policy: str, gamma_max: int, prompts, max_tokens: int, dtype: str, tree: int = 0):
    """Single stream: prompts one after another. Returns (tokens/s, engine stats, step log, γ=0 cost)."""
    async with Engine(policy=policy, dtype=dtype, gamma_max=gamma_max, draft_tree=tree, draft_tree_batch=1,
                      **engine_args(pair)) as eng:
        await _one(eng, prompts[0], 8)                                   # warm-up
        eng.collector.stats.__init__()
        log = StepLog()
        eng.bus.add_tap(log)
        feature_cost = _time_feature_work(eng)
        n, t0 = 0, time.perf_counter()
        for p in prompts:
            n += await _one(eng, p, max_tokens)
        return n / (time.perf_counter() - t0), eng.stats, log, feature_cost


def _time_feature_work(eng) -> list[float]:
    """Wrap the head executor's feature store and the verifier's capture hand-off: seconds per step."""
    from nightjar.actors.draft_head import HeadDraftExecutor

    ex = next((a for a in eng.actors if isinstance(a, HeadDraftExecutor)), None)
    spent: list[float] = []
    if ex is None:
        return spent
    store = ex._store

    def timed(v):
        t0 = time.perf_counter()
        store(v)
        spent.append(time.perf_counter() - t0)
    ex._store = timed
    return spent


async def _one(eng, prompt: str, max_tokens: int, sp: SamplingParams | None = None) -> int:
    n = 0
    sp = sp or SamplingParams(max_tokens=max_tokens)
    async for o in eng.generate([{"role": "user", "content": prompt}], sp):
        n += len(o.token_ids)
    return n


async def sampled_acceptance(pair, gamma: int, prompts, max_tokens: int, dtype: str, temperature: float,
                             seeded: bool) -> dict:
    """Acceptance of sampled requests at fixed γ: seeded ones (Gumbel coupling) or unseeded (rejection)."""
    async with Engine(policy=f"fixed:{gamma}", dtype=dtype, gamma_max=gamma, **engine_args(pair)) as eng:
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if seeded else None)
            await _one(eng, p, max_tokens, sp)
        st = eng.stats
    return {"per_position_acceptance": [round(x / st.num_drafts, 3) for x in st.accepted_per_pos],
            "mean_accepted_tokens": round(1 + st.accepted_tokens / st.num_drafts, 3)}


def acceptance(pair, a, prompts) -> dict:
    """Greedy acceptance at fixed γ and the B=1 draft-pass / verify costs measured in the same run."""
    _, st, log, _ = asyncio.run(run_policy(pair, f"fixed:{a.gamma}", a.gamma, prompts, a.max_tokens, a.dtype))
    t_draft, t_verify = statistics.median(log.draft_pass), statistics.median(log.verify)
    return {"mean_accepted_tokens": round(1 + st.accepted_tokens / st.num_drafts, 3),
            "per_position_acceptance": [round(x / st.num_drafts, 3) for x in st.accepted_per_pos],
            "draft_pass_ms": round(t_draft * 1e3, 2), "target_verify_ms": round(t_verify * 1e3, 2),
            "draft_target_time_ratio": round(t_draft / t_verify, 4)}


def tree_acceptance(pair, a, prompts, tree: int) -> dict:
    """At fixed γ with a draft tree of ``tree`` runner-ups: how often a drafting row took one, tokens per step."""
    _, st, log, _ = asyncio.run(run_policy(pair, f"fixed:{a.gamma}", a.gamma, prompts, a.max_tokens, a.dtype, tree))
    return {"runner_up_taken_per_draft": round(st.tree_hits / st.num_drafts, 3),
            "mean_tokens_per_step": round(1 + (st.accepted_tokens + st.tree_hits) / st.num_drafts, 3),
            "target_verify_ms": round(statistics.median(log.verify) * 1e3, 2)}


def trees_of(a) -> list[int]:
    return [int(k) for k in a.draft_tree.split(",") if k.strip()] if a.draft_tree else []


def speed_runs(pairs: dict, a, prompts) -> tuple[dict, dict]:
    """Interleaved single-stream runs: (median tokens/s per run name, γ=0 feature-work share per head)."""
    runs = [("off", None, "off", 0)]
    policies = [f"fixed:{g}" for g in range(1, a.gamma + 1)] + ["nightjar"]
    for name, pair in pairs.items():
        runs += [(f"{name} {p}", pair, p, 0) for p in policies]
        if head(pair):
            runs.append((f"{name} fixed:0", pair, "fixed:0", 0))
            runs += [(f"{name} {p} tree{k}", pair, p, k) for k in trees_of(a) for p in policies]
    target = next(iter(pairs.values()))[0]
    speeds = {r[0]: [] for r in runs}
    zero_cost: dict[str, list[float]] = {}
    for rep in range(a.repeats):
        k = rep % len(runs)
        for label, pair, policy, tree in runs[k:] + runs[:k]:            # rotate the order
            tps, _, log, cost = asyncio.run(run_policy(pair or (target, None, {}), policy, a.gamma,
                                                       prompts[: a.speed_prompts], a.max_tokens, a.dtype, tree))
            speeds[label].append(tps)
            if policy == "fixed:0" and cost:
                zero_cost.setdefault(label.split()[0], []).append(statistics.median(cost) /
                                                                  statistics.median(log.verify))
            print(f"  {label:40s} {tps:6.1f} tok/s", flush=True)
    med = {k: round(statistics.median(v), 2) for k, v in speeds.items()}
    return med, {k: round(statistics.median(v), 4) for k, v in zero_cost.items()}


def engine_args(pair) -> dict:
    """The Engine's keywords for a (target, drafter, keywords) triple: a loaded draft model or head, or the n-gram
    drafter's spec (a string: it has no weights), and the drafter's own engine keywords (``prompt_lookup``)."""
    target, draft, kw = pair
    if isinstance(draft, str):
        return {"loaded": (target, None), "draft": draft, **kw}
    return {"loaded": (target, draft), **kw}


LOOKUP = ":lookup="      # a head's prompt lookup in a --draft spec: default:lookup=0 (off), default:lookup=2


def head(pair) -> bool:
    return pair[1] is not None and not isinstance(pair[1], str) and is_head(pair[1].model)


def load_draft_spec(spec: str, target, dtype: str, quantization: str):
    """NAME or NAME@MODE (weight-only quantization of the draft's layers, models/quant.py; without one, the
    engine's default for a target of that ``quantization``); ``ngram[:MIN-MAX]`` stays a spec (no weights)."""
    if parse_ngram(spec) is not None:
        return spec
    name, _, mode = spec.partition("@")
    return load_quantized(name, dtype, "cpu", draft_mode(quantization, mode or None), draft_for=target.config)


def summarize(name: str, med: dict, gamma: int, suffix: str = "") -> dict:
    fixed = {g: med[f"{name} fixed:{g}{suffix}"] for g in range(1, gamma + 1)}
    best = max(fixed, key=fixed.get)
    return {"best_gamma": best, "speedup_best_fixed_vs_off": round(fixed[best] / med["off"], 3),
            "nightjar_vs_best_fixed": round(med[f"{name} nightjar{suffix}"] / fixed[best], 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="heldout")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="default", help="comma-separated drafts (models, head directories or "
                    "ngram[:MIN-MAX]); a head's NAME:lookup=N sets its prompt lookup (0: off; default: the engine's); "
                    "NAME@MODE quantizes one (none, int8, int4, w4a8, mixed; without: as the engine does), "
                    "e.g. default@none,default@int4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "w4a8"), help="the target's")
    ap.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    ap.add_argument("--categories", default="", help="only prompts of these categories (comma-separated)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of the speed runs")
    ap.add_argument("--speed-prompts", type=int, default=12, help="prompts per single-stream speed run")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="also measure sampled acceptance at this temperature, seeded vs unseeded")
    ap.add_argument("--skip-speed", action="store_true", help="only acceptance (no speed runs)")
    ap.add_argument("--draft-tree", default="", metavar="K,..", help="also measure heads with these tree widths")
    a = ap.parse_args(argv)
    try:
        if any(not 1 <= k <= MAX_TREE for k in trees_of(a)):
            raise ValueError
    except ValueError:
        ap.error(f"argument --draft-tree: widths 1..{MAX_TREE}, comma-separated; got {a.draft_tree!r}")
    prompts = read_prompts(a.prompts, a.limit, a.categories)
    if not prompts:
        ap.error(f"no prompts in {a.prompts!r}" + (f" of categories {a.categories!r}" if a.categories else ""))
    # loaded on a thread that exits: torch work on this (main) thread would leave an OpenMP team beside each
    # engine's compute thread and every forward would run ~2x slower (nightjar/kernel/threads.py)
    target = on_fresh_thread(load_quantized, a.model, a.dtype, "cpu", a.quantization)
    pairs = {d: (target, on_fresh_thread(load_draft_spec, d.split(LOOKUP)[0], target, a.dtype, a.quantization),
                 {"prompt_lookup": int(d.split(LOOKUP)[1])} if LOOKUP in d else {})
             for d in a.draft.split(",")}
    result = {"prompts": len(prompts), "gamma": a.gamma, "drafts": {}}
    for name, pair in pairs.items():
        r = acceptance(pair, a, prompts)
        for k in trees_of(a) if head(pair) else []:
            r[f"tree{k}"] = tree_acceptance(pair, a, prompts, k)
        if a.temperature > 0:
            for kind, seeded in (("seeded_gumbel", True), ("unseeded_rejection", False)):
                r[f"T{a.temperature}_{kind}"] = asyncio.run(sampled_acceptance(
                    pair, a.gamma, prompts, a.max_tokens, a.dtype, a.temperature, seeded))
        result["drafts"][name] = r
        print(f"{name}: {r}", flush=True)
    if not a.skip_speed:
        med, zero = speed_runs(pairs, a, prompts)
        result["tokens_per_s"] = med
        for name in pairs:
            result["drafts"][name].update(summarize(name, med, a.gamma))
            for k in trees_of(a) if head(pairs[name]) else []:
                result["drafts"][name][f"tree{k}"].update(
                    {key + "_tree": v for key, v in summarize(name, med, a.gamma, f" tree{k}").items()})
            if name in zero:
                result["drafts"][name]["gamma0_feature_work_share"] = zero[name]
                result["drafts"][name]["gamma0_vs_off"] = round(med[f"{name} fixed:0"] / med["off"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
