"""GPU kernels (Triton) beside their torch references, and the one switch between them.

Each kernel module holds a torch ``*_ref`` and a Triton ``*_triton`` with the same signature:
paged_attention, kv_store, block_migration, rejection_triton (the torch rejection reference the
engine uses lives in rejection.py); weight_pack is torch only. Importing this package does not
import Triton; the dispatch helpers import a kernel module on first use.

The dispatch helpers are ``run_paged_attention``, ``run_kv_store`` and ``run_migrate_blocks``.
"""
from __future__ import annotations

import functools
import os



import torch


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def use_triton() -> bool:
    """True only when CUDA is available and env NIGHTJAR_TRITON is not "0"."""
    return _cuda() and os.environ.get("NIGHTJAR_TRITON", "1") != "0"


def run_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Varlen paged attention of one layer/segment, q [T, nh, d] -> [T, nh, d]."""
    from nightjar.triton_kernels.paged_attention import paged_attention_ref, paged_attention_triton
    fn = paged_attention_triton if use_triton() and q.is_cuda else paged_attention_ref
    return fn(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def run_kv_store(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [T, nkv, d] into the caches at slot_mapping [T] (-1 = skip)."""
    from nightjar.triton_kernels.kv_store import kv_store_ref, kv_store_triton
    fn = kv_store_triton if use_triton() and k.is_cuda else kv_store_ref
    fn(k, v, k_cache, v_cache, slot_mapping)


def run_migrate_blocks(cache_data, pairs) -> None:
    """Copy (src, dst) local blocks of one segment [L, 2, n, bs, nkv, d] for all layers."""
    from nightjar.triton_kernels.block_migration import migrate_blocks_ref, migrate_blocks_triton
    fn = migrate_blocks_triton if use_triton() and cache_data.is_cuda else migrate_blocks_ref
    fn(cache_data, pairs)
