"""Outputs: the result JSON, a markdown table on stdout, PNG plots (matplotlib, Agg backend)."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from nightjar.bench.metrics import METRICS, _pct_key

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                            "torch": version("torch"), "nightjar": version("nightjar"), "aiohttp": version("aiohttp")}
    try:
        info["git_rev"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except Exception:
        info["git_rev"] = None
    try:
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf -> None (inf request rates become the string "inf"), numpy -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj == math.inf else None
    return obj


def write_json(obj: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(obj), indent=2) + "\n")
    return p


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def markdown_summary(result: dict[str, Any], percentile_metrics=METRICS, percentiles=(50, 99)) -> str:
    m = result
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Rejected (429)", m["rejected_429"]), ("Benchmark duration (s)", m["duration_s"]),
            ("Total input tokens", m["total_input_tokens"]), ("Total output tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]),
            ("Total token throughput (tok/s)", m["total_token_throughput"])]
    if m.get("request_goodput") is not None:
        slo = ", ".join(f"{k}≤{v:g} ms" for k, v in m["goodput_slo_ms"].items())
        rows.append((f"Request goodput (req/s) [{slo}]", m["request_goodput"]))
    spec = result.get("server", {}).get("spec_decode") or {}
    if spec.get("acceptance_rate") is not None:
        rows += [("Draft acceptance rate", spec["acceptance_rate"]),
                 ("Mean acceptance length", spec["mean_acceptance_length"])]
    if spec.get("mean_gamma") is not None:
        rows.append(("Mean γ (server)", spec["mean_gamma"]))
    lines = [f"## {result.get('title', 'Serving benchmark')}", "", "| metric | value |", "|---|---:|"]
    lines += [f"| {k} | {_fmt(v, 4 if isinstance(v, float) and abs(v) < 10 else 2)} |" for k, v in rows]
    ps = sorted(set([99.0] + [float(p) for p in percentiles]) - {50.0})        # P50 is the median column
    head = "| latency (ms) | mean | median | " + " | ".join(f"P{p:g}" for p in ps) + " |"
    lines += ["", head, "|---" * (3 + len(ps)) + "|"]
    for name in percentile_metrics:
        vals = [m.get(f"mean_{name}_ms"), m.get(f"median_{name}_ms")] + [m.get(f"{_pct_key(p)}_{name}_ms") for p in ps]
        lines.append(f"| {_NAMES[name]} | " + " | ".join(_fmt(v) for v in vals) + " |")
    return "\n".join(lines)


def _cdf(ax, xs, label):
    a = np.sort(np.asarray([x for x in xs if x is not None], dtype=float))
    if len(a):
        ax.step(a, np.arange(1, len(a) + 1) / len(a), where="post", label=f"{label} (n={len(a)})")


def plot_result(result: dict[str, Any], path: str | Path) -> Path:
    """One PNG: throughput, batch/queue, γ and acceptance, KV free blocks, draft residency, latency CDFs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.get("timeline") or {}
    t = np.asarray(tl.get("t", []), dtype=float)
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), constrained_layout=True)
    (a_tp, a_b), (a_g, a_kv), (a_d, a_cdf) = axes
    fig.suptitle(result.get("title", "Serving benchmark"), fontsize=11)

    def series(key):
        v = tl.get(key)
        return None if v is None else np.asarray([np.nan if x is None else x for x in v], dtype=float)

    def shade(ax):
        bounds = (result.get("arrivals", {}).get("trace") or {}).get("phases")
        if not bounds:
            return
        start = 0.0
        for i, ph in enumerate(bounds):
            if i % 2:
                ax.axvspan(start, start + ph["duration_s"], color="0.92", zorder=0)
            start += ph["duration_s"]

    for ax, keys, ylabel in [
        (a_tp, [("output_tokens_per_s", "client output tok/s"), ("server_tokens_per_s", "server generated tok/s")],
         "tokens/s"),
        (a_b, [("running", "running"), ("waiting", "waiting"), ("arrivals_per_s", "arrivals/s")], "requests"),
        (a_g, [("gamma_mean", "mean γ"), ("acceptance_rate", "acceptance rate")], "γ / rate"),
        (a_kv, [("kv_blocks_free", "free KV blocks"), ("kv_blocks_total", "total KV blocks")], "blocks"),
        (a_d, [("draft_resident", "draft resident")], "0/1"),
    ]:
        shade(ax)
        for key, label in keys:
            y = series(key)
            if y is not None and len(t) == len(y):
                ax.plot(t, y, label=label, drawstyle="steps-post")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(ylabel)
        if len(t):
            ax.set_xlim(0, float(t[-1]) + float(tl.get("interval_s", 1.0)))
        if ax is a_d:
            ax.set_ylim(-0.1, 1.1)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.grid(alpha=0.3)
    reqs = [r for r in result.get("requests", []) if r.get("success")]
    _cdf(a_cdf, [r["ttft_ms"] for r in reqs], "TTFT")
    _cdf(a_cdf, [r["e2e_ms"] for r in reqs], "E2E")
    _cdf(a_cdf, [r["tpot_ms"] for r in reqs], "TPOT")
    a_cdf.set_xscale("log")
    a_cdf.set_xlabel("latency (ms, log)")
    a_cdf.set_ylabel("CDF")
    a_cdf.grid(alpha=0.3, which="both")
    if a_cdf.get_legend_handles_labels()[0]:
        a_cdf.legend(fontsize=8, loc="lower right")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p


def plot_compare(summary: dict[str, Any], path: str | Path) -> Path:
    """Bars: median over repetitions (whiskers: min-max) of output throughput, mean TTFT, mean E2E per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = list(summary["policies"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for ax, (key, label) in zip(axes, [("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT (ms)"),
                                       ("mean_e2e_ms", "mean E2E (ms)")]):
        med, lo, hi = [], [], []
        for p in pols:
            vals = [r[key] for r in summary["policies"][p]["runs"] if r.get(key) is not None]
            m = float(np.median(vals)) if vals else np.nan
            med.append(m)
            lo.append(m - min(vals) if vals else 0)
            hi.append(max(vals) - m if vals else 0)
        ax.bar(range(len(pols)), med, yerr=[lo, hi], capsize=4, color="tab:blue", alpha=0.8)
        ax.set_xticks(range(len(pols)), pols, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p


def command_line(argv: list[str] | None) -> str:
    import shlex
    return shlex.join(["nightjar", "bench"] + list(argv if argv is not None else sys.argv[1:]))
