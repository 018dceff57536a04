#!/usr/bin/env python
"""Weight-only quantization (``--quantization``): what it costs in quality and what it buys in speed.

    .venv/bin/python bench/quant_quality.py [--model smollm2-135m] [--modes bf16,int8,int4] [--prompts 16]
        [--max-tokens 32] [--batches 1,4,16] [--queries 1,5] [--reps 7] [--policies off,nightjar]
        [--sections kernels,steps,quality,stream] [--threads N]

Every variant is loaded as the engine loads it (``models.quant.load_quantized``: bf16 = the served bf16
model; int8/int4 = layers quantized, LM head an int8 copy where the fused CPU ops build). Sections:

* **kernels** (only when asked): one layer of each MLP shape at M rows: bf16 ``F.linear``, the packed
  int8/int4 kernels (int4 with group 32 and 64), dequantize-then-GEMM and the int8 head's ``int8_linear``:
  where PACKED_MAX_ROWS and the group size come from.
* **steps**: median target step time T(B, q) at context 256, the variants timed in turn within every
  repetition (interleaved), with each one's ratio to bf16.
* **quality**, on the held-out prompts of nightjar/data (chat template): the fp32 model's greedy answer
  (``--max-tokens``) is the reference text. Per variant: teacher-forced top-1 agreement with bf16 on the
  answer positions; free-running greedy agreement with bf16 (share of the ``--max-tokens`` generated tokens
  before the first difference, and the share of identical answers); mean log-likelihood per token of the
  reference answers and of the prompts' own text (human-written, produced by no variant). The fp32 model
  itself is the last row: how far bf16 alone already is from it.
* **stream**: output tokens/s through the Engine (greedy) per variant and policy: single stream (one
  request at a time, the engines alternating prompt by prompt), then all prompts at once (closed loop at
  concurrency = ``--prompts``, best of two rounds); the draft is quantized as the target.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nightjar.kvpool.cache import KVCache  # noqa: E402
from nightjar.models import build_layout  # noqa: E402
from nightjar.models.quant import load_quantized  # noqa: E402

BS = 16


def load_variants(model: str, modes: list[str]) -> dict:
    out = {}
    for m in modes:
        t0 = time.perf_counter()
        out[m] = load_quantized(model, "bfloat16", "cpu", "none" if m == "bf16" else m)
        print(f"# loaded {m}: {out[m].model.weight_bytes() / 1e6:.1f} MB held, {time.perf_counter() - t0:.0f} s",
              flush=True)
    return out


COLS = ("bf16", "onednn", "int8", "int8d", "int8h", "int4", "int4b", "int4d", "int4f")


# ---- kernels -------------------------------------------------------------------------------------
def kernel_table(rows: list[int], shapes: list[tuple[int, int]], reps: int) -> None:
    """Per layer shape and rows M: bf16 F.linear, each quantized kernel, and dequantize + GEMM (us)."""
    import torch.nn.functional as F

    from nightjar.models import cpu_fused
    from nightjar.models.cpu_linear import PackedLinear
    from nightjar.models.quant import QuantHead, QuantLinear

    print(f"\n## One linear layer, us (p20 of {reps * 5} calls, interleaved): packed kernel vs dequantize + GEMM")
    print("| out x in | M | bf16 | bf16 oneDNN | int8 | int8 deq+GEMM | int8_linear (QuantHead) | int4 g32 | int4 g64 "
          "| int4 g32 deq+GEMM | int4_linear g32 (QuantLinear) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        packed = PackedLinear(w)
        q8h = QuantHead.from_weight(w) if cpu_fused.available() else None
        q8, q4, q4b = (QuantLinear.from_weight(w, "int8"), QuantLinear.from_weight(w, "int4", 32),
                       QuantLinear.from_weight(w, "int4", 64) if k % 64 == 0 else None)
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            fns = {"bf16": lambda: F.linear(x, w), "onednn": lambda: packed(x),
                   "int8": lambda: torch.ops.aten._weight_int8pack_mm(x, q8.qweight, q8.scales),
                   "int8d": lambda: q8.dense_mm(x),
                   "int8h": (lambda: q8h(x)) if q8h else None,
                   "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4.qweight, 32, q4.scales),
                   "int4b": (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4b.qweight, 64, q4b.scales))
                   if q4b else None,
                   "int4d": lambda: q4.dense_mm(x),
                   "int4f": (lambda: torch.ops.nightjar_cpu.int4_linear.default(x, q4.qweight, q4.scales, 32))
                   if cpu_fused.available() and n % 64 == 0 else None}
            ts = {name: [] for name, f in fns.items() if f}
            for _ in range(reps * 5 + 2):
                for name in ts:
                    t0 = time.perf_counter()
                    fns[name]()
                    ts[name].append(time.perf_counter() - t0)
            p20 = {name: sorted(t[2:])[len(t[2:]) // 5] * 1e6 for name, t in ts.items()}
            cells = [f"{p20[c]:.0f}" if c in p20 else "n/a" for c in COLS]
            print(f"| {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


# ---- steps ----------------------------------------------------------------------------------------
def step_table(models: dict, batches: list[int], queries: list[int], reps: int, ctx: int = 256) -> None:
    names = list(models)
    cfg, dtype = models[names[0]].cfg, models[names[0]].dtype
    print(f"\n## T(B, q) in ms, context {ctx}, median of {reps} interleaved")
    cols = [f"q={q} {n}" for q in queries for n in names] + [f"q={q} {n}/{names[0]}" for q in queries
                                                              for n in names[1:]]
    print("| B | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for B in batches:
        med = {}
        for q in queries:
            nb = (ctx + q) // BS + 1
            cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, B * nb, dtype, "cpu")
            lay = build_layout([[5] * q] * B, [ctx] * B, [tuple(range(b * nb, (b + 1) * nb)) for b in range(B)],
                               BS, [q] * B)
            ts = {n: [] for n in names}
            for r in range(reps + 2):
                for n, m in models.items():
                    t0 = time.perf_counter()
                    m(lay, cache)
                    if r >= 2:
                        ts[n].append(time.perf_counter() - t0)
            med[q] = {n: statistics.median(t) for n, t in ts.items()}
        cells = [f"{med[q][n] * 1e3:.1f}" for q in queries for n in names]
        cells += [f"{med[q][n] / med[q][names[0]]:.2f}x" for q in queries for n in names[1:]]
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)


# ---- quality --------------------------------------------------------------------------------------
def forward_all(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] (fp32) of one sequence, teacher-forced, in one prefill."""
    nb = len(ids) // BS + 1
    cache = KVCache(model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim, BS, nb, model.dtype, "cpu")
    return model(build_layout([ids], [0], [tuple(range(nb))], BS, [len(ids)]), cache)


