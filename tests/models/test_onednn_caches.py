"""oneDNN's primitive cache and ideep's computation cache are bounded (models/cpu_linear.py): a packed linear
called at many row counts stops growing the process once the caches are full."""
import os
import subprocess
import sys

import pytest
import torch

from nightjar.models.cpu_linear import ONEDNN_CACHE_CAPACITY, packing_available

VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

# Runs in a fresh process: the caches read their capacity once, at their first use.
GROWTH = """
import torch
import nightjar.models
from nightjar.api.heap import malloc_trim, rss_mib
from nightjar.models.cpu_linear import PackedLinear
torch.manual_seed(0)
torch.set_num_threads(1)
lin = PackedLinear(torch.randn(1536, 576, dtype=torch.bfloat16))
trim = malloc_trim()
def shapes(lo, hi):
    for m in range(lo, hi):
        lin(torch.randn(m, 576, dtype=torch.bfloat16))
    trim(0)
    return rss_mib()
shapes(1, {warm})
full = shapes({warm}, {warm} + 1)
print(shapes({warm} + 1, {end}) - full)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(extra)
    return env


def test_importing_models_sets_a_capacity_unless_the_environment_has_one():
    code = "import os, nightjar.models; print(*(os.environ[v] for v in %r))" % (VARS,)
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(ONEDNN_CACHE_CAPACITY)] * 2
    out = subprocess.run([sys.executable, "-c", code], env=_env(LRU_CACHE_CAPACITY="7"), capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == [str(ONEDNN_CACHE_CAPACITY), "7"]


@pytest.mark.skipif(not packing_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 kernels")
def test_new_row_counts_stop_growing_the_process_once_the_caches_are_full():
    # 600 row counts after 300 filled the caches: unbounded (1024 entries each) they add ~250 MiB on this
    # box; bounded at nightjar's capacity a few MiB.
    code = GROWTH.format(warm=300, end=900)
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert float(out.stdout) < 40
