"""Client-side serving metrics with vLLM's definitions (``vllm bench serve``), plus a per-interval timeline.

Per request (times measured at the client with ``time.perf_counter``, from the moment the request is sent):

* **TTFT**: sent -> first chunk that carries output text (the role-only head chunk of a chat stream does not count).
* **ITL**: gaps between consecutive output chunks after the first (chunks with text or a ``finish_reason``),
  pooled over all requests. Under speculative decoding one chunk may carry several tokens, so ITL overstates the
  per-token latency; TPOT does not.
* **TPOT**: ``(E2E − TTFT) / (output_tokens − 1)`` for requests with at least 2 output tokens.
* **E2E (e2el)**: sent -> last output chunk.
* **output_tokens**: ``usage.completion_tokens`` of the final usage chunk (``stream_options.include_usage``);
  never the number of chunks. A server without usage gets a tokenizer count of the text, if a tokenizer is given,
  else the request has no token count and is left out of token-based metrics (reported as
  ``requests_without_usage``).

Over the run (``duration_s`` = first send -> last completion):
request / output-token / total-token throughput, and **goodput** = requests meeting every SLO of
``--goodput ttft:MS tpot:MS e2el:MS`` per second (DistServe). A request with one output token has no TPOT and
meets any TPOT SLO. Failed requests count in no latency statistic and never in goodput.

Percentiles are ``numpy.percentile`` (linear interpolation), like vLLM.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
_GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    index: int
    scheduled_s: float = 0.0          # planned send time (s from the benchmark start)
    start_s: float = 0.0              # actual send time (s from the benchmark start)
    success: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)   # output chunk times, s from start_s
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    usage_source: str = "usage"       # "usage", "tokenizer" or "none"
    status: int = 0
    error: str = ""
    finish_reason: str | None = None
    category: str = ""
    phase: int | None = None
    prompt_len: int = 0               # client-side count of the prompt
    max_tokens: int = 0
    text: str = ""

    @property
    def itl_s(self) -> list[float]:
        c = self.chunk_s
        return [b - a for a, b in zip(c, c[1:])]

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens is None or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        ms = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
        d = {"i": self.index, "phase": self.phase, "category": self.category, "prompt_len": self.prompt_len,
             "max_tokens": self.max_tokens, "scheduled_s": round(self.scheduled_s, 6),
             "start_s": round(self.start_s, 6),
             "success": self.success, "status": self.status, "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s),
             "e2e_ms": ms(self.e2e_s), "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
             "num_chunks": len(self.chunk_s), "finish_reason": self.finish_reason}
        if self.usage_source != "usage":
            d["usage_source"] = self.usage_source
        if self.error:
            d["error"] = self.error
        if detailed:
            d["itl_ms"] = [round(x * 1e3, 3) for x in self.itl_s]
            d["text"] = self.text
        return d


# ---- parsing of the CLI options ---------------------------------------------------------------------
def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or ():
        for part in item.replace(",", " ").split():
            key, sep, val = part.partition(":")
            key = key.strip().lower()
            if key == "e2e":
                key = "e2el"
            if not sep or key not in _GOODPUT_KEYS:
                raise ValueError(f"bad --goodput item {part!r}: expected KEY:MS with KEY in {', '.join(_GOODPUT_KEYS)}")
            try:
                ms = float(val)
            except ValueError:
                raise ValueError(f"bad --goodput item {part!r}: {val!r} is not a number of milliseconds") from None
            if not ms > 0:
                raise ValueError(f"bad --goodput item {part!r}: the SLO must be > 0 ms")
            slo[key] = ms
    return slo


def parse_percentiles(text: str | Iterable[float]) -> list[float]:
    vals = [float(x) for x in (text.split(",") if isinstance(text, str) else text) if str(x).strip()]
    for v in vals:
        if not 0 <= v <= 100:
            raise ValueError(f"percentile {v} is outside [0, 100]")
    return vals


def parse_metric_names(text: str) -> list[str]:
    names = [x.strip().lower().replace("e2e", "e2el").replace("e2ell", "e2el") for x in text.split(",") if x.strip()]
    for n in names:
        if n not in METRICS:
            raise ValueError(f"unknown metric {n!r} in --percentile-metrics: choose from {', '.join(METRICS)}")
    return names


def _pct_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def _stats(name: str, xs_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    a = np.asarray(xs_s, dtype=float) * 1e3
    out: dict[str, float | None] = {}
    ps = sorted(set([50.0, 99.0] + list(percentiles)))
    if not len(a):
        out.update({f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None})
        out.update({f"{_pct_key(p)}_{name}_ms": None for p in ps})
        return out
    out[f"mean_{name}_ms"] = float(a.mean())
    out[f"median_{name}_ms"] = float(np.median(a))
    out[f"std_{name}_ms"] = float(a.std())
    for p in ps:
        out[f"{_pct_key(p)}_{name}_ms"] = float(np.percentile(a, p))
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    if "ttft" in slo and (r.ttft_s is None or r.ttft_s * 1e3 > slo["ttft"]):
        return False
    if "tpot" in slo and r.tpot_s is not None and r.tpot_s * 1e3 > slo["tpot"]:
        return False
    if "e2el" in slo and (r.e2e_s is None or r.e2e_s * 1e3 > slo["e2el"]):
        return False
    return True


def compute_metrics(results: list[RequestResult], duration_s: float, *, percentiles: Iterable[float] = (50, 99),
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The summary dict (vLLM's key names: ``mean_ttft_ms``, ``p99_e2el_ms``, ``output_throughput``, ...)."""
    pcts = list(percentiles)
    ok = [r for r in results if r.success]
    counted = [r for r in ok if r.output_tokens is not None]
    out_tok = sum(r.output_tokens for r in counted)
    in_tok = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")
    m: dict[str, Any] = {
        "duration_s": duration_s, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "rejected_429": sum(r.status == 429 for r in results),
        "requests_without_usage": len(ok) - len(counted),
        "total_input_tokens": int(in_tok), "total_output_tokens": int(out_tok),
        "request_throughput": len(ok) / dur, "output_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        m.update(goodput_slo_ms=dict(slo), good_requests=good, request_goodput=good / dur)
    else:
        m.update(goodput_slo_ms=None, request_goodput=None)
    m.update(_stats("ttft", [r.ttft_s for r in ok if r.ttft_s is not None], pcts))
    m.update(_stats("tpot", [t for r in counted if (t := r.tpot_s) is not None], pcts))
    m.update(_stats("itl", [g for r in ok for g in r.itl_s], pcts))
    m.update(_stats("e2el", [r.e2e_s for r in ok if r.e2e_s is not None], pcts))
    for k, v in list(m.items()):
        if isinstance(v, float) and math.isnan(v):
            m[k] = None
    return m


# ---- Prometheus text and the timeline ---------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Flat ``{"name" or "name{labels}": value}`` from the text exposition format (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        except ValueError:
            continue
    return out


# Server series, by suffix (any prefix: ``nightjar:``, ``vllm:``, ...). Counters may carry ``_total``.
SERIES = {
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "kv_free": ("kv_blocks_free",),
    "kv_total": ("kv_blocks_total",),
    "kv_usage": ("kv_cache_usage_perc",),
    "draft_resident": ("draft_resident",),
    "gamma_sum": ("spec_gamma_sum",),
    "gamma_count": ("spec_gamma_count",),
    "gen_tokens": ("generation_tokens_total", "generation_tokens"),
    "drafts": ("spec_decode_num_drafts_total", "spec_decode_num_drafts"),
    "draft_tokens": ("spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens"),
    "accepted": ("spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens"),
    "offloads": ("draft_offloads_total",),
    "reloads": ("draft_reloads_total",),
}


def pick_series(flat: dict[str, float]) -> dict[str, float]:
    """The unlabelled samples of :data:`SERIES`, whatever the metric prefix."""
    out: dict[str, float] = {}
    for key, suffixes in SERIES.items():
        for name, v in flat.items():
            if "{" in name:
                continue
            base = name.rsplit(":", 1)[-1]
            if base in suffixes:
                out[key] = v
                break
    return out


@dataclass
class Sample:
    t: float                          # s from the benchmark start
    values: dict[str, float]


def _delta(a: dict, b: dict, key: str) -> float | None:
    if key in a and key in b:
        return b[key] - a[key]
    return None


def spec_summary(first: Sample | None, last: Sample | None) -> dict[str, Any] | None:
    """Speculative-decoding counters over the run (delta of the first and last scrape)."""
    if first is None or last is None:
        return None
    d = {k: _delta(first.values, last.values, k) for k in ("drafts", "draft_tokens", "accepted", "gen_tokens",
                                                           "gamma_sum", "gamma_count", "offloads", "reloads")}
    out: dict[str, Any] = {"num_drafts": d["drafts"], "num_draft_tokens": d["draft_tokens"],
                           "num_accepted_tokens": d["accepted"], "generation_tokens": d["gen_tokens"],
                           "draft_offloads": d["offloads"], "draft_reloads": d["reloads"]}
    out["acceptance_rate"] = d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None
    out["mean_acceptance_length"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else None
    out["mean_gamma"] = d["gamma_sum"] / d["gamma_count"] if d["gamma_count"] else None
    return out


def load_summary(samples: list[Sample]) -> dict[str, float | None]:
    """Batch and pool gauges over every scrape: the peak and mean number of running requests (the batch
    size) and the largest KV pool seen (it grows when the draft is offloaded)."""
    def series(key):
        return [s.values[key] for s in samples if key in s.values]
    running, total = series("running"), series("kv_total")
    return {"max_running": max(running) if running else None,
            "mean_running": float(np.mean(running)) if running else None,
            "max_kv_blocks_total": max(total) if total else None,
            "min_kv_blocks_total": min(total) if total else None}


def build_timeline(results: list[RequestResult], samples: list[Sample], duration_s: float, interval_s: float,
                   phase_bounds: list[float] | None = None) -> dict[str, Any]:
    """Per-interval series over ``[0, duration_s)``.

    Client side: ``arrivals`` / ``completions`` per s, and ``output_tokens_per_s`` where each request's usage token
    count is spread evenly over its output chunks (an approximation, since one chunk can carry several tokens).
    Server side (from ``/metrics`` scrapes): the last gauge value scraped in the interval (``running``, ``waiting``,
    ``kv_blocks_free``, ``kv_blocks_total``, ``draft_resident``), and counter rates over consecutive scrape pairs,
    each pair credited to the interval holding its midpoint: ``server_tokens_per_s`` (generation tokens),
    ``gamma_mean`` (Δ spec_gamma_sum / Δ spec_gamma_count: the mean γ of the decode steps) and
    ``acceptance_rate`` (Δ accepted / Δ draft tokens). ``None`` where there is no data.
    """
    n = max(1, int(math.ceil(duration_s / interval_s))) if duration_s > 0 else 1
    edges = np.arange(n + 1) * interval_s
    arrivals = np.zeros(n)
    completions = np.zeros(n)
    tokens = np.zeros(n)

    def bucket(t: float) -> int | None:
        i = int(t // interval_s)
        return i if 0 <= i < n else (n - 1 if i == n and t <= duration_s + 1e-9 else None)

    for r in results:
        if (b := bucket(r.start_s)) is not None:
            arrivals[b] += 1
        if r.success and r.end_s is not None and (b := bucket(r.end_s)) is not None:
            completions[b] += 1
        if r.success and r.output_tokens and r.chunk_s:
            share = r.output_tokens / len(r.chunk_s)
            for c in r.chunk_s:
                if (b := bucket(r.start_s + c)) is not None:
                    tokens[b] += share
    tl: dict[str, Any] = {
        "interval_s": interval_s, "t": [round(float(x), 6) for x in edges[:-1]],
        "arrivals_per_s": (arrivals / interval_s).tolist(), "completions_per_s": (completions / interval_s).tolist(),
        "output_tokens_per_s": (tokens / interval_s).round(3).tolist(),
    }
    if phase_bounds:
        tl["phase"] = [int(np.searchsorted(phase_bounds, float(t), side="right") - 1) for t in edges[:-1]]
    gauges = {"running": "running", "waiting": "waiting", "kv_blocks_free": "kv_free", "kv_blocks_total": "kv_total",
              "kv_cache_usage": "kv_usage", "draft_resident": "draft_resident"}
    series: dict[str, list] = {k: [None] * n for k in list(gauges) + ["server_tokens_per_s", "gamma_mean",
                                                                        "acceptance_rate"]}
    samples = sorted(samples, key=lambda s: s.t)
    for s in samples:                                   # gauges: the last scrape inside the interval
        if (b := bucket(s.t)) is not None:
            for out_key, key in gauges.items():
                if key in s.values:
                    series[out_key][b] = s.values[key]
    acc: dict[int, dict[str, float]] = {}               # counters: each scrape pair goes to its midpoint's interval
    for a, c in zip(samples, samples[1:]):
        if c.t <= a.t or (b := bucket((a.t + c.t) / 2)) is None:
            continue
        d = acc.setdefault(b, {})
        d["dt"] = d.get("dt", 0.0) + (c.t - a.t)
        for key in ("gen_tokens", "gamma_sum", "gamma_count", "draft_tokens", "accepted"):
            if (x := _delta(a.values, c.values, key)) is not None:
                d[key] = d.get(key, 0.0) + x
    for b, d in acc.items():
        if "gen_tokens" in d:
            series["server_tokens_per_s"][b] = round(d["gen_tokens"] / d["dt"], 3)
        if d.get("gamma_count"):
            series["gamma_mean"][b] = round(d["gamma_sum"] / d["gamma_count"], 4)
        if d.get("draft_tokens"):
            series["acceptance_rate"][b] = round(d.get("accepted", 0.0) / d["draft_tokens"], 4)
    for k, v in series.items():
        if any(x is not None for x in v):
            tl[k] = v
    tl["num_scrapes"] = len(samples)
    return tl
