"""Step-time profiles for simulation: measured on this machine (``nightjar profile`` JSON) or a
roofline estimate for a named GPU and model shape.

A profile answers, in seconds:
  target_time(B, q)      one target forward of B decode rows with q tokens each (γ+1 when verifying), each row
                         at ``ctx_ref`` tokens of context (0: the roofline's T reads no KV)
  + context_time(...)    kv_s_per_ctx_token per token of context the rows read beyond ``ctx_ref`` each (fewer:
                         negative); a measured profile times T(B, 1) at two contexts for it
  + prefill_s_per_token  per prefill token in the same step
  draft_time(B)          one batched draft call (a step with γ makes γ calls)
  catchup_s(tokens)      draft catch-up prefill of lagging rows
  offload_s / reload_s   moving the draft (weights + KV) off and back
  step_overhead_s        engine cost per step beyond the forwards (measured profiles)
and the memory plan: num_blocks, block_size, draft_blocks (what the pool grows by on offload).
"""
from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass, field

# name: (memory bytes, dense bf16 FLOP/s, HBM bytes/s, host link bytes/s)
GPUS = {
    "a100": (40e9, 312e12, 1.555e12, 24e9),
    "a100-80g": (80e9, 312e12, 2.0e12, 24e9),
    "h100": (80e9, 989e12, 3.35e12, 50e9),
    "l20": (48e9, 119.5e12, 0.864e12, 24e9),
    "rtx4090": (24e9, 165e12, 1.008e12, 24e9),
}
GPU_ALIASES = {"4090": "rtx4090", "rtx-4090": "rtx4090", "a100-40g": "a100", "h100-sxm": "h100"}


@dataclass(frozen=True)
class Shape:
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# Targets like Qwen2.5-7B, Vicuna-13B (MHA), Qwen2.5-32B; drafts of 0.5B (Qwen2.5-0.5B) and 1B (Llama-3.2-1B).
SHAPES = {
    "7b": (Shape(7.6e9, 28, 4, 128), Shape(0.49e9, 24, 2, 64)),
    "8b": (Shape(8.0e9, 32, 8, 128), Shape(1.24e9, 16, 8, 64)),
    "13b": (Shape(13.0e9, 40, 40, 128), Shape(1.24e9, 16, 8, 64)),
    "32b": (Shape(32.8e9, 64, 8, 128), Shape(0.49e9, 24, 2, 64)),
}


