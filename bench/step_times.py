"""Median target step time T(B, q) at a fixed context, beside the memory-bandwidth floor.

    python bench/step_times.py [--model smollm2-135m] [--dtype bfloat16] [--context 256] [--reps 7]
                               [--variants served,torch] [--batches 1,4,16] [--queries 1,5] [--block 1]

Variants, all built from the same checkpoint and timed interleaved (round robin: call by call, or ``--block K``
warm calls per turn) so that a noisy machine slows them alike:
  plain   separate q/k/v and gate/up projections, plain ``F.linear`` (the engine before fusion)
  fused   q/k/v and gate/up fused into one GEMM each
  served  what the engine serves: fused, plus oneDNN-packed weights on a bf16 CPU (models/cpu_linear.py) and, on
          CPU, the fused C++ ops for norms, rope + KV store, attention and SiLU·up (models/cpu_fused.py)
  torch   ``served`` with torch ops in place of the fused C++ ops (the CPU engine before them)
  modules ``served`` with every layer's ops reached through nn.Module calls (the fused path before
          ``DecoderLayer.forward_fused``)
  unpadded  ``served`` without padding forwards of fewer than ``PACKED_MIN_ROWS`` tokens (before it)
  int8, int4, w4a8  ``served`` with ``--quantization int8|int4|w4a8`` (layers quantized, the LM head an int8 copy)
  int8-bf16head, int4-bf16head  the same with the LM head left in the dtype (oneDNN-packed, as before QuantHead)
  int4-torchmm  ``int4`` with torch's packed int4 kernel in place of the fused ``int4_linear`` (as before it)
  int8-torchmm  ``int8`` with torch's packed int8 kernel in place of ``int8_linear`` on AMX tiles (as before it)
  int4-vector  ``int4`` with ``int4_linear`` and the int8 head on their AVX-512 kernels where they would run on
               AMX tiles (as before them)
  w4a8-rowhead  ``w4a8`` with int4's LM head: x as it is, codes in row order, ``int8_linear`` (as before
               ``int8_linear_a8``)
With several variants the table prints each one's median and its ratio to the first.

The floor is the served model's weight bytes / measured copy bandwidth (a large copy on the same device);
the packed LM head of a tied-embedding model is a second copy of the embedding but the step reads only one
of them, so the floor counts the parameters once (and a quantized head's embedding table, of which a step
reads a few rows, not at all).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nightjar.argtypes import positive, positive_list
from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout, parse_dtype, resolve_model_path
from nightjar.models.loader import build_model, read_gguf_state, read_safetensors_state

QUANTIZED = {"int8": ("int8", True), "int4": ("int4", True), "w4a8": ("w4a8", True), "int8-bf16head": ("int8", False),
             "int4-bf16head": ("int4", False), "int4-torchmm": ("int4", True), "int4-vector": ("int4", True),
             "int8-torchmm": ("int8", True), "w4a8-rowhead": ("w4a8", True)}
VARIANTS = ("plain", "fused", "served", "torch", "modules", "unpadded", *QUANTIZED)


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


def build_variants(spec: str, dtype: str, device: str, names: list[str]) -> dict:
    path = resolve_model_path(spec)
    if path.suffix == ".gguf":
        cfg, state, _ = read_gguf_state(path)
    else:
        cfg, state = read_safetensors_state(path)
    models = {}
    for name in names:
        if name in QUANTIZED:
            models[name] = quantized_variant(cfg, state, dtype, device, *QUANTIZED[name], name.endswith("torchmm"))
            models[name].amx = name != "int4-vector"
            if name == "w4a8-rowhead":
                head = models[name].lm_head
                models[name].lm_head = type(head)(head.codes().clone(), head.scales)
            continue
        model = build_model(cfg, dict(state), parse_dtype(dtype), device, fuse=name != "plain")
        if name in ("served", "torch", "modules", "unpadded"):
            model.pack_cpu_weights()
        model.select_kernels(cpu_fused=None if name in ("served", "modules", "unpadded") else False)
        if name == "modules":
            model.fused_path = lambda x, cache: False                    # this instance only
        if name == "unpadded":
            model.gemm_min_rows = model.head_min_rows = 0
        models[name] = model
    return models


def quantized_variant(cfg, state: dict, dtype: str, device: str, mode: str, head: bool, torch_mm: bool = False):
    """As ``load_quantized``: built in fp32, quantized (the head too with ``head``), cast, packed; ``torch_mm``:
    quantized layers on torch's packed kernels."""
    from nightjar.models.quant import QuantLinear, cast_floats, quantize_model

    model = build_model(cfg, {k: v.float() for k, v in state.items()}, torch.float32, device, fuse=True)
    quantize_model(model, mode, head=head)
    for m in model.modules() if torch_mm else ():
        if isinstance(m, QuantLinear):
            m.use_fused = False
    cast_floats(model, parse_dtype(dtype))
    model.pack_cpu_weights()
    model.select_kernels(cpu_fused=None)
    return model


