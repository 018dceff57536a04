"""GPU kernels (Triton) beside their torch references, and the one switch between them.

Each kernel module holds a torch reference and a Triton ``*_triton`` with the same semantics:
paged_attention, kv_store, block_migration, rejection_triton. ``use_triton()`` picks the kernels on
CUDA: the model's attention and KV stores (models/llama.py), pool-shrink block copies
(kvpool/cache.py) and verification (actors/sampler.py). Importing this package does not import
Triton; those callers import a kernel module on first use, on CUDA only.
"""
from __future__ import annotations

import functools
import os

import torch

# Without CUDA, Triton kernels can only run under its interpreter (tests, CPU tensors), and
# TRITON_INTERPRET is read when triton is first imported: this package's init runs before any kernel
# module imports triton. An explicit TRITON_INTERPRET=0 is respected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def use_triton() -> bool:
    """True only when CUDA is available and env NIGHTJAR_TRITON is not "0"."""
    return _cuda() and os.environ.get("NIGHTJAR_TRITON", "1") != "0"
