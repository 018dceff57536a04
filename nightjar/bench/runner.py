"""One benchmark run: options -> (requests, arrival plan) -> load against a base URL -> result dict.

The result dict has vLLM's summary keys at the top level (``request_throughput``, ``output_throughput``,
``mean_ttft_ms``, ``p99_e2el_ms``, ...) plus the sections documented in ``docs/bench_harness.md``.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from nightjar.bench.client import ClientConfig, run_load
from nightjar.bench.datasets import BenchRequest, build_requests, load_tokenizer
from nightjar.bench.metrics import METRICS, build_timeline, compute_metrics, load_summary, spec_summary
from nightjar.bench.report import machine_info
from nightjar.offline import arrivals as arr

SCHEMA = "nightjar.bench/1"
CLOSED_LOOP_POOL = 1000          # distinct requests cycled by closed-loop clients without --num-prompts


@dataclass
class BenchOptions:
    # dataset
    dataset_name: str = "prompts"
    dataset_path: str | None = None
    split: str = "auto"
    num_prompts: int | None = None
    output_len: int | None = None
    random_input_len: int = 128
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    tokenizer: str | None = "auto"
    max_total_len: int | None = 2048 - 64
    seed: int = 0
    # arrivals
    request_rate: float = math.inf
    burstiness: float = 1.0
    trace: str | None = None
    trace_rate_scale: float = 1.0
    trace_time_scale: float = 1.0
    closed_loop: int | None = None
    duration_s: float | None = None
    max_concurrency: int | None = None
    # requests
    model: str | None = None
    endpoint_type: str = "chat"
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    num_warmups: int = 0
    # reporting
    goodput: dict[str, float] = field(default_factory=dict)
    percentile_metrics: list[str] = field(default_factory=lambda: list(METRICS))
    metric_percentiles: list[float] = field(default_factory=lambda: [50.0, 99.0])
    timeline_interval_s: float = 1.0
    progress: bool = True
    save_detailed: bool = False

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        if d.get("api_key"):
            d["api_key"] = "***"
        return d


@dataclass
class Prepared:
    requests: list[BenchRequest]
    dataset: dict[str, Any]
    plan: arr.ArrivalPlan
    tokenizer: Any = None


def prepare(opts: BenchOptions, tokenizer: Any = "load") -> Prepared:
    """Requests and arrivals, deterministic in ``opts.seed`` (``compare`` calls this once for all policies)."""
    trace = None
    if opts.trace:
        trace = arr.load_trace(opts.trace).scaled(opts.trace_rate_scale, opts.trace_time_scale)
    if opts.closed_loop:
        plan = arr.closed_loop_plan(opts.closed_loop, opts.duration_s or 0, opts.seed, opts.num_prompts)
        n = opts.num_prompts or CLOSED_LOOP_POOL
    else:
        plan = arr.plan_arrivals(seed=opts.seed, request_rate=opts.request_rate, burstiness=opts.burstiness,
                                 num_prompts=opts.num_prompts, trace=trace)
        n = max(1, plan.num_requests or 0)
    tok = load_tokenizer(opts.tokenizer) if tokenizer == "load" else tokenizer
    reqs, info = build_requests(opts.dataset_name, n, seed=opts.seed, tokenizer=tok, split=opts.split,
                                output_len=opts.output_len, random_input_len=opts.random_input_len,
                                random_output_len=opts.random_output_len, random_range_ratio=opts.random_range_ratio,
                                dataset_path=opts.dataset_path, max_total_len=opts.max_total_len)
    if plan.info.get("mode") != "closed-loop":
        plan.info["requests_fingerprint"] = hashlib.sha256(
            "\x00".join(f"{r.max_tokens}:{r.prompt}" for r in reqs).encode()).hexdigest()[:16]
    return Prepared(reqs, info, plan, tok)


def client_config(opts: BenchOptions, base_url: str, tokenizer: Any = None) -> ClientConfig:
    return ClientConfig(base_url=base_url, model=opts.model, endpoint_type=opts.endpoint_type,
                        temperature=opts.temperature, ignore_eos=opts.ignore_eos, max_concurrency=opts.max_concurrency,
                        request_timeout_s=opts.request_timeout_s, timeline_interval_s=opts.timeline_interval_s,
                        api_key=opts.api_key, extra_body=dict(opts.extra_body), progress=opts.progress,
                        tokenizer=tokenizer)


def _phase_table(result_reqs, plan: arr.ArrivalPlan, timeline: dict) -> list[dict[str, Any]] | None:
    if plan.trace is None:
        return None
    rows = []
    bounds = plan.trace.boundaries
    tps = timeline.get("output_tokens_per_s", [])
    stps = timeline.get("server_tokens_per_s")
    t = np.asarray(timeline.get("t", []), dtype=float)
    for i, ph in enumerate(plan.trace.phases):
        rs = [r for r in result_reqs if r.phase == i]
        ok = [r for r in rs if r.success]
        sel = (t >= bounds[i]) & (t < bounds[i + 1])

        def mean(xs):
            xs = [x for x in xs if x is not None]
            return float(np.mean(xs)) * 1e3 if xs else None

        def p99(xs):
            xs = [x for x in xs if x is not None]
            return float(np.percentile(xs, 99)) * 1e3 if xs else None
        row = {"phase": i, "kind": ph.kind, "start_s": bounds[i], "duration_s": ph.duration_s, "rate": ph.rate,
               "burstiness": ph.burstiness, "num_requests": len(rs), "completed": len(ok),
               "mean_ttft_ms": mean([r.ttft_s for r in ok]), "p99_ttft_ms": p99([r.ttft_s for r in ok]),
               "mean_tpot_ms": mean([r.tpot_s for r in ok]), "mean_e2el_ms": mean([r.e2e_s for r in ok]),
               "p99_e2el_ms": p99([r.e2e_s for r in ok]),
               "output_tokens_per_s": float(np.mean(np.asarray(tps)[sel])) if sel.any() and len(tps) else None}
        if stps is not None and sel.any():
            v = [x for x, s in zip(stps, sel) if s and x is not None]
            row["server_tokens_per_s"] = float(np.mean(v)) if v else None
        g = timeline.get("gamma_mean")
        if g is not None and sel.any():
            v = [x for x, s in zip(g, sel) if s and x is not None]
            row["gamma_mean"] = float(np.mean(v)) if v else None
        rows.append(row)
    return rows


def run_prepared(opts: BenchOptions, prep: Prepared, base_url: str, *, title: str = "Serving benchmark",
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = client_config(opts, base_url, prep.tokenizer)
    out = asyncio.run(run_load(cfg, prep.requests, prep.plan, num_warmups=opts.num_warmups,
                               closed_loop=opts.closed_loop, duration_s=opts.duration_s,
                               max_requests=opts.num_prompts))
    return assemble(opts, prep, out, base_url, title=title, extra=extra)


def assemble(opts: BenchOptions, prep: Prepared, out, base_url: str, *, title: str = "Serving benchmark",
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    m = compute_metrics(out.results, out.duration_s, percentiles=opts.metric_percentiles, slo=opts.goodput or None)
    bounds = prep.plan.trace.boundaries if prep.plan.trace is not None else None
    timeline = build_timeline(out.results, out.samples, out.duration_s, opts.timeline_interval_s or 1.0, bounds)
    errors: dict[str, int] = {}
    for r in out.results:
        if r.error:
            key = r.error[:120]
            errors[key] = errors.get(key, 0) + 1
    result: dict[str, Any] = {
        "schema": SCHEMA, "title": title, "date": dt.datetime.now().isoformat(timespec="seconds"),
        "base_url": base_url, "model": opts.model, "endpoint_type": opts.endpoint_type,
        **(extra or {}),
        **m,
        "errors": errors,
        "dataset": prep.dataset, "arrivals": prep.plan.info,
        "server": {"spec_decode": spec_summary(out.samples[0] if out.samples else None,
                                               out.samples[-1] if out.samples else None),
                   "load": load_summary(out.samples),
                   "num_scrapes": len(out.samples), "scrape_errors": out.scrape_errors},
        "timeline": timeline,
        "per_phase": _phase_table(out.results, prep.plan, timeline),
        "warmup": {"num_warmups": opts.num_warmups, "errors": out.warmup_errors},
        "config": opts.public(), "machine": machine_info(),
        "requests": [r.to_dict(opts.save_detailed) for r in out.results],
    }
    return result
