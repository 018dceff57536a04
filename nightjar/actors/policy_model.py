"""Model-based Nightjar planner (``nightjar``, ``nightjar-nooffload``): pure Python, stdlib only.

Per decode step it predicts, for every γ, seconds per emitted token and plays the optimistic argmin
(``docs/planner.md`` has the full description):

* **Acceptance** (``AcceptanceModel``), one model shared by every batch size: discounted per-position
  counts accepted_i / reached_i → ρ_i (smoothed toward the previous position),
  E(γ) = 1 + Σ_{i≤γ} Π_{k≤i} ρ_k;
  a position's counts decay (by ``d^n`` for n new samples) only when new data for it arrives. An optimistic
  E⁺ adds z·√(ρ(1−ρ)/n) per position. Two one-sided CUSUMs on first-position acceptance (a drop, a rise)
  each keep ``cusum_keep`` of the counts when they fire. With prompt lookup (``LookupSplit``, from the first step
  that reports lookup drafts) the lookup's rows and the draft model's are learnt as two such models, E⁺ is the
  two mixed by the share of rows expected to look up next step (predicted from the last drafting step's share),
  and draft passes are priced for the other rows.
* **Step time** T̂(B, γ) = level · base(B, γ) · m(c, γ). ``base`` is the profile
  (``target_time(B, γ+1) + γ·draft_time(B)``, ``nightjar profile`` JSON or the simulator's profile) or,
  without one, a generic roofline-shaped prior (then the level is kept per bucket and arms not yet played
  in a bucket take the line through the played arms' times over γ). Its draft part is re-priced at the
  measured draft seconds per priced pass (``draft_scale``, from ``StepTimed.draft_time_s``), so the draft's
  error is learned apart from the target's. The profile's T is timed at one context a row (``ctx_ref``);
  its ``kv_s_per_ctx_token`` prices the decode rows' own context past it (``context_base``, the same for
  every γ, negative for shorter rows), so that γ's share of a step is priced at the context served.
  ``level`` is learned online from decode-only steps' timed forward and draft passes; each step's surprise
  is split between the level and the played arm by how well the arm is known. What a step's wall-clock period
  holds past that is learnt per family (``outside``: γ = 0 or drafting, with or without a prompt chunk) and
  added to its arms. A γ = 0 step with a prompt chunk teaches a per-prompt-token term; a drafting one a
  per-drafted-token extra (``mixed_extra``) that ``decide`` adds to γ > 0 when the step carries a chunk.
  m(c, γ) is the per-(bucket, γ) correction: the discounted
  mean of the measured ratio T / (level · base) shrunk toward 1 by ``prior_weight`` pseudo-samples; its
  standard error falls from ``model_sd`` to the per-step noise / √samples. While an arm rests its samples fade
  (``fade`` per step of its bucket): its mean returns to what its bucket's other arms measure, and its
  error regrows faster (``stale_discount``), so a transient (contention during its steps) cannot price it
  out for good. The measured draft scale fades back to the profile's price the same way while nothing drafts.
* **Decision**: the played arm minimises the lower bound (T̂ · (1 − z·se) + extras) / (B · E⁺(γ)): an
  arm is tried only if its interval reaches below the best; no forced uniform exploration, no randomness.
  Hysteresis: the bucket's current arm is kept unless beaten by ``hysteresis`` (``hysteresis_onoff`` for
  turning speculation off).
* **Extras for γ > 0**: (a) prompt prefill in steady state -- the draft must prefill every new prompt,
  so each γ>0 arm pays C_catch(prompt tokens entering decode per step, EMA); (b) switching on from γ=0
  pays the catch-up of the *generated*-token lag (prompt tokens excluded: (a) covers them), spread over
  the expected dwell (EMA of past γ>0 run lengths). C_catch is the catch-up line learned from
  ``catchup_time_s`` (seeded from the profile).
* **Per-row γ_i** (``nightjar:per-request``, ``decide_rows``): the same T̂ pieces price a mixed step
  (``mixed_base``: draft pass k over the rows with γ_i ≥ k) and ``gamma_allocator.allocate`` hands out
  γ_i from per-request acceptance (shrunk toward the shared optimistic rates), counting expected tokens
  in the closed loop's steady state (rows weighted by their realised tokens per step). Not drafting at all is
  priced without optimism (its arm is rarely played when some row drafts); switching on or off needs a
  ``hysteresis`` margin; the memory term still credits γ=0.
* **Draft tree** (``--draft-tree``): a drafting row that takes a runner-up first draft emits one token more
  (actors/verifier.py). Per bucket the discounted share of drafting rows that did (``tree_rate``) is added to
  E⁺(γ) of every γ > 0; it stays 0 where no row sends runner-ups (no tree, or a batch above its limit).
* **Memory** (``elastic_memory`` only): when requests wait and the pool cannot take one more, γ=0 is
  credited with the batch the draft's blocks would admit: loss(0) = min(loss(0), T̂(B', 0) / B'),
  B' = B + min(waiting, draft_blocks / blocks-per-request, max_batch − B). The weight mover offloads
  after γ=0 holds for its persist steps, so offload follows from this decision.
"""
from __future__ import annotations

import copy
import math
from typing import Any

from nightjar.actors.gamma_allocator import RAGGED_COST, RequestAcceptance, allocate, priced_verify
from nightjar.actors.policies import (
    PlannerState,
    Policy,
    SwitchCostModel,
    bucket,
    bucket_label,
)
from nightjar.kernel.messages import StepTimed

__all__ = ["AcceptanceModel", "ModelNightjarPolicy", "MODEL_OPTS", "load_profile"]

MODEL_OPTS = ("profile", "z", "z_accept", "model_sd", "noise_floor", "arm_discount", "stale_discount", "fade",
              "level_rate", "accept_window", "rho_prior", "cusum_k", "cusum_h", "cusum_keep", "hysteresis",
              "dwell0", "switch_cost", "prompt_charge", "kv_cost", "prior_weight", "hysteresis_onoff",
              "per_request", "harmonic", "ragged_cost")


HARMONIC_ROWS = 16          # rows ``nightjar:harmonic`` reads per decision (a stride sample beyond)


def load_profile(profile: Any):
    """A profile object (``target_time``, ``draft_time``) from itself, a dict or a JSON path; None stays None."""
    if profile is None or hasattr(profile, "target_time"):
        return profile
    from nightjar.actors.step_profile import Profile  # stdlib-only module
    if isinstance(profile, dict):
        return Profile.from_json(profile)
    return Profile.load(str(profile))


