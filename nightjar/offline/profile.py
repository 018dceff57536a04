"""``nightjar profile``: measure this machine's step-time profile for ``nightjar simulate --profile``.

  nightjar profile [--model M --draft D --dtype bfloat16 --ctx 256 --out prof.json --quick]

Measures (lower quartile of interleaved repetitions after two warm-up passes, on a worker thread):
  T_target(B, q)  one target forward of B rows x q tokens at context ``--ctx`` (logits for all q; on CUDA a
                  captured graph's replay, as the engine runs it, models/cuda_graph.py),
                  B in {1,2,4,8,16,32,64}, q in {1,2,3,4,5} (the same grid with --quick, fewer repetitions;
                  the cells of B <= 8 three times as many as the others);
                  then made non-decreasing in q and in B (isotonic regression; the raw grid is kept in
                  meta["T_raw"]): noise on a shared CPU can make a 2-token step look cheaper than a
                  1-token one, and the planner would chase that
  T_draft(B)      one draft forward of B rows x 1 token, timed right after a target forward of B rows x
                  2 tokens, as the engine runs it (the target evicts the draft's weights from the caches:
                  on this CPU the draft then takes 1.12-1.18x its back-to-back time)
  prefill         target seconds per prompt token (one 128-token chunk)
  context         seconds per token of context a decode row reads (``kv_s_per_ctx_token``): T(B, 1) at ``--ctx``
                  against ctx/8 at B = 32 and 64; T is priced at the rows' own context from there (``ctx_ref``)
  catch-up        draft prefill cost c0 + c1·tokens
  transfer        host copy of the draft (weights + KV) and back
  step overhead   the engine's per-step cost beyond the forwards (bus hand-offs, sampling, scheduling),
                  from a short real engine run (skipped with --no-engine)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from nightjar.actors.common import run_chunks
from nightjar.actors.step_profile import Profile
from nightjar.kernel.threads import on_fresh_thread
from nightjar.kvpool.blocks import BlockAllocator
from nightjar.kvpool.cache import KVCache
from nightjar.models.cuda_graph import attach_graphs, detach_graphs
from nightjar.models.eagle import is_head
from nightjar.models.llama import build_layout

# One grid for both modes: the planner reads T up to B = 64 and q = Γmax + 1 = 5, and a quick grid that
# stopped at B = 8, q = 3 extrapolated a B = 64 step at 2.4x its real cost and γ = 4 at B = 4 as nearly free.
# q = 4 is γ = 3's verify: at one row a bf16 forward of 1-3 tokens is padded to 4 rows (models/cpu_linear.py), so
# T(1, 4) sits near T(1, 3), not halfway to T(1, 5) (14.41 ms against 14.75 and 14.73 on a profile bench; 15.68
# against 15.64 and 16.58 in the first quick profile with the cell): interpolated, γ = 3, the choice one row most
# often makes, was priced 2-3 % too dear (docs/benchmarks.md, twenty-fifth session).
GRID_B, GRID_Q = [1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 4, 5]
# Cells up to this batch size get SMALL_B_FACTOR times the repetitions: there the planner's arms are 5-10 %
# apart, while between quick profiles T(B, q)/T(B, 1) varied by 4.3 % sd (up to 10.5 %) with 5 repetitions,
# 2.6 % (up to 5.5 %) with 15; with q = 1, 2, 3, 5 a pass over these cells cost ~0.4 s against ~1.7 s for the
# others (docs/benchmarks.md: a quick profile took 3 s longer).
SMALL_B, SMALL_B_FACTOR = 8, 3


class _Bench:
    """A model + its own paged cache big enough for max_b rows of ctx + 160 tokens. On CUDA its short steps
    replay captured graphs as the engine's do (models/cuda_graph.py; prefill and catch-up chunks stay eager
    there too): eager steps of a 7B on an H200 were launch-bound, 15-22 ms at any B against 5.8-10.2 ms
    captured, so an eager profile would price γ with another shape than the engine runs. ``close`` detaches."""

    def __init__(self, model, block_size: int, max_b: int, ctx: int):
        c = model.cfg
        self.model, self.bs, self.ctx = model, block_size, ctx
        per = -(-(ctx + 160) // block_size)
        self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, block_size, per * max_b,
                             model.dtype, model.device)
        alloc = BlockAllocator(per * max_b, block_size)
        for r in range(max_b):
            alloc.reserve(r, per * block_size)
        self.tables = [alloc.block_table(r) for r in range(max_b)]
        self.graphs = None if is_head(model) else attach_graphs(
            model, self.cache, max_batch=max_b, max_q=max(GRID_Q), max_model_len=per * block_size)

    def close(self) -> None:
        if self.graphs is not None:
            detach_graphs(self.model)
            self.graphs = None

    def __enter__(self) -> _Bench:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def forward(self, b: int, q: int, start: int | None = None) -> None:
        start = self.ctx if start is None else start
        if is_head(self.model):        # a draft head: its inputs are states, not just ids
            lay = build_layout([[5] * q] * b, [start] * b, self.tables[:b], self.bs, [1] * b, self.model.device)
            x = torch.zeros((b * q, self.model.hc.hidden_size), dtype=self.model.dtype, device=self.model.device)
            self.model(lay, self.cache, x, x)                                      # emb, g [b*q, H]
        else:
            run_chunks(self.model, self.cache, self.bs, [[5] * q] * b, [start] * b, self.tables[:b], [q] * b)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()               # time the kernels, not their launch


def _stat(ts: list[float]) -> float:
    """Lower quartile: on an oversubscribed CPU, torch's thread pool makes one call bimodal (e.g. 1.3 ms
    or 48 ms for the same tiny forward), and the median lands on whichever mode dominated that window."""
    ts = sorted(ts)
    return ts[(len(ts) - 1) // 4]


def isotonic(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []                # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def monotone_grid(T: list[list[float]]) -> list[list[float]]:
    """T[i][j] (B[i], q[j]) made non-decreasing along q, then along B. Isotonic regression preserves
    order between inputs, so the second pass keeps the first pass's monotonicity."""
    rows = [isotonic(r) for r in T]
    cols = [isotonic([r[j] for r in rows]) for j in range(len(rows[0]))]
    return [[cols[j][i] for j in range(len(cols))] for i in range(len(rows))]


