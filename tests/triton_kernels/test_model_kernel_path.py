"""The model's Triton path (the GPU hot path) matches the torch path: through the interpreter on a CPU, compiled
on CUDA (the model, cache and layouts on the test's device)."""
from __future__ import annotations

import pytest
import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from tests.conftest import random_model, tiny_config


def run(model, kernels: bool, device: str, seg0: int = 16):
    """``seg0`` < 16: a grown pool, blocks [seg0, 16) in a second segment (the kernels' segment table)."""
    model.select_kernels(kernels)
    c = model.cfg
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 4, seg0, torch.float32, device, head_major=not kernels)
    if seg0 < 16:
        cache.add_segment(16 - seg0)
    pre = build_layout([[3, 1, 4, 1, 5, 9, 2], [6, 5]], [0, 0], [(0, 1), (5,)], 4, [1, 1], device)
    a = model(pre, cache)
    ver = build_layout([[2, 6, 5], [3]], [7, 2], [(0, 1, 2), (5,)], 4, [3, 1], device)   # verify + decode rows
    return torch.cat([a, model(ver, cache)])


@pytest.mark.parametrize("seg0", [16, 2], ids=["one-segment", "grown-pool"])
def test_triton_kernels_in_the_model_match_the_torch_references(device, seg0):
    model = random_model(tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2), seed=3, std=0.3).to(device)
    want = run(model, kernels=False, device=device)
    got = run(model, kernels=True, device=device, seg0=seg0)     # grown: row 0 crosses into segment 1 at block 2
    model.select_kernels(False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
