"""Speculation policies: pick the draft length γ for each decode step (stdlib only).

Every policy answers ``decide(B, state) -> γ`` before a decode step and learns
from ``observe(StepTimed)`` after it.  All randomness comes from a private
``random.Random(seed)``, so a policy fed the same results makes the same choices.

Policies (``make_policy(spec)``; see ``shared/reference/algorithm.md`` §2, §5):

* ``off``, ``fixed:K`` -- constant γ.
* ``table:<ranges>`` / ``table:mlc`` / ``table:trtllm`` -- batch-size table.
* ``dsd`` (aliases ``goodput``, ``smartspec``) -- DSD/SmartSpec goodput argmax.
* ``banditspec`` (alias ``ucb``) -- UCBSpec, no context.
* ``nightjar`` / ``nightjar-nooffload`` -- the model-based planner (``actors/policy_model.py``).
* ``nightjar-paper`` -- the paper's contextual bin-greedy bandit (§2), bug-fixed: the bin counter b
  runs on across blocks (exploration probability 1/b follows elapsed time, as in ADA-BINGREEDY).

``nightjar-paper`` design choices (recorded here and in ``snapshot()``):

* **Loss** of arm (c, γ) is seconds per emitted token *per request*, estimated as
  a ratio of (discounted) sums: ``Σ step_time_s / Σ (tokens_emitted / B)``,
  i.e. ``1 / ĝ`` with ĝ the pooled per-request goodput (the authors' reward).
  We deliberately do *not* average per-step ``T·B/tokens``: by Jensen that
  mean over-penalises high-variance (long γ) arms, e.g. at B=1, α=0.8 it ranks
  γ=2 above γ=4 although γ=4 has the higher goodput.
* **Discount** (``discount=0.99``): every update of (c, γ) multiplies that arm's
  sums by the factor first, so the estimate tracks roughly the last
  ``1/(1-discount)`` samples of that arm (arms not played keep their values).
  0.98 was too noisy at B=1 (γ=2 vs γ=4 are 7% apart); 0.995 tracked too slowly.
* **Change detection** (``detector="ph"``, ``None`` disables): a two-sided
  Page-Hinkley/CUSUM test on the per-step loss ``T·B/tokens`` of the arm just
  played, standardised by that arm's running mean/sd since the last reset
  (sd floored at ``ph_floor``·mean, z clipped to ±``ph_clip``; ``ph_warmup``
  samples before testing; drift ``ph_delta``=1.0, threshold ``ph_lambda``=12).
  An alarm restarts that context's schedule at block 1 (so it re-explores) and
  caps every arm's effective count at ``ph_keep`` (default 0: the context's
  arms are forgotten and each is re-tried once before the argmin is trusted).
* **Switching cost**: ``C_switch(L_max, B)`` is a least-squares line
  ``c0 + c1·x`` fitted online to observed catch-ups, ``x = catchup_tokens``
  (``lag="sum"``, predicted with ``x = B·L_max``) or ``x = max_draft_lag``
  (``lag="max"``, predicted with ``x = L_max``).  Before any catch-up it uses
  ``c_switch_seed`` or 0.  Charged as ``C_switch / γ`` when ``prev_gamma == 0``.
* **Untried arms**: an exploit bin that finds arms never played in its context
  plays one of them (chosen by the rng) before trusting the argmin.
* **Draft not resident**: ``decide`` returns 0 and leaves the schedule untouched
  (no bin step is consumed, no rng draw), so the bin lock resumes where it was
  once the draft is back.  ``observe`` still records those γ=0 steps as γ=0
  samples (they are genuine) and any catch-up they report.
"""
from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from nightjar.kernel.messages import StepTimed

__all__ = [
    "PlannerState", "Policy",
    "bucket", "bucket_label", "expected_tokens", "SwitchCostModel",
    "OffPolicy", "FixedPolicy", "TablePolicy", "DSDPolicy", "BanditSpecPolicy",
    "NightjarPaperPolicy",
]


