#!/usr/bin/env python
"""Peer baselines (optional, not part of ``make test``): the same prompts through HF transformers ``generate``,
llama.cpp (``llama-cpp-python``, if installed) and Nightjar's engine (in process, one line per policy), single
stream and at a concurrency of 16, greedy, printing output tok/s side by side.

    .venv/bin/python bench/peers.py --num-prompts 16 --output-len 64 --policies off,fixed:2,nightjar \
        --output-json peers.json

* **transformers**: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` on the pulled SmolLM2 GGUF
  (dequantized to fp32 by transformers). Single stream = one ``generate`` per prompt; concurrency = batches of
  ``--concurrency`` prompts, left-padded, one ``generate`` per batch (static batching: a batch runs until its longest
  answer ends). Tokens = generated ids up to and including the first EOS.
* **llama.cpp**: ``llama_cpp.Llama(model_path=gguf)``; single stream only (the high-level API runs one sequence at
  a time, so the concurrency column is ``n/a``). Install it with (about 10+ min to compile on a small CPU)::

      CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
          .venv/bin/pip install llama-cpp-python

  Missing: the row says ``not installed`` and the script goes on. (A ``GGML_NATIVE=ON`` build died with SIGILL on
  chat-length prompts on the project's VM; the flags above work. Installing with ``--target DIR`` and running with
  ``PYTHONPATH=DIR`` keeps it out of the venv.)
* **nightjar**: ``Engine(policy=P, ...)`` per policy; single stream = sequential ``generate``; concurrency =
  ``--concurrency`` requests in flight (continuous batching). Tokens = output token ids.

Each backend, and each Nightjar entry, runs in a process of its own (spawned, one at a time): in one process the
second backend's forwards would run ~2x slower (see ``in_own_process``).

Every backend gets the same prompts (``nightjar.bench.datasets``, chat template applied) and the same
``max_tokens``; EOS ends a generation (use ``--ignore-eos`` for fixed lengths where the backend supports it:
transformers via ``min_new_tokens``, Nightjar via ``ignore_eos``; llama.cpp has no such switch and is marked).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nightjar.bench.datasets import build_requests, load_tokenizer  # noqa: E402
from nightjar.models import hub  # noqa: E402


def _rate(tokens: int, secs: float) -> float | None:
    return round(tokens / secs, 2) if secs > 0 else None


def run_transformers(prompts, max_tokens, concurrency, ignore_eos, threads):
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        return {"status": f"not installed ({e})"}
    torch.set_num_threads(threads)
    path = hub.model_path(hub.DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    eos = tok.eos_token_id

    def count(ids):
        n = 0
        for t in ids.tolist():
            n += 1
            if t == eos and not ignore_eos:
                break
        return n

    def gen(batch):
        enc = tok(batch, return_tensors="pt", padding=True)
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        if ignore_eos:
            kw["min_new_tokens"] = max_tokens
        with torch.inference_mode():
            out = model.generate(**enc, **kw)
        return sum(count(row[enc["input_ids"].shape[1]:]) for row in out)

    gen(texts[:1])                                      # warm-up
    t0 = time.perf_counter()
    single = sum(gen([t]) for t in texts)
    t1 = time.perf_counter()
    batched = sum(gen(texts[i:i + concurrency]) for i in range(0, len(texts), concurrency)) if concurrency else 0
    t2 = time.perf_counter()
    return {"status": "ok", "single_tok_s": _rate(single, t1 - t0),
            "concurrent_tok_s": _rate(batched, t2 - t1) if concurrency else None,
            "tokens": [single, batched], "dtype": "float32 (dequantized GGUF)"}


def run_llamacpp(prompts, max_tokens, threads):
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"status": "not installed (see the docstring for the pip command)"}
    llm = Llama(model_path=str(hub.model_path(hub.DEFAULT_MODEL)), n_ctx=2048, n_threads=threads, verbose=False,
                seed=0)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    llm.create_chat_completion(msgs[0], max_tokens=4, temperature=0.0)
    t0 = time.perf_counter()
    n = 0
    for m in msgs:
        out = llm.create_chat_completion(m, max_tokens=max_tokens, temperature=0.0)
        n += out["usage"]["completion_tokens"]
    t1 = time.perf_counter()
    return {"status": "ok", "single_tok_s": _rate(n, t1 - t0), "concurrent_tok_s": None,
            "note": "single sequence API: no concurrency; EOS always honoured", "tokens": [n, None]}


def run_nightjar(prompts, max_tokens, concurrency, ignore_eos, policy, server_args):
    from nightjar.bench.server import engine_factory_from_args
    from nightjar.sampling import SamplingParams

    make, _ = engine_factory_from_args(server_args, policy)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)

    async def one(eng, p):
        n = 0
        async for out in eng.generate([{"role": "user", "content": p}], params):
            n += len(out.token_ids)
        return n

    async def main():
        async with make() as eng:
            await one(eng, prompts[0])                  # warm-up
            t0 = time.perf_counter()
            single = 0
            for p in prompts:
                single += await one(eng, p)
            t1 = time.perf_counter()
            sem = asyncio.Semaphore(concurrency)

            async def bounded(p):
                async with sem:
                    return await one(eng, p)
            batched = sum(await asyncio.gather(*(bounded(p) for p in prompts))) if concurrency else 0
            t2 = time.perf_counter()
        return {"status": "ok", "single_tok_s": _rate(single, t1 - t0),
                "concurrent_tok_s": _rate(batched, t2 - t1) if concurrency else None, "tokens": [single, batched]}
    return asyncio.run(main())


def backend_runners(a, prompts) -> list[tuple[str, object, tuple]]:
    """(row name, module-level runner, its arguments) per backend and Nightjar entry (POLICY or POLICY@FLAGS)."""
    from nightjar.bench.compare import split_variant

    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    out = []
    if "transformers" in backends:
        out.append(("transformers", run_transformers, (prompts, a.output_len, a.concurrency, a.ignore_eos, a.threads)))
    if "llama.cpp" in backends:
        out.append(("llama.cpp", run_llamacpp, (prompts, a.output_len, a.threads)))
    if "nightjar" in backends:
        for entry in [p.strip() for p in a.policies.split(",") if p.strip()]:
            pol, extra = split_variant(entry)
            flags = f"{a.server_args} {extra}".strip()
            out.append((f"nightjar {entry}", run_nightjar,
                        (prompts, a.output_len, a.concurrency, a.ignore_eos, pol, flags)))
    return out


def in_own_process(fn, args) -> dict:
    """``fn(*args)`` in a fresh (spawned) process. Backends never share one: torch's OpenMP runtime keeps a
    thread team per OS thread that ever ran parallel work, and once two teams exist on a small box every
    forward of both runs ~2x slower (nightjar/kernel/threads.py), so a backend run after another in the same
    process would be measured throttled."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def run_rounds(runners, repeats: int, run=in_own_process) -> dict[str, list[dict]]:
    """Every runner once per round, each in its own process, the order rotated each round (a noisy box
    slows them alike)."""
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in runners}
    for r in range(repeats):
        k = r % len(runners)
        for name, fn, args in runners[len(runners) - k:] + runners[:len(runners) - k]:
            print(f"round {r + 1}/{repeats}: {name} ...", file=sys.stderr)
            try:
                rows[name].append(run(fn, args))
            except Exception as e:
                rows[name].append({"status": f"failed: {type(e).__name__}: {e}"})
    return rows


