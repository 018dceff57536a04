"""ideep's computation cache is bounded (models/cpu_linear.py): a packed linear called at many row counts stops
growing the process once oneDNN's own primitive cache (1024 entries by default) is full."""
import os
import subprocess
import sys

import pytest
import torch

from nightjar.models.cpu_linear import IDEEP_CACHE_CAPACITY, packing_available

# Runs in a fresh process: the caches read their capacity once, at their first use. Prints the MiB the
# process grew by over row counts [warm + 1, end), after row counts [1, warm] were seen.
GROWTH = """
import torch
import nightjar.models
from nightjar.api.heap import malloc_trim, rss_mib
from nightjar.models.cpu_linear import PackedLinear
torch.manual_seed(0)
torch.set_num_threads(1)
lin = PackedLinear(torch.randn(1536, 576, dtype=torch.bfloat16))
trim = malloc_trim()
def rows(lo, hi):
    for m in range(lo, hi):
        lin(torch.randn(m, 576, dtype=torch.bfloat16))
    trim(0)
    return rss_mib()
start = rows(1, {warm} + 1)
print(rows({warm} + 1, {end}) - start)
"""


def _run(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "LRU_CACHE_CAPACITY"}
    return subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True,
                          check=True).stdout


def test_importing_models_sets_a_capacity_unless_the_environment_has_one():
    code = "import os, nightjar.models; print(os.environ['LRU_CACHE_CAPACITY'])"
    assert _run(code).split() == [str(IDEEP_CACHE_CAPACITY)]
    assert _run(code, LRU_CACHE_CAPACITY="7").split() == ["7"]


@pytest.mark.skipif(not packing_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 kernels")
def test_new_row_counts_stop_growing_the_process_once_the_caches_are_full():
    # 1100 row counts fill oneDNN's primitive cache; 500 more add ~0.3 MB each to ideep's cache at its own
    # default (1024 entries), and nothing that lasts at nightjar's bound.
    code = GROWTH.format(warm=1100, end=1600)
    assert float(_run(code)) < 40
