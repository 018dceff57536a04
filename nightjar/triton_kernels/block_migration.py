"""Copy KV blocks (src -> dst) for every layer, K and V, in one launch (pool shrink).

cache_data is one segment's tensor ``[L, 2, n_blocks, block_size, nkv, d]``; ids are local.
pairs is ``[P, 2]`` int (src, dst). Copies run in parallel, so no dst may also be a src
(shrink moves live blocks from the dropped tail into free blocks below it, so they are disjoint).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nightjar.triton_kernels.kv_store import _BITS


def _as_pairs(pairs, device) -> torch.Tensor:
    if isinstance(pairs, torch.Tensor):
        return pairs.to(device).view(-1, 2)
    return torch.tensor(list(pairs), dtype=torch.int64, device=device).view(-1, 2)


def migrate_blocks_ref(cache_data: torch.Tensor, pairs) -> None:
    """cache_data[:, :, dst] = cache_data[:, :, src] for each (src, dst) pair."""
    p = _as_pairs(pairs, cache_data.device).long()                          # [P, 2]
    cache_data[:, :, p[:, 1]] = cache_data[:, :, p[:, 0]]


@triton.jit
def _migrate_kernel(data_ptr, pairs_ptr, stride_lk, stride_b, E,
                    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    pair = tl.program_id(0)
    lk = tl.program_id(1).to(tl.int64)                                     # layer * 2 + kv
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    base = data_ptr + lk * stride_lk
    offs = tl.arange(0, BLOCK)
    for c in tl.static_range(NUM_CHUNKS):
        o = c * BLOCK + offs
        x = tl.load(base + src * stride_b + o, mask=o < E)
        tl.store(base + dst * stride_b + o, x, mask=o < E)


def migrate_blocks_triton(cache_data: torch.Tensor, pairs) -> None:
    """Triton version of migrate_blocks_ref; grid (P, 2L), each program copies one block slab."""
    assert cache_data.is_contiguous()
    L, two, n, bs, nkv, d = cache_data.shape
    p = _as_pairs(pairs, cache_data.device)
    if p.shape[0] == 0:
        return
    p = p.contiguous()
    E = bs * nkv * d                                                       # one (layer, kv, block)
    block = min(triton.next_power_of_2(E), 8192)
    bits = cache_data.view(_BITS[cache_data.element_size()])
    _migrate_kernel[(p.shape[0], L * two)](
        bits, p, cache_data.stride(1), cache_data.stride(2), E,
        BLOCK=block, NUM_CHUNKS=triton.cdiv(E, block),
    )
