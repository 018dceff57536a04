"""The one switch between Triton kernels and torch references, and where the engine uses it."""
import subprocess
import sys

import torch

import nightjar.triton_kernels as tk
from nightjar.kvpool.cache import KVCache


def test_triton_is_used_only_with_cuda_and_without_the_opt_out(monkeypatch):
    monkeypatch.setattr(tk, "_cuda", lambda: True)
    monkeypatch.delenv("NIGHTJAR_TRITON", raising=False)
    assert tk.use_triton()
    monkeypatch.setenv("NIGHTJAR_TRITON", "0")
    assert not tk.use_triton()
    monkeypatch.setattr(tk, "_cuda", lambda: False)
    monkeypatch.setenv("NIGHTJAR_TRITON", "1")
    assert not tk.use_triton()


def test_cpu_caches_migrate_with_torch_even_when_triton_is_on(monkeypatch):
    monkeypatch.setattr(tk, "_cuda", lambda: True)               # a CPU cache never takes the kernel
    cache = KVCache(2, 1, 8, 4, 6, torch.float32, "cpu", head_major=False)   # blocks on dim 2, as on CUDA
    data = cache.segments[0].data
    data.copy_(torch.randn(data.shape))
    before = data.clone()
    cache.migrate([(5, 0), (4, 1)])
    assert torch.equal(data[:, :, 0], before[:, :, 5]) and torch.equal(data[:, :, 1], before[:, :, 4])
    assert torch.equal(data[:, :, 2:], before[:, :, 2:])


def test_importing_the_package_and_the_engine_sampler_does_not_import_triton():
    code = ("import sys, nightjar.triton_kernels, nightjar.actors.sampler, nightjar.kvpool.cache; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
