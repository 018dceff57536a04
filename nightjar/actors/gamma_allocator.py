"""Per-request draft lengths (issue 17): per-request acceptance and the greedy γ_i allocator. Pure Python.

* ``RequestAcceptance``: per request, discounted per-position counts from its own last few drafting steps
  (accepted_i / reached_i, each step's counts decayed by ``decay``), shrunk toward the planner's shared
  rate by ``prior_weight`` pseudo-samples: ρ_{r,i} = (a_i + w·s_r·ρ_i) / (n_i + w), s_r the request's
  scale (its accepted drafts over what the shared rates expected where it drafted, shrunk to 1). A
  request that does not draft (γ_i = 0) forgets its counts slowly (``idle_decay`` per step), so it
  drifts back toward the shared rate and is re-tried. A new request starts at the shared rate.
  Each request also keeps its realised tokens per step (EMA). (No context-length feature.)
  With ``class_prior`` (off by default: it helps the simulator's two-class workload but measured worse on
  the real pair, docs/planner.md) the first-position rate is instead read against a prior learned from
  the population (``pi`` on ``GRID``, one EM step per verified step): the ratio of its posterior mean to the
  population's mean under ``pi`` is the scale, and position 1 is the shared rate times it. A mix of request
  classes gives ``pi`` one mode per class, so a few drafts place a request in its class instead of pulling
  it toward the shared rate; with one class every request sits at the shared rate.
* ``allocate``: row i's k-th draft token is worth g_{i,k} = Π_{j≤k} ρ_{i,j} expected tokens. Tokens are
  taken in order of g (largest first; g is non-increasing in k, so each row's tokens come in order) and
  every prefix of that order, and every uniform γ_i = γ, is priced with the step-time model, whose cost
  depends on the tokens verified and on the draft passes (pass k runs the n_k rows with γ_i ≥ k):
      base = target(B, 1 + Σ_i γ_i / B) + Σ_k draft(n_k)
  (target(B, q̄) linear between integer q, ``verify_by_tokens``; for γ_i = γ on every row this is the
  batch-level base(B, γ) exactly). A ragged verify (rows of different γ_i) costs more than the same tokens in
  uniform rows, 1.02–1.11× measured (bench/mixed_steps.py): ``allocate(..., ragged=r)`` prices its target
  part ×(1 + r), ``RAGGED_COST`` in the planner.
  The candidate with the fewest seconds per expected token wins: tokens are added while they pay, and a
  draft pass's fixed cost is judged by the whole layer it buys, not by its first token. Rows whose tokens
  at a depth are worth the same (e.g. requests with no history yet) move together, so with equal
  acceptance the candidates are exactly γ_i = γ for all i and the batch-level choice is the special case.
* The tokens a candidate is expected to emit are counted in the closed loop's steady state when the rows'
  arrival weights are given (``steady_tokens``: B·W / Σ_i w_i / E_i, w_i a row's realised tokens per
  step, ``RequestAcceptance.weights_rows``): a request stays in the batch for L / E_i steps, so a deep
  draft for a row that already runs fast buys less than Σ_i E_i says; it leaves sooner and the batch fills
  with slow rows. Tokens are then taken in order of the drop in Σ_i w_i / E_i. With w_i = E_i the count is
  Σ_i E_i; with equal weights and equal acceptance it is the batch-level choice again.

Message convention (columnar): a step's per-row γ travels as ``gammas`` (one per decode row, 0 for rows
that do not draft) next to ``gamma`` = max γ_i; an empty ``gammas`` means the batch-level form (every
speculating decode row drafts ``gamma``). ``row_gammas`` expands either form.
"""
from __future__ import annotations

import math

GRID = tuple(0.05 + 0.1 * k for k in range(10))     # first-position rates the class prior lives on
CLASS_ROWS = 16                                      # rows per EM step of the class prior (a stride sample)
_LOG_G = tuple(math.log(g) for g in GRID)
_LOG_Q = tuple(math.log(1.0 - g) for g in GRID)

__all__ = ["GRID", "RequestAcceptance", "Allocation", "allocate", "steady_tokens", "verify_by_tokens", "row_gammas",
           "gamma_histogram", "layer_counts", "RAGGED_COST", "priced_verify"]

RAGGED_COST = 0.07      # a ragged verify over the same tokens in uniform rows, less 1 (bench/mixed_steps.py, bf16 CPU)