def greedy(model, ids: list[int], n: int) -> list[int]:
    nb = (len(ids) + n) // BS + 1
    cache = KVCache(model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim, BS, nb, model.dtype, "cpu")
    table = [tuple(range(nb))]
    out, chunk, start = [], ids, 0
    for _ in range(n):
        logits = model(build_layout([chunk], [start], table, BS, [1]), cache)
        tok = int(logits[-1].argmax())
        out.append(tok)
        start += len(chunk)
        chunk = [tok]
    return out


def quality(variants: dict, ref_model, prompts: list[list[int]], user_spans: list[tuple[int, int]],
            n: int) -> None:
    refs = [greedy(ref_model, p, n) for p in prompts]
    names = list(variants)
    stats = {m: {"tf": [], "ll": [], "ll_prompt": [], "prefix": [], "same": []} for m in names}
    free = {m: [greedy(variants[m].model, p, n) for p in prompts] for m in names}
    for i, (p, a) in enumerate(zip(prompts, refs)):
        logits = {}
        for m in names:
            lp = forward_all(variants[m].model, p + a).log_softmax(-1)   # [len, V]
            logits[m] = lp
            ans = torch.tensor(a)
            stats[m]["ll"].append(lp[len(p) - 1: -1].gather(1, ans[:, None]).mean().item())
            s, e = user_spans[i]
            stats[m]["ll_prompt"].append(lp[s - 1: e - 1].gather(1, torch.tensor(p[s:e])[:, None]).mean().item())
        base = logits[names[0]][len(p) - 1: -1].argmax(-1)
        for m in names:
            stats[m]["tf"].append((logits[m][len(p) - 1: -1].argmax(-1) == base).float().mean().item())
            x, y = free[m][i], free[names[0]][i]
            k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), n)
            stats[m]["prefix"].append(k / n)
            stats[m]["same"].append(float(x == y))
    print(f"\n## Quality: {len(prompts)} held-out prompts, {n} reference tokens each (fp32 greedy answers)")
    print(f"| variant | top-1 agreement with {names[0]} (teacher-forced) | greedy tokens before first difference "
          f"| identical greedy answers | mean log-lik / token, reference answers | mean log-lik / token, prompt text |")
    print("|---|---|---|---|---|---|")
    for m in names:
        s = stats[m]
        print(f"| {m} | {statistics.mean(s['tf']):.3f} | {statistics.mean(s['prefix']):.3f} | "
              f"{statistics.mean(s['same']):.2f} | {statistics.mean(s['ll']):.4f} | "
              f"{statistics.mean(s['ll_prompt']):.4f} |", flush=True)