# ---------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True)
class PlannerState:
    """Engine state the planner may condition on (fields after ``prev_gamma``: -1/0 = unknown)."""

    draft_resident: bool = True
    max_draft_lag: int = 0
    prev_gamma: int = 0
    lag_tokens: int = -1          # Σ generated-token draft lag over catching-up rows (prompt excluded)
    prompt_lag_tokens: int = 0    # Σ prompt tokens the draft has not prefilled yet
    new_prompt_tokens: int = 0    # prompt tokens of requests whose prefill finished this step
    new_prompts: int = 0
    num_waiting: int = 0
    free_blocks: int = -1         # KV pool after the previous step's reservation
    total_blocks: int = 0
    draft_blocks: int = 0         # KV blocks the pool gains when the draft is offloaded
    max_batch: int = 1 << 30
    req_ids: tuple[int, ...] = ()      # decode rows (only for a policy that ``observes_rows``)
    speculate: tuple[bool, ...] = ()   # per decode row: may it draft
    context_tokens: int = -1           # Σ context (tokens in the KV) over the decode rows; -1: unknown
    prefill_tokens: int = 0            # prompt tokens the step's prefill rows feed beside the decode rows


# ---------------------------------------------------------------- helpers
def bucket(batch_size: int) -> int:
    """log2 context bucket: 1→0, 2→1, 3–4→2, 5–8→3, ... (B ≤ 0 → 0)."""
    return (batch_size - 1).bit_length() if batch_size > 1 else 0


def bucket_label(c: int) -> str:
    """Human-readable range of bucket ``c`` ("1", "2", "3-4", "5-8", ...)."""
    if c <= 1:
        return str(c + 1)
    return f"{(1 << (c - 1)) + 1}-{1 << c}"


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ) = (1 − α^(γ+1)) / (1 − α): expected tokens per request per step."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def check_opts(name: str, opts: dict, allowed: Sequence[str]) -> None:
    """Raise ValueError naming any option the policy does not understand."""
    bad = sorted(set(opts) - set(allowed))
    if bad:
        raise ValueError(f"policy {name!r}: unknown option(s) {bad}; accepted: {sorted(allowed)}")


class _LinFit:
    """Discounted least-squares line y ≈ a + b·x (O(1) update and predict)."""

    __slots__ = ("discount", "w", "sx", "sy", "sxx", "sxy")

    def __init__(self, discount: float = 1.0) -> None:
        self.discount = discount
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        """Add one observation (older ones are multiplied by ``discount``)."""
        d = self.discount
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    def coef(self, through_origin: bool = False) -> tuple[float, float] | None:
        """(a, b), or None without data; degenerate x → constant or proportional."""
        if self.w <= 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 1e-9 * max(1.0, mx * mx):
            b = (self.sxy / self.w - mx * my) / var
            return my - b * mx, b
        if through_origin and mx > 0.0:
            return 0.0, my / mx
        return my, 0.0


