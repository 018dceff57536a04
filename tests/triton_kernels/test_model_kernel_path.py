"""The model's Triton path (the GPU hot path), run here through the interpreter, matches the torch path."""
from __future__ import annotations

import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from tests.conftest import random_model, tiny_config


def run(model, kernels: bool):
    model.select_kernels(kernels)
    c = model.cfg
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 4, 16, torch.float32, head_major=not kernels)
    pre = build_layout([[3, 1, 4, 1, 5, 9, 2], [6, 5]], [0, 0], [(0, 1), (5,)], 4, [1, 1])
    a = model(pre, cache)
    ver = build_layout([[2, 6, 5], [3]], [7, 2], [(0, 1, 2), (5,)], 4, [3, 1])   # verify + decode rows
    return torch.cat([a, model(ver, cache)])


def test_triton_kernels_in_the_model_match_the_torch_references():
    model = random_model(tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2), seed=3, std=0.3)
    want = run(model, kernels=False)
    got = run(model, kernels=True)
    model.select_kernels(False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