def _quartile_time(fn, reps: int, before=None) -> float:
    """Lower-quartile time of ``fn`` over ``reps`` calls after two warm-up calls; with ``before``, every
    call (warm-ups included) follows an untimed ``before()``."""
    ts = []
    for r in range(reps + 2):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if r >= 2:
            ts.append(time.perf_counter() - t0)
    return _stat(ts)


def measure(target, draft, **kw) -> dict:
    """Run the measurements on a fresh worker thread, as the engine runs its forwards (its compute
    thread): on this box the main thread's first forwards were 50-300 ms where the worker's were 1-8 ms.
    Load the models on a thread that has exited by then (``main``): while another live thread has run
    torch's parallel work, every forward here is ~2x slower (kernel/threads.py)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="nightjar-profile") as ex:
        return ex.submit(_measure, target, draft, **kw).result()


@torch.inference_mode()
def _measure(target, draft, *, block_size: int = 16, ctx: int = 256, quick: bool = False, reps: int | None = None,
             log=print) -> dict:
    reps = reps or (5 if quick else 9)
    with _Bench(target, block_size, max(GRID_B), ctx) as tb:
        out = _measure_target(tb, reps, log)
        if draft is None:
            out.update(draft_B=[1], draft_T=[0.0], catchup_per_token=0.0, catchup_c0=0.0, offload_s=0.0,
                       reload_s=0.0, draft_bytes=0)
            return out
        with _Bench(draft, block_size, max(GRID_B), ctx) as db:
            out.update(_measure_draft(tb, db, reps))
            out.update(_transfer(draft, db.cache, reps))
    return out


def _measure_target(tb: _Bench, reps: int, log) -> dict:
    """T(B, q) over the grid (interleaved passes, small B more often) and prefill seconds per token."""
    Bs, qs = GRID_B, GRID_Q
    cells = [(i, j) for i in range(len(Bs)) for j in range(len(qs))]
    samples: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    passes = SMALL_B_FACTOR * reps + 2
    for r in range(passes):                     # interleaved: background noise spreads over all cells
        for i, j in cells:
            if r >= reps + 2 and Bs[i] > SMALL_B:
                continue                        # a large cell has its reps; small ones go on
            t0 = time.perf_counter()
            tb.forward(Bs[i], qs[j])
            if r >= 2:                          # passes 0-1 warm every shape up
                samples[(i, j)].append(time.perf_counter() - t0)
        log(f"  target pass {r + 1}/{passes} (the first 2 warm up; from {reps + 3} on B <= {SMALL_B} only)")
    raw = [[_stat(samples[(i, j)]) for j in range(len(qs))] for i in range(len(Bs))]
    T = monotone_grid(raw)
    pre = _quartile_time(lambda: tb.forward(1, 128, 0), reps)
    return {"B": Bs, "q": qs, "T": T, "T_raw": raw, "ctx": tb.ctx, "prefill_s_per_token": max(pre - T[0][0], 0.0) / 127,
            "kv_s_per_ctx_token": context_slope(tb, reps)}


def context_slope(tb: _Bench, reps: int) -> float:
    """Seconds per token of context a decode row reads: T(B, 1) at the profile's context against an eighth of
    it, interleaved, at the grid's two largest B (where the KV read stands out of the noise), the mean of
    the two slopes. The grid is timed at one context; served rows are shorter or longer, and the KV they
    read is a cost of its own that does not grow with q (the fused attention reads a row's KV once for all
    its queries): on this box's int4 model T(64, 1) was 34 ms at 96 tokens against 56 at 256."""
    lo, out = tb.ctx // 8, []
    for b in GRID_B[-2:]:
        hi_ts, lo_ts = [], []
        for r in range(reps + 2):
            for start, ts in ((tb.ctx, hi_ts), (lo, lo_ts)):
                t0 = time.perf_counter()
                tb.forward(b, 1, start)
                if r >= 2:
                    ts.append(time.perf_counter() - t0)
        out.append(max(_stat(hi_ts) - _stat(lo_ts), 0.0) / (b * (tb.ctx - lo)))
    return sum(out) / len(out)


