"""Draft quality for a target/draft pair: acceptance, cost ratio and single-stream speed-up (greedy).

    python bench/acceptance.py --prompts FILE.jsonl [--gamma 4] [--max-tokens 64] [--model M] [--draft D]
    python bench/acceptance.py --temperature 0.8 --skip-speed    # sampled: Gumbel coupling vs rejection

With ``--temperature T`` the acceptance at γ is also measured for sampled requests, seeded (verified by
Gumbel-max coupling, reproducible) and unseeded (optimal rejection sampling), on the same prompts.

``--prompts heldout`` uses the held-out split of nightjar/data/prompts.jsonl. Each line of FILE is
``{"prompt": ...}``, sent as one user chat message. The last line printed is one JSON object with
mean_accepted_tokens, per_position_acceptance, draft_target_time_ratio, speedup_best_fixed_vs_off,
best_gamma (and the per-policy tokens/s behind them).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from step_times import step_time  # noqa: E402

from nightjar.engine import Engine  # noqa: E402
from nightjar.models import load_draft, load_model  # noqa: E402
from nightjar.sampling import SamplingParams  # noqa: E402


def read_prompts(spec: str, limit: int | None) -> list[str]:
    if spec == "heldout":
        from nightjar.data import load_prompts

        rows = load_prompts(split="heldout")
    else:
        rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows][:limit]


async def run_policy(pair, policy: str, gamma_max: int, prompts, max_tokens: int, dtype: str):
    """Single stream: prompts one after another. Returns (tokens/s, engine stats)."""
    async with Engine(policy=policy, loaded=pair, dtype=dtype, gamma_max=gamma_max) as eng:
        await _one(eng, prompts[0], 8)                                   # warm-up
        eng.collector.stats.__init__()
        n, t0 = 0, time.perf_counter()
        for p in prompts:
            n += await _one(eng, p, max_tokens)
        return n / (time.perf_counter() - t0), eng.stats


async def _one(eng, prompt: str, max_tokens: int, sp: SamplingParams | None = None) -> int:
    n = 0
    sp = sp or SamplingParams(max_tokens=max_tokens)
    async for o in eng.generate([{"role": "user", "content": prompt}], sp):
        n += len(o.token_ids)
    return n


async def sampled_acceptance(pair, gamma: int, prompts, max_tokens: int, dtype: str, temperature: float,
                             seeded: bool) -> dict:
    """Acceptance of sampled requests at fixed γ: seeded ones (Gumbel coupling) or unseeded (rejection)."""
    async with Engine(policy=f"fixed:{gamma}", loaded=pair, dtype=dtype, gamma_max=gamma) as eng:
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if seeded else None)
            await _one(eng, p, max_tokens, sp)
        st = eng.stats
    return {"per_position_acceptance": [round(x / st.num_drafts, 3) for x in st.accepted_per_pos],
            "mean_accepted_tokens": round(1 + st.accepted_tokens / st.num_drafts, 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="heldout")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of the speed runs")
    ap.add_argument("--speed-prompts", type=int, default=12, help="prompts per single-stream speed run")
    ap.add_argument("--write-card", action="store_true", help="append the figures to the draft's model card")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="also measure sampled acceptance at this temperature, seeded vs unseeded")
    ap.add_argument("--skip-speed", action="store_true", help="only acceptance (no greedy or speed runs)")
    a = ap.parse_args(argv)
    prompts = read_prompts(a.prompts, a.limit)
    target = load_model(a.model, a.dtype)
    draft = load_draft(a.draft, target.config, a.dtype)
    pair = (target, draft)
    sampled = {}
    if a.temperature > 0:
        for name, seeded in (("seeded_gumbel", True), ("unseeded_rejection", False)):
            sampled[name] = asyncio.run(sampled_acceptance(pair, a.gamma, prompts, a.max_tokens, a.dtype,
                                                           a.temperature, seeded))
            print(f"  T={a.temperature} {name}: {sampled[name]}", flush=True)
        if a.skip_speed:
            print(json.dumps({"prompts": len(prompts), "gamma": a.gamma, "temperature": a.temperature, **sampled}))
            return sampled
    _, st = asyncio.run(run_policy(pair, f"fixed:{a.gamma}", a.gamma, prompts, a.max_tokens, a.dtype))
    per_pos = [x / st.num_drafts for x in st.accepted_per_pos]
    mean_acc = 1 + st.accepted_tokens / st.num_drafts
    t_target = step_time(target.model, 1, 1, 256, 15, "cpu")
    t_draft = step_time(draft.model, 1, 1, 256, 15, "cpu")
    policies = ["off"] + [f"fixed:{g}" for g in range(1, a.gamma + 1)]
    speeds = {p: [] for p in policies}
    for r in range(a.repeats):
        for p in policies[r % len(policies):] + policies[: r % len(policies)]:     # rotate the order
            tps, _ = asyncio.run(run_policy(pair, p, a.gamma, prompts[: a.speed_prompts], a.max_tokens, a.dtype))
            speeds[p].append(tps)
            print(f"  {p:8s} {tps:6.1f} tok/s", flush=True)
    med = {p: statistics.median(v) for p, v in speeds.items()}
    best = max(policies[1:], key=lambda p: med[p])
    result = {
        "prompts": len(prompts), "gamma": a.gamma, "mean_accepted_tokens": round(mean_acc, 3),
        "per_position_acceptance": [round(x, 3) for x in per_pos],
        "draft_target_time_ratio": round(t_draft / t_target, 4),
        "target_step_ms": round(t_target * 1e3, 2), "draft_step_ms": round(t_draft * 1e3, 2),
        "tokens_per_s": {p: round(v, 2) for p, v in med.items()},
        "speedup_best_fixed_vs_off": round(med[best] / med["off"], 3), "best_gamma": int(best.split(":")[1]),
        **({"temperature": a.temperature, **sampled} if sampled else {}),
    }
    print(f"per-position acceptance: {result['per_position_acceptance']}, mean accepted tokens/step "
          f"(incl. bonus) at γ={a.gamma}: {mean_acc:.2f}; draft/target step time at B=1: "
          f"{t_draft * 1e3:.2f}/{t_target * 1e3:.2f} ms = {t_draft / t_target:.1%}; best {best}: "
          f"{result['speedup_best_fixed_vs_off']}x off")
    if a.write_card and a.draft == "default":
        _write_card(result, a)
    print(json.dumps(result))
    return result


def _write_card(result: dict, a) -> None:
    from nightjar.models import DEFAULT_DRAFT_DIR

    card = DEFAULT_DRAFT_DIR / "README.md"
    text = card.read_text().split("## Measured acceptance")[0]
    text += ("## Measured acceptance\n\n"
             f"`python bench/acceptance.py --prompts {a.prompts} --gamma {a.gamma} --max-tokens {a.max_tokens}` "
             f"({result['prompts']} held-out prompts, greedy, bf16, 2-core CPU):\n\n```json\n"
             + json.dumps(result, indent=2) + "\n```\n")
    card.write_text(text)


if __name__ == "__main__":
    main()
