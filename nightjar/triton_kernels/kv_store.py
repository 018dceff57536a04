"""Write new keys and values into the paged cache of one layer (one segment, or two: segments.py).

``slot = block * block_size + offset``; slot -1 marks a padded token that is not stored.
The Triton kernel is a pure copy, so it moves raw bits (tensors viewed as same-size ints):
dtype-agnostic and immune to the interpreter's bf16 bug.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nightjar.triton_kernels.segments import segment_table

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, nkv, d] -> caches [n_blocks, bs, nkv, d] at slot_mapping [T] (-1 = skip)."""
    keep = slot_mapping >= 0                                               # [T]
    slots = slot_mapping[keep].long()
    nkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, nkv, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, nkv, d)[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, T,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, seg1, kc_delta, vc_delta,
                     HEAD_DIM: tl.constexpr, NUM_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)            # [BT]
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < T, other=-1).to(tl.int64)
    t_ok = slot >= 0
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    e = tl.arange(0, BLOCK_E)                                              # [E] = head * d + dim
    h = e // HEAD_DIM
    dd = e % HEAD_DIM
    ok = t_ok[:, None] & (e < NUM_KV * HEAD_DIM)[None, :]                  # [BT, E]
    t64 = offs_t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + h[None, :] * stride_kh + dd[None, :], mask=ok)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + h[None, :] * stride_vh + dd[None, :], mask=ok)
    in1 = blk >= seg1                                                      # [BT] in segment 1 (segments.py)
    kc = kc_ptr + (blk * stride_kcb + off * stride_kcs + tl.where(in1, kc_delta, 0))[:, None] \
        + (h * stride_kch + dd)[None, :]
    vc = vc_ptr + (blk * stride_vcb + off * stride_vcs + tl.where(in1, vc_delta, 0))[:, None] \
        + (h * stride_vch + dd)[None, :]
    tl.store(kc, k, mask=ok)
    tl.store(vc, v, mask=ok)


def kv_store_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_seg1: torch.Tensor | None = None, v_seg1: torch.Tensor | None = None,
                    seg1_start: int = 0) -> None:
    """Triton version of kv_store_ref (k, v may be strided views, e.g. slices of a fused qkv); ``k_seg1``/``v_seg1``:
    a grown pool's second segment, holding block ids from ``seg1_start`` on (segments.py)."""
    T, nkv, d = k.shape
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, "kv_store does not cast"
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if T == 0:
        return
    bits = _BITS[k.element_size()]
    seg1, kd, vd = segment_table(k_cache, v_cache, k_seg1, v_seg1, seg1_start)
    kb, vb, kcb, vcb = (x.view(bits) for x in (k, v, k_cache, v_cache))
    block_e = triton.next_power_of_2(nkv * d)
    block_t = max(1, min(16, 4096 // block_e))                              # ~4K elements per program
    _kv_store_kernel[(triton.cdiv(T, block_t),)](
        kb, vb, kcb, vcb, slot_mapping, T,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), seg1, kd, vd,
        HEAD_DIM=d, NUM_KV=nkv, BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t, BLOCK_E=block_e,
    )