class SwitchCostModel:
    """Online ``C_switch(L_max, B)``: time for the draft to catch up its lag.

    ``robust`` (the model-based planner's): a catch-up that paid a one-off (a first run's compile, capture or
    allocation, a stall) is not learnt, the way a shape's slow first step is not (policy_model.py ``_cold``):
    the line is an undiscounted least-squares fit, one such catch-up would stay in it for good, and the
    planner it priced would hold γ = 0 and never catch up again to correct it (bench/catchup_outlier.py:
    one catch-up 1 s slow kept a B = 1 planner at γ = 0 for every later request). Once the fit has data, a
    catch-up slower than ``OUTLIER`` times its prediction is not learnt, unless ``MAX_REJECTS`` in a row were
    not (then the fit is what is wrong) or it is more than twice the tokens of any learnt so far (a line is
    not trusted that far out: a batch's catch-up may cost more per token than one row's). Before, the first
    catch-up waits for the second and the two judge each other (``_pair``); the seed (a profile's bare
    forwards, not the engine's catch-ups) prices switching meanwhile but judges nothing."""

    OUTLIER, MAX_REJECTS = 3.0, 2

    def __init__(self, lag: str = "sum", seed: tuple[float, float] | None = None,
                 discount: float = 1.0, robust: bool = False) -> None:
        if lag not in ("sum", "max"):
            raise ValueError(f"lag must be 'sum' or 'max', got {lag!r}")
        self.lag = lag
        self.seed = None if seed is None else (float(seed[0]), float(seed[1]))
        self._fit = _LinFit(discount)
        self.observations = 0
        self._coef: tuple | None = None         # (coef(),) until the next observation
        self.robust = robust
        self.rejected = self._in_a_row = 0      # catch-ups not learnt (``robust``), and how many in a row
        self._pending: tuple[float, float] | None = None    # the first catch-up, while the fit has no data
        self._x_max = 0.0                       # the most tokens of a learnt catch-up

    def observe(self, r: StepTimed) -> None:
        """Learn from a step that reported a catch-up."""
        if r.catchup_time_s <= 0.0 and r.catchup_tokens <= 0:
            return
        x, y = float(r.catchup_tokens if self.lag == "sum" else r.max_draft_lag), float(r.catchup_time_s)
        if not self.robust:
            self._add(x, y)
        elif self.observations == 0:
            self._pair(x, y)
        elif not self._one_off(x, y):
            self._add(x, y)

    def _add(self, x: float, y: float) -> None:
        self._fit.add(x, y)
        self._x_max = max(self._x_max, x)
        self.observations += 1
        self._coef = None

    def _one_off(self, x: float, y: float) -> bool:
        """Slower than ``OUTLIER`` times the line's prediction, within twice the tokens learnt (and not the
        ``MAX_REJECTS``+1-th in a row)."""
        a, b = self.coef()
        pred = a + b * x
        out = (pred > 0.0 and y > self.OUTLIER * pred and x <= 2.0 * self._x_max
               and self._in_a_row < self.MAX_REJECTS)
        self._in_a_row = self._in_a_row + 1 if out else 0
        self.rejected += out
        return out

    def _pair(self, x: float, y: float) -> None:
        """No fit yet: hold the first catch-up; with the second, learn both unless one is out of line with
        the other (a catch-up of more tokens costs more, at most ``OUTLIER``·(x2/x1) times as much): then
        only the faster one."""
        if self._pending is None:
            self._pending = (x, y)
            return
        (x1, y1), (x2, y2) = sorted([self._pending, (x, y)])
        self._pending = None
        if y2 > self.OUTLIER * (x2 / max(x1, 1.0)) * y1:
            self.rejected += 1
            self._add(x1, y1)
        elif y1 > self.OUTLIER * y2:
            self.rejected += 1
            self._add(x2, y2)
        else:
            self._add(x1, y1)
            self._add(x2, y2)

    def coef(self) -> tuple[float, float] | None:
        """Current (c0, c1): fitted, else the seed, else None (kept until the next observation)."""
        c = self._coef
        if c is None:
            c = self._coef = (self._fit_coef(),)
        return c[0]

    def _fit_coef(self) -> tuple[float, float] | None:
        ab = self._fit.coef(through_origin=True)
        if ab is not None and ab[1] < 0.0:  # noisy fit: fall back to proportional
            ab = (0.0, self._fit.sy / self._fit.sx) if self._fit.sx > 0 else (ab[0], 0.0)
        return ab if ab is not None else self.seed

    def predict(self, l_max: int, batch_size: int) -> float:
        """Predicted catch-up seconds for lag ``l_max`` on ``batch_size`` requests."""
        if l_max <= 0:
            return 0.0
        ab = self.coef()
        if ab is None:
            return 0.0
        x = l_max * batch_size if self.lag == "sum" else l_max
        return max(0.0, ab[0] + ab[1] * x)


# ---------------------------------------------------------------- base
class Policy(ABC):
    """A γ planner.  ``decide`` must return 0 while the draft is not resident."""

    name: str = "policy"
    uses_draft: bool = True
    elastic_memory: bool = False
    holds_zero: bool = False    # a γ = 0 decision may stand for the next step too (the planner commits to it)

    def __init__(self, gamma_max: int) -> None:
        if not isinstance(gamma_max, int) or isinstance(gamma_max, bool) or gamma_max < 0:
            raise ValueError(f"gamma_max must be an int >= 0, got {gamma_max!r}")
        self.gamma_max = gamma_max

    @abstractmethod
    def decide(self, batch_size: int, state: PlannerState) -> int:
        """γ for the next decode step of ``batch_size`` running requests."""

    def observe(self, result: StepTimed) -> None:
        """Learn from a finished step (default: nothing to learn)."""

    def snapshot(self) -> dict:
        """Small JSON-able summary for logs and metrics."""
        return {"policy": self.name, "gamma_max": self.gamma_max}


# ---------------------------------------------------------------- constant policies
class OffPolicy(Policy):
    """γ = 0 always ("w/o SD")."""

    name = "off"
    uses_draft = False
    holds_zero = True

    def decide(self, batch_size: int, state: PlannerState) -> int:
        """Always 0."""
        return 0