class AcceptanceModel:
    """Per-position acceptance shared across batch sizes, with one-sided change detection."""

    def __init__(self, gamma_max: int, window: float = 400.0, prior: float = 0.5, z: float = 1.0,
                 cusum_k: float = 0.5, cusum_h: float = 8.0, keep: float = 0.2, prior_weight: float = 4.0) -> None:
        self.g, self.d, self.pw, self.window = gamma_max, 1.0 - 1.0 / window, prior_weight, window
        self.prior, self.z = prior, z
        self.acc = [0.0] * gamma_max
        self.n = [0.0] * gamma_max
        self.k, self.h, self.keep = cusum_k, cusum_h, keep
        self.up = self.dn = 0.0
        self.alarms = 0
        self.e = [1.0] * (gamma_max + 1)
        self.e_hi = [1.0] * (gamma_max + 1)
        self.rate_hi = [prior] * gamma_max      # optimistic per-position rates (E⁺'s factors)
        self._refresh()

    def empty(self) -> AcceptanceModel:
        """A model with the same parameters and no counts."""
        return AcceptanceModel(self.g, self.window, self.prior, self.z, self.k, self.h, self.keep, self.pw)

    def rho(self, i: int) -> float:
        """Smoothed rate at position i: ``prior_weight`` pseudo-samples at the previous position's rate
        (``prior`` for the first), so deep positions, which see data slowly, start from their neighbour."""
        prior = self.rho(i - 1) if i else self.prior
        return (self.acc[i] + self.pw * prior) / (self.n[i] + self.pw)

    def _refresh(self) -> None:
        """Recompute E(γ) and its optimistic version."""
        p = p_hi = 1.0
        prior = self.prior
        for i in range(self.g):
            r = (self.acc[i] + self.pw * prior) / (self.n[i] + self.pw)
            prior = r
            r_hi = min(0.995, r + self.z * math.sqrt(r * (1.0 - r) / (self.n[i] + self.pw)))
            self.rate_hi[i] = r_hi
            p, p_hi = p * r, p_hi * r_hi
            self.e[i + 1] = self.e[i] + p
            self.e_hi[i + 1] = self.e_hi[i] + p_hi

    def observe(self, per_pos: tuple[int, ...], drafts: int, reached_per_pos: tuple[int, ...] = ()) -> None:
        """One drafting step: ``drafts`` rows, ``per_pos[i]`` of them accepted position i; with per-row γ,
        ``reached_per_pos[i]`` rows drafted position i with every earlier one accepted (else per_pos[i-1])."""
        if drafts <= 0 or not per_pos:
            return
        n0 = reached_per_pos[0] if reached_per_pos else drafts
        if n0 > 0:
            self._detect(per_pos[0], n0)
        reached = drafts
        for i, a in enumerate(per_pos[: self.g]):
            if reached_per_pos:
                reached = reached_per_pos[i] if i < len(reached_per_pos) else 0
            if reached <= 0:
                break
            f = self.d ** reached
            self.acc[i] = f * self.acc[i] + a
            self.n[i] = f * self.n[i] + reached
            reached = a
        self._refresh()

    def _detect(self, a: int, n: int) -> None:
        """CUSUMs on first-position acceptance: a drop and a rise, each forgets part of the counts."""
        if self.n[0] < 20.0:
            return
        r = min(max(self.rho(0), 0.02), 0.98)
        z = max(-4.0, min(4.0, (a - n * r) / math.sqrt(n * r * (1.0 - r))))
        self.up = max(0.0, self.up + z - self.k)
        self.dn = max(0.0, self.dn - z - self.k)
        if self.up > self.h or self.dn > self.h:
            self.up = self.dn = 0.0
            self.alarms += 1
            self.acc = [x * self.keep for x in self.acc]
            self.n = [x * self.keep for x in self.n]


class LookupSplit:
    """Prompt lookup's drafts learnt apart from the draft model's (``StepTimed.lookup_drafts``): a row whose
    context repeats drafts by lookup, accepts long runs and runs no draft pass, so the two are priced apart and
    mixed by the share of drafting rows expected to look up next step. That share follows from the last drafting
    step's, ``share``: a row that looked up is likelier to again (in the middle of a copied passage it goes on
    copying; on the real pair at N = 4, 0.59 against 0.15 for one that did not). ``expected`` is the discounted
    least-squares line from one drafting step's share to the next one's (``window`` pairs), the last share itself
    until ``min_pairs`` pairs were seen. Created at the first step with lookup drafts; until then every draft was
    the model's, so ``head`` starts as a copy of the pooled model."""

    def __init__(self, pooled: AcceptanceModel, window: float = 200.0, min_pairs: float = 8.0) -> None:
        self.head = copy.deepcopy(pooled)
        self.lookup = pooled.empty()
        self.share = 0.0
        self.expected = 0.0                 # the next drafting step's share, predicted from ``share``
        self._d, self._min = 1.0 - 1.0 / window, min_pairs
        self._sums = [0.0] * 5              # discounted Σw, Σx, Σy, Σxx, Σxy over (share, next share) pairs
        self._first = True

    def observe(self, r: StepTimed) -> None:
        n, k = r.num_drafts or r.batch_size, r.lookup_drafts
        if k:
            lk = r.lookup_accepted_per_pos
            self.lookup.observe(lk, k)
            if n > k:
                self.head.observe(tuple(a - b for a, b in zip(r.accepted_per_pos, lk)), n - k)
        else:
            self.head.observe(r.accepted_per_pos, n, r.reached_per_pos)
        if n > 0:
            self._learn_share(k / n)

    def _learn_share(self, y: float) -> None:
        """One more drafting step's share ``y``: a pair with the last one, then the next step's expected share."""
        w, sx, sy, sxx, sxy = self._sums
        if not self._first:
            x, d = self.share, self._d
            w, sx, sy, sxx, sxy = d * w + 1.0, d * sx + x, d * sy + y, d * sxx + x * x, d * sxy + x * y
            self._sums = [w, sx, sy, sxx, sxy]
        self._first, self.share = False, y
        var = w * sxx - sx * sx
        if w < self._min or var <= 1e-6 * w * w:
            self.expected = y
            return
        b = (w * sxy - sx * sy) / var
        self.expected = min(1.0, max(0.0, (sy - b * sx) / w + b * y))

    def e_hi(self) -> list[float]:
        """E⁺(γ) of the next step's drafting rows: the two optimistic curves mixed by the expected share."""
        s = self.expected
        return [h + s * (x - h) for h, x in zip(self.head.e_hi, self.lookup.e_hi)]


