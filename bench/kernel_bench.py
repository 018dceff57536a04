"""Time each Triton kernel against its torch reference and the memory roofline.

    python bench/kernel_bench.py                # CUDA if available: refs + Triton, big shapes
    python bench/kernel_bench.py --device cpu   # refs only, small shapes (Triton cannot launch)

Roofline = bytes the kernel must move / measured device copy bandwidth (a large ``copy_``,
counted as read + write). "roof%" = roofline time / kernel time (100% = bandwidth bound).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Row:
    name: str
    shape: str
    nbytes: int
    ref_ms: float
    triton_ms: float | None = None


def timer(device: str, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn() after one warm-up call (CUDA events on the GPU)."""
    def run(fn):
        fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    return run


def copy_bandwidth(device: str, t) -> float:
    """Bytes per second of a large device copy (read + write)."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (t(lambda: dst.copy_(src)) / 1e3)


def bench_paged_attention(device, t, big, dtype, use_triton):
    from nightjar.triton_kernels.paged_attention import paged_attention_ref, paged_attention_triton
    nh, nkv, d, bs = (32, 8, 128, 16) if big else (8, 2, 64, 16)
    cases = ([("decode", 64, 1, 2048), ("verify γ=4", 64, 5, 2048), ("prefill chunk", 4, 512, 2048)]
             if big else [("decode", 8, 1, 256), ("verify γ=4", 8, 5, 256), ("prefill chunk", 2, 64, 256)])
    rows = []
    for label, B, qlen, ctx in cases:
        nblk = B * math.ceil(ctx / bs)
        kc = torch.randn(nblk, bs, nkv, d, device=device, dtype=dtype)
        vc = torch.randn_like(kc)
        table = torch.randperm(nblk, device=device).view(B, -1).to(torch.int32)
        q = torch.randn(B * qlen, nh, d, device=device, dtype=dtype)
        qsl = torch.arange(0, B * qlen + 1, qlen, device=device, dtype=torch.int32)
        lens = torch.full((B,), ctx, device=device, dtype=torch.int32)
        args = (q, kc, vc, table, qsl, lens, 1 / math.sqrt(d))
        nbytes = 2 * B * ctx * nkv * d * dtype.itemsize + 2 * q.numel() * dtype.itemsize
        row = Row(f"paged_attention {label}", f"B={B} q={qlen} ctx={ctx} h={nh}/{nkv} d={d}", nbytes,
                  t(lambda: paged_attention_ref(*args)))
        if use_triton:
            row.triton_ms = t(lambda: paged_attention_triton(*args))
        rows.append(row)
    return rows


def bench_kv_store(device, t, big, dtype, use_triton):
    from nightjar.triton_kernels.kv_store import kv_store_ref, kv_store_triton
    T, nkv, d, bs = (4096, 8, 128, 16) if big else (512, 2, 64, 16)
    nblk = 2 * T // bs
    kc = torch.zeros(nblk, bs, nkv, d, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    k = torch.randn(T, nkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(nblk * bs, device=device)[:T]
    args = (k, v, kc, vc, slots)
    row = Row("kv_store", f"T={T} nkv={nkv} d={d}", 4 * k.numel() * dtype.itemsize,
              t(lambda: kv_store_ref(*args)))
    if use_triton:
        row.triton_ms = t(lambda: kv_store_triton(*args))
    return [row]


def bench_migration(device, t, big, dtype, use_triton):
    from nightjar.triton_kernels.block_migration import migrate_blocks_ref, migrate_blocks_triton
    L, n, bs, nkv, d, P = (32, 1024, 16, 8, 128, 256) if big else (4, 128, 16, 2, 64, 32)
    data = torch.zeros(L, 2, n, bs, nkv, d, device=device, dtype=dtype)
    pairs = torch.stack((torch.arange(n - P, n), torch.arange(P)), 1).to(device)   # tail -> head
    nbytes = 2 * P * L * 2 * bs * nkv * d * dtype.itemsize
    row = Row("migrate_blocks", f"L={L} pairs={P} block={bs}x{nkv}x{d}", nbytes,
              t(lambda: migrate_blocks_ref(data, pairs)))
    if use_triton:
        row.triton_ms = t(lambda: migrate_blocks_triton(data, pairs))
    return [row]


def bench_rejection(device, t, big, use_triton):
    from nightjar.actors.sampler import draw_uniforms, rejection_sample
    from nightjar.triton_kernels.rejection_triton import draw_noise, rejection_sample_noise_ref, rejection_sample_triton
    B, G, V = (64, 5, 128256) if big else (8, 4, 32000)
    p = torch.rand(B, G + 1, V, device=device).softmax(-1)
    q = torch.rand(B, G, V, device=device).softmax(-1)
    d = torch.randint(0, V, (B, G), device=device)
    nd = torch.full((B,), G, device=device)
    greedy = torch.arange(B, device=device) % 2 == 0
    gens = [torch.Generator(device=device).manual_seed(b) for b in range(B)]
    u, e = draw_noise(gens, (~greedy).tolist(), G, V, device)
    args = (p, d, q, nd, greedy, u, e)
    nbytes = (p.numel() + q.numel() + e.numel()) * 4
    shape = f"B={B} γ={G} V={V} (half greedy)"
    rows = [Row("rejection (noise ref)", shape, nbytes, t(lambda: rejection_sample_noise_ref(*args)))]
    if use_triton:
        rows[0].triton_ms = t(lambda: rejection_sample_triton(*args))
    uu = draw_uniforms(gens, (~greedy).tolist(), G + 1, device)
    rows.append(Row("rejection_sample (engine, torch)", shape, nbytes,
                    t(lambda: rejection_sample(p, d, q, nd, greedy, uu))))
    return rows


def bench_weight_pack(device, t, big):
    from nightjar.transfer.weight_pack import pack_tensors, unpack_tensors
    n, each = (64, 4 << 20) if big else (64, 1 << 20)             # 64 tensors x 4 / 1 MiB
    host = [torch.randn(each // 4) for _ in range(n)]               # pageable fp32
    buf, layout = pack_tensors(host)
    nbytes = n * each
    one = t(lambda: unpack_tensors(buf, layout, device))
    per = t(lambda: [x.to(device, copy=True) for x in host])
    return [Row("weight_pack unpack (1 copy)", f"{n} tensors, {nbytes >> 20} MiB", nbytes, one),
            Row("per-tensor .to() (pageable)", f"{n} tensors, {nbytes >> 20} MiB", nbytes, per)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default 20 GPU, 5 CPU)")
    args = ap.parse_args()
    device = args.device
    use_triton = device == "cuda"
    big = device == "cuda"
    t = timer(device, args.reps or (20 if big else 5))
    dtype = torch.bfloat16 if big else torch.float32
    bw = copy_bandwidth(device, t)
    print(f"device={device} ({torch.cuda.get_device_name() if use_triton else 'cpu'}) "
          f"copy bandwidth {bw / 1e9:.0f} GB/s; Triton {'on' if use_triton else 'off (refs only)'}")
    rows = (bench_paged_attention(device, t, big, dtype, use_triton)
            + bench_kv_store(device, t, big, dtype, use_triton)
            + bench_migration(device, t, big, dtype, use_triton)
            + bench_rejection(device, t, big, use_triton)
            + bench_weight_pack(device, t, big))
    head = (f"{'kernel':32} {'shape':42} {'MB':>8} {'roof ms':>8} {'ref ms':>9} {'triton ms':>9} "
            f"{'xref':>6} {'roof%':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        roof = r.nbytes / bw * 1e3
        tri = f"{r.triton_ms:9.3f}" if r.triton_ms is not None else f"{'-':>9}"
        speed = f"{r.ref_ms / r.triton_ms:6.1f}" if r.triton_ms else f"{'-':>6}"
        best = r.triton_ms if r.triton_ms is not None else r.ref_ms
        print(f"{r.name:32} {r.shape:42} {r.nbytes / 1e6:8.1f} {roof:8.3f} {r.ref_ms:9.3f} {tri} "
              f"{speed} {100 * roof / best:5.0f}%")


if __name__ == "__main__":
    main()