class FixedPolicy(Policy):
    """γ = K whenever the draft is resident ("standard SD")."""

    name = "fixed"
    holds_zero = True

    def __init__(self, gamma_max: int, k: int) -> None:
        super().__init__(gamma_max)
        if not 0 <= k <= gamma_max:
            raise ValueError(f"fixed:K needs 0 <= K <= gamma_max={gamma_max}, got K={k}")
        self.k = k
        self.uses_draft = k > 0

    def decide(self, batch_size: int, state: PlannerState) -> int:
        """K, or 0 while the draft is not resident."""
        return self.k if state.draft_resident else 0

    def snapshot(self) -> dict:
        """Adds K."""
        return {**super().snapshot(), "k": self.k}


# ---------------------------------------------------------------- table
_TABLE_PRESETS: dict[str, tuple[tuple[int, int | None, int], ...]] = {
    # MLC auto_spec_decode.cc: running <10→4, <20→3, <30→2, else 0.
    "mlc": ((1, 9, 4), (10, 19, 3), (20, 29, 2), (30, None, 0)),
    # TRT-LLM draft_len_schedule={4:4, 8:2, 32:1}; B > 32 → 0.
    "trtllm": ((1, 4, 4), (5, 8, 2), (9, 32, 1), (33, None, 0)),
}


def _parse_range(item: str) -> tuple[int, int | None]:
    """'a-b' → (a, b); 'a-' → (a, None); 'a' → (a, a)."""
    lo, dash, hi = item.partition("-")
    start = int(lo)
    end = (None if hi.strip() == "" else int(hi)) if dash else start
    if start < 1 or (end is not None and end < start):
        raise ValueError(f"bad batch-size range {item!r}")
    return start, end


def parse_table(body: str) -> tuple[tuple[int, int | None, int], ...]:
    """Parse ``'1-4:4,5-16:2,33-:0'`` into sorted, non-overlapping (start, end, K)."""
    if body.strip().lower() in _TABLE_PRESETS:
        return _TABLE_PRESETS[body.strip().lower()]
    entries = []
    for item in (s.strip() for s in body.split(",")):
        rng, sep, k = item.rpartition(":")
        try:
            start, end = _parse_range(rng.strip())
            kk = int(k)
        except ValueError as exc:
            raise ValueError(f"malformed table entry {item!r} in {body!r}: expected "
                             f"'start-end:K', 'start-:K' or 'B:K' ({exc})") from None
        if not sep or kk < 0:
            raise ValueError(f"malformed table entry {item!r} in {body!r}: K must be an int >= 0")
        entries.append((start, end, kk))
    entries.sort()
    for (s0, e0, _), (s1, _, _) in zip(entries, entries[1:]):
        if e0 is None or e0 >= s1:
            raise ValueError(f"table ranges overlap near start={s1} in {body!r}")
    return tuple(entries)


class TablePolicy(Policy):
    """vLLM ``num_speculative_tokens_per_batch_size`` semantics.

    Ranges are inclusive; a B in a gap (or past the last closed range) takes the
    previous entry; a B below the first range gets 0; K is clamped to gamma_max.
    ``max_num_sequence`` (MLC): γ = 0 if B·(γ+1) exceeds it.
    """

    name = "table"
    holds_zero = True

    def __init__(self, gamma_max: int, body: str, max_num_sequence: int | None = None) -> None:
        super().__init__(gamma_max)
        self.entries = parse_table(body)
        self._starts = [s for s, _, _ in self.entries]
        self._ks = [min(k, gamma_max) for _, _, k in self.entries]
        self.max_num_sequence = max_num_sequence
        self.uses_draft = any(self._ks)

    def lookup(self, batch_size: int) -> int:
        """Table γ for ``batch_size`` (ignoring residency)."""
        i = bisect_right(self._starts, batch_size) - 1
        k = self._ks[i] if i >= 0 else 0
        if self.max_num_sequence is not None and batch_size * (k + 1) > self.max_num_sequence:
            return 0
        return k

    def decide(self, batch_size: int, state: PlannerState) -> int:
        """Table γ, or 0 while the draft is not resident."""
        return self.lookup(batch_size) if state.draft_resident else 0

    def snapshot(self) -> dict:
        """Adds the (clamped) table."""
        rows = [[s, e, k] for (s, e, _), k in zip(self.entries, self._ks)]
        return {**super().snapshot(), "table": rows}


