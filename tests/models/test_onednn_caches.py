"""oneDNN's primitive cache and ideep's computation cache are bounded (models/cpu_linear.py): a packed linear
called at many row counts stops growing the process once they are full."""
import os
import subprocess
import sys

import pytest
import torch

from nightjar.models.cpu_linear import ONEDNN_CACHE_CAPACITY, packing_available

VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

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
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    return subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True,
                          check=True).stdout


def test_importing_models_sets_a_capacity_unless_the_environment_has_one():
    code = "import os, nightjar.models; print(*(os.environ[v] for v in %r))" % (VARS,)
    assert _run(code).split() == [str(ONEDNN_CACHE_CAPACITY)] * 2
    assert _run(code, LRU_CACHE_CAPACITY="7").split() == [str(ONEDNN_CACHE_CAPACITY), "7"]


@pytest.mark.skipif(not packing_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 kernels")
def test_new_row_counts_stop_growing_the_process_once_the_caches_are_full():
    # 600 row counts fill both caches at nightjar's bound; 500 more replace entries (+4 MiB measured). At
    # torch's default bound (1024 each) the same 500 added 130 MiB on the 2-vCPU box.
    code = GROWTH.format(warm=600, end=1100)
    assert float(_run(code)) < 40