def _measure_draft(tb: _Bench, db: _Bench, reps: int) -> dict:
    """T_draft(B) right after a target forward of B rows, and the catch-up line c0 + c1·tokens."""
    out = {"draft_B": GRID_B,
           "draft_T": isotonic([_quartile_time(lambda: db.forward(b, 1), reps, before=lambda: tb.forward(b, 2))
                                for b in GRID_B])}
    c16 = _quartile_time(lambda: db.forward(1, 16, 0), reps)
    c128 = _quartile_time(lambda: db.forward(1, 128, 0), reps)
    out["catchup_per_token"] = max(c128 - c16, 0.0) / 112
    out["catchup_c0"] = max(c16 - 16 * out["catchup_per_token"], 0.0)
    return out


def _transfer(draft, cache, reps: int) -> dict:
    tensors = [p.data for p in draft.parameters()] + [s.data for s in getattr(cache, "segments", [])]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host = [torch.empty_like(t, device="cpu") for t in tensors]

    def off():
        for h, t in zip(host, tensors):
            h.copy_(t)

    def back():
        for h, t in zip(host, tensors):
            t.copy_(h)
    return {"offload_s": _quartile_time(off, reps), "reload_s": _quartile_time(back, reps), "draft_bytes": nbytes}


def engine_overhead(make_engine, n: int = 8, max_tokens: int = 24) -> float:
    """Per-step engine cost beyond the recorded forwards: (wall time of decode-heavy run − Σ step_time_s −
    Σ catch-up) / steps, with policy ``off`` so every step is one target forward."""
    from nightjar.kernel.messages import StepTimed
    from nightjar.sampling import SamplingParams

    async def main():
        async with make_engine() as eng:
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            await asyncio.gather(*[_drain(eng.generate([11 + i] * 16, sp)) for i in range(2)])   # warm-up
            times: list[float] = []
            eng.bus.add_tap(lambda env: times.append(env.msg.step_time_s) if isinstance(env.msg, StepTimed) else None)
            t0 = time.perf_counter()
            await asyncio.gather(*[_drain(eng.generate([20 + i] * 16, sp)) for i in range(n)])
            wall = time.perf_counter() - t0
            return (wall - sum(times)) / max(len(times), 1)
    return max(asyncio.run(main()), 0.0)


async def _drain(agen) -> None:
    async for _ in agen:
        pass