# ---------------------------------------------------------------- DSD / SmartSpec
class DSDPolicy(Policy):
    """DSD/SmartSpec: γ = argmax_k B·E(k) / T(B, k).

    α is the pooled MLE over the last ``alpha_window`` drafting steps,
    accepted / (accepted + first rejections) (needs ``accepted_per_pos``; else
    accepted / drafted from ``tokens_emitted``), ``alpha0`` before data.
    T(B, k) = a_k + b_k·(B·(k+1)) -- one least-squares line per k over the
    tokens the target verifies (B·(k+1), not the authors' B·k).  Until every k
    has been observed in B's log2 bucket, decide() tries the lowest untried k.
    Probe: α only learns from drafting steps, so after ``probe_every`` decode steps without one
    decide() plays γ=1 once (0 disables); otherwise one unlucky window could pin it at γ=0 forever.
    """

    name = "dsd"

    def __init__(self, gamma_max: int, alpha0: float = 0.7, alpha_window: int = 10,
                 fit_discount: float = 1.0, probe_every: int = 32) -> None:
        super().__init__(gamma_max)
        self.probe_every = probe_every
        self._since_draft = 0
        self.alpha0 = alpha0
        self._win: deque[tuple[float, float]] = deque(maxlen=alpha_window)
        self._fits = [_LinFit(fit_discount) for _ in range(gamma_max + 1)]
        self._tried: dict[int, int] = {}  # bucket → bitmask of observed γ
        self._full = (1 << (gamma_max + 1)) - 1
        self.alpha = alpha0

    def _untried(self, batch_size: int) -> int:
        """Lowest γ not yet observed in this bucket, or -1."""
        mask = self._tried.get(bucket(batch_size), 0)
        if mask == self._full:
            return -1
        return ((~mask) & (mask + 1)).bit_length() - 1

    def predict_time(self, batch_size: int, k: int) -> float | None:
        """Fitted step time for γ = k at batch size B (None without data)."""
        ab = self._fits[k].coef()
        return None if ab is None else ab[0] + ab[1] * batch_size * (k + 1)

    def decide(self, batch_size: int, state: PlannerState) -> int:
        """Explore untried γ in the bucket, then argmax modelled goodput."""
        if not state.draft_resident or batch_size <= 0:
            return 0
        k = self._untried(batch_size)
        if k >= 0:
            return k
        if self.probe_every and self.gamma_max and self._since_draft >= self.probe_every:
            return 1
        best, best_g = 0, -1.0
        for k in range(self.gamma_max + 1):
            t = self.predict_time(batch_size, k)
            g = batch_size * expected_tokens(self.alpha, k) / max(t or 0.0, 1e-9)
            if g > best_g:
                best, best_g = k, g
        return best

    def _acceptance_counts(self, r: StepTimed) -> tuple[float, float]:
        """(accepted, first-rejections) of one drafting step."""
        drafts = r.num_drafts or r.batch_size
        if r.accepted_per_pos:
            acc = float(sum(r.accepted_per_pos))
            return acc, float(drafts - r.accepted_per_pos[-1])
        acc = float(max(0, r.tokens_emitted - drafts))
        return acc, max(0.0, drafts * r.gamma - acc)

    def observe(self, result: StepTimed) -> None:
        """Update α window, the per-γ time line and the bucket's tried set."""
        r = result
        if r.batch_size <= 0 or not 0 <= r.gamma <= self.gamma_max:
            return
        c = bucket(r.batch_size)
        self._tried[c] = self._tried.get(c, 0) | (1 << r.gamma)
        self._fits[r.gamma].add(float(r.batch_size * (r.gamma + 1)), r.step_time_s)
        self._since_draft = 0 if r.gamma > 0 else self._since_draft + 1
        if r.gamma > 0:
            self._win.append(self._acceptance_counts(r))
            acc = sum(a for a, _ in self._win)
            tot = acc + sum(f for _, f in self._win)
            self.alpha = min(acc / tot, 0.999) if tot > 0 else self.alpha0

    def snapshot(self) -> dict:
        """Adds α and the per-γ (a, b) time lines."""
        fits = [self._fits[k].coef() for k in range(self.gamma_max + 1)]
        return {**super().snapshot(), "alpha": self.alpha,
                "time_fit": [None if f is None else list(f) for f in fits]}


