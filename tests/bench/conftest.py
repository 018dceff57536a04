"""Fixtures for the benchmark-harness tests: an in-process server on the tiny random model."""
from __future__ import annotations

import pytest


@pytest.fixture
def tiny_engine_factory(make_engine):
    """``factory(policy)`` -> a fresh Engine on the tiny random pair (small pool, short context)."""
    def make(policy: str = "off"):
        return make_engine(policy, num_blocks=256, max_model_len=512, max_num_seqs=16)
    return make
