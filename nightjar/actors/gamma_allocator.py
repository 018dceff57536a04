"""Per-request draft lengths (issue 17): per-request acceptance and the greedy γ_i allocator. Pure Python.

* ``RequestAcceptance``: per request, discounted per-position counts from its own last few drafting steps
  (accepted_i / reached_i, each step's counts decayed by ``decay``), shrunk toward the planner's shared
  rate by ``prior_weight`` pseudo-samples: ρ_{r,i} = (a_i + w·ρ_i) / (n_i + w). A request that does not
  draft (γ_i = 0) forgets its counts slowly (``idle_decay`` per step), so it drifts back to the shared
  rate and is re-tried. A new request starts at the shared rate. (No context-length feature.)
* ``allocate``: row i's k-th draft token is worth g_{i,k} = Π_{j≤k} ρ_{i,j} expected tokens. Tokens are
  taken in order of g (largest first; g is non-increasing in k, so each row's tokens come in order) and
  every prefix of that order is priced with the step-time model, whose cost depends on the tokens
  verified and on the draft passes (pass k runs the n_k rows with γ_i ≥ k):
      base = target(B, 1) + Σ_k [target(n_k, k+1) − target(n_k, k) + draft(n_k)]
  (for γ_i = γ on every row this is the batch-level base(B, γ) exactly). The prefix with the fewest
  seconds per expected token wins: tokens are added while they pay, and a draft pass's fixed cost is
  judged by the whole layer it buys, not by its first token. Rows whose tokens at a depth are worth the
  same (e.g. requests with no history yet) move together, so with equal acceptance the candidates are
  exactly γ_i = γ for all i and the batch-level choice is the special case.

Message convention (columnar): a step's per-row γ travels as ``gammas`` (one per decode row, 0 for rows
that do not draft) next to ``gamma`` = max γ_i; an empty ``gammas`` means the batch-level form (every
speculating decode row drafts ``gamma``). ``row_gammas`` expands either form.
"""
from __future__ import annotations

__all__ = ["RequestAcceptance", "Allocation", "allocate", "row_gammas", "gamma_histogram", "layer_counts"]


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
                 idle_decay: float = 0.97) -> None:
        self.g, self.decay, self.w, self.idle = gamma_max, decay, prior_weight, idle_decay
        self.acc: dict[int, list[float]] = {}      # req_id → discounted accepted counts per position
        self.n: dict[int, list[float]] = {}        # req_id → discounted reached counts per position

    def observe(self, req_ids, gammas, accepted) -> None:
        """One verified step: row r drafted gammas[r] tokens and accepted accepted[r] of them."""
        for rid, g, a in zip(req_ids, gammas, accepted):
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

    def forget(self, live) -> None:
        """Drop requests not in ``live``."""
        for rid in [r for r in self.acc if r not in live]:
            del self.acc[rid], self.n[rid]

    def gains(self, rid: int, shared: list[float], top: int) -> list[float]:
        """g_k = Π_{j≤k} ρ_{r,j} for k = 1..top (``shared``: the shared per-position rates).

        The prior of position i is the shared rate times the request's scale s = (A + w)/(Ê + w), A its
        accepted drafts and Ê what the shared rates expected at the positions it reached: a request that
        rejects at position 0 is believed weaker at positions it never reached too (the shared rate at deep
        positions comes mostly from requests that got there)."""
        acc, n = self.acc.get(rid), self.n.get(rid)
        out, p, w = [], 1.0, self.w
        if acc is None:
            for i in range(top):
                p *= shared[i]
                out.append(p)
            return out
        a_sum = e_sum = 0.0
        for i in range(self.g):
            a_sum += acc[i]
            e_sum += n[i] * shared[i]
        scale = (a_sum + w) / (e_sum + w)
        for i in range(top):
            r = (acc[i] + w * min(0.995, shared[i] * scale)) / (n[i] + w)
            p *= r
            out.append(p)
        return out


class Allocation:
    """The allocator's answer: γ_i per row and its predicted seconds per expected token."""

    __slots__ = ("gammas", "score", "zero_score", "best_on_score")

    def __init__(self, gammas: tuple[int, ...], score: float, zero_score: float, best_on_score: float) -> None:
        self.gammas, self.score, self.zero_score, self.best_on_score = gammas, score, zero_score, best_on_score


def allocate(gains: list[list[float]], target: list[list[float]], draft: list[float], factor: list[float],
             extra: float, row_extra: list[float] | None = None) -> Allocation:
    """γ_i per row minimising predicted seconds per expected token.

    gains[i][k-1]: expected tokens row i's k-th draft token adds (empty list: the row may not draft).
    target[n][q]: target forward of n rows with q tokens each; draft[n]: one draft pass over n rows
    (dense tables, n up to the batch). factor[g]: seconds per base unit when the deepest row drafts g
    (the planner's level and per-(bucket, g) correction, optimistic). extra: seconds every drafting step
    pays (prompt prefill, spread catch-up); row_extra[i]: seconds row i pays when it drafts at all
    (its own generated-token catch-up, spread).
    """
    B = len(gains)
    base0 = target[B][1]
    zero = factor[0] * base0 / B
    order = sorted(((g, k, i) for i, row in enumerate(gains) for k, g in enumerate(row, 1)),
                   key=lambda x: -x[0])
    n = [0] * (len(factor) + 1)                 # n[k]: rows with γ_i ≥ k so far
    layers = 0.0                                 # Σ_k target and draft increments at the current n_k
    tokens, rx, deepest = float(B), 0.0, 0
    best, best_m, best_on = zero, 0, float("inf")
    last = len(order)
    for m, (g, k, i) in enumerate(order, 1):
        c = n[k]
        layers += (target[c + 1][k + 1] - target[c + 1][k] + draft[c + 1]) - (
            (target[c][k + 1] - target[c][k] + draft[c]) if c else 0.0)
        n[k] = c + 1
        tokens += g
        if k == 1 and row_extra is not None:
            rx += row_extra[i]
        if k > deepest:
            deepest = k
        if m < last and order[m][1] == k and order[m][0] >= g * (1.0 - 1e-9):
            continue                            # rows tied with this one at this depth move together
        s = (factor[deepest] * (base0 + layers) + extra + rx) / tokens
        if s < best_on:
            best_on = s
        if s < best:
            best, best_m = s, m
    out = [0] * B
    for g, k, i in order[:best_m]:
        if k > out[i]:
            out[i] = k
    return Allocation(tuple(out), best, zero, best_on)
