"""``nightjar bench compare``: several policies on the SAME requests and arrival times, each on a fresh server,
in an interleaved order over repetitions, with paired ratios to ``off`` and to the best fixed γ."""
from __future__ import annotations

import contextlib
import datetime as dt
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nightjar.bench.report import machine_info, plot_result, write_json
from nightjar.bench.runner import BenchOptions, Prepared, prepare, run_prepared

SCHEMA = "nightjar.bench.compare/1"
# summary key -> (key in a run result, higher is better)
KEYS = {"output_throughput": ("output_throughput", True), "total_token_throughput": ("total_token_throughput", True),
        "request_throughput": ("request_throughput", True), "mean_ttft_ms": ("mean_ttft_ms", False),
        "p99_ttft_ms": ("p99_ttft_ms", False), "mean_tpot_ms": ("mean_tpot_ms", False),
        "mean_e2e_ms": ("mean_e2el_ms", False), "p99_e2e_ms": ("p99_e2el_ms", False),
        "request_goodput": ("request_goodput", True)}
RATIO_KEYS = ("output_throughput", "mean_ttft_ms", "mean_e2e_ms")


def parse_policies(text: str) -> list[str]:
    pols = [p.strip() for p in text.split(",") if p.strip()]
    if not pols:
        raise ValueError("--policies needs at least one policy, e.g. off,fixed:2,nightjar")
    if len(set(pols)) != len(pols):
        raise ValueError(f"--policies lists a policy twice: {text}")
    for p in pols:
        split_variant(p)
    return pols


def split_variant(entry: str) -> tuple[str, str]:
    """``POLICY@SERVER ARGS`` -> (policy, extra server args): one comparison entry may run with its own
    server flags, e.g. ``nightjar@--quantization int4`` beside plain ``nightjar``."""
    policy, _, extra = entry.partition("@")
    if not policy.strip():
        raise ValueError(f"--policies entry {entry!r} names no policy")
    return policy.strip(), extra.strip()


def rotation(policies: list[str], rep: int) -> list[str]:
    """rep 0: A B C; rep 1: C A B; rep 2: B C A; ... (each policy takes every position once per len(policies))."""
    k = rep % len(policies)
    return policies[len(policies) - k:] + policies[:len(policies) - k]


def _run_summary(res: dict[str, Any]) -> dict[str, Any]:
    s = {k: res.get(src) for k, (src, _) in KEYS.items()}
    spec = (res.get("server") or {}).get("spec_decode") or {}
    load = (res.get("server") or {}).get("load") or {}
    s.update(completed=res.get("completed"), failed=res.get("failed"), duration_s=res.get("duration_s"),
             acceptance_rate=spec.get("acceptance_rate"), mean_gamma=spec.get("mean_gamma"),
             max_running=load.get("max_running"), max_kv_blocks_total=load.get("max_kv_blocks_total"))
    return s


def _spread(xs: list[float]) -> dict[str, float | None]:
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}


def _paired(runs: dict[str, list[dict]], p: str, ref: str, key: str) -> dict[str, float | None]:
    a = {r["rep"]: r.get(key) for r in runs[p] if "error" not in r}
    b = {r["rep"]: r.get(key) for r in runs[ref] if "error" not in r}
    return _spread([a[k] / b[k] for k in a if k in b and a[k] is not None and b[k]])


