"""The fused CPU paged attention (models/cpu_fused.cpp) alone: µs per layer call at several (B, q, context).

    python bench/cpu_attention.py [--dtype bfloat16] [--calls 200]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head_dim 64), blocks of 16 slots in a shuffled
order, every row verifying q tokens after ``context`` cached positions; the best of 5 rounds. Compare a change by
running it before and after (the op keeps no switch for its old code).
"""
from __future__ import annotations

import argparse
import time

import torch

from nightjar.argtypes import positive
from nightjar.models import cpu_fused, parse_dtype

CASES = ((1, 1, 256), (1, 5, 256), (16, 1, 256), (16, 5, 256), (16, 1, 1024), (64, 1, 256))
NH, NKV, D, BS = 9, 3, 64, 16


def time_case(B: int, q: int, ctx: int, dtype: torch.dtype, calls: int) -> float:
    """Best-of-5 µs per call for B rows of q queries after ctx positions."""
    g = torch.Generator().manual_seed(0)
    nb = (ctx + q) // BS + 1
    cache = torch.randn(2, NKV, B * nb * BS, D, generator=g).to(dtype)
    tables = torch.randperm(B * nb, generator=g).view(B, nb)
    qs = torch.randn(B * q, NH, D, generator=g).to(dtype)
    starts, lens = torch.arange(0, B * q + 1, q), torch.full((B,), ctx + q)
    op = torch.ops.nightjar_cpu.paged_attention

    def call():
        op(qs, cache, tables, starts, lens, BS, D ** -0.5, 64)

    for _ in range(10):
        call()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            call()
        best = min(best, (time.perf_counter() - t0) / (calls // 5) * 1e6)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--calls", type=positive(int), default=200)
    a = ap.parse_args(argv)
    if not cpu_fused.available():
        ap.exit(2, "cpu_attention.py: the fused CPU ops are not available here\n")
    dtype = parse_dtype(a.dtype)
    print(f"| B | q | context | µs per layer call ({a.dtype}) |")
    print("|---:|---:|---:|---:|")
    for B, q, ctx in CASES:
        print(f"| {B} | {q} | {ctx} | {time_case(B, q, ctx, dtype, a.calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
