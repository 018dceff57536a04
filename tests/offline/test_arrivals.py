"""Arrival generators: rates and burstiness (seeded statistical checks), traces, determinism."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nightjar.offline.arrivals import (
    Phase,
    Trace,
    closed_loop_plan,
    fingerprint,
    gamma_gaps,
    phase_arrivals,
    plan_arrivals,
    poisson_arrivals,
)


@pytest.mark.parametrize("rate,b", [(5.0, 1.0), (2.0, 0.25), (20.0, 4.0), (0.5, 0.35)])
def test_gamma_gaps_mean_and_cv(rate, b):
    n = 50_000
    g = gamma_gaps(np.random.default_rng(7), rate, b, n)
    # mean gap 1/rate for every burstiness; relative SE = CV/sqrt(n) <= 2/224 < 1%: 4 % is > 4 SE
    assert g.mean() == pytest.approx(1 / rate, rel=0.04)
    # CV = 1/sqrt(b) (gamma shape b); SE of the CV estimate is ~1.2 % at b=0.25 (kurtosis 6/b), so 6 %
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(b), rel=0.06)
    assert (g >= 0).all()


def test_poisson_is_exponential():
    g = gamma_gaps(np.random.default_rng(1), 3.0, 1.0, 40_000)
    # P(gap < mean) = 1 - 1/e for the exponential; binomial SE ~0.0024
    assert (g < 1 / 3.0).mean() == pytest.approx(1 - math.exp(-1), abs=0.012)
    # memorylessness: P(gap > 2/λ | gap > 1/λ) = P(gap > 1/λ)
    tail = g[g > 1 / 3.0]
    assert (tail > 2 / 3.0).mean() == pytest.approx(math.exp(-1), abs=0.02)


def test_poisson_arrivals_shape_and_rate():
    t = poisson_arrivals(10_000, 8.0, 1.0, np.random.default_rng(3))
    assert t[0] == 0.0 and (np.diff(t) >= 0).all() and len(t) == 10_000
    assert (len(t) - 1) / t[-1] == pytest.approx(8.0, rel=0.04)
    assert (poisson_arrivals(5, math.inf, 1.0, np.random.default_rng(0)) == 0).all()


def test_same_seed_same_arrivals():
    a = plan_arrivals(seed=11, request_rate=4.0, burstiness=0.5, num_prompts=300)
    b = plan_arrivals(seed=11, request_rate=4.0, burstiness=0.5, num_prompts=300)
    c = plan_arrivals(seed=12, request_rate=4.0, burstiness=0.5, num_prompts=300)
    assert np.array_equal(a.times, b.times) and a.info["fingerprint"] == b.info["fingerprint"]
    assert not np.array_equal(a.times, c.times) and a.info["fingerprint"] != c.info["fingerprint"]
    assert a.info["mode"] == "gamma" and a.info["num_requests"] == 300
    assert fingerprint(a.times) == a.info["fingerprint"]


def test_phase_counts_match_rates():
    ph = [Phase(200, 2.0), Phase(100, 0.0, kind="idle"), Phase(200, 10.0, 0.5, kind="surge"), Phase(50, 1.0, 3.0)]
    tr = Trace(tuple(ph), "t")
    plan = plan_arrivals(seed=5, trace=tr)
    t, phases = plan.times, np.asarray(plan.phases)
    assert (np.diff(t) >= 0).all() and t[-1] < tr.duration_s
    bounds = tr.boundaries
    for i, p in enumerate(ph):
        sel = t[phases == i]
        assert ((sel >= bounds[i]) & (sel < bounds[i + 1])).all()
        mean = p.rate * p.duration_s
        if mean == 0:
            assert len(sel) == 0
            continue
        # count of a renewal process over T: variance ≈ mean·CV² = mean/b; 4 SD (+1 for the phase restart)
        assert abs(len(sel) - mean) <= 4 * math.sqrt(mean / p.burstiness) + 1, (i, len(sel), mean)
    assert plan.info["mode"] == "trace" and plan.info["trace"]["expected_requests"] == pytest.approx(2450)


def test_trace_burstiness_within_phase():
    g = np.diff(phase_arrivals(Phase(4000, 5.0, 0.25), 0.0, np.random.default_rng(2)))
    assert g.std() / g.mean() == pytest.approx(2.0, rel=0.08)


def test_num_prompts_caps_trace_and_scaling():
    tr = Trace((Phase(100, 5.0),), "t")
    assert len(plan_arrivals(seed=0, trace=tr, num_prompts=17).times) == 17
    s = tr.scaled(rate_scale=2.0, time_scale=0.5)
    assert s.phases[0].rate == 10.0 and s.duration_s == 50.0 and s.meta["rate_scale"] == 2.0


def test_bad_rate_arguments():
    with pytest.raises(ValueError):
        plan_arrivals(seed=0, request_rate=1.0)               # no num_prompts
    with pytest.raises(ValueError):
        plan_arrivals(seed=0, request_rate=1.0, num_prompts=3, burstiness=0)
    with pytest.raises(ValueError):
        closed_loop_plan(0, 10, 0)
