"""Arrival schedules: Poisson / gamma renewal processes (``vllm bench serve`` semantics) and phased traces.

* ``--request-rate R --burstiness b``: gaps are i.i.d. Gamma(shape=b, scale=θ) with θ = 1/(R·b), so the mean gap
  is 1/R for every b; b = 1 is Poisson (exponential gaps), b < 1 is burstier (CV = 1/√b), b > 1 smoother.
  ``R = inf`` sends every request at t = 0. The first request leaves at t = 0, as in vLLM.
* ``--trace FILE``: ``{"phases": [{"duration_s": 30, "rate": 1.0, "burstiness": 1.0, "kind": "low"}, ...]}``.
  Each phase is its own renewal process over ``[start, start + duration_s)``; ``rate: 0`` is an idle phase.
  Extra keys (``kind``, ``note``, ...) are kept and reported. Top-level ``name``/``description``/``scaling`` are
  optional metadata.

All randomness comes from a ``numpy.random.Generator`` seeded by the caller, so the same seed gives the same
arrival times on every run (``compare`` relies on this).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TRACE_DIR = Path(__file__).resolve().parents[2] / "bench" / "traces"
_PHASE_KEYS = ("duration_s", "rate", "burstiness")


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and the offending phase/key."""


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: float
    burstiness: float = 1.0
    kind: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {"duration_s": self.duration_s, "rate": self.rate, "burstiness": self.burstiness}
        if self.kind:
            d["kind"] = self.kind
        return {**d, **self.extra}


@dataclass(frozen=True)
class Trace:
    phases: tuple[Phase, ...]
    name: str = ""
    description: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return float(sum(p.duration_s for p in self.phases))

    @property
    def boundaries(self) -> list[float]:
        """Start time of every phase, then the end of the trace."""
        return [0.0] + list(np.cumsum([p.duration_s for p in self.phases]).tolist())

    def expected_requests(self) -> float:
        return float(sum(p.rate * p.duration_s for p in self.phases))

    def scaled(self, rate_scale: float = 1.0, time_scale: float = 1.0) -> "Trace":
        """Multiply every rate by ``rate_scale`` and every duration by ``time_scale`` (to move a trace between
        machines: scale rates by the ratio of saturation throughputs)."""
        if rate_scale <= 0 or time_scale <= 0:
            raise TraceError("trace scales must be > 0")
        if rate_scale == 1.0 and time_scale == 1.0:
            return self
        ph = tuple(Phase(p.duration_s * time_scale, p.rate * rate_scale, p.burstiness, p.kind, p.extra)
                   for p in self.phases)
        return Trace(ph, self.name, self.description, {**self.meta, "rate_scale": rate_scale,
                                                        "time_scale": time_scale})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, **self.meta,
                "duration_s": self.duration_s, "expected_requests": round(self.expected_requests(), 1),
                "phases": [p.to_dict() for p in self.phases]}


