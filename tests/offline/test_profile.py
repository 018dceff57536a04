"""``nightjar profile``'s measurement grid (its isotonic fit: tests/test_planner_profile.py)."""
from collections import Counter

import pytest

import nightjar.offline.profile as prof


def test_the_small_batch_cells_get_more_repetitions_than_the_large_ones(tiny_pair, monkeypatch):
    calls: Counter = Counter()
    forward = prof._Bench.forward

    def counted(self, b, q, start=None):
        if start is None:                       # a grid cell (prefill is timed with start=0)
            calls[(b, q)] += 1
        return forward(self, b, q, start)

    monkeypatch.setattr(prof._Bench, "forward", counted)
    out = prof._measure(tiny_pair[0].model, None, block_size=8, ctx=16, reps=2)
    small = prof.SMALL_B_FACTOR * 2 + 2                         # + the 2 warm-up passes
    for b in prof.GRID_B:
        for q in prof.GRID_Q:
            assert calls[(b, q)] == (small if b <= prof.SMALL_B else 4), (b, q)
    T = out["T"]
    assert all(T[i][j] <= T[i][j + 1] for i in range(len(T)) for j in range(len(T[0]) - 1))    # monotone in q
    assert all(T[i][j] <= T[i + 1][j] for i in range(len(T) - 1) for j in range(len(T[0])))    # and in B


def test_the_context_slope_is_the_kv_read_per_token_a_decode_row(monkeypatch):
    """T(B, 1) at the profile's context against an eighth of it, per row and token of context between."""
    clock = [0.0]
    monkeypatch.setattr(prof.time, "perf_counter", lambda: clock[0])

    class Bench:
        ctx = 256

        def forward(self, b, q, start=None):
            clock[0] += 0.005 + 1.5e-6 * b * (self.ctx if start is None else start)

    assert prof.context_slope(Bench(), reps=3) == pytest.approx(1.5e-6)