class Step:
    """One (B, q) decode/verify batch at a fixed context, ready to run on any variant."""

    def __init__(self, cfg, B: int, q: int, ctx: int, dtype, device: str):
        bs = 16
        nb = (ctx + q) // bs + 1
        self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bs, B * nb, dtype, device)
        tables = [tuple(range(b * nb, (b + 1) * nb)) for b in range(B)]
        self.lay = build_layout([[5] * q] * B, [ctx] * B, tables, bs, [q] * B, device=device)
        self.device = device

    def time(self, model) -> float:
        _select_amx(getattr(model, "amx", True))
        _sync(self.device)
        t0 = time.perf_counter()
        model(self.lay, self.cache)
        _sync(self.device)
        return time.perf_counter() - t0


def interleaved(models: dict, step: Step, reps: int, block: int = 1) -> dict[str, float]:
    """Median seconds per variant, timing the variants in turn within every repetition; with ``block`` > 1 each
    turn runs a variant block + 1 times and times the last ``block`` calls (its weights back in cache: on a CPU
    whose last-level cache holds one model's weights but not several, call-by-call turns time every variant
    cold)."""
    for m in models.values():
        for _ in range(2):
            step.time(m)
    ts = {name: [] for name in models}
    for _ in range(reps):
        for name, m in models.items():
            if block > 1:
                step.time(m)
            ts[name] += [step.time(m) for _ in range(block)]
    return {name: statistics.median(t) for name, t in ts.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batches", type=positive_list(int), default=(1, 2, 4, 8, 16, 32, 64))
    ap.add_argument("--queries", type=positive_list(int), default=(1, 2, 3, 5))
    ap.add_argument("--variants", default="served", help=f"comma-separated, from {','.join(VARIANTS)}")
    ap.add_argument("--block", type=positive(int), default=1,
                    help="calls per variant in each turn, the first untimed (default 1: call by call, cold caches)")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    if any(n not in VARIANTS for n in names):
        ap.error(f"--variants: choose from {','.join(VARIANTS)}")
    models = build_variants(a.model, a.dtype, a.device, names)
    first = models[names[0]]
    bw = copy_bandwidth(a.device)
    nbytes = first.weight_bytes() - _unread_bytes(first)       # what one step reads
    floor = nbytes / bw
    Bs, qs = a.batches, a.queries
    print(f"# {a.model} {a.dtype} on {a.device}, context {a.context}: weights read per step {nbytes / 1e6:.1f} MB, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s, floor {floor * 1e3:.2f} ms; variants {', '.join(names)} "
          f"(interleaved, median of {a.reps}" + (f" turns of {a.block} warm calls)" if a.block > 1 else ")"))
    cols = [f"q={q} {n} (ms)" for q in qs for n in names]
    extra = [f"q=1 {n}/{names[0]}" for n in names[1:]] + [f"q=1 {names[-1]} / floor"]
    print("| B | " + " | ".join(cols + extra) + " |")
    print("|---|" + "---|" * (len(cols) + len(extra)))
    for B in Bs:
        row = {q: interleaved(models, Step(first.cfg, B, q, a.context, first.dtype, a.device), a.reps, a.block)
               for q in qs}
        cells = [f"{row[q][n] * 1e3:.1f}" for q in qs for n in names]
        q1 = row[qs[0]]
        cells += [f"{q1[n] / q1[names[0]]:.2f}x" for n in names[1:]] + [f"{q1[names[-1]] / floor:.2f}x"]
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)


def _select_amx(on: bool) -> None:
    """The quantized ops on AMX tiles where they can (``on``) or on their vector kernels, for the variant about to
    run (``int4-vector`` turns them off; an int8 model's layers chose their kernel when it was built)."""
    from nightjar.models import cpu_fused

    if cpu_fused.available():
        torch.ops.nightjar_cpu.use_amx(on)


def _unread_bytes(model) -> int:
    """Bytes held but not streamed by a step: a packed LM head's copy of a tied embedding, or the embedding
    table beside an int8 head (a step reads a few of its rows)."""
    from nightjar.models.cpu_linear import PackedLinear
    from nightjar.models.quant import QuantHead

    head, table = model.lm_head, model.embed_tokens.weight
    if isinstance(head, QuantHead):
        return table.numel() * table.element_size()
    return head.nbytes if isinstance(head, PackedLinear) and model.cfg.tie_embeddings else 0


if __name__ == "__main__":
    main()
