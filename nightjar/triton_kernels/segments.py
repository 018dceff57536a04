"""A KV pool grown by one segment (kvpool/cache.py), as the kernels read it: one base pointer per cache plus
a segment table of one entry.

Blocks ``[0, seg1)`` live in segment 0's tensor, blocks ``[seg1, ...)`` in segment 1's, both with the same
strides past the block dimension. A kernel addresses block ``blk`` at ``base0 + blk * stride_b`` and adds
``delta`` when ``blk >= seg1``, where ``delta`` is the element distance from segment 0's block ``seg1`` (past
its end) to segment 1's block 0: one flat address space on a GPU, so the second tensor needs no pointer of its
own. One segment: ``seg1`` past any block id and ``delta`` 0.
"""
from __future__ import annotations

import torch

NO_SEGMENT = 1 << 62          # seg1 of a single-segment pool: no block id reaches it


def segment_args(c0: torch.Tensor, c1: torch.Tensor | None, seg1: int) -> tuple[int, int]:
    """(seg1, delta) for cache tensors ``c0`` (segment 0) and ``c1`` (segment 1, or None), each [n, bs, ...]
    with the block dimension first."""
    if c1 is None:
        return NO_SEGMENT, 0
    assert c1.dtype == c0.dtype and c1.stride() == c0.stride(), "segments differ in layout"
    dist, rem = divmod(c1.data_ptr() - c0.data_ptr(), c0.element_size())
    assert rem == 0, "segment 1 is not element-aligned with segment 0"
    return seg1, dist - seg1 * c0.stride(0)


def segment_table(k0: torch.Tensor, v0: torch.Tensor, k1: torch.Tensor | None, v1: torch.Tensor | None,
                  seg1: int) -> tuple[int, int, int]:
    """(seg1, k_delta, v_delta): a kernel's segment table for a K and a V cache (``segment_args`` each)."""
    seg, kd = segment_args(k0, k1, seg1)
    return seg, kd, segment_args(v0, v1, seg1)[1]