def _number(v: Any, where: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{where}: {key!r} must be a number, got {v!r}")
    x = float(v)
    if math.isnan(x):
        raise TraceError(f"{where}: {key!r} is NaN")
    return x


def parse_trace(obj: Any, source: str = "<trace>") -> Trace:
    """Validate a decoded trace object; every error names ``source`` and the phase index."""
    if isinstance(obj, list):
        obj = {"phases": obj}
    if not isinstance(obj, dict):
        raise TraceError(f"{source}: a trace must be a JSON object with a 'phases' list, got {type(obj).__name__}")
    if "phases" not in obj:
        raise TraceError(f"{source}: missing the 'phases' key (expected {{\"phases\": [{{\"duration_s\": 30, "
                         f"\"rate\": 1.0, \"burstiness\": 1.0}}, ...]}})")
    raw = obj["phases"]
    if not isinstance(raw, list) or not raw:
        raise TraceError(f"{source}: 'phases' must be a non-empty list")
    phases = []
    for i, p in enumerate(raw):
        where = f"{source}: phase {i}"
        if not isinstance(p, dict):
            raise TraceError(f"{where}: must be an object, got {p!r}")
        for key in ("duration_s", "rate"):
            if key not in p:
                raise TraceError(f"{where}: missing {key!r}")
        dur = _number(p["duration_s"], where, "duration_s")
        rate = _number(p["rate"], where, "rate")
        b = _number(p.get("burstiness", 1.0), where, "burstiness")
        if not math.isfinite(dur) or dur <= 0:
            raise TraceError(f"{where}: 'duration_s' must be a finite number > 0, got {p['duration_s']!r}")
        if not math.isfinite(rate) or rate < 0:
            raise TraceError(f"{where}: 'rate' must be a finite number >= 0 (req/s), got {p['rate']!r}")
        if not math.isfinite(b) or b <= 0:
            raise TraceError(f"{where}: 'burstiness' must be a finite number > 0, got {p.get('burstiness')!r}")
        kind = p.get("kind", "")
        if not isinstance(kind, str):
            raise TraceError(f"{where}: 'kind' must be a string, got {kind!r}")
        extra = {k: v for k, v in p.items() if k not in _PHASE_KEYS and k != "kind"}
        phases.append(Phase(dur, rate, b, kind, extra))
    meta = {k: v for k, v in obj.items() if k not in ("phases", "name", "description")}
    name, desc = obj.get("name", ""), obj.get("description", "")
    return Trace(tuple(phases), str(name) if name else Path(source).stem, str(desc), meta)


def resolve_trace_path(path: str | Path) -> Path:
    """``path`` as given, else a shipped trace by name (``spike`` -> ``bench/traces/spike.json``)."""
    p = Path(path)
    if p.exists():
        return p
    for cand in (TRACE_DIR / p.name, TRACE_DIR / f"{p.name}.json"):
        if cand.exists():
            return cand
    shipped = ", ".join(sorted(q.stem for q in TRACE_DIR.glob("*.json"))) if TRACE_DIR.is_dir() else "none"
    raise TraceError(f"{path}: no such trace file (shipped traces: {shipped})")


def load_trace(path: str | Path) -> Trace:
    p = resolve_trace_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{p}: cannot read: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return parse_trace(obj, str(p))


# ---- generators -------------------------------------------------------------------------------------
def gamma_gaps(rng: np.random.Generator, rate: float, burstiness: float, n: int) -> np.ndarray:
    """``n`` inter-arrival gaps with mean 1/rate: Gamma(shape=burstiness, scale=1/(rate·burstiness))."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def poisson_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of ``n`` requests: the first at 0, then ``n-1`` gamma gaps."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(gamma_gaps(rng, rate, burstiness, n - 1))])


def phase_arrivals(phase: Phase, start: float, rng: np.random.Generator) -> np.ndarray:
    """Arrivals of one phase in ``[start, start + duration)``: a renewal process started at ``start``."""
    if phase.rate <= 0:
        return np.zeros(0)
    out: list[np.ndarray] = []
    t, end = 0.0, phase.duration_s
    chunk = int(phase.rate * phase.duration_s * 1.3) + 16
    while True:
        times = t + np.cumsum(gamma_gaps(rng, phase.rate, phase.burstiness, chunk))
        keep = times[times < end]
        out.append(keep)
        if len(keep) < chunk:
            break
        t = float(times[-1])
    return start + np.concatenate(out)


@dataclass
class ArrivalPlan:
    """Send times (s from the benchmark start; ``None`` in closed-loop mode) and, for traces, each request's
    phase index. ``info`` goes to the result JSON under ``arrivals``."""
    times: np.ndarray | None
    phases: list[int] | None
    info: dict[str, Any]
    trace: Trace | None = None

    @property
    def num_requests(self) -> int | None:
        return None if self.times is None else len(self.times)


def fingerprint(times: np.ndarray) -> str:
    """Short hash of the send times (rounded to µs): equal fingerprints = identical arrivals."""
    return hashlib.sha256(np.round(np.asarray(times, dtype=np.float64), 6).tobytes()).hexdigest()[:16]


def plan_arrivals(*, seed: int, request_rate: float = math.inf, burstiness: float = 1.0,
                  num_prompts: int | None = None, trace: Trace | None = None) -> ArrivalPlan:
    """Open-loop schedule from a rate (needs ``num_prompts``) or a trace (``num_prompts`` caps it)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA221]))
    if trace is not None:
        times, phases = [], []
        for i, (ph, start) in enumerate(zip(trace.phases, trace.boundaries)):
            t = phase_arrivals(ph, start, rng)
            times.append(t)
            phases += [i] * len(t)
        arr = np.concatenate(times) if times else np.zeros(0)
        if num_prompts is not None:
            arr, phases = arr[:num_prompts], phases[:num_prompts]
        info = {"mode": "trace", "trace": trace.to_dict(), "seed": seed}
    else:
        if num_prompts is None or num_prompts <= 0:
            raise ValueError("--num-prompts must be > 0 without --trace")
        if burstiness <= 0:
            raise ValueError("--burstiness must be > 0")
        if not request_rate > 0:
            raise ValueError("--request-rate must be > 0 (or inf)")
        arr, phases = poisson_arrivals(num_prompts, request_rate, burstiness, rng), None
        info = {"mode": "poisson" if burstiness == 1.0 else "gamma", "request_rate": request_rate,
                "burstiness": burstiness, "seed": seed}
    info.update(num_requests=int(len(arr)), span_s=round(float(arr[-1]), 6) if len(arr) else 0.0,
                fingerprint=fingerprint(arr))
    return ArrivalPlan(arr, phases, info, trace)


def closed_loop_plan(concurrency: int, duration_s: float, seed: int, num_prompts: int | None = None) -> ArrivalPlan:
    if concurrency <= 0 or duration_s <= 0:
        raise ValueError("--closed-loop N needs N > 0 and --duration > 0")
    return ArrivalPlan(None, None, {"mode": "closed-loop", "concurrency": concurrency, "duration_s": duration_s,
                                    "max_requests": num_prompts, "seed": seed})