def build_profile(target, draft, *, name: str, block_size: int = 16, ctx: int = 256, quick: bool = False,
                  num_blocks: int = 2048, draft_blocks: int = 0, overhead_s: float = 0.0, reps: int | None = None,
                  log=print) -> Profile:
    m = measure(target, draft, block_size=block_size, ctx=ctx, quick=quick, reps=reps, log=log)
    return Profile(name=name, B=m["B"], q=m["q"], T=m["T"], draft_B=m["draft_B"], draft_T=m["draft_T"],
                   prefill_s_per_token=m["prefill_s_per_token"], catchup_c0=m["catchup_c0"],
                   catchup_per_token=m["catchup_per_token"], offload_s=m["offload_s"], reload_s=m["reload_s"],
                   draft_bytes=m["draft_bytes"], num_blocks=num_blocks, block_size=block_size,
                   draft_blocks=draft_blocks, step_overhead_s=overhead_s,
                   kv_s_per_ctx_token=m["kv_s_per_ctx_token"], ctx_ref=ctx,
                   meta={"ctx": ctx, "step_overhead_s": overhead_s, "torch": torch.__version__, "T_raw": m["T_raw"],
                         "threads": torch.get_num_threads(), "quick": quick, "measured": time.time()})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "w4a8"],
                   help="quantization of the target, as the engine's flag")
    p.add_argument("--draft-quantization", default=None, choices=["none", "int8", "int4", "w4a8", "mixed"],
                   help="the draft's, as the engine's flag (default: as --quantization; mixed beside none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ctx", type=int, default=256, help="context length of the measured decode rows")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV pool size recorded for the simulator")
    p.add_argument("--quick", action="store_true", help="5 repetitions instead of 9, 15 instead of 27 for B <= 8 "
                        "(what --planner-profile auto runs)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine step-overhead run")
    p.add_argument("--out", default="profile.json")
    return p


def _load_pair(a: argparse.Namespace):
    from nightjar.actors.draft_ngram import parse_ngram
    from nightjar.models.quant import draft_mode, load_quantized

    target = load_quantized(a.model, a.dtype, a.device, a.quantization)
    dq = draft_mode(a.quantization, a.draft_quantization)
    draft = (load_quantized(a.draft, a.dtype, a.device, dq, draft_for=target.config)      # the n-gram drafter:
             if a.draft not in ("none", "") and parse_ngram(a.draft) is None else None)    # no draft passes to time
    return target, draft


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not Path(a.out).resolve().parent.is_dir():
        raise FileNotFoundError(f"--out {a.out}: no such directory")    # before a minute of measuring
    from nightjar.engine import Engine, plan_memory
    from nightjar.kernel.config import EngineConfig
    # loaded on a thread that then exits, so the measuring thread is the only one with an OpenMP team
    target, draft = on_fresh_thread(_load_pair, a)
    cfg = EngineConfig(model=a.model, draft=a.draft, dtype=a.dtype, block_size=a.block_size, num_blocks=a.num_blocks,
                       quantization=a.quantization)
    mem = plan_memory(cfg, target, draft)
    overhead = 0.0
    if not a.no_engine:
        overhead = engine_overhead(lambda: Engine(a.model, a.draft, "off", loaded=(target, draft), dtype=a.dtype,
                                                  block_size=a.block_size, num_blocks=a.num_blocks,
                                                  quantization=a.quantization))
        print(f"engine step overhead: {overhead * 1e3:.2f} ms", file=sys.stderr)
    prof = build_profile(target.model, draft.model if draft else None, name=f"measured:{a.model}:{a.dtype}"
                         + ("" if a.quantization == "none" else f":{a.quantization}"),
                         block_size=a.block_size, ctx=a.ctx, quick=a.quick, num_blocks=mem.num_blocks,
                         draft_blocks=mem.draft_footprint // mem.block_bytes, overhead_s=overhead,
                         log=lambda s: print(s, file=sys.stderr))
    with open(a.out, "w") as f:
        json.dump(prof.to_json(), f, indent=1)
    print(f"wrote {a.out}: T_target(1,1) {prof.T[0][0] * 1e3:.2f} ms, T_target({prof.B[-1]},{prof.q[-1]}) "
          f"{prof.T[-1][-1] * 1e3:.2f} ms, T_draft(1) {prof.draft_T[0] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
