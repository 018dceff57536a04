"""``nightjar trace summary FILE [--phases N] [--png OUT.png] [--by-gamma] [--by-batch] [--min-steps K]``: what
happened, phase by phase.

Time is split into N equal windows (default 10). Per window: arrivals, output tokens/s, decode steps,
mean batch size, γ distribution, acceptance rate (accepted / drafted), draft offloads/reloads, KV pool
size and the lowest free-block count. ``--png`` draws batch size, γ, free KV blocks and draft residency
against time (matplotlib, Agg). ``--by-gamma`` adds what each γ's decode-only steps cost (``gamma_rows``),
``--by-batch`` the same per token at each batch size (``batch_rows``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field

from nightjar.actors.planner import follows_on
from nightjar.argtypes import positive
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftOffloaded,
    DraftReloaded,
    DraftResidency,
    PoolResized,
    StepScheduled,
    StepTimed,
    SubmitRequest,
    TokensCommitted,
)
from nightjar.kernel.trace import TraceError, TraceReader


@dataclass
class Timeline:
    """Per-event series pulled from a trace (times in seconds from the first envelope)."""
    t0: float = 0.0
    t_end: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    tokens: list[tuple[float, int]] = field(default_factory=list)            # (t, tokens committed)
    steps: list[tuple[float, StepTimed]] = field(default_factory=list)
    free: list[tuple[float, int, int]] = field(default_factory=list)         # (t, num_free, num_total)
    resident: list[tuple[float, bool, str]] = field(default_factory=list)
    offloads: list[float] = field(default_factory=list)
    reloads: list[float] = field(default_factory=list)
    resizes: list[tuple[float, int]] = field(default_factory=list)           # (t, num_total)
    scheduled: dict[int, float] = field(default_factory=dict)                 # step → t of its StepScheduled
    rows: dict[int, tuple[frozenset, tuple[int, ...]]] = field(default_factory=dict)   # step → (decode rows, all)


def load_timeline(path: str, **reader_kw) -> Timeline:
    tl, first = Timeline(), None
    for env in TraceReader(path, **reader_kw):
        if first is None:
            first = env.t
        t, m = env.t - first, env.msg
        tl.t_end = t
        match m:
            case SubmitRequest():
                tl.arrivals.append(t)
            case TokensCommitted():
                tl.tokens.append((t, sum(m.counts)))
            case StepScheduled():
                tl.scheduled[m.step] = t
                tl.rows[m.step] = (frozenset(m.req_ids[:m.num_decode]), m.req_ids)
            case StepTimed():
                tl.steps.append((t, m))
            case BlocksReserved():
                tl.free.append((t, m.num_free, m.num_total))
            case DraftResidency():
                tl.resident.append((t, m.resident, m.state))
            case DraftOffloaded():
                tl.offloads.append(t)
            case DraftReloaded():
                tl.reloads.append(t)
            case PoolResized():
                tl.resizes.append((t, m.num_total))
    return tl


def _in(t: float, lo: float, hi: float, last: bool) -> bool:
    return lo <= t < hi or (last and t == hi)


def phase_rows(tl: Timeline, num_phases: int = 10) -> list[dict]:
    """One dict per equal time window."""
    span = max(tl.t_end, 1e-9)
    rows = []
    for i in range(num_phases):
        lo, hi, last = span * i / num_phases, span * (i + 1) / num_phases, i == num_phases - 1
        steps = [s for t, s in tl.steps if _in(t, lo, hi, last)]
        dec = [s for s in steps if s.batch_size > 0]
        drafted = sum(sum(s.drafted_per_pos) if s.drafted_per_pos else s.num_drafts * s.gamma for s in dec)
        accepted = sum(sum(s.accepted_per_pos) for s in dec)
        free = [(f, n) for t, f, n in tl.free if _in(t, lo, hi, last)]
        rows.append({
            "t0": lo, "t1": hi, "requests": sum(1 for t in tl.arrivals if _in(t, lo, hi, last)),
            "tok_s": sum(n for t, n in tl.tokens if _in(t, lo, hi, last)) / (hi - lo),
            "steps": len(dec), "mean_batch": sum(s.batch_size for s in dec) / len(dec) if dec else 0.0,
            "gamma": dict(sorted(Counter(s.gamma for s in dec).items())),
            "accept": accepted / drafted if drafted else None,
            "offloads": sum(1 for t in tl.offloads if _in(t, lo, hi, last)),
            "reloads": sum(1 for t in tl.reloads if _in(t, lo, hi, last)),
            "pool": free[-1][1] if free else None, "min_free": min(f for f, _ in free) if free else None,
        })
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'phase':>5} {'t0-t1 (s)':>15} {'reqs':>5} {'tok/s':>9} {'steps':>6} {'mean B':>7} "
            f"{'accept':>7} {'off/re':>6} {'pool':>6} {'minfree':>7}  γ distribution")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows):
        acc = "-" if r["accept"] is None else f"{r['accept']:.2f}"
        gam = " ".join(f"{g}:{n}" for g, n in r["gamma"].items()) or "-"
        lines.append(f"{i:>5} {r['t0']:7.2f}-{r['t1']:<7.2f} {r['requests']:>5} {r['tok_s']:>9.1f} {r['steps']:>6} "
                     f"{r['mean_batch']:>7.2f} {acc:>7} {r['offloads']:>2}/{r['reloads']:<3} "
                     f"{'-' if r['pool'] is None else r['pool']:>6} "
                     f"{'-' if r['min_free'] is None else r['min_free']:>7}  {gam}")
    return "\n".join(lines)


def _period(tl: Timeline, s: StepTimed) -> float | None:
    """The step's wall-clock period less its catch-up, when the next step follows on from it (the planner's rule,
    ``actors.planner.follows_on``: a row goes on and no idle gap), else None."""
    if s.step not in tl.scheduled or s.step + 1 not in tl.scheduled or s.step not in tl.rows:
        return None
    took = tl.scheduled[s.step + 1] - tl.scheduled[s.step] - s.catchup_time_s
    return took if follows_on(tl.rows[s.step][0], tl.rows[s.step + 1][1], took, s.step_time_s) else None


def gamma_rows(tl: Timeline) -> list[dict]:
    """Per γ, over decode steps without prefill tokens: steps, tokens a step, mean step and draft-pass ms and,
    over those the next step follows on from (``_period``), the wall-clock period per token (catch-up taken out,
    as the planner learns it) and the median period outside the step (bus, hand-offs, bookkeeping)."""
    by: dict[int, list[StepTimed]] = {}
    for _, s in tl.steps:
        if s.batch_size > 0 and s.num_prefill_tokens == 0:
            by.setdefault(s.gamma, []).append(s)
    rows = []
    for g, ss in sorted(by.items()):
        tok = sum(s.tokens_emitted for s in ss)
        per = [(p, s) for s in ss if (p := _period(tl, s)) is not None]
        ptok = sum(s.tokens_emitted for _, s in per)
        rows.append({"gamma": g, "steps": len(ss), "tok_step": tok / len(ss),
                     "step_ms": 1e3 * sum(s.step_time_s for s in ss) / len(ss),
                     "draft_ms": 1e3 * sum(s.draft_time_s for s in ss) / len(ss),
                     "period_ms_tok": 1e3 * sum(p for p, _ in per) / ptok if ptok else None,
                     "outside_ms": 1e3 * statistics.median(p - s.step_time_s for p, s in per) if per else None})
    return rows


def batch_rows(tl: Timeline, min_steps: int = 1) -> list[dict]:
    """Per (batch size, γ), over decode steps without prefill tokens that the next step follows on from
    (``_period``): steps, tokens a row and the wall-clock period per token (catch-up taken out), so that γs are
    compared at the same batch size; pairs with fewer than ``min_steps`` such steps are left out."""
    by: dict[tuple[int, int], list[tuple[float, StepTimed]]] = {}
    for _, s in tl.steps:
        if s.batch_size > 0 and s.num_prefill_tokens == 0 and (p := _period(tl, s)) is not None:
            by.setdefault((s.batch_size, s.gamma), []).append((p, s))
    rows = []
    for (b, g), per in sorted(by.items()):
        if len(per) < min_steps:
            continue
        tok = sum(s.tokens_emitted for _, s in per)
        rows.append({"batch": b, "gamma": g, "steps": len(per), "tok_row": tok / (b * len(per)),
                     "period_ms_tok": 1e3 * sum(p for p, _ in per) / tok if tok else None})
    return rows


def format_batch_table(rows: list[dict]) -> str:
    head = f"{'B':>4} {'γ':>3} {'steps':>6} {'tok/row':>8} {'period ms/tok':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        per = "-" if r["period_ms_tok"] is None else f"{r['period_ms_tok']:.3f}"
        lines.append(f"{r['batch']:>4} {r['gamma']:>3} {r['steps']:>6} {r['tok_row']:>8.2f} {per:>13}")
    return "\n".join(lines)


def format_gamma_table(rows: list[dict]) -> str:
    head = (f"{'γ':>3} {'steps':>6} {'tok/step':>8} {'step ms':>8} {'draft ms':>8} {'period ms/tok':>13} "
            f"{'outside ms':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        per = "-" if r["period_ms_tok"] is None else f"{r['period_ms_tok']:.2f}"
        out = "-" if r["outside_ms"] is None else f"{r['outside_ms']:.3f}"
        lines.append(f"{r['gamma']:>3} {r['steps']:>6} {r['tok_step']:>8.2f} {r['step_ms']:>8.2f} "
                     f"{r['draft_ms']:>8.2f} {per:>13} {out:>10}")
    return "\n".join(lines)


def plot_timeline(tl: Timeline, out: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    dec = [(t, s) for t, s in tl.steps if s.batch_size > 0]
    ax[0].plot([t for t, _ in dec], [s.batch_size for _, s in dec], lw=0.8)
    ax[0].set_ylabel("batch size")
    ax[1].step([t for t, _ in dec], [s.gamma for _, s in dec], where="post", lw=0.8)
    ax[1].set_ylabel("γ")
    ax[2].plot([t for t, _, _ in tl.free], [f for _, f, _ in tl.free], lw=0.8, label="free")
    ax[2].plot([t for t, _, _ in tl.free], [n for _, _, n in tl.free], lw=0.8, ls="--", label="pool")
    ax[2].set_ylabel("KV blocks")
    ax[2].legend(loc="upper right", fontsize=8)
    pts = tl.resident + [(tl.t_end, tl.resident[-1][1], "")] if tl.resident else []
    ax[3].step([t for t, _, _ in pts], [int(r) for _, r, _ in pts], where="post")
    ax[3].set_ylabel("draft resident")
    ax[3].set_yticks([0, 1])
    ax[3].set_xlabel("time (s)")
    for t in tl.offloads:
        ax[3].axvline(t, color="r", lw=0.5)
    for t in tl.reloads:
        ax[3].axvline(t, color="g", lw=0.5)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def cmd_summary(a: argparse.Namespace) -> int:
    try:
        tl = load_timeline(a.file, allow_schema_drift=a.allow_schema_drift, allow_truncated=a.allow_truncated)
    except (TraceError, OSError) as e:
        print(f"nightjar trace: {e}", file=sys.stderr)
        return 2
    rows = phase_rows(tl, a.phases)
    total = sum(n for _, n in tl.tokens)
    print(f"{a.file}: {len(tl.arrivals)} requests, {total} tokens in {tl.t_end:.2f} s "
          f"({total / max(tl.t_end, 1e-9):.1f} tok/s), {len(tl.offloads)} offloads, {len(tl.reloads)} reloads")
    print(format_table(rows))
    if a.by_gamma:
        print("\nby γ, decode steps without prefill (period: from the step's StepScheduled to the next one's, "
              "when that one follows on: a row goes on, no idle gap)")
        print(format_gamma_table(gamma_rows(tl)))
    if a.by_batch:
        print(f"\nby batch size and γ, decode steps without prefill that the next one follows on from "
              f"(pairs with at least {a.min_steps} steps)")
        print(format_batch_table(batch_rows(tl, a.min_steps)))
    if a.png:
        plot_timeline(tl, a.png, a.file)
        print(f"wrote {a.png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar trace", description="inspect a recorded trace")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", help="per-phase table (and a PNG timeline)")
    s.add_argument("file")
    s.add_argument("--phases", type=positive(int), default=10, help="number of equal time windows")
    s.add_argument("--png", default=None, help="write a timeline plot here")
    s.add_argument("--by-gamma", action="store_true", help="also what each γ's decode steps cost")
    s.add_argument("--by-batch", action="store_true", help="also what each γ costs a token at each batch size")
    s.add_argument("--min-steps", type=positive(int), default=10, help="--by-batch: leave out pairs with fewer steps")
    s.add_argument("--allow-schema-drift", action="store_true")
    s.add_argument("--allow-truncated", action="store_true")
    s.set_defaults(func=cmd_summary)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
