"""End-to-end engine throughput on random-weight large shapes with SYNTHETIC acceptance.

    python -m nightjar.bench.e2e_synthetic [--target 7b] [--draft 0.5b] [--acceptance 0.7] [--batches 1,8,32,64]
        [--policies off,fixed:1,fixed:3,nightjar] [--tokens 128] [--reps 2]

Random weights make real acceptance ~0, so drafts are accepted at a set rate (like vLLM's synthetic
rejection sampler): the figures measure the engine and its kernels, NOT output quality. On a CPU
``--small`` shrinks the shapes to a smoke test.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from nightjar.kernel.threads import on_fresh_thread
from nightjar.models import LlamaModel, LoadedModel
from nightjar.models.config import ModelConfig

SHAPES = {   # hidden, layers, heads, kv heads, mlp, vocab
    "7b": (4096, 32, 32, 8, 14336, 32000),
    "0.5b": (1024, 24, 16, 4, 2816, 32000),
    "small-target": (512, 8, 8, 4, 1536, 32000),
    "small-draft": (128, 2, 4, 2, 384, 32000),
}


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int) -> LlamaModel:
    h, layers, heads, kv, mlp, vocab = SHAPES[shape]
    cfg = ModelConfig(vocab_size=vocab, hidden_size=h, intermediate_size=mlp, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, head_dim=h // heads, rope_theta=500000.0, max_position=4096, name=shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.select_kernels()
    return model.eval()


async def run(pair, policy: str, batch: int, tokens: int, acceptance: float, dtype: str) -> float:
    """tok/s of the second of two rounds of ``batch`` concurrent requests on one engine: the first round
    captures the CUDA graphs of this batch's shapes, compiles Triton and starts the planner's learning."""
    from nightjar.engine import Engine
    from nightjar.sampling import SamplingParams

    async with Engine(policy=policy, loaded=pair, dtype=dtype, synthetic_acceptance=acceptance,
                      max_num_seqs=max(batch, 1), num_blocks=batch * 16 + 64) as eng:
        prompt = list(range(100, 228))                                    # 128 tokens
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)

        async def one():
            return sum([len(o.token_ids) async for o in eng.generate(prompt, sp)] or [0])

        async def one_round() -> float:
            t0 = time.perf_counter()
            n = sum(await asyncio.gather(*[one() for _ in range(batch)]))
            return n / (time.perf_counter() - t0)
        await one_round()                                                  # warm-up at this batch
        return await one_round()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="7b")
    ap.add_argument("--draft", default="0.5b")
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--policies", default="off,fixed:1,fixed:3,nightjar")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions (a fresh engine each); the median")
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16"
    if a.small or device == "cpu":
        a.target, a.draft, a.batches = "small-target", "small-draft", "1,4"
    # built on threads that exit, so the engine's compute thread is alone (kernel/threads.py)
    target = LoadedModel(on_fresh_thread(random_model, a.target, device, torch.bfloat16, 0), None, f"random-{a.target}")
    draft = LoadedModel(on_fresh_thread(random_model, a.draft, device, torch.bfloat16, 1), None, f"random-{a.draft}")
    print(f"# SYNTHETIC acceptance {a.acceptance} (drafts accepted at random; not the target's outputs)")
    print(f"# target {a.target} ({target.model.weight_bytes() / 1e9:.2f} GB), draft {a.draft} "
          f"({draft.model.weight_bytes() / 1e9:.2f} GB) on {device}, {a.tokens} tokens per request")
    policies = a.policies.split(",")
    static = [p for p in policies if p == "off" or p.startswith("fixed:")]
    adaptive = [p for p in policies if p not in static]
    ratios = [f"{p} / best static" for p in adaptive] if static else []
    print(f"# median of {a.reps} interleaved runs; each the second round of B requests on its own engine")
    print("| B | " + " | ".join([f"{p} tok/s" for p in policies] + ratios) + " |\n|---|"
          + "---|" * (len(policies) + len(ratios)))
    for B in (int(x) for x in a.batches.split(",")):
        runs: dict[str, list[float]] = {p: [] for p in policies}
        for _ in range(a.reps):
            for p in policies:
                runs[p].append(asyncio.run(run((target, draft), p, B, a.tokens, a.acceptance, dtype)))
        med = {p: statistics.median(r) for p, r in runs.items()}
        best = max((med[p] for p in static), default=0.0)
        cells = [f"{med[p]:.1f}" for p in policies] + ([f"{med[p] / best:.2f}" for p in adaptive] if static else [])
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