# ---------------------------------------------------------------- BanditSpec / UCBSpec
class BanditSpecPolicy(Policy):
    """UCBSpec without context: round-robin warm-up, then the UCB index.

    index_i = μ̂_i + (L/2)·√((1+n_i)/n_i² · (1 + 2·ln(K·t²·√(1+n_i)/δ))),
    reward = tokens_emitted / B / step_time_s (tok/s per request) divided by
    ``reward_scale``; L = gamma_max unless given; t = 1 + observations.
    """

    name = "banditspec"

    def __init__(self, gamma_max: int, delta: float = 0.5, L: float | None = None,
                 warmup_rounds: int = 1, min_gamma: int = 0, reward_scale: float = 1.0) -> None:
        super().__init__(gamma_max)
        if not 0 <= min_gamma <= gamma_max:
            raise ValueError(f"min_gamma must be in [0, {gamma_max}], got {min_gamma}")
        self.arms = tuple(range(min_gamma, gamma_max + 1))
        self.delta, self.reward_scale = delta, reward_scale
        self.L = float(gamma_max if L is None else L)
        self._warm = warmup_rounds * len(self.arms)
        self._rr = 0
        self._n = [0] * len(self.arms)
        self._mu = [0.0] * len(self.arms)
        self._t = 0

    def _index(self, i: int, log_kt2: float) -> float:
        """UCB index of arm position ``i``."""
        n = self._n[i]
        if n == 0:
            return math.inf
        bonus = (1 + n) / (n * n) * (1 + 2 * (log_kt2 + 0.5 * math.log1p(n)))
        return self._mu[i] + 0.5 * self.L * math.sqrt(bonus)

    def decide(self, batch_size: int, state: PlannerState) -> int:
        """Round-robin for the warm-up, then argmax of the index."""
        if not state.draft_resident:
            return 0
        if self._rr < self._warm:
            self._rr += 1
            return self.arms[(self._rr - 1) % len(self.arms)]
        t = self._t + 1
        log_kt2 = math.log(len(self.arms) * t * t / self.delta)
        best = max(range(len(self.arms)), key=lambda i: self._index(i, log_kt2))
        return self.arms[best]

    def observe(self, result: StepTimed) -> None:
        """Update the played arm's mean reward."""
        r = result
        if r.batch_size <= 0 or r.step_time_s <= 0 or r.gamma not in self.arms:
            return
        i = r.gamma - self.arms[0]
        reward = r.tokens_emitted / r.batch_size / r.step_time_s / self.reward_scale
        self._n[i] += 1
        self._mu[i] += (reward - self._mu[i]) / self._n[i]
        self._t += 1

    def snapshot(self) -> dict:
        """Adds per-arm counts and mean rewards."""
        return {**super().snapshot(), "arms": list(self.arms), "n": list(self._n),
                "mean_reward": list(self._mu), "rounds": self._t}


# ---------------------------------------------------------------- Nightjar
class _Arm:
    """Discounted loss sums plus Page-Hinkley state for one (context, γ)."""

    __slots__ = ("n", "w", "st", "sk", "pn", "pmean", "pm2", "up", "dn")

    def __init__(self) -> None:
        self.n = 0
        self.w = self.st = self.sk = 0.0
        self.pn = 0
        self.pmean = self.pm2 = self.up = self.dn = 0.0

    def loss(self) -> float:
        """Seconds per emitted token per request (ratio estimator)."""
        return self.st / self.sk if self.sk > 0.0 else math.inf

    def update(self, time_s: float, tok_per_req: float, discount: float) -> None:
        """Add one step; older steps are down-weighted by ``discount``."""
        self.n += 1
        self.w = discount * self.w + 1.0
        self.st = discount * self.st + time_s
        self.sk = discount * self.sk + tok_per_req

    def shrink(self, keep: float) -> None:
        """Cap the effective count at ``keep`` (0 forgets the arm) and reset the detector."""
        if keep <= 0.0:
            self.n, self.w, self.st, self.sk = 0, 0.0, 0.0, 0.0
        elif self.w > keep:
            f = keep / self.w
            self.w, self.st, self.sk = keep, self.st * f, self.sk * f
        self.pn, self.pmean, self.pm2, self.up, self.dn = 0, 0.0, 0.0, 0.0, 0.0