def encode_prompts(tok, texts: list[str]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Chat-templated ids and, per prompt, the [start, end) token span of its user text (located by
    encoding the template around an empty message and the message)."""
    ids, spans = [], []
    for t in texts:
        full = tok.encode_chat([{"role": "user", "content": t}])
        empty = tok.encode_chat([{"role": "user", "content": ""}])
        pre = next((j for j, (u, v) in enumerate(zip(full, empty)) if u != v), len(empty))
        post = len(empty) - pre
        ids.append(full)
        spans.append((max(pre, 1), len(full) - post))
    return ids, spans


# ---- stream ---------------------------------------------------------------------------------------
def stream(variants: dict, model: str, policies: list[str], prompts: list[str], n: int) -> None:
    from nightjar.engine import Engine
    from nightjar.models.quant import load_quantized as lq
    from nightjar.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0)
    target_cfg = next(iter(variants.values())).config
    drafts = {m: lq("default", "bfloat16", "cpu", "none" if m == "bf16" else m, draft_for=target_cfg)
              for m in variants}

    async def one(eng, p):
        k = 0
        async for out in eng.generate([{"role": "user", "content": p}], params):
            k += len(out.token_ids)
        return k

    async def main():
        engines = {}
        for m, target in variants.items():
            for pol in policies:
                draft = drafts[m] if pol != "off" else None
                engines[(m, pol)] = await Engine(policy=pol, loaded=(target, draft), gamma_max=4).start()
        toks = {k: 0 for k in engines}
        secs = {k: 0.0 for k in engines}
        for e in engines.values():
            await one(e, prompts[0])                                       # warm-up
        for p in prompts:                                                  # interleaved: prompt by prompt
            for k, e in engines.items():
                t0 = time.perf_counter()
                toks[k] += await one(e, p)
                secs[k] += time.perf_counter() - t0
        conc = {k: [] for k in engines}
        for _ in range(2):                                                 # closed loop, all prompts at once
            for k, e in engines.items():
                t0 = time.perf_counter()
                n_tok = sum(await asyncio.gather(*(one(e, p) for p in prompts)))
                conc[k].append(n_tok / (time.perf_counter() - t0))
        for e in engines.values():
            await e.stop()
        return {k: toks[k] / secs[k] for k in engines}, toks, {k: max(v) for k, v in conc.items()}

    rates, toks, conc = asyncio.run(main())
    first = (next(iter(variants)), policies[0])
    print(f"\n## {len(prompts)} held-out prompts, max {n} tokens, greedy: single stream (engines alternate per "
          f"prompt) and all {len(prompts)} at once (best of 2 rounds, engines in turn)")
    print(f"| variant | policy | tokens | single tok/s | vs {first[0]} {first[1]} | concurrent tok/s | vs {first[0]} "
          f"{first[1]} |\n|---|---|---|---|---|---|---|")
    for (m, pol), r in rates.items():
        c = conc[(m, pol)]
        print(f"| {m} | {pol} | {toks[(m, pol)]} | {r:.1f} | {r / rates[first]:.2f}x | {c:.1f} | "
              f"{c / conc[first]:.2f}x |", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="bf16,int8,int4")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--queries", default="1,5")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--policies", default="off,nightjar")
    ap.add_argument("--sections", default="steps,quality,stream")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; 1 is steadier on a shared, oversubscribed box)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from nightjar.data import load_prompts

    torch.manual_seed(0)
    sections = a.sections.split(",")
    if "kernels" in sections:
        kernel_table([1, 4, 16, 32, 64, 128, 256], [(3072, 576), (576, 1536)], a.reps)
        kernel_table([1, 5, 16], [(49152, 576)], a.reps)                 # the (tied) LM head's shape
        if sections == ["kernels"]:
            return
    variants = load_variants(a.model, a.modes.split(","))
    print(f"# {a.model}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if "steps" in sections:
        step_table({m: v.model for m, v in variants.items()}, [int(x) for x in a.batches.split(",")],
                   [int(x) for x in a.queries.split(",")], a.reps)
    texts = [r["prompt"] for r in load_prompts(split="heldout")][: a.prompts]
    if "quality" in sections:
        ref = load_quantized(a.model, "float32", "cpu", "none")
        tok = next(iter(variants.values())).tokenizer or ref.tokenizer
        ids, spans = encode_prompts(tok, texts)
        quality({**variants, "fp32 (reference)": ref}, ref.model, ids, spans, a.max_tokens)
        del ref
    if "stream" in sections:
        stream(variants, a.model, a.policies.split(","), texts, a.max_tokens)


if __name__ == "__main__":
    main()
