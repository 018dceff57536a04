"""The one switch between Triton kernels and torch references."""
import subprocess
import sys

import torch

import nightjar.triton_kernels as tk


def test_triton_is_used_only_with_cuda_and_without_the_opt_out(monkeypatch):
    monkeypatch.setattr(tk, "_cuda", lambda: True)
    monkeypatch.delenv("NIGHTJAR_TRITON", raising=False)
    assert tk.use_triton()
    monkeypatch.setenv("NIGHTJAR_TRITON", "0")
    assert not tk.use_triton()
    monkeypatch.setattr(tk, "_cuda", lambda: False)
    monkeypatch.setenv("NIGHTJAR_TRITON", "1")
    assert not tk.use_triton()


def test_the_dispatch_helpers_stay_functions_after_the_kernel_modules_are_imported():
    import nightjar.triton_kernels.kv_store  # noqa: F401
    import nightjar.triton_kernels.paged_attention  # noqa: F401
    assert callable(tk.run_paged_attention) and callable(tk.run_kv_store) and callable(tk.run_migrate_blocks)


def test_cpu_tensors_go_to_the_references():
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    k = torch.randn(3, 1, 8)
    tk.run_kv_store(k, k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache.view(-1, 1, 8)[5], k[0]) and torch.equal(v_cache.view(-1, 1, 8)[0], k[2])
    q = torch.randn(2, 2, 8)
    out = tk.run_paged_attention(q, k_cache, v_cache, torch.tensor([[1, 0]]), torch.tensor([0, 2]),
                             torch.tensor([6]), 0.5)
    assert out.shape == q.shape and not out.isnan().any()
    data = torch.randn(1, 2, 3, 4, 1, 8)
    tk.run_migrate_blocks(data, [(2, 0)])
    assert torch.equal(data[:, :, 0], data[:, :, 2])


def test_importing_the_package_and_the_torch_rejection_reference_does_not_import_triton():
    code = ("import sys, nightjar.triton_kernels, nightjar.triton_kernels.rejection; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
