"""Simulated workloads: arrival times (Poisson, gamma-bursty, phased, the paper's stress shapes) and
per-request prompt / output lengths, all from one numpy seed so every policy sees the same requests.

Gaps follow ``nightjar bench`` semantics: Gamma(shape=b, scale=1/(R·b)), mean 1/R, b = 1 is Poisson.
Phased traces use the bench JSON format ``{"phases": [{"duration_s": 30, "rate": 1.0, "burstiness": 1.0}]}``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nightjar.offline.arrivals import Phase, gamma_gaps, load_trace, poisson_arrivals

# The paper's stress shapes: the rates (req/s) the shipped bench traces were scaled from ("paper_rate").
STRESS_TRACES = {"spike": "spike", "oscillation": "oscillation", "worst": "worst_case"}
STRESS_ALIASES = {"burst": "spike", "burst-spike": "spike", "osc": "oscillation", "worst-case": "worst"}


def stress_rates(name: str) -> list[float]:
    """The paper's rates of a stress shape, read from its bench trace (``bench/traces/NAME.json``)."""
    return [float(p.extra["paper_rate"]) for p in load_trace(STRESS_TRACES[name]).phases]


@dataclass
class Workload:
    name: str
    times: np.ndarray             # arrival times (s), ascending
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    phases: list[Phase] | None = None

    def __len__(self) -> int:
        return len(self.times)


def phase_times(phases: list[Phase], rng: np.random.Generator) -> np.ndarray:
    """Arrival times of consecutive phases (the bench's gamma gaps; each phase drawn in chunks)."""
    out, start = [], 0.0
    for ph in phases:
        if ph.rate > 0:
            n = int(ph.rate * ph.duration_s * 1.5) + 32
            t = start + np.cumsum(gamma_gaps(rng, ph.rate, ph.burstiness, n))
            while t[-1] < start + ph.duration_s:        # rare: draw more
                t = np.concatenate([t, t[-1] + np.cumsum(gamma_gaps(rng, ph.rate, ph.burstiness, n))])
            out.append(t[t < start + ph.duration_s])
        start += ph.duration_s
    return np.concatenate(out) if out else np.zeros(0)


def lengths(rng: np.random.Generator, n: int, mean: float, lo: int, hi: int, sigma: float = 0.6) -> np.ndarray:
    """Log-normal lengths with the given mean, clipped to [lo, hi]."""
    if sigma <= 0:
        return np.full(n, int(mean), dtype=np.int64)
    mu = np.log(mean) - sigma * sigma / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), lo, hi).astype(np.int64)


def make_workload(spec: str, *, seed: int = 0, num_requests: int | None = None, duration_s: float | None = None,
                  phase_s: float = 30.0, prompt_mean: float = 128, output_mean: float = 128, sigma: float = 0.6,
                  max_len: int = 2048) -> Workload:
    """``poisson:RATE``, ``gamma:RATE:BURSTINESS``, a stress name (spike, oscillation, worst), or a JSON
    phases file. Poisson/gamma run for ``num_requests`` (default 1000) unless ``duration_s`` is given;
    phased workloads are cut at ``num_requests`` if given."""
    rng = np.random.default_rng(seed)
    head, _, rest = spec.partition(":")
    phases = None
    key = STRESS_ALIASES.get(spec, spec)
    if head in ("poisson", "gamma"):
        parts = rest.split(":")
        rate = float(parts[0])
        b = float(parts[1]) if head == "gamma" and len(parts) > 1 else 1.0
        if duration_s is not None:
            times = phase_times([Phase(duration_s, rate, b)], rng)
        else:
            times = poisson_arrivals(num_requests or 1000, rate, b, rng)
    elif key in STRESS_TRACES:
        phases = [Phase(phase_s, r) for r in stress_rates(key)]
        times = phase_times(phases, rng)
    else:
        phases = list(load_trace(spec).phases)
        times = phase_times(phases, rng)
    if num_requests is not None:
        times = times[:num_requests]
    n = len(times)
    prompt = lengths(rng, n, prompt_mean, 4, max_len // 2, sigma)
    out = np.minimum(lengths(rng, n, output_mean, 1, max_len // 2, sigma), max_len - 1 - prompt)
    return Workload(spec, times, prompt, out, phases)