def verify_by_tokens(row: list[float], batch: int, drafted: int) -> float:
    """The target forward of ``batch`` decode rows verifying ``drafted`` draft tokens in all, however they are
    spread over the rows: T(B, q̄) from the uniform row ``row`` (row[q] = T(B, q)), q̄ = 1 + drafted / B,
    linear between integer q. Measured on this engine (bench/mixed_steps.py, docs/planner.md): a ragged
    verify costs what the same tokens in uniform rows cost (1.00–1.11×), not the sum of per-depth layers."""
    if drafted <= 0:
        return row[1]
    q = 1.0 + drafted / batch
    lo = int(q)
    if lo + 1 >= len(row):
        return row[-1] + (q - (len(row) - 1)) * (row[-1] - row[-2])
    return row[lo] + (q - lo) * (row[lo + 1] - row[lo])


def priced_verify(row: list[float], batch: int, drafted: int, deepest_rows: int, ragged: float) -> float:
    """``verify_by_tokens`` ×(1 + ragged) when the rows verify different lengths, i.e. when fewer than ``batch``
    rows reach the deepest draft position (``deepest_rows``); a uniform or draft-free verify is not surcharged."""
    t = verify_by_tokens(row, batch, drafted)
    return t * (1.0 + ragged) if drafted > 0 and deepest_rows < batch else t


def row_gammas(gamma: int, gammas: tuple[int, ...], speculate: tuple[bool, ...], num_decode: int) -> tuple[int, ...]:
    """γ_i per decode row from a message's (gamma, gammas) and the schedule's speculate flags."""
    if gammas:
        return tuple(gammas[:num_decode])
    return tuple(gamma if speculate[i] else 0 for i in range(num_decode))


def layer_counts(gammas, gamma_max: int) -> tuple[int, ...]:
    """n_k = rows with γ_i ≥ k, for k = 1..max γ (the rows draft pass k runs)."""
    top = max(gammas, default=0)
    return tuple(sum(1 for g in gammas if g >= k) for k in range(1, min(top, gamma_max) + 1))


def gamma_histogram(batch_size: int, gamma: int, num_drafts: int, drafted_per_pos: tuple[int, ...]) -> list[int]:
    """Rows per γ_i value (index = γ_i) of one decode step, from StepTimed fields (either form)."""
    if not drafted_per_pos:
        drafted_per_pos = (num_drafts,) * gamma if gamma else ()
    n = (batch_size,) + tuple(drafted_per_pos) + (0,)
    return [n[k] - n[k + 1] for k in range(len(n) - 1)]


