"""Median target step time T(B, q) at a fixed context, beside the memory-bandwidth floor.

    python bench/step_times.py [--model smollm2-135m] [--dtype bfloat16] [--context 256] [--reps 7]

The floor is weight bytes / measured copy bandwidth (a large tensor copy on the same device).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout, load_model


def copy_bandwidth(device: str, nbytes: int = 512 << 20) -> float:
    """Bytes/s of a large device copy, counting the bytes copied once (the usual "copy bandwidth")."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    ts = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_time(model, B: int, q: int, ctx: int, reps: int, device: str) -> float:
    c, bs = model.cfg, 16
    nb = (ctx + q) // bs + 1
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, bs, B * nb, model.dtype, device)
    tables = [tuple(range(b * nb, (b + 1) * nb)) for b in range(B)]
    lay = build_layout([[5] * q] * B, [ctx] * B, tables, bs, [q] * B, device=device)
    for _ in range(2):
        model(lay, cache)
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        model(lay, cache)
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--queries", default="1,2,3,5")
    a = ap.parse_args(argv)
    model = load_model(a.model, a.dtype, a.device).model
    bw = copy_bandwidth(a.device)
    floor = model.weight_bytes() / bw
    Bs, qs = [int(x) for x in a.batches.split(",")], [int(x) for x in a.queries.split(",")]
    print(f"# {a.model} {a.dtype} on {a.device}, context {a.context}: weights {model.weight_bytes() / 1e6:.1f} MB, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s, floor {floor * 1e3:.2f} ms")
    print("| B | " + " | ".join(f"q={q} (ms)" for q in qs) + " | q=1 / floor |")
    print("|---|" + "---|" * (len(qs) + 1))
    for B in Bs:
        row = [step_time(model, B, q, a.context, a.reps, a.device) for q in qs]
        print(f"| {B} | " + " | ".join(f"{t * 1e3:.1f}" for t in row) + f" | {row[0] / floor:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