def ratios(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per repetition ``value(policy) / value(reference)``, then median and min-max over repetitions.
    ``vs_best_fixed``: the reference is chosen per metric among ``fixed:K`` policies by median (highest
    throughput, lowest latency)."""
    runs = {p: d["runs"] for p, d in policies.items()}
    out: dict[str, Any] = {}
    if "off" in policies:
        out["vs_off"] = {p: {k: _paired(runs, p, "off", k) for k in RATIO_KEYS} for p in policies if p != "off"}
    fixed = [p for p in policies if p.startswith("fixed")]
    if fixed:
        best = {}
        for k in RATIO_KEYS:
            cand = [(policies[p].get(k), p) for p in fixed if policies[p].get(k) is not None]
            if cand:
                best[k] = (max if KEYS[k][1] else min)(cand)[1]
        out["vs_best_fixed"] = {"reference": best,
                                **{p: {k: _paired(runs, p, best[k], k) for k in best} for p in policies}}
    return out


Launcher = Callable[[str], contextlib.AbstractContextManager]


def run_compare(opts: BenchOptions, policies: list[str], launcher: Launcher, *, repeats: int = 3,
                prep: Prepared | None = None, runs_dir: str | Path | None = None, command: str = "",
                mode: str = "subprocess", server_args: str = "", log=print) -> dict[str, Any]:
    """``launcher(policy)`` is a context manager yielding an object with ``base_url`` (a fresh server)."""
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    prep = prep or prepare(opts)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    orders = [rotation(policies, r) for r in range(repeats)]
    for rep, order in enumerate(orders):
        for pos, pol in enumerate(order):
            log(f"[compare] rep {rep + 1}/{repeats} · {pos + 1}/{len(order)} · policy {pol}")
            entry: dict[str, Any] = {"rep": rep, "position": pos}
            try:
                with launcher(pol) as srv:
                    res = run_prepared(opts, prep, srv.base_url, title=f"{pol} (rep {rep + 1})",
                                       extra={"policy": pol, "rep": rep})
            except Exception as e:  # a server that fails to start: record it, go on with the others
                entry["error"] = f"{type(e).__name__}: {e}"
                log(f"[compare]   failed: {entry['error'][:500]}")
                runs[pol].append(entry)
                continue
            entry.update(_run_summary(res))
            if runs_dir is not None:
                d = Path(runs_dir)
                stem = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', pol)}_rep{rep + 1}"
                entry["result_file"] = str(write_json(res, d / f"{stem}.json"))
                try:
                    entry["plot_file"] = str(plot_result(res, d / f"{stem}.png"))
                except Exception as e:  # plotting is optional
                    log(f"[compare]   plot failed: {e}")
            log(f"[compare]   {entry['output_throughput'] or 0:.1f} out tok/s, mean TTFT "
                f"{entry['mean_ttft_ms'] or 0:.0f} ms, mean E2E {entry['mean_e2e_ms'] or 0:.0f} ms, "
                f"{entry['failed']} failed")
            runs[pol].append(entry)
    summary: dict[str, dict[str, Any]] = {}
    for p in policies:
        ok = [r for r in runs[p] if "error" not in r]
        s = {k: _spread([r.get(k) for r in ok])["median"] for k in KEYS}
        s.update(acceptance_rate=_spread([r.get("acceptance_rate") for r in ok])["median"],
                 mean_gamma=_spread([r.get("mean_gamma") for r in ok])["median"],
                 max_running=_spread([r.get("max_running") for r in ok])["median"],
                 max_kv_blocks_total=_spread([r.get("max_kv_blocks_total") for r in ok])["median"],
                 spread={k: _spread([r.get(k) for r in ok]) for k in RATIO_KEYS},
                 num_ok=len(ok), runs=runs[p])
        summary[p] = s
    return {"schema": SCHEMA, "date": dt.datetime.now().isoformat(timespec="seconds"), "command": command,
            "mode": mode, "server_args": server_args, "repeats": repeats, "orders": orders,
            "policies": summary, "ratios": ratios(summary), "arrivals": prep.plan.info, "dataset": prep.dataset,
            "config": opts.public(), "machine": machine_info()}


def _r(v: dict | None) -> str:
    if not v or v.get("median") is None:
        return "-"
    if v["n"] > 1:
        return f"{v['median']:.3f} ({v['min']:.3f}–{v['max']:.3f})"
    return f"{v['median']:.3f}"


def markdown_compare(summary: dict[str, Any]) -> str:
    pols = summary["policies"]
    lines = [f"## Policy comparison ({summary['repeats']} repetition(s), medians; spread min–max)", "",
             "| policy | ok runs | output tok/s | mean TTFT (ms) | mean E2E (ms) | mean TPOT (ms) | acceptance "
             "| mean γ "
             "| max batch | max KV blocks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(p, k, nd):
        sp = pols[p]["spread"].get(k) if k in pols[p]["spread"] else None
        v = pols[p].get(k)
        if v is None:
            return "-"
        if sp and sp["n"] > 1:
            return f"{v:,.{nd}f} ({sp['min']:,.{nd}f}–{sp['max']:,.{nd}f})"
        return f"{v:,.{nd}f}"
    for p, s in pols.items():
        acc = "-" if s.get("acceptance_rate") is None else f"{s['acceptance_rate']:.3f}"
        g = "-" if s.get("mean_gamma") is None else f"{s['mean_gamma']:.2f}"
        tpot = "-" if s.get("mean_tpot_ms") is None else f"{s['mean_tpot_ms']:.1f}"
        peak = "-" if s.get("max_running") is None else f"{s['max_running']:.0f}"
        blocks = "-" if s.get("max_kv_blocks_total") is None else f"{s['max_kv_blocks_total']:.0f}"
        lines.append(f"| {p} | {s['num_ok']}/{len(s['runs'])} | {cell(p, 'output_throughput', 1)} | "
                     f"{cell(p, 'mean_ttft_ms', 0)} | {cell(p, 'mean_e2e_ms', 0)} | {tpot} | {acc} | {g} "
                     f"| {peak} | {blocks} |")
    rat = summary["ratios"]
    for name, title in (("vs_off", "Ratio to off"), ("vs_best_fixed", "Ratio to the best fixed γ")):
        if name not in rat:
            continue
        ref = rat[name].get("reference")
        extra = f" (reference per metric: {', '.join(f'{k}={v}' for k, v in ref.items())})" if ref else ""
        lines += ["", f"### {title}{extra}: paired per repetition, median (min–max)", "",
                  "| policy | output tok/s | mean TTFT | mean E2E |", "|---|---:|---:|---:|"]
        for p, v in rat[name].items():
            if p == "reference":
                continue
            lines.append(f"| {p} | {_r(v.get('output_throughput'))} | {_r(v.get('mean_ttft_ms'))} | "
                         f"{_r(v.get('mean_e2e_ms'))} |")
    return "\n".join(lines)