class RequestAcceptance:
    """Per-request discounted acceptance counts per draft position, shrunk toward a shared estimate."""

    def __init__(self, gamma_max: int, decay: float = 0.9, prior_weight: float = 2.0,
                 idle_decay: float = 0.97, class_prior: bool = False) -> None:
        self.g, self.decay, self.w, self.idle = gamma_max, decay, prior_weight, idle_decay
        self.w_min = prior_weight
        self.tau2 = 0.05                           # between-request variance of first-position rates (EMA)
        self.acc: dict[int, list[float]] = {}      # req_id → discounted accepted counts per position
        self.n: dict[int, list[float]] = {}        # req_id → discounted reached counts per position
        self.rate: dict[int, float] = {}           # req_id → realised tokens per step (EMA, ``rate_decay``)
        self.rate_decay = 0.8
        self.class_prior = class_prior
        self.pi = [1.0 / len(GRID)] * len(GRID)    # population prior of first-position rates (on GRID)
        self._log_pi = [math.log(x) for x in self.pi]
        self.pi_mean = sum(self.pi[k] * GRID[k] for k in range(len(GRID)))     # the population's mean rate
        self.rho1: dict[int, float] = {}           # req_id → posterior mean first-position rate under pi

    def observe(self, req_ids, gammas, accepted) -> None:
        """One verified step: row r drafted gammas[r] tokens and accepted accepted[r] of them."""
        rate, rd = self.rate, self.rate_decay
        for rid, g, a in zip(req_ids, gammas, accepted):
            t = 1.0 + a if g > 0 else 1.0
            r = rate.get(rid)
            rate[rid] = t if r is None else rd * r + (1.0 - rd) * t
            acc, n = self.acc.get(rid), self.n.get(rid)
            if acc is None:
                acc = self.acc[rid] = [0.0] * self.g
                n = self.n[rid] = [0.0] * self.g
            if g <= 0:
                if n[0] > 0.0:
                    f = self.idle
                    for i in range(self.g):
                        acc[i] *= f
                        n[i] *= f
                continue
            d = self.decay
            reach = min(a, g - 1) + 1                # positions 0..reach-1 were drafted and reached
            for i in range(reach):
                n[i] = d * n[i] + 1.0
                acc[i] = d * acc[i] + (1.0 if a > i else 0.0)
        self._spread(req_ids)

    def _spread(self, req_ids) -> None:
        """Empirical Bayes: the variance of the batch's first-position rates beyond binomial noise is the
        between-request variance τ²; the prior weight is ρ(1−ρ)/τ² pseudo-samples (at least ``prior_weight``),
        so requests that only differ by chance are shrunk to the shared rate and distinct classes are not."""
        rs, noise = [], 0.0
        acc_of, n_of = self.acc, self.n
        for rid in req_ids:
            n = n_of.get(rid)
            if n is not None and n[0] >= 2.0:
                p = acc_of[rid][0] / n[0]
                rs.append(p)
                noise += 1.0 / n[0]
        if self.class_prior:
            self._class_posteriors(req_ids)
        k = len(rs)
        if k < 4:
            return
        m = sum(rs) / k
        var = sum((x - m) ** 2 for x in rs) / (k - 1)
        tau2 = max(var - m * (1.0 - m) * noise / k, 1e-4)
        self.tau2 += 0.1 * (tau2 - self.tau2)
        self.w = min(200.0, max(self.w_min, m * (1.0 - m) / self.tau2))

    def _class_posteriors(self, req_ids) -> None:
        """A nonparametric prior for the first-position rate: pi on GRID, one EM step per verified step from
        the posteriors of up to ``CLASS_ROWS`` rows with at least two drafts (a stride sample); each row's
        posterior mean under pi is kept (``rho1``). With a mix of classes pi has a mode per class, so a few
        drafts put a request in its class, where a one-hump prior centred on the shared rate would pull it
        toward the middle; with one class pi concentrates there and shrinks chance differences away."""
        lp = self._log_pi
        acc_of, n_of, rho1 = self.acc, self.n, self.rho1
        exp, grid = math.exp, GRID
        em = []
        for rid in req_ids:
            n = n_of.get(rid)
            if n is None or n[0] <= 0.0:
                continue
            a0, n0 = acc_of[rid][0], n[0]
            b0 = n0 - a0
            # log-likelihoods are bounded (n0 ≤ 1/(1 − decay)), so no max-shift is needed before exp
            post = [exp(lpk + a0 * lg + b0 * lq) for lpk, lg, lq in zip(lp, _LOG_G, _LOG_Q)]
            z = sum(post)
            rho1[rid] = sum(q * g for q, g in zip(post, grid)) / z
            if n0 >= 2.0:
                em.append((post, z))
        if em:
            k = -(-len(em) // CLASS_ROWS)
            em = em[::k]
            pi, eta = self.pi, 0.05 / len(em)
            for j in range(len(pi)):
                pi[j] = 0.95 * pi[j] + eta * sum(post[j] / z for post, z in em)
            self._log_pi = [math.log(x if x > 1e-300 else 1e-300) for x in pi]
            self.pi_mean = sum(x * g for x, g in zip(pi, grid))

    def forget(self, live) -> None:
        """Drop requests not in ``live``."""
        for rid in [r for r in self.acc if r not in live]:
            del self.acc[rid], self.n[rid]
        for rid in [r for r in self.rate if r not in live]:
            del self.rate[rid]
        for rid in [r for r in self.rho1 if r not in live]:
            del self.rho1[rid]

    def weights_rows(self, rids) -> list[float]:
        """Each row's realised tokens per step (its arrival weight in ``steady_tokens``); a request with
        none yet gets the mean of the others (1 when none has any)."""
        rate = self.rate
        known = [rate[r] for r in rids if r in rate]
        dflt = sum(known) / len(known) if known else 1.0
        return [rate.get(r, dflt) for r in rids]

    def gains(self, rid: int, shared: list[float], top: int) -> list[float]:
        """g_k = Π_{j≤k} ρ_{r,j} for k = 1..top (``shared``: the shared per-position rates).

        The prior of position i is the shared rate times the request's scale s = (A + w)/(Ê + w), A its
        accepted drafts and Ê what the shared rates expected at the positions it reached: a request that
        rejects at position 0 is believed weaker at positions it never reached too (the shared rate at deep
        positions comes mostly from requests that got there)."""
        return self.gains_rows((rid,), (True,), shared, top)[0]

    def gains_rows(self, rids, speculate, shared: list[float], top: int) -> list[list[float]]:
        """``gains`` for every row ([] for rows that may not draft): the planner's hot path."""
        fresh, p = [], 1.0
        for i in range(top):
            p *= shared[i]
            fresh.append(p)
        acc_of, out = self.acc, []
        for rid, sp in zip(rids, speculate):
            acc = acc_of.get(rid) if sp else None
            out.append(([] if not sp else fresh) if acc is None else
                       self._own(acc, self.n[rid], shared, top, self.rho1.get(rid)))
        return out

    def _own(self, acc: list[float], n: list[float], shared: list[float], top: int,
             rho1: float | None = None) -> list[float]:
        """One tracked request's g_k = Π_{j≤k} ρ_{r,j}, k = 1..top (see ``gains``). With the class prior
        (``rho1``: the posterior mean under pi) the scale is that mean over the population's mean under pi,
        and position 1 is the shared rate times the scale: the prior places the request among the others,
        the shared (optimistic) rate keeps the level, so with one class every request is at the shared rate."""
        w = self.w
        first = None                               # position 1's rate when the class prior sets it
        if rho1 is not None and self.pi_mean > 0.0:
            scale = rho1 / self.pi_mean
            first = min(shared[0] * scale, 0.995)
        else:
            e_sum = 0.0
            for i in range(self.g):
                e_sum += n[i] * shared[i]
            scale = (sum(acc) + w) / (e_sum + w)
        row, p = [], 1.0
        for i in range(top):
            if i == 0 and first is not None:
                p *= first
            else:
                r = shared[i] * scale
                p *= (acc[i] + w * (r if r < 0.995 else 0.995)) / (n[i] + w)
            row.append(p)
        return row


class Allocation:
    """The allocator's answer: γ_i per row and its predicted seconds per expected token."""

    __slots__ = ("gammas", "score", "zero_score", "best_on_score")

    def __init__(self, gammas: tuple[int, ...], score: float, zero_score: float, best_on_score: float) -> None:
        self.gammas, self.score, self.zero_score, self.best_on_score = gammas, score, zero_score, best_on_score


def allocate(gains: list[list[float]], target: list[list[float]], draft: list[float], factor: list[float],
             extra: float, row_extra: list[float] | None = None, weights: list[float] | None = None,
             ragged: float = 0.0) -> Allocation:
    """γ_i per row minimising predicted seconds per expected token.

    gains[i][k-1]: expected tokens row i's k-th draft token adds (empty list: the row may not draft).
    target[n][q]: target forward of n rows with q tokens each; draft[n]: one draft pass over n rows
    (dense tables, n up to the batch). factor[g]: seconds per base unit when the deepest row drafts g
    (the planner's level and per-(bucket, g) correction, optimistic). extra: seconds every drafting step
    pays (prompt prefill, spread catch-up); row_extra[i]: seconds row i pays when it drafts at all
    (its own generated-token catch-up, spread).

    weights (optional): the rows' arrival weights w_i for the steady-state objective (see ``steady_tokens``);
    the expected tokens of a candidate are then B·W / Σ_i w_i / E_i instead of Σ_i E_i.
    ragged: the target forward of a candidate whose rows verify different lengths costs ×(1 + ragged).
    """
    B = len(gains)
    base0 = target[B][1]
    zero = factor[0] * base0 / B
    if weights is not None and len(weights) != B:
        raise ValueError(f"{len(weights)} weights for {B} rows")
    order = _order(gains, weights)
    W = 0.0 if weights is None else float(sum(weights))
    S = W                                       # Σ_i w_i / E_i so far (every E_i = 1)
    e_row = [1.0] * B
    n = [0] * (len(factor) + 1)                 # n[k]: rows with γ_i ≥ k so far
    tb = target[B]
    drafted, passes = 0, 0.0                    # draft tokens so far; Σ_k draft(n_k)
    tokens, rx, deepest = float(B), 0.0, 0
    best, best_m, best_on = zero, 0, float("inf")
    last = len(order)
    for m in range(last):
        ng, k, i = order[m]
        c = n[k] + 1
        passes += draft[c] - draft[c - 1]
        n[k] = c
        drafted += 1
        if weights is None:
            tokens -= ng
        else:
            e0 = e_row[i]
            e_row[i] = e1 = e0 + gains[i][k - 1]
            S -= weights[i] * (1.0 / e0 - 1.0 / e1)
            tokens = B * W / S if S > 0.0 else tokens
        if k == 1 and row_extra is not None:
            rx += row_extra[i]
        if k > deepest:
            deepest = k
        if m + 1 < last:
            nxt = order[m + 1]
            if nxt[1] == k and nxt[0] <= ng * (1.0 - 1e-9):
                continue                        # rows tied with this one at this depth move together
        s = (factor[deepest] * (priced_verify(tb, B, drafted, n[deepest], ragged) + passes) + extra + rx) / tokens
        if s < best_on:
            best_on = s
        if s < best:
            best, best_m = s, m + 1
    out = [0] * B
    for _, k, i in order[:best_m]:
        if k > out[i]:
            out[i] = k
    u, us = _best_uniform(gains, target, draft, factor, extra, row_extra, weights, ragged)
    if us < best:                               # γ_i = γ on every drafting row beats the greedy prefixes
        return Allocation(u, us, zero, min(best_on, us))
    return Allocation(tuple(out), best, zero, min(best_on, us))


def _order(gains, weights) -> list[tuple[float, int, int]]:
    """Every (−value, depth k, row i) of a draft token, most valuable first (ties: shallower, then lower row).
    Value: g_{i,k} expected tokens, or with weights w_i·(1/E_{i,k−1} − 1/E_{i,k}), the drop in Σ_i w_i/E_i
    (also non-increasing in k, so each row's tokens still come in order)."""
    order = []
    for i, row in enumerate(gains):
        e, w = 1.0, (1.0 if weights is None else weights[i])
        for k, g in enumerate(row, 1):
            if weights is None:
                order.append((-g, k, i))
            else:
                order.append((-w * g / (e * (e + g)), k, i))
            e += g
    order.sort()
    return order


def steady_tokens(gains, gammas, weights) -> float:
    """Expected tokens per step of an allocation in the closed loop's steady state: B·W / Σ_i w_i / E_i(γ_i).

    A request of class c needs L / E_c steps, so it stays in the batch in proportion to 1/E_c: what the
    loop emits per step is the w-weighted harmonic mean of the rows' E_i, w the classes' arrival weights. A
    row's arrival weight is estimated by its realised tokens per step (present rows of class c number
    ∝ p_c / r_c). With w_i = E_i this is Σ_i E_i; deeper drafts for rows that already run fast are worth
    less than the arithmetic sum says (they leave sooner, and the batch fills with slow rows)."""
    B = len(gains)
    S = 0.0
    for row, g, w in zip(gains, gammas, weights):
        S += w / (1.0 + sum(row[:g]))
    return B * sum(weights) / S if S > 0.0 else float(B)


def _best_uniform(gains, target, draft, factor, extra, row_extra, weights=None,
                  ragged: float = 0.0) -> tuple[tuple[int, ...], float]:
    """The batch-level candidates: every row that may draft gets the same γ ≥ 1; (γ_i, score) of the best
    (ragged where some rows may not draft)."""
    B = len(gains)
    rows = [i for i, g in enumerate(gains) if g]
    nr = len(rows)
    if not nr:
        return (0,) * B, float("inf")
    top = min(len(gains[i]) for i in rows)
    rx = sum(row_extra[i] for i in rows) if row_extra is not None else 0.0
    tb, tokens = target[B], float(B)
    best, best_g = float("inf"), 0
    for k in range(1, top + 1):
        if weights is None:
            tokens += sum(gains[i][k - 1] for i in rows)
        else:
            tokens = steady_tokens(gains, [k if g else 0 for g in gains], weights)
        s = (factor[k] * (priced_verify(tb, B, k * nr, nr, ragged) + k * draft[nr]) + extra + rx) / tokens
        if s < best:
            best, best_g = s, k
    out = [0] * B
    for i in rows:
        out[i] = best_g
    return tuple(out), best
