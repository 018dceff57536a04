"""Is a verify step with rows of different lengths priced right? Measured ragged step vs the planner's formula.

    python bench/mixed_steps.py [--model smollm2-135m] [--dtype bfloat16] [--quantization none] [--context 256]
                                [--reps 15] [--cases '4:0,0,2,2;16:0x8,4x8;...']

``nightjar:per-request`` prices a step whose decode rows verify γ_i + 1 tokens each from uniform measurements:
    T_mixed = T(B, 1) + Σ_k [T(n_k, k+1) − T(n_k, k)],   n_k = rows with γ_i ≥ k
(the target part; draft pass k over n_k rows is a plain smaller batch of the draft). On the real engine a
ragged batch leaves the dense attention path (rows of unequal length are grouped), so the formula may miss
a cost. This times, interleaved call by call, the ragged target forward and every uniform T(n, q) the
formula needs, and prints measured / predicted per case, with T(B, max γ + 1) (every row padded to the
deepest) beside it. Target only, the served model (fused, packed weights, fused CPU ops).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_times import build_variants  # noqa: E402

from nightjar.kvpool.cache import KVCache  # noqa: E402
from nightjar.models import build_layout  # noqa: E402

DEFAULT_CASES = "4:0,0,2,2;4:0,1,2,3;8:0x4,4x4;16:0x8,2x8;16:0x8,4x8;16:0x12,3x4;32:0x16,2x16;32:0x24,4x8"


def parse_cases(spec: str) -> list[tuple[int, ...]]:
    """'B:g,g,..' or 'B:gxN,..' per case, ';'-separated → γ vectors (ValueError unless each has B rows, γ ≥ 0)."""
    out = []
    for case in spec.split(";"):
        b, _, body = case.partition(":")
        vec: list[int] = []
        for part in body.split(","):
            g, _, n = part.partition("x")
            vec += [int(g)] * (int(n) if n else 1)
        if len(vec) != int(b) or min(vec) < 0 or max(vec) < 1:
            raise ValueError(f"case {case!r}: expected {b} rows of γ ≥ 0, at least one ≥ 1 (got {vec})")
        out.append(tuple(vec))
    return out


class Batch:
    """One target forward: row b verifies qs[b] tokens at a fixed context."""

    def __init__(self, cfg, qs: list[int], ctx: int, dtype, device: str):
        bs = 16
        nb = (ctx + max(qs)) // bs + 1
        B = len(qs)
        self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bs, B * nb, dtype, device)
        tables = [tuple(range(b * nb, (b + 1) * nb)) for b in range(B)]
        self.lay = build_layout([[5] * q for q in qs], [ctx] * B, tables, bs, list(qs), device=device)

    def time(self, model) -> float:
        t0 = time.perf_counter()
        model(self.lay, self.cache)
        return time.perf_counter() - t0


def needed(vec: tuple[int, ...]) -> set[tuple[int, int]]:
    """The uniform (n, q) steps the formula reads for one γ vector, plus the padded T(B, max γ + 1) and the
    two T(B, q) around the mean tokens per row."""
    B, top = len(vec), max(vec)
    qbar = 1.0 + sum(vec) / B
    out = {(B, 1), (B, top + 1), (B, int(qbar)), (B, min(int(qbar) + 1, top + 1))}
    for k in range(1, top + 1):
        n = sum(1 for g in vec if g >= k)
        out |= {(n, k + 1), (n, k)}
    return out


def predicted(vec: tuple[int, ...], t: dict[tuple[int, int], float]) -> float:
    B, top = len(vec), max(vec)
    out = t[(B, 1)]
    for k in range(1, top + 1):
        n = sum(1 for g in vec if g >= k)
        out += t[(n, k + 1)] - t[(n, k)]
    return out


def by_tokens(vec: tuple[int, ...], t: dict[tuple[int, int], float]) -> float:
    """T(B, q̄) linearly interpolated, q̄ = 1 + Σγ_i / B: the same tokens in uniform rows."""
    B = len(vec)
    qbar = 1.0 + sum(vec) / B
    lo = int(qbar)
    hi = min(lo + 1, max(vec) + 1)
    f = qbar - lo
    return t[(B, lo)] if hi == lo else (1 - f) * t[(B, lo)] + f * t[(B, hi)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "w4a8"))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--cases", default=DEFAULT_CASES, help="';'-separated B:γ_1,..,γ_B (gxN repeats g N times)")
    a = p.parse_args(argv)
    try:
        cases = parse_cases(a.cases)
    except ValueError as e:
        p.error(f"--cases: {e}")
    variant = "served" if a.quantization == "none" else a.quantization
    model = build_variants(a.model, a.dtype, "cpu", [variant])[variant]
    cfg, dt = model.cfg, model.dtype
    steps = {nq: Batch(cfg, [nq[1]] * nq[0], a.context, dt, "cpu") for c in cases for nq in needed(c)}
    ragged = {c: Batch(cfg, [g + 1 for g in c], a.context, dt, "cpu") for c in cases}
    ts: dict = {k: [] for k in (*steps, *ragged)}
    with torch.inference_mode():
        for rep in range(a.reps + 2):                       # two warm-up rounds, not kept
            for k, s in (*steps.items(), *ragged.items()):
                x = s.time(model)
                if rep >= 2:
                    ts[k].append(x)
    med = {k: statistics.median(v) for k, v in ts.items()}
    print(f"{a.model} {a.dtype} {variant}, context {a.context}, medians of {a.reps} interleaved calls (ms)\n")
    print("| B | γ_i | measured ragged | formula (layers) | measured / formula | T(B, q̄) by tokens | "
          "measured / by tokens | padded T(B, max γ+1) |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cases:
        pred, tok = predicted(c, med), by_tokens(c, med)
        pad = med[(len(c), max(c) + 1)]
        short = ",".join(f"{g}x{sum(1 for x in c if x == g)}" for g in sorted(set(c)))
        print(f"| {len(c)} | {short} | {1e3 * med[c]:.2f} | {1e3 * pred:.2f} | {med[c] / pred:.3f} | "
              f"{1e3 * tok:.2f} | {med[c] / tok:.3f} | {1e3 * pad:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
