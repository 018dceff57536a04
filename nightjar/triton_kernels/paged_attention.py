"""Varlen paged attention over one layer of a KV pool of one or two segments (prefill chunks, decode, verify).

Sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; they are the LAST
``q_len`` positions of its context of ``seq_lens[b]`` tokens, causal within the chunk. Key
position j of sequence b lives in cache block ``block_tables[b, j // bs]`` at offset ``j % bs`` (of segment 1
at and past its first block id, triton_kernels/segments.py).

The Triton kernel launches one program per (query tile, kv head). Tiles never straddle
sequences: sequence b's tiles start at ``query_start_loc[b] // BLOCK_Q + b`` (an upper bound on
the tiles before it), so the grid ``T // BLOCK_Q + B`` needs no host sync; a program finds its
sequence by binary search and exits when its tile is past the sequence's queries. The G query
heads that share a kv head are packed into the tile's rows (``BLOCK_M = BLOCK_Q * G``), so a
decode tile (q_len 1) still feeds tl.dot with G rows and each K/V tile is read once per group.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nightjar.triton_kernels.segments import segment_table


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference (host-syncing loop over sequences). q [T, nh, d] -> [T, nh, d]."""
    T, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        blocks = block_tables[b, : -(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, nkv, d)[:ctx].float()               # [ctx, nkv, d]
        v = v_cache[blocks].reshape(-1, nkv, d)[:ctx].float()
        k = k.repeat_interleave(nh // nkv, dim=1)                            # [ctx, nh, d] (GQA)
        v = v.repeat_interleave(nh // nkv, dim=1)
        qpos = torch.arange(ctx - (hi - lo), ctx, device=q.device)           # [n]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [n, ctx]
        s = torch.einsum("nhd,khd->hnk", q[lo:hi].float(), k) * scale        # [nh, n, ctx]
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        o = torch.einsum("hnk,khd->nhd", p, v)                               # [n, nh, d]
        out[lo:hi] = o.to(q.dtype)
    return out


@triton.jit
def _find_seq(query_start_loc, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs          # annotated: stays an int32 tensor even when B == 1 specializes
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid).to(tl.int32) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, seg1, k_delta, v_delta,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, G: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_lo = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_lo
    local = tile - (q_lo // BLOCK_Q + b)
    if local * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local * BLOCK_Q + offs_m // G                       # [M] query index in the chunk
    head = kv_head * G + offs_m % G                              # [M] query head
    row_ok = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx                                  # [M] absolute position
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = (q_lo + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the tile's last query position are masked for every row: stop there.
    last = tl.minimum(ctx, ctx - q_len + (local + 1) * BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, last, BLOCK_N):
        k_pos = start + offs_n                                   # [N]
        k_ok = k_pos < last
        blk = tl.load(bt_ptr + b * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in1 = blk >= seg1                                        # [N] in segment 1 (segments.py)
        slot_k = blk * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh + tl.where(in1, k_delta, 0)
        slot_v = blk * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh + tl.where(in1, v_delta, 0)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot_k[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_ptr + slot_v[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # "ieee" keeps fp32 exact (no TF32); fp16/bf16 operands ignore it.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)    # rows with nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, k_seg1: torch.Tensor | None = None,
                           v_seg1: torch.Tensor | None = None, seg1_start: int = 0) -> torch.Tensor:
    """Triton paged attention; same contract as paged_attention_ref (no host sync). ``k_seg1``/``v_seg1``:
    a grown pool's second segment, holding block ids from ``seg1_start`` on (segments.py)."""
    T, nh, d = q.shape
    _, bs, nkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    G = nh // nkv
    assert nh == G * nkv and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(q)
    # Decode/verify batches (short chunks) use 16-row tiles; prefill chunks use 64 rows.
    rows = 16 if T <= 8 * B else 64
    block_q = triton.next_power_of_2(max(1, rows // G))
    block_m = max(16, triton.next_power_of_2(block_q * G))
    grid = (T // block_q + B, nkv)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, float(scale), B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        *segment_table(k_cache, v_cache, k_seg1, v_seg1, seg1_start),
        HEAD_DIM=d, BLOCK_SIZE=bs, G=G, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=_interpreting() or q.dtype == torch.float32,
    )
    return out