class _Context:
    """Block/bin schedule of one batch-size bucket plus its arms."""

    __slots__ = ("j", "b", "block_steps", "bin_len", "step_in_bin", "explore",
                 "locked", "bins", "resets", "arms")

    def __init__(self, n_arms: int) -> None:
        self.arms = [_Arm() for _ in range(n_arms)]
        self.bins = self.resets = 0
        self.restart()

    def restart(self) -> None:
        """Back to block 1; the next decide opens a new bin."""
        self.j, self.b, self.block_steps = 1, 0, 0
        self.bin_len = self.step_in_bin = 0
        self.explore, self.locked = True, -1


NIGHTJAR_PAPER_OPTS = ("decay", "prior", "discount", "detector", "ph_delta", "ph_lambda",
                  "ph_warmup", "ph_floor", "ph_clip", "ph_keep", "lag", "c_switch_seed",
                  "c_switch_discount", "switch_cost")


class NightjarPaperPolicy(Policy):
    """The paper's contextual bin-greedy bandit over γ with a learned switching cost (§2)."""

    name = "nightjar-paper"
    elastic_memory = True

    def __init__(self, gamma_max: int, seed: int = 0, *, decay: str = "inv",
                 prior: Sequence[float] | None = None, discount: float = 0.99,
                 detector: str | None = "ph", ph_delta: float = 1.0, ph_lambda: float = 12.0,
                 ph_warmup: int = 10, ph_floor: float = 0.05, ph_clip: float = 4.0,
                 ph_keep: float = 0.0, lag: str = "sum",
                 c_switch_seed: tuple[float, float] | None = None,
                 c_switch_discount: float = 1.0, switch_cost: bool = True) -> None:
        super().__init__(gamma_max)
        self._rng = random.Random(seed)
        self._p_explore = _decay_fn(decay)
        self.decay, self.discount, self.detector = decay, float(discount), detector
        if not 0.0 < self.discount <= 1.0 or detector not in ("ph", None):
            raise ValueError("discount must be in (0, 1] and detector 'ph' or None")
        self._ph = (ph_delta, ph_lambda, ph_warmup, ph_floor, ph_clip)
        self.ph_keep = ph_keep
        self._prior_cum = _prior_cumulative(prior, gamma_max)
        self.switch = SwitchCostModel(lag, c_switch_seed, c_switch_discount)
        self.switch_cost = switch_cost
        self._ctxs: list[_Context] = []
        self.last_explore = False

    # ------------------------------------------------------------ decide
    def _context(self, c: int) -> _Context:
        """The context for bucket ``c`` (created on first use)."""
        while len(self._ctxs) <= c:
            self._ctxs.append(_Context(self.gamma_max + 1))
        return self._ctxs[c]

    def decide(self, batch_size: int, state: PlannerState) -> int:
        """Bin-locked γ for this bucket; 0 (schedule frozen) if draft not resident."""
        if not state.draft_resident or batch_size <= 0:
            return 0
        c = (batch_size - 1).bit_length() if batch_size > 1 else 0
        ctx = self._ctxs[c] if c < len(self._ctxs) else self._context(c)
        if ctx.step_in_bin >= ctx.bin_len:
            self._new_bin(ctx)
        if ctx.locked < 0:
            ctx.locked = self._explore_arm() if ctx.explore else self._exploit(ctx, batch_size, state)
        ctx.step_in_bin += 1
        self.last_explore = ctx.explore
        return ctx.locked

    def _new_bin(self, ctx: _Context) -> None:
        """Close the current bin (and block if covered), draw explore for the next."""
        ctx.block_steps += ctx.step_in_bin
        h = 1 << (ctx.j - 1)
        if ctx.block_steps >= h:          # next block; b runs on (the paper's bin index is global)
            ctx.j, ctx.block_steps = ctx.j + 1, 0
            h <<= 1
        ctx.b += 1
        ctx.bins += 1
        ctx.bin_len = min(max(1, math.isqrt(h)), h - ctx.block_steps)
        ctx.step_in_bin = 0
        ctx.explore = self._rng.random() < self._p_explore(ctx.b)
        ctx.locked = -1

    def _explore_arm(self) -> int:
        """Uniform γ, or a draw from the prior weights."""
        if self._prior_cum is None:
            return self._rng.randrange(self.gamma_max + 1)
        return bisect_right(self._prior_cum, self._rng.random() * self._prior_cum[-1])

    def _exploit(self, ctx: _Context, batch_size: int, state: PlannerState) -> int:
        """Untried arm if any, else argmin loss + restart cost (ties → lower γ)."""
        untried = [k for k, a in enumerate(ctx.arms) if a.n == 0]
        if untried:
            return untried[self._rng.randrange(len(untried))]
        cost = 0.0
        if self.switch_cost and state.prev_gamma == 0:
            cost = self.switch.predict(state.max_draft_lag, batch_size)
        best, best_loss = 0, math.inf
        for k, arm in enumerate(ctx.arms):
            loss = arm.loss() + (cost / k if k else 0.0)
            if loss < best_loss:
                best, best_loss = k, loss
        return best

    # ------------------------------------------------------------ observe
    def observe(self, result: StepTimed) -> None:
        """Update C_switch, the played arm's loss and its change detector."""
        r = result
        self.switch.observe(r)
        if r.batch_size <= 0 or r.tokens_emitted <= 0 or not 0 <= r.gamma <= self.gamma_max:
            return
        ctx = self._context(bucket(r.batch_size))
        arm = ctx.arms[r.gamma]
        tok = r.tokens_emitted / r.batch_size
        arm.update(r.step_time_s, tok, self.discount)
        if self.detector == "ph" and _ph_step(arm, r.step_time_s / tok, *self._ph):
            self._reset(ctx)

    def _reset(self, ctx: _Context) -> None:
        """Change detected: re-explore this context from block 1."""
        ctx.restart()
        ctx.resets += 1
        for arm in ctx.arms:
            arm.shrink(self.ph_keep)

    # ------------------------------------------------------------ introspection
    def snapshot(self) -> dict:
        """Per-context schedule, losses and counts, plus the C_switch line."""
        ab = self.switch.coef()
        return {**super().snapshot(), "elastic_memory": self.elastic_memory,
                "reward": "loss = sum(step_time_s)/sum(tokens_emitted/B), discounted",
                "discount": self.discount, "detector": self.detector, "decay": self.decay,
                "c_switch": None if ab is None else list(ab), "lag": self.switch.lag,
                "contexts": {bucket_label(c): _ctx_summary(x)
                             for c, x in enumerate(self._ctxs) if x.bins}}