def _median(rs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def print_table(rows: dict[str, list[dict]], a, n_prompts: int) -> None:
    print(f"\n{n_prompts} prompts ({a.dataset_name}), max_tokens {a.output_len}, greedy"
          f"{', ignore_eos' if a.ignore_eos else ''}, {a.threads} threads, {a.repeats} rotated round(s), medians\n")
    ref = {b: _median(rows.get(b, []), "single_tok_s") for b in ("llama.cpp", "transformers")}
    f = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    x = lambda v, b: "n/a" if v is None or not ref[b] else f"{v / ref[b]:.2f}x"  # noqa: E731
    print(f"| backend | single-stream tok/s | vs llama.cpp | vs transformers | concurrency {a.concurrency} tok/s "
          "| status |")
    print("|---|---:|---:|---:|---:|---|")
    for name, rs in rows.items():
        single = _median(rs, "single_tok_s")
        status = rs[-1]["status"] if rs else "not run"
        print(f"| {name} | {f(single)} | {x(single, 'llama.cpp')} | {x(single, 'transformers')} | "
              f"{f(_median(rs, 'concurrent_tok_s'))} | {status} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset-name", default="prompts")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="0: single stream only")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--policies", default="off,nightjar",
                    help="Nightjar entries ('' to skip Nightjar); POLICY@FLAGS adds engine flags to one entry, "
                         "e.g. fixed:1@--quantization int4")
    ap.add_argument("--server-args", default="", help="Nightjar engine flags for every entry, e.g. '--dtype float32'")
    ap.add_argument("--backends", default="transformers,llama.cpp,nightjar")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over every backend, order rotated")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    if not hub.is_pulled(hub.DEFAULT_MODEL):
        print("SmolLM2 is not pulled: run `nightjar models pull` first", file=sys.stderr)
        return 1
    reqs, _ = build_requests(a.dataset_name, a.num_prompts, seed=a.seed, tokenizer=load_tokenizer("auto"),
                             output_len=a.output_len)
    prompts = [r.prompt for r in reqs]
    rows = run_rounds(backend_runners(a, prompts), max(1, a.repeats))
    print_table(rows, a, len(prompts))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps({"config": vars(a), "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