class _Arm:
    """Discounted sums (per sample of the arm) of the ratio measured / (level · base) for one
    (bucket, γ); ``t`` is the bucket's step count at the last sample: the samples of an arm left alone
    fade per step of the bucket (``ModelNightjarPolicy._faded``), so its mean returns to its prior and
    it is re-tried if it could be best."""

    __slots__ = ("n", "w", "s", "t")

    def __init__(self) -> None:
        self.n, self.w, self.s, self.t = 0, 0.0, 0.0, 0


def _extrapolate(ts: list[tuple[float, float]], arms: list[_Arm]) -> None:
    """Without a profile: an arm with no data in the bucket gets the line through the played arms'
    times over γ (sample-weighted least squares, ≥ 2 played arms), keeping its prior uncertainty."""
    sw = sx = sy = sxx = sxy = 0.0
    for g, (t, _) in enumerate(ts):
        w = arms[g].w
        if w > 0.0:
            sw, sx, sy, sxx, sxy = sw + w, sx + w * g, sy + w * t, sxx + w * g * g, sxy + w * g * t
    var = sxx * sw - sx * sx
    if var <= 1e-9 * sw * sw:
        return
    slope = (sxy * sw - sx * sy) / var
    icpt = (sy - slope * sx) / sw
    for g, arm in enumerate(arms):
        if arm.w <= 0.0:
            ts[g] = (max(icpt + slope * g, 0.05 * ts[g][0]), ts[g][1])


class _Scaled:
    """A profile whose step times are multiplied by ``scale`` (a deliberately wrong model)."""

    def __init__(self, profile: Any, scale: float) -> None:
        self.p, self.scale = profile, scale
        self.name = f"{getattr(profile, 'name', 'profile')}x{scale:g}"
        self.prefill_s_per_token = getattr(profile, "prefill_s_per_token", 0.0) * scale
        self.catchup_c0 = getattr(profile, "catchup_c0", 0.0) * scale
        self.catchup_per_token = getattr(profile, "catchup_per_token", 0.0) * scale
        self.kv_s_per_ctx_token = getattr(profile, "kv_s_per_ctx_token", 0.0) * scale
        self.ctx_ref = getattr(profile, "ctx_ref", 0)

    def target_time(self, b: float, q: float) -> float:
        return self.p.target_time(b, q) * self.scale

    def draft_time(self, b: float) -> float:
        return self.p.draft_time(b) * self.scale


def _generic_base(b: int, g: int) -> float:
    """Profile-free prior shape (relative units): a fixed cost, a draft pass ~12 % of it per γ, and
    a per-token cost past a 4-token knee (1/16 of the fixed cost per token). Corrections refine it."""
    return 1.0 + 0.12 * g + max(0, b * (g + 1) - 4) / 16.0


