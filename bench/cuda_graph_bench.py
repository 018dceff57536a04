"""Eager vs CUDA-graph step time on the 7B-shaped random target (models/cuda_graph.py).

    python bench/cuda_graph_bench.py                       # CUDA: 7b shape, bf16
    python bench/cuda_graph_bench.py --shape 0.5b --batches 1,8 --q 1,4
    python bench/cuda_graph_bench.py --smoke               # CPU: no-capture runner on a tiny shape (no timing claim)

A step is what the verifier and the draft executor call: ``run_chunks`` (host layout + forward + logits)
for B rows of q query tokens each (q=1 decode, q=γ+1 verify) at a context of --ctx tokens per row, all
rows asking for logits of every token. Eager and graph runs alternate, --reps rounds of --steps steps
each; the table reports the median round per step and the eager/graph ratio, measured side by side in
one run, plus the largest |logits| difference between the two paths on the same step. "eager forward alone"
runs the model on a layout built once (no host layout work): the part of the gain that is launch overhead.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nightjar.actors.common import run_chunks  # noqa: E402
from nightjar.bench.e2e_synthetic import random_model  # noqa: E402
from nightjar.kvpool.cache import KVCache  # noqa: E402
from nightjar.models import build_layout  # noqa: E402
from nightjar.models.cuda_graph import GraphRunner  # noqa: E402

BS = 16


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def case(model, B: int, q: int, ctx: int, device: str):
    """A cache with B rows of ctx tokens (random KV) and the step's arguments."""
    c = model.cfg
    per_row = -(-(ctx + q) // BS)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, BS, B * per_row + 1, model.dtype, device)
    cache.segments[0].data.normal_(0, 1)
    tables = [tuple(range(1 + b * per_row, 1 + (b + 1) * per_row)) for b in range(B)]
    chunks = [[(7 * b + i) % c.vocab_size for i in range(q)] for b in range(B)]
    return cache, (chunks, [ctx] * B, tables, [q] * B)


def round_ms(step, steps: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def eager_only(model) -> None:
    model.__dict__.pop("graph_runner", None)        # run_chunks runs eagerly; the runner keeps its graphs


def measure(model, B: int, q: int, a, device: str, capture: bool) -> tuple[dict[str, float], float, dict]:
    """Median ms/step of: run_chunks eager, the eager forward alone (layout built once), run_chunks on graphs."""
    cache, args = case(model, B, q, a.ctx, device)
    lay = build_layout(args[0], args[1], args[2], BS, args[3], device)
    steps = {"eager": lambda: run_chunks(model, cache, BS, *args), "forward": lambda: model(lay, cache),
             "graph": lambda: run_chunks(model, cache, BS, *args)}
    runner = GraphRunner(model, cache, max_batch=max(a.max_batch, B), max_q=q, max_model_len=a.ctx + q, capture=capture)
    eager_only(model)
    want = run_chunks(model, cache, BS, *args)                          # eager (also warms up)
    model.graph_runner = runner
    got = run_chunks(model, cache, BS, *args)                           # captures
    diff = float((got - want).abs().max())
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a.reps):                                             # interleaved rounds
        for name, step in steps.items():
            if name == "graph":
                model.graph_runner = runner
            else:
                eager_only(model)
            times[name].append(round_ms(step, a.steps, device))
    stats = dict(runner.stats, bucket=next(iter(runner.entries)).batch if runner.entries else None)
    eager_only(model)
    runner.reset()
    return {k: statistics.median(v) for k, v in times.items()}, diff, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7b", help="a shape of nightjar/bench/e2e_synthetic.py (7b, 0.5b, ...)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--q", default="1,4", help="query tokens per row: 1 = decode, γ+1 = verify")
    ap.add_argument("--max-batch", type=int, default=64, help="largest bucket (the engine's max_num_seqs)")
    ap.add_argument("--ctx", type=int, default=512, help="context tokens per row")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, no-capture runner, 1 round of 2 steps")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.smoke:
        print("no CUDA: CUDA graphs need a GPU (use --smoke for a CPU run of the runner without capture)")
        return 2
    if a.smoke:
        a.shape, a.batches, a.q, a.ctx, a.steps, a.reps, a.max_batch = "small-draft", "1,3", "1,2", 24, 2, 1, 4
    capture = device == "cuda"
    model = random_model(a.shape, device, torch.bfloat16, 0)
    if device == "cpu":
        model.select_kernels(True)            # the Triton interpreter: the path graphs capture on CUDA
    print(f"# {a.shape} random target ({model.weight_bytes() / 1e9:.2f} GB bf16) on {device}; ctx {a.ctx}; "
          f"{a.reps} interleaved rounds x {a.steps} steps; {'captured graphs' if capture else 'NO capture (smoke)'}")
    print("| B | bucket | q | eager ms/step | eager forward alone | graph ms/step | eager/graph | forward/graph "
          "| max abs logit diff | runner |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B in (int(x) for x in a.batches.split(",")):
        for q in (int(x) for x in a.q.split(",")):
            t, diff, stats = measure(model, B, q, a, device, capture)
            e, f, g = t["eager"], t["forward"], t["graph"]
            print(f"| {B} | {stats['bucket']} | {q} | {e:.3f} | {f:.3f} | {g:.3f} | {e / g:.2f}x | {f / g:.2f}x "
                  f"| {diff:.3g} | "
                  f"{stats.get('captures', 0)} capture, {stats.get('replays', 0)} replays |", flush=True)
            if stats.get("eager", 0):
                print(f"FAILED: B={B} q={q} fell back to eager {stats['eager']} times")
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