@dataclass
class Profile:
    name: str
    B: list[int]                      # grid of batch sizes (ascending)
    q: list[int]                      # grid of tokens per row (ascending)
    T: list[list[float]]              # T[i][j] = target step time at B[i], q[j]
    draft_B: list[int]
    draft_T: list[float]
    prefill_s_per_token: float
    catchup_c0: float
    catchup_per_token: float
    offload_s: float
    reload_s: float
    draft_bytes: int
    num_blocks: int
    block_size: int
    draft_blocks: int
    kv_s_per_ctx_token: float = 0.0
    ctx_ref: int = 0                  # context per row that T already pays for (a measured profile's context)
    step_overhead_s: float = 0.0      # wall time per step outside the forwards (not in StepTimed.step_time_s)
    meta: dict = field(default_factory=dict)

    # ---- lookups (piecewise-linear in B, linear in q; linear extrapolation past the grid) ----------
    def target_time(self, b: float, q: float) -> float:
        if b <= 0:
            return 0.0
        cols = [_interp(self.B, [row[j] for row in self.T], b) for j in range(len(self.q))]
        return max(_interp(self.q, cols, q), 0.0)

    def draft_time(self, b: float) -> float:
        return 0.0 if b <= 0 else max(_interp(self.draft_B, self.draft_T, b), 0.0)

    def context_time(self, ctx_tokens: float, rows: float) -> float:
        """Seconds a step whose ``rows`` decode rows read ``ctx_tokens`` tokens of context in all pays on top of
        T(B, q): the tokens past ``ctx_ref`` a row (negative below it)."""
        return self.kv_s_per_ctx_token * (ctx_tokens - rows * self.ctx_ref)

    def catchup_s(self, tokens: int) -> float:
        return self.catchup_c0 + self.catchup_per_token * tokens if tokens > 0 else 0.0

    def tables(self, max_b: int, max_q: int) -> tuple[list[list[float]], list[float]]:
        """Dense T[b][q] for b in 0..max_b, q in 0..max_q, and draft[b]: O(1) lookups in the hot path."""
        tt = [[self.target_time(b, q) if q else 0.0 for q in range(max_q + 1)] for b in range(max_b + 1)]
        return tt, [self.draft_time(b) for b in range(max_b + 1)]

    # ---- JSON -----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, obj: dict) -> "Profile":
        known = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            return cls.from_json(json.load(f))


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def roofline_profile(gpu: str, shape: str, *, block_size: int = 16, mem_util: float = 0.9,
                     mem_eff: float = 0.8, flop_eff: float = 0.55, step_overhead_s: float = 4e-3,
                     draft_overhead_s: float = 1.2e-3, ctx: int = 512, max_b: int = 256) -> Profile:
    """A roofline estimate: each step costs max(bytes / bandwidth, FLOPs / FLOP/s) plus a fixed overhead
    (eager launch and scheduling, as in the paper's vLLM V0 setup). ``ctx``: context per row for the
    reported T grid; the simulator adds KV reads per actual context token."""
    key = GPU_ALIASES.get(gpu.lower(), gpu.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; choose from {', '.join(GPUS)}")
    skey = shape.lower().removesuffix("-like")
    if skey not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")
    mem, flops, bw, link = GPUS[key]
    tgt, dft = SHAPES[skey]
    bw_e, fl_e = bw * mem_eff, flops * flop_eff
    kv_t, kv_d = tgt.kv_bytes_per_token(), dft.kv_bytes_per_token()
    w_t, w_d = 2 * tgt.params, 2 * dft.params

    def t_target(b, q, ctx_tokens):
        return step_overhead_s + max((w_t + kv_t * ctx_tokens) / bw_e, 2 * tgt.params * b * q / fl_e)

    def t_draft(b):
        return draft_overhead_s + max((w_d + kv_d * b * ctx) / bw_e, 2 * dft.params * b / fl_e)

    Bs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    Bs = [b for b in Bs if b <= max_b] or [1]
    qs = [1, 2, 3, 4, 5, 6, 8]
    T = [[t_target(b, q, 0) for q in qs] for b in Bs]       # context added per step by the simulator
    block_bytes = block_size * kv_t
    free = mem * mem_util - w_t - w_d
    d_footprint_per_block = block_size * kv_d                # draft KV mirrors the pool's token capacity
    n = int(free // (block_bytes + d_footprint_per_block))
    if n < 16:
        raise ValueError(f"{shape} does not fit on {gpu} ({mem / 1e9:.0f} GB)")
    draft_bytes = int(w_d + n * d_footprint_per_block)
    move = draft_bytes / link
    return Profile(
        name=f"roofline:{key}:{skey}", B=Bs, q=qs, T=T, draft_B=Bs, draft_T=[t_draft(b) for b in Bs],
        prefill_s_per_token=2 * tgt.params / fl_e, catchup_c0=draft_overhead_s,
        catchup_per_token=2 * dft.params / fl_e + kv_d / bw_e, offload_s=move, reload_s=move,
        draft_bytes=draft_bytes, num_blocks=n, block_size=block_size, draft_blocks=draft_bytes // block_bytes,
        kv_s_per_ctx_token=kv_t / bw_e,
        meta={"gpu": key, "shape": skey, "memory": mem, "flops": flops, "bandwidth": bw, "link": link,
              "mem_eff": mem_eff, "flop_eff": flop_eff, "target_params": tgt.params, "draft_params": dft.params},
    )