class ModelNightjarPolicy(Policy):
    """The default Nightjar planner: model-based, optimistic, with hysteresis and a memory term."""

    name = "nightjar"
    elastic_memory = True
    holds_zero = True           # hysteresis makes γ = 0 sticky anyway: holding it one more step delays SD by a step
    learns_periods = True       # the planner hands it decode steps' wall-clock periods (observe_period)

    def __init__(self, gamma_max: int, seed: int = 0, *, profile: Any = None, z: float = 1.5,
                 z_accept: float = 0.5, model_sd: float | None = None, prior_weight: float | None = None,
                 noise_floor: float = 0.02, arm_discount: float = 0.97, stale_discount: float = 0.98,
                 fade: float = 0.995, level_rate: float = 0.2, accept_window: float = 400.0, rho_prior: float = 0.5,
                 cusum_k: float = 0.5, cusum_h: float = 8.0, cusum_keep: float = 0.2, hysteresis: float = 0.02,
                 hysteresis_onoff: float = 0.04, dwell0: float = 64.0, switch_cost: bool = True,
                 prompt_charge: bool = True, kv_cost: bool = True, per_request: bool = False,
                 harmonic: bool = False, ragged_cost: float = RAGGED_COST) -> None:
        super().__init__(gamma_max)
        if not (0.0 < arm_discount <= 1.0 and 0.0 < level_rate <= 1.0 and 0.0 < fade <= 1.0) or (model_sd or 1) <= 0 \
                or z < 0 or not ragged_cost >= 0:
            raise ValueError("nightjar: arm_discount, level_rate and fade in (0, 1], model_sd > 0, z >= 0, "
                             "ragged_cost >= 0")
        self.seed = seed                    # deterministic: no randomness is drawn
        self.ragged_cost = ragged_cost      # per-row γ: a ragged verify's price over uniform rows', less 1
        self.profile = load_profile(profile)
        self.model_sd, self.prior_weight = model_sd, prior_weight
        self.z, self.noise_floor = z, noise_floor
        self._set_model_var()
        self.arm_discount, self.level_rate, self.hyst = arm_discount, level_rate, hysteresis
        self.hyst_onoff, self.stale_discount, self.fade = hysteresis_onoff, stale_discount, fade
        self.drift_var = 0.03 ** 2
        self.accept = AcceptanceModel(gamma_max, accept_window, rho_prior, z_accept, cusum_k, cusum_h, cusum_keep)
        self.level = 0.0                    # seconds per base unit; 0 until the first decode step
        self.noise2 = 0.05 ** 2             # per-step squared relative deviation (EMA)
        self.pf_nx = self.pf_xx = 0.0       # prefill seconds/token: Σ n·resid, Σ n²  (discounted)
        self.pf_obs = 0
        self.mix_w = self.mix_s = 0.0       # extra seconds per token drafted beside a prompt chunk: Σ w, Σ w·x
        self.mix_t = 0                      # ``clock`` at its last sample
        self._outside: dict[tuple[bool, bool, int], tuple[float, float]] = {}   # (drafting, chunk, bucket): Σw, Σw·s
        self.switch = SwitchCostModel("sum", self._catchup_seed(), robust=True)
        self.switch_cost, self.prompt_charge, self.kv_cost = switch_cost, prompt_charge, kv_cost
        self.dwell, self._run = float(dwell0), 0
        self.new_tok = self.new_req = 0.0   # EMA of prompt tokens / prompts entering decode per step
        self._base: list[tuple[list[float], float] | None] = []   # per B: target part per γ, one draft pass
        self.draft_w = self.draft_s = 0.0   # discounted sums of measured draft seconds / the draft base priced
        self.draft_t = self.clock = 0       # decode steps observed: at the last drafting one, and in all
        self._arms: list[list[_Arm]] = []
        self._cur: list[int] = []
        self._steps: list[int] = []          # observed steps per bucket
        self._now = self._c = 0
        self._levels: list[float] = []      # per bucket, without a profile
        self.last_explore = False
        self.decisions = self.kv_decisions = 0
        self.per_request = bool(per_request)     # γ_i per row (``decide_rows``); else one γ per step
        self.harmonic = bool(harmonic) and not self.per_request   # one γ, priced by rows' own rates
        self.req_accept = RequestAcceptance(gamma_max)
        self._tt: list[list[float]] = []         # target(n, q) for q = 0..Γmax+1, per n (per-row allocator)
        self._dt: list[float] = []               # draft(n)
        self.row_decisions = 0
        self._shapes: set[tuple[int, int]] = set()         # (B, γ) whose first step was seen (``_learn_time``)
        self._tree: dict[int, tuple[float, float]] = {}     # per bucket: discounted (tree hits, drafting rows)
        self._tree_d = 1.0 - 1.0 / accept_window
        self.looked: LookupSplit | None = None   # prompt lookup's drafts apart (from the first step that had any)

    def tree_rate(self, c: int) -> float:
        """Share of drafting rows in bucket ``c`` that took a runner-up first draft (draft tree), discounted."""
        hits, rows = self._tree.get(c, (0.0, 0.0))
        return hits / rows if rows > 0 else 0.0

    def _learn_tree(self, r: StepTimed) -> None:
        n = r.num_drafts or r.batch_size
        c = bucket(r.batch_size)
        if r.tree_hits or c in self._tree:
            hits, rows = self._tree.get(c, (0.0, 0.0))
            f = self._tree_d ** n
            self._tree[c] = (f * hits + r.tree_hits, f * rows + n)

    def set_profile(self, profile: Any, scale: float = 1.0) -> None:
        """Use ``profile`` (times multiplied by ``scale``) as the step-time model from now on."""
        self.profile = _Scaled(load_profile(profile), scale) if scale != 1.0 else load_profile(profile)
        self._base = []
        self._set_model_var()
        if self.switch.observations == 0:
            self.switch = SwitchCostModel("sum", self._catchup_seed(), robust=True)

    def _set_model_var(self) -> None:
        """Prior of the step-time model: sd 8 % and 4 pseudo-samples with a profile; sd 30 % and half
        a pseudo-sample for the generic prior (unless given)."""
        has = self.profile is not None
        sd = self.model_sd if self.model_sd is not None else (0.08 if has else 0.30)
        self.model_var = sd * sd
        self.prior_w = self.prior_weight if self.prior_weight is not None else (4.0 if has else 0.5)

    # ------------------------------------------------------------ model pieces
    def _catchup_seed(self) -> tuple[float, float] | None:
        p = self.profile
        c1 = getattr(p, "catchup_per_token", None) if p is not None else None
        return None if c1 is None else (float(getattr(p, "catchup_c0", 0.0)), float(c1))

    def base_row(self, b: int, heads: float | None = None, ctx: float = -1) -> list[float]:
        """base(B, γ) for γ = 0..gamma_max (in the level's units, for the bucket ``_ctx`` selected): the
        target's forward plus γ draft passes, each priced at the profile's (or the generic prior's) pass
        until a draft time was measured, then at the measured seconds (``draft_scale``) over the level.
        ``heads``: rows the draft passes run (the others draft by prompt lookup), B when not given; ``ctx``:
        the rows' context in all (``context_base``; < 0: the profile's own)."""
        tgt, dpass = self._base_parts(b)
        if heads is not None and heads < b:
            dpass = self._pass_of(b, heads)
        d = dpass * self._draft_factor()
        add = self.context_base(b, ctx)
        return [max(max(t + add, 0.2 * t) + g * d, 1e-9) for g, t in enumerate(tgt)]

    def context_base(self, b: float, ctx: float) -> float:
        """What B rows reading ``ctx`` tokens of context in all add to the profile's T(B, q) (negative when
        shorter than the context it was timed at): its ``kv_s_per_ctx_token`` past ``ctx_ref`` a row. The same
        for every γ: a verify row's queries read its KV once. 0 without a profile or a context."""
        kv = getattr(self.profile, "kv_s_per_ctx_token", 0.0) if self.profile is not None else 0.0
        if not kv or ctx < 0:
            return 0.0
        return kv * (ctx - b * getattr(self.profile, "ctx_ref", 0))

    def _pass_of(self, b: int, heads: float) -> float:
        """One draft pass over ``heads`` rows of a B-row step, linear between whole rows (0 rows: free)."""
        dt = self._tables(b)[1]
        lo = int(heads)
        return dt[lo] if lo >= b else dt[lo] + (heads - lo) * (dt[lo + 1] - dt[lo])

    def _heads(self, b: int) -> float | None:
        """Rows expected to run the draft passes next step: those not expected to look up (``LookupSplit``)."""
        return None if self.looked is None else b * (1.0 - self.looked.expected)

    def _draft_factor(self) -> float:
        """What a draft base unit is worth in the level's units: measured seconds per priced unit / level.
        The measurements fade while no step drafts (``_faded``); below one sample's weight the profile's
        price (1) fills the rest, so a draft measured slow in a transient is tried again."""
        lvl = self._level()
        w, s = self._faded(self.draft_w, self.draft_s, self.draft_t, self.clock)
        if w <= 0.0 or lvl <= 0.0:
            return 1.0
        return s / (w * lvl) if w >= 1.0 else s / lvl + (1.0 - w)

    @property
    def draft_scale(self) -> float:
        """Measured draft seconds per priced unit (0: none yet), faded as ``_draft_factor`` reads it."""
        w, s = self._faded(self.draft_w, self.draft_s, self.draft_t, self.clock)
        return s / w if w > 0.0 else 0.0

    def _faded(self, w: float, s: float, t: int, now: int) -> tuple[float, float]:
        """Discounted sums (weight, sum) last fed at ``t``, faded by ``fade`` per step since."""
        if w and t != now:
            f = self.fade ** (now - t)
            return w * f, s * f
        return w, s

    def _base_parts(self, b: int) -> tuple[list[float], float]:
        """(target part of base(B, γ) for γ = 0..gamma_max, one draft pass), cached per B."""
        while len(self._base) <= b:
            self._base.append(None)
        parts = self._base[b]
        if parts is None:
            p, G = self.profile, self.gamma_max
            if p is None:
                parts = ([_generic_base(b, g) - 0.12 * g for g in range(G + 1)], 0.12)
            else:
                parts = ([p.target_time(b, g + 1) for g in range(G + 1)], p.draft_time(b))
            self._base[b] = parts
        return parts

    def _learn_draft(self, r: StepTimed) -> None:
        """The draft passes' measured seconds against the base the model priced them at: the draft's share
        of a step is known apart from the target's, so γ = 0 (which never drafts) does not inherit the
        draft's error through its bucket's pooled correction. In the engine a draft pass costs 1.3-2.3x a bare
        draft forward of the profile (Python per pass: layout, argmax, bookkeeping)."""
        if r.gamma <= 0 or r.draft_time_s <= 0.0:
            return
        if r.drafted_per_pos:
            dt = self._tables(r.batch_size)[1]
            priced = sum(dt[n] for n in r.drafted_per_pos if n > 0)
        else:                                           # the passes ran only the rows that did not look up
            priced = r.gamma * self._pass_of(r.batch_size, r.batch_size - r.lookup_drafts)
        if priced <= 0.0:
            return
        w, s = self._faded(self.draft_w, self.draft_s, self.draft_t, self.clock)
        self.draft_w, self.draft_s, self.draft_t = 0.9 * w + 1.0, 0.9 * s + r.draft_time_s / priced, self.clock

    def _ctx(self, c: int) -> list[_Arm]:
        """The bucket's arms; sets ``_now`` to its step count (what arm decay is measured against)."""
        while len(self._arms) <= c:
            self._arms.append([_Arm() for _ in range(self.gamma_max + 1)])
            self._cur.append(-1)
            self._steps.append(0)
        self._now = self._steps[c]
        self._c = c
        return self._arms[c]

    def _level(self) -> float:
        """Seconds per base unit for the bucket ``_ctx`` last selected: one global level with a
        profile; per bucket without one (the generic prior's B-shape is not trusted across buckets),
        a new bucket starting from the nearest one below it that has a level."""
        if self.profile is not None:
            return self.level
        lv = self._levels
        c = self._c
        while len(lv) <= c:
            lv.append(0.0)
        if lv[c] <= 0.0:
            return next((lv[i] for i in range(c - 1, -1, -1) if lv[i] > 0.0), self.level)
        return lv[c]

    def _set_level(self, v: float) -> None:
        self.level = v
        if self.profile is None:
            self._levels[self._c] = v

    def predict(self, b: int, g: int) -> tuple[float, float]:
        """(T̂ seconds, its relative standard error) for B rows at γ (no extras), its period outside the timed
        forward and draft passes included."""
        c = bucket(b)
        t, se = self._time(self._ctx(c)[g], self.base_row(b)[g])
        return t + self.outside(g, False, c), se

    def outside(self, g: int, chunk: bool, c: int) -> float:
        """Seconds a step of γ's family (γ = 0, or drafting) with or without a prompt chunk takes in bucket ``c``
        past its timed forward and draft passes (bus hand-offs, the head's work on features, Python per row; a
        γ = 0 step runs ahead of much of it): the family's discounted mean in the bucket, else in the nearest
        bucket that has one, else the chunk-less family's, else 0."""
        f, out = g > 0, self._outside
        for ch in ((chunk, False) if chunk else (False,)):
            got = out.get((f, ch, c))
            if got is None:
                near = [(abs(k[2] - c), v) for k, v in out.items() if k[0] == f and k[1] == ch]
                got = min(near)[1] if near else None
            if got is not None:
                return got[1] / got[0]
        return 0.0

    def _with_outside(self, ts: list[tuple[float, float]], chunk: bool, c: int) -> list[tuple[float, float]]:
        """Each γ's (T̂, se) with its family's ``outside`` added to T̂."""
        o0, o1 = self.outside(0, chunk, c), self.outside(1, chunk, c)
        return [(t + (o1 if g else o0), se) for g, (t, se) in enumerate(ts)]

    def _learn_outside(self, r: StepTimed, seconds: float) -> None:
        key = (r.gamma > 0, r.num_prefill_tokens > 0, bucket(r.batch_size))
        w, s = self._outside.get(key, (0.0, 0.0))
        self._outside[key] = (0.95 * w + 1.0, 0.95 * s + seconds - r.step_time_s)

    def _pooled(self, arms: list[_Arm]) -> tuple[float, float] | None:
        """(Σ w, Σ s) over a bucket's arms with a profile; None without one (``_prior_of``)."""
        if self.profile is None:
            return None
        w = s = 0.0
        for a in arms:
            aw, as_ = self._faded(a.w, a.s, a.t, self._now)
            w, s = w + aw, s + as_
        return w, s

    def _prior_of(self, own: tuple[float, float], pooled: tuple[float, float] | None) -> float:
        """The correction an arm is shrunk toward. With a profile: the pooled correction of its bucket's
        *other* arms, shrunk toward 1 by ``prior_weight`` pseudo-samples. The profile's shape across γ
        within a bucket is trusted, its level per bucket is not (in a real run B = 1 steps came in at 0.7×
        what the level learned at B = 4 predicted): an arm not yet played starts from what its bucket's
        other arms measured, not from the global level. Without a profile the bucket level already holds
        it (``_renormalise``). ``own``: the arm's faded (weight, sum); ``pooled``: its bucket's."""
        if pooled is None:
            return 1.0
        k, w, s = self.prior_w, pooled[0] - own[0], pooled[1] - own[1]
        if w <= 1e-9:                   # a bucket with no data yet: what every bucket measured (the level and
            w = s = 0.0                 # the corrections are only known as a product: the level alone was 9 % off)
            for c, arms in enumerate(self._arms):
                for a in arms:
                    aw, as_ = self._faded(a.w, a.s, a.t, self._steps[c])
                    w, s = w + aw, s + as_
        return (k + s) / (k + w)

    def _time(self, arm: _Arm, base: float) -> tuple[float, float]:
        """Correction = (k·m + Σ ratio) / (k + w): k = ``prior_weight`` pseudo-samples at the bucket's
        correction m (``_prior_of``), so a young arm's first samples cannot absorb a drift the level
        is still learning; its standard error falls from ``model_sd`` (no data) to the per-step noise / √w."""
        k = self.prior_w
        mk2, nv = self.model_var * k * k, max(self.noise2, self.noise_floor ** 2)
        lvl = self._level()
        lvl = lvl if lvl > 0.0 else (1.0 if self.profile is not None else 0.03)
        w, s = own = self._faded(arm.w, arm.s, arm.t, self._now)        # as in _times
        mean = (k * self._prior_of(own, self._pooled(self._arms[self._c])) + s) / (k + w)
        if w and arm.t != self._now:
            w = arm.w * self.stale_discount ** (self._now - arm.t)
        return lvl * base * mean, math.sqrt(mk2 + nv * w) / (k + w)

    def _times(self, arms: list[_Arm], bases: list[float]) -> list[tuple[float, float]]:
        """``_time`` for several arms of the current bucket (the hot path of ``decide``)."""
        k, now, sd = self.prior_w, self._now, self.stale_discount
        mk2, nv = self.model_var * k * k, max(self.noise2, self.noise_floor ** 2)
        lvl = self._level()
        lvl = lvl if lvl > 0.0 else (1.0 if self.profile is not None else 0.03)
        pooled = self._pooled(arms)
        out = []
        for arm, base in zip(arms, bases):
            w, s = own = self._faded(arm.w, arm.s, arm.t, now)     # a resting arm's mean returns to its prior
            mean = (k * self._prior_of(own, pooled) + s) / (k + w)
            if w and arm.t != now:                # and it loses confidence faster
                w = arm.w * sd ** (now - arm.t)
            out.append((lvl * base * mean, math.sqrt(mk2 + nv * w) / (k + w)))
        return out

    @property
    def observes_rows(self) -> bool:
        """Whether the planner should feed per-request acceptance (``observe_rows``) and the rows' ids."""
        return self.per_request or self.harmonic

    def _rows_e(self, state: PlannerState) -> list[float]:
        """``harmonic``: per γ, the harmonic mean over the decode rows of each row's own expected tokens
        E_i⁺(γ) (per-request rates shrunk toward the shared optimistic ones; a row that may not draft has
        E_i = 1). A request needs L / E_i steps, so the time to serve the rows is Σ_i 1/E_i, not B / mean E_i:
        with a mix of easy and hard requests a deep γ finishes the easy ones sooner and leaves the batch
        to the hard ones, which the arithmetic mean of the rows present does not see. Over at most
        ``HARMONIC_ROWS`` rows (every k-th): the planner runs every step."""
        G = self.gamma_max
        ids, spec = state.req_ids, state.speculate
        k = -(-len(ids) // HARMONIC_ROWS)
        if k > 1:
            ids, spec = ids[::k], spec[::k]
        inv = [0.0] * (G + 1)                       # Σ_i 1 / E_i(γ)
        for row in self.req_accept.gains_rows(ids, spec, self.accept.rate_hi, G):
            e = 1.0
            inv[0] += 1.0
            for g in range(G):
                if row:                             # [] = may not draft: E_i = 1
                    e += row[g]
                inv[g + 1] += 1.0 / e
        return [inv[0] / x for x in inv]

    # ------------------------------------------------------------ decide
    def decide(self, batch_size: int, state: PlannerState) -> int:
        """Optimistic argmin of seconds per token, kept unless clearly beaten (hysteresis)."""
        if not state.draft_resident or batch_size <= 0:
            return 0
        b, c = batch_size, bucket(batch_size)
        arms, row = self._ctx(c), self.base_row(b, self._heads(b), state.context_tokens)
        z, mixed = self.z, state.prefill_tokens > 0
        x = self.mixed_extra if mixed else 0.0
        if self.harmonic and state.req_ids:
            e_hi = self._rows_e(state)
        else:
            e_hi = self.accept.e_hi if self.looked is None else self.looked.e_hi()
        extra = self._extras(state)
        ts = self._times(arms, row)
        if self.profile is None:
            _extrapolate(ts, arms)
        ts = self._with_outside(ts, mixed, c)
        scores = [ts[0][0] * (1.0 - z * ts[0][1]) / b]
        tree = self.tree_rate(c)
        for g in range(1, self.gamma_max + 1):
            t, se = ts[g]
            scores.append((t * (1.0 - z * se) + extra + x * b * g) / (b * (e_hi[g] + tree)))
        if self.kv_cost and self.elastic_memory:
            scores[0] = min(scores[0], self._kv_alt(b, state))
        self.last_scores = scores
        best = 0
        for g in range(1, len(scores)):
            if scores[g] < scores[best]:
                best = g
        cur = self._cur[c]
        if 0 <= cur <= self.gamma_max and best != cur:
            h = self.hyst_onoff if best == 0 else self.hyst     # switching on already pays its catch-up
            if scores[best] > (1.0 - h) * scores[cur]:
                best = cur
        if not mixed:                   # a step with a prompt chunk decides for itself, not for its bucket
            self._cur[c] = best
        self.decisions += 1
        self.last_explore = False
        return best

    # ------------------------------------------------------------ per-row γ (issue 17)
    def _tables(self, b: int) -> tuple[list[list[float]], list[float]]:
        """Dense target(n, q) and draft(n) for n ≤ b (the profile's, or the generic prior's split)."""
        tt, dt, p, G = self._tt, self._dt, self.profile, self.gamma_max
        while len(tt) <= b:
            n = len(tt)
            if p is None:
                tt.append([0.0] + [1.0 + max(0, n * q - 4) / 16.0 if n else 0.0 for q in range(1, G + 2)])
                dt.append(0.12 if n else 0.0)
            else:
                tt.append([0.0] + [p.target_time(n, q) if n else 0.0 for q in range(1, G + 2)])
                dt.append(p.draft_time(n) if n else 0.0)
        return tt, dt

    def mixed_base(self, b: int, drafted_per_pos) -> float:
        """base of a step with B rows whose draft pass k ran drafted_per_pos[k-1] rows (see gamma_allocator)."""
        tt, dt = self._tables(b)
        deep = [n for n in drafted_per_pos if n > 0]
        out = priced_verify(tt[b], b, sum(deep), deep[-1] if deep else b, self.ragged_cost)
        f = self._draft_factor()
        for n in drafted_per_pos:
            if n > 0:
                out += dt[n] * f
        return max(out, 1e-9)

    def decide_rows(self, batch_size: int, state: PlannerState, req_ids, speculate, row_lags=None) -> tuple[int, ...]:
        """γ_i per decode row: the greedy allocator over per-request gains, priced by this planner's model."""
        b = batch_size
        if not state.draft_resident or b <= 0:
            return (0,) * b
        c = bucket(b)
        arms, row = self._ctx(c), self.base_row(b)
        ts = self._times(arms, row)
        if self.profile is None:
            _extrapolate(ts, arms)
        ts = self._with_outside(ts, False, c)
        z, G = self.z, self.gamma_max
        factor = [t * (1.0 - z * se) / base for (t, se), base in zip(ts, row)]
        factor[0] = ts[0][0] / row[0]           # no optimism for not drafting at all (see docs/planner.md)
        shared = self.accept.rate_hi
        ra = self.req_accept
        gains = ra.gains_rows(req_ids, speculate, shared, G)
        extra, row_extra = self._row_extras(state, row_lags)
        tt, dt = self._tables(b)
        f = self._draft_factor()
        if f != 1.0:
            dt = [x * f for x in dt]
        weights = ra.weights_rows(req_ids[:b])  # arrival weights of the decode rows: the loop's steady state
        alloc = allocate(gains, tt, dt, factor, extra, row_extra, weights, self.ragged_cost)
        out = alloc.gammas
        zero = alloc.zero_score
        if self.kv_cost and self.elastic_memory:
            zero = min(zero, self._kv_alt(b, state))
        if any(out):
            h = self.hyst if state.prev_gamma == 0 else 0.0
            if not alloc.score < (1.0 - h) * zero:
                out = (0,) * b
        elif state.prev_gamma > 0 and not zero < (1.0 - self.hyst) * alloc.best_on_score:
            out = self._keep_on(gains, tt, dt, factor, extra, row_extra, weights)
        self._cur[c] = max(out, default=0)
        self.decisions += 1
        self.row_decisions += 1
        return out

    def _keep_on(self, gains, tt, dt, factor, extra, row_extra, weights=None) -> tuple[int, ...]:
        """Hysteresis on turning speculation off: the best allocation that drafts at least one token."""
        best = allocate(gains, tt, dt, [math.inf] + factor[1:], extra, row_extra, weights, self.ragged_cost)
        return best.gammas

    def _row_extras(self, state: PlannerState, row_lags) -> tuple[float, list[float] | None]:
        """Seconds every drafting step pays (steady prompt prefill; a catch-up call's fixed cost when
        switching on) and, per row, its own generated-token catch-up spread over the expected dwell."""
        extra = self._extras(PlannerState(draft_resident=True, prev_gamma=state.prev_gamma, lag_tokens=0,
                                          new_prompt_tokens=state.new_prompt_tokens, new_prompts=state.new_prompts))
        ab = self.switch.coef()
        if ab is None or not self.switch_cost or not row_lags:
            return extra, None
        c1 = ab[1] / self.dwell
        return extra, [c1 * lag if lag >= 2 else 0.0 for lag in row_lags]

    def observe_rows(self, req_ids, gammas, accepted) -> None:
        """Per-request acceptance from a verified step (decode rows: γ_i drafted, accepted)."""
        self.req_accept.observe(req_ids, gammas, accepted)

    def _extras(self, state: PlannerState) -> float:
        """Seconds per step every γ>0 arm pays beyond T̂: steady prompt prefill + spread catch-up."""
        ab = self.switch.coef()
        if ab is None:
            return 0.0
        c0, c1 = ab
        if self.prompt_charge:
            self.new_tok = 0.95 * self.new_tok + 0.05 * state.new_prompt_tokens
            self.new_req = 0.95 * self.new_req + 0.05 * state.new_prompts
        out = c1 * self.new_tok + c0 * min(1.0, self.new_req) if self.prompt_charge else 0.0
        if self.switch_cost and state.prev_gamma == 0:
            lag = state.lag_tokens if state.lag_tokens >= 0 else state.max_draft_lag
            if lag > 0:
                out += (c0 + c1 * lag) / self.dwell
        return out

    def _kv_alt(self, b: int, state: PlannerState) -> float:
        """Seconds per token at γ=0 with the draft's blocks serving as KV (inf when memory is not short)."""
        w, free, used = state.num_waiting, state.free_blocks, state.total_blocks - state.free_blocks
        if w <= 0 or free < 0 or state.draft_blocks <= 0 or used <= 0:
            return math.inf
        per_req = used / b
        if free >= per_req:
            return math.inf                          # the pool could take another request: not KV-bound
        extra = min(w, int(state.draft_blocks / per_req), max(0, state.max_batch - b))
        if extra <= 0:
            return math.inf
        b2 = b + extra
        now, c = self._now, self._c
        ctx = state.context_tokens * b2 / b if state.context_tokens >= 0 else -1
        t, _ = self._time(self._ctx(bucket(b2))[0], self.base_row(b2, None, ctx)[0])
        t += self.outside(0, False, bucket(b2))
        self._now, self._c = now, c
        self.kv_decisions += 1
        return t / b2

    # ------------------------------------------------------------ observe
    def observe(self, result: StepTimed, learn_time: bool = True) -> None:
        """Update acceptance, the catch-up line, dwell, the prefill term, level and the played arm (the last
        three from ``step_time_s`` unless ``learn_time`` is off: the step's period comes later)."""
        r = result
        self.switch.observe(r)
        if r.batch_size <= 0 or not 0 <= r.gamma <= self.gamma_max:
            return
        self.clock += 1
        if r.gamma > 0:
            self._run += 1
            if r.accepted_per_pos:
                if r.lookup_drafts and self.looked is None:
                    self.looked = LookupSplit(self.accept)
                self.accept.observe(r.accepted_per_pos, r.num_drafts or r.batch_size, r.reached_per_pos)
                if self.looked is not None:
                    self.looked.observe(r)
            self._learn_tree(r)
        elif self._run and not r.num_prefill_tokens:     # a prompt chunk's γ = 0 step does not end a run
            self.dwell = min(512.0, max(16.0, 0.9 * self.dwell + 0.1 * self._run))
            self._run = 0
        if r.step_time_s > 0.0:
            self._learn_draft(r)
            if learn_time:
                self._learn_time(r, r.step_time_s)

    def observe_period(self, result: StepTimed, seconds: float, context_tokens: int = -1) -> None:
        """What the step cost the engine: its wall-clock period (one schedule to the next, catch-up taken
        out), the bus, the hand-offs and a run-ahead's overlap included. The part past its timed forward and
        draft passes is learnt per family (``outside``): a drafting step pays hops and head work a γ = 0 step
        runs ahead of (actors/planner.py), and an arm that has not played must not inherit them through its
        bucket's pooled correction; the arms and the level learn the timed part, the profile's own measure.
        ``context_tokens``: its decode rows' context (``PlannerState.context_tokens``), priced as ``decide`` does."""
        r = result
        if r.batch_size > 0 and 0 <= r.gamma <= self.gamma_max and seconds > 0.0:
            if r.step_time_s > 0.0:
                self._learn_outside(r, seconds)
                self._learn_time(r, r.step_time_s, context_tokens)
            else:
                self._learn_time(r, seconds, context_tokens)

    def _learn_time(self, r: StepTimed, t: float, ctx: int = -1) -> None:
        b, g = r.batch_size, r.gamma
        arm = self._ctx(bucket(b))[g]                 # first: the base's draft part reads the bucket's level
        if r.drafted_per_pos:
            tgt = self._base_parts(b)[0][0]
            base = self.mixed_base(b, r.drafted_per_pos) + max(self.context_base(b, ctx), -0.8 * tgt)
        else:
            base = self.base_row(b, b - r.lookup_drafts, ctx)[g]
        if (b, g) not in self._shapes:
            self._shapes.add((b, g))
            if self._cold(arm, base, t):
                return
        if r.num_prefill_tokens > 0:
            if self._level() <= 0.0:
                return
            pred = self._time(arm, base)[0]
            if g > 0:                           # priced apart: a decode arm does not learn it
                self._learn_mixed(r, t, pred)
            else:                               # the prompt tokens' price; the arms and the level keep to
                self._learn_prefill(t, r.num_prefill_tokens, pred)     # decode-only steps
            return
        lvl = self._level()
        if lvl <= 0.0:
            lvl = t / base
        else:                                   # the surprise goes to the level (common drift) or to
            pred, se = self._time(arm, base)    # the arm, by how well the arm is known: a young or
            dev = t / pred - 1.0                # stale arm mostly corrects itself
            self.noise2 += 0.05 * (min(dev * dev, 1.0) - self.noise2)
            share = self.drift_var / (self.drift_var + se * se)
            lvl *= 1.0 + self.level_rate * share * dev
        self._set_level(lvl)
        ratio = t / (lvl * base)
        c = bucket(b)
        self._steps[c] += 1
        d = self.arm_discount
        w, s = self._faded(arm.w, arm.s, arm.t, self._steps[c] - 1)      # what it had faded to by this step
        arm.n, arm.t = arm.n + 1, self._steps[c]
        arm.w = d * w + 1.0
        arm.s = d * s + ratio
        if self.profile is None:
            self._renormalise(self._arms[c])

    def _cold(self, arm: _Arm, base: float, t: float) -> bool:
        """A shape's first step pays one-off kernel set-up (oneDNN primitives, allocations): on the real pair
        the first γ = 1, 2, 3 steps at B = 1 took 1.3-2.3x the steady time and kept the planner off γ = 2 and 3
        for ~70 steps. Not learnt when it is the first step of all or slower than predicted by 20 %."""
        return self._level() <= 0.0 or t > 1.2 * self._time(arm, base)[0]

    def _renormalise(self, arms: list[_Arm]) -> None:
        """Without a profile: fold the bucket's mean correction into its level, so an arm with no
        data is predicted at the sample-weighted mean ratio of the arms played (level and
        corrections are otherwise only identified as a product)."""
        sw = sum(a.w for a in arms)
        avg = sum(a.s for a in arms) / sw if sw > 0.0 else 1.0
        if avg > 0.0 and abs(avg - 1.0) > 1e-3:
            self._set_level(self._level() * avg)
            for a in arms:
                a.s /= avg

    @property
    def mixed_extra(self) -> float:
        """Seconds a drafted token costs a step that carries a prompt chunk beyond its price in a decode-only step:
        the samples' mean beside one pseudo-sample at 0, the samples fading by ``fade`` per decode step since the
        last one, so an estimate that keeps such steps at γ = 0 (where it is not measured) is tried again once
        the prompt tokens' own price was learnt from them. Never below 0."""
        w, s = self._faded(self.mix_w, self.mix_s, self.mix_t, self.clock)
        return max(0.0, s / (w + 1.0))

    def _learn_mixed(self, r: StepTimed, t: float, pred: float) -> None:
        """A drafting step with a prompt chunk: what it took beyond the decode-only price of its γ and the
        prompt tokens' own price (learnt from γ = 0 mixed steps, the profile's until then), per drafted token.
        There the forward is past its flat region, so a verify token costs the full per-token rate; and the head's
        work on the prompt's features delays the step (docs/planner.md)."""
        n = r.num_prefill_tokens
        pf = self.pf_nx / self.pf_xx if self.pf_obs >= 3 and self.pf_xx > 0.0 else None
        if pf is None:
            p = getattr(self.profile, "prefill_s_per_token", None) if self.profile is not None else None
            if p is None:
                return
            pf = p
        x = (t - pred - max(0.0, pf) * n) / max(1, (r.num_drafts or r.batch_size) * r.gamma)
        w, s = self._faded(self.mix_w, self.mix_s, self.mix_t, self.clock)
        self.mix_w, self.mix_s, self.mix_t = 0.95 * w + 1.0, 0.95 * s + x, self.clock

    def _learn_prefill(self, t: float, n: int, pred: float) -> None:
        """The prompt tokens' price from a γ = 0 step with ``n`` of them: seconds past its decode-only
        prediction, regressed on n (``_learn_mixed`` reads it from 3 such steps on)."""
        resid = t - pred
        self.pf_nx = 0.98 * self.pf_nx + n * resid
        self.pf_xx = 0.98 * self.pf_xx + n * n
        self.pf_obs += 1

    # ------------------------------------------------------------ introspection
    def snapshot(self) -> dict:
        """Acceptance, level, dwell, catch-up line and per-bucket arm counts and predicted times."""
        ab = self.switch.coef()
        ctxs = {}
        for c, arms in enumerate(self._arms):
            if any(a.n for a in arms):
                b = 1 << c
                ctxs[bucket_label(c)] = {"n": [a.n for a in arms], "current": self._cur[c],
                                         "t_s": [self.predict(b, g)[0] for g in range(self.gamma_max + 1)]}
        return {**super().snapshot(), "elastic_memory": self.elastic_memory, "model": "nightjar-v2",
                "profile": getattr(self.profile, "name", None), "level": self.level, "draft_scale": self.draft_scale,
                "rho": [self.accept.rho(i) for i in range(self.gamma_max)], "E": list(self.accept.e),
                "accept_alarms": self.accept.alarms, "dwell": self.dwell,
                "prefill_s_per_token": self.pf_nx / self.pf_xx if self.pf_xx else None,
                "mixed_extra_s_per_drafted_token": self.mixed_extra,
                "c_switch": None if ab is None else list(ab), "contexts": ctxs,
                "decisions": self.decisions, "kv_decisions": self.kv_decisions, "per_request": self.per_request,
                "tree_rate": {bucket_label(c): self.tree_rate(c) for c in sorted(self._tree)},
                "lookup": None if (lk := self.looked) is None else {
                    "share": lk.share, "expected": lk.expected, "E_head": list(lk.head.e),
                    "E_lookup": list(lk.lookup.e)}}