def _ctx_summary(ctx: _Context) -> dict:
    """JSON-able view of one context."""
    losses = [a.loss() for a in ctx.arms]
    return {"block": ctx.j, "bin": ctx.b, "bins": ctx.bins, "resets": ctx.resets,
            "locked": ctx.locked, "explore": ctx.explore, "n": [a.n for a in ctx.arms],
            "loss_s": [None if math.isinf(x) else x for x in losses]}


def _ph_step(arm: _Arm, x: float, delta: float, lam: float, warmup: int,
             floor: float, clip: float) -> bool:
    """Two-sided Page-Hinkley (CUSUM form) on standardised ``x``; True on alarm."""
    alarm = False
    if arm.pn >= warmup:
        sd = max(math.sqrt(arm.pm2 / (arm.pn - 1)), floor * abs(arm.pmean), 1e-12)
        z = max(-clip, min(clip, (x - arm.pmean) / sd))
        arm.up = max(0.0, arm.up + z - delta)
        arm.dn = max(0.0, arm.dn - z - delta)
        alarm = arm.up > lam or arm.dn > lam
    arm.pn += 1
    d = x - arm.pmean
    arm.pmean += d / arm.pn
    arm.pm2 += d * (x - arm.pmean)
    return alarm


def _decay_fn(decay: str) -> Callable[[int], float]:
    """Exploration probability of bin b: 1/b ("inv", the paper) or 1/√b ("sqrt")."""
    if decay in ("inv", "1/b"):
        return lambda b: 1.0 / b
    if decay in ("sqrt", "1/sqrt(b)"):
        return lambda b: 1.0 / math.sqrt(b)
    raise ValueError(f"decay must be 'inv' (1/b) or 'sqrt' (1/sqrt(b)), got {decay!r}")


def _prior_cumulative(prior: Sequence[float] | None, gamma_max: int) -> list[float] | None:
    """Cumulative exploration weights over γ = 0..gamma_max (None = uniform)."""
    if prior is None:
        return None
    w = [float(x) for x in prior]
    if len(w) != gamma_max + 1 or min(w) < 0 or sum(w) <= 0:
        raise ValueError(f"prior needs {gamma_max + 1} non-negative weights with a positive sum")
    out, acc = [], 0.0
    for x in w:
        acc += x
        out.append(acc)
    return out
