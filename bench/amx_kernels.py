"""The quantized CPU ops on AMX tiles against their vector kernels, side by side (models/cpu_fused.cpp).

    python bench/amx_kernels.py [--rows 1,2,3,5,8,16,17,32,64,128] [--rounds 5] [--calls 10]

For each M (rows of x, bf16): one decode step's int4 layers of SmolLM2-135M (the four layer shapes, 30 layers,
random weights quantized as the engine does) through ``int4_linear``, and its int8 LM head (49152 x 576) through
``int8_linear``, with ``use_amx(True)`` and ``use_amx(False)`` in turn within every round; the best round's
milliseconds per step and the ratio vector / AMX (> 1: the tiles are faster). Needs the fused CPU ops; on a CPU
without AMX both columns are the vector kernel.
"""
from __future__ import annotations

import argparse
import time

import torch

from nightjar.argtypes import positive, positive_list
from nightjar.models import cpu_fused
from nightjar.models.quant import QuantLinear

LAYERS = ((960, 576), (576, 576), (3072, 576), (576, 1536))     # (out, in): qkv, o, gate_up, down
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def int4_layers() -> list[QuantLinear]:
    g = torch.Generator().manual_seed(0)
    return [QuantLinear.from_weight(torch.randn(n, k, generator=g) * 0.05, "int4").to(torch.bfloat16)
            for n, k in LAYERS]


def best_ms(fn, calls: int, amx: bool, out: dict) -> None:
    """Append to out[amx] the mean ms of ``calls`` calls of fn after one warm call, with the tiles on or off."""
    torch.ops.nightjar_cpu.use_amx(amx)
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    out.setdefault(amx, []).append((time.perf_counter() - t0) / calls * 1e3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=positive_list(int), default=(1, 2, 3, 5, 8, 16, 17, 32, 64, 128))
    ap.add_argument("--rounds", type=positive(int), default=5)
    ap.add_argument("--calls", type=positive(int), default=10)
    a = ap.parse_args(argv)
    if not cpu_fused.available():
        ap.exit(2, "amx_kernels.py: the fused CPU ops are not available here\n")
    ops = torch.ops.nightjar_cpu
    layers = int4_layers()
    g = torch.Generator().manual_seed(1)
    head_q = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=g, dtype=torch.int8)
    head_s = torch.rand(VOCAB, generator=g) * 0.01
    print(f"# AMX available: {bool(ops.use_amx(True))}; best of {a.rounds} rounds of {a.calls} calls, tiles on/off "
          f"in turn")
    print("| M | int4 layers AMX (ms) | int4 layers vector (ms) | vector / AMX | int8 head AMX (ms) | "
          "int8 head vector (ms) | vector / AMX |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in a.rows:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in LAYERS}}

        def layer_set():                                   # one decoder layer's four int4 calls
            for layer in layers:
                ops.int4_linear(xs[layer.in_features], layer.qweight, layer.scales, layer.group_size)

        def head():
            ops.int8_linear(xs[HIDDEN], head_q, head_s)

        t4, t8 = {}, {}
        for _ in range(a.rounds):
            for amx in (True, False):
                best_ms(layer_set, a.calls, amx, t4)
                best_ms(head, a.calls, amx, t8)
        l_on, l_off = min(t4[True]) * NUM_LAYERS, min(t4[False]) * NUM_LAYERS     # a step's 30 layers
        h_on, h_off = min(t8[True]), min(t8[False])
        print(f"| {m} | {l_on:.2f} | {l_off:.2f} | {l_off / l_on:.2f}x | {h_on:.2f} | {h_off:.2f} | "
              f"{h_off / h_on:.2f}x |", flush=True)
    ops.use_amx(cpu_fused.amx_enabled())


if __name__ == "__main__":
    main()
