"""Simulation-specific executors: stand-ins for the GPU side (draft + verifier, transfer worker).

``SimExecutor`` answers each scheduled step after a profiled delay with the same two messages the
verifier sends (StepVerified, StepTimed); tokens are a synthetic id and each drafting row's accepted
count is drawn from a per-position acceptance model. ``SimTransfer`` emulates the weight mover's
transfer worker with profiled offload/reload times. ``SimCollector`` keeps per-request latencies.
"""
from __future__ import annotations

import random
from typing import ClassVar

from nightjar.actors.gamma_allocator import gamma_histogram, layer_counts, row_gammas, verify_by_tokens
from nightjar.actors.step_profile import Profile
from nightjar.kernel.messages import (
    BlocksReserved,
    StepScheduled,
    StepTimed,
    StepVerified,
    SubmitRequest,
    TokensCommitted,
    TransferFinished,
)

TOKEN = 5
DEFAULT_ACCEPTANCE = (0.78, 0.74, 0.71, 0.68, 0.66, 0.64, 0.62, 0.60)


def fit_acceptance(steps, gamma_max: int) -> tuple[float, ...]:
    """Per-position conditional acceptance P(accept i | accepted 0..i-1) from StepTimed messages."""
    num = [0] * gamma_max
    den = [0] * gamma_max
    for s in steps:
        if not s.gamma or not s.accepted_per_pos or not s.num_drafts:
            continue
        prev = s.num_drafts
        for i, a in enumerate(s.accepted_per_pos[:gamma_max]):
            num[i] += a
            den[i] += prev
            prev = a
    out, last = [], DEFAULT_ACCEPTANCE[0]
    for i in range(gamma_max):
        last = num[i] / den[i] if den[i] >= 20 else (last if i else DEFAULT_ACCEPTANCE[0])
        out.append(min(max(last, 0.0), 0.999))
    return tuple(out)


def context_s(p: Profile, starts, nd: int) -> float:
    """Seconds the rows' KV reads add to T: every row's context (a prefill chunk reads its earlier chunks), less
    the ``ctx_ref`` per decode row that T already pays for (``Profile.context_time``)."""
    return p.context_time(sum(starts), nd) if p.kv_s_per_ctx_token else 0.0


class SimExecutor:
    """Draft + verifier on a virtual clock: wall time from the profile, acceptance from the model."""
    name: ClassVar[str] = "verifier"
    subscribes = (StepScheduled, BlocksReserved)

    def __init__(self, profile: Profile, acceptance, max_b: int, gamma_max: int, seed: int = 0):
        self.p = profile
        self.mix = acceptance if isinstance(acceptance, AcceptanceMix) else None
        if self.mix is not None:
            self.mix = AcceptanceMix(self.mix.classes, seed, gamma_max)
            acceptance = self.mix.mean()
        self.acc = tuple(acceptance) + (0.0,) * max(0, gamma_max - len(acceptance))
        self.T, self.Td = profile.tables(max_b, gamma_max + 1)
        self.rng = random.Random(seed)
        self.sched: StepScheduled | None = None
        self.tokens = (TOKEN,) * (1 << 14)
        self.busy_s = 0.0

    def on_start(self, now):
        return None

    def handle(self, msg, now):
        if type(msg) is StepScheduled:
            self.sched = msg
        elif self.sched is not None and msg.step == self.sched.step:
            dt, out = self._step(self.sched, msg.gamma, msg.gammas)
            self.busy_s += dt
            self.bus.at(now + dt, self.bus.publish, self.name, out)
        return None

    def _step(self, s: StepScheduled, g: int, gammas: tuple[int, ...] = ()):
        if gammas or self.mix is not None:
            return self._step_rows(s, g, gammas)
        nd, p = s.num_decode, self.p
        rnd, acc = self.rng.random, self.acc
        counts, accepted = [], []
        per_pos = [0] * g
        n_spec = catch = 0
        for spec, start, dc in zip(s.speculate, s.starts, s.draft_computed):       # the decode rows
            if g and spec:
                n_spec += 1
                a = 0
                while a < g and rnd() < acc[a]:
                    per_pos[a] += 1
                    a += 1
                lag = start - dc
                if lag >= 2:
                    catch += lag
                counts.append(a + 1)
                accepted.append(a)
            else:
                counts.append(1)
                accepted.append(0)
        emitted = sum(counts)
        n_pre = 0
        for done, chunk in zip(s.prefill_done, s.chunk_ids[nd:]):
            n_pre += len(chunk)
            counts.append(1 if done else 0)
            accepted.append(0)
        q = g + 1 if n_spec else 1
        T = self.T
        if n_spec == nd:
            verify = T[nd][q]
        else:                               # one forward: the non-drafting rows feed 1 token each
            verify = verify_by_tokens(T[nd], nd, n_spec * (q - 1))
        verify += context_s(p, s.starts, nd) + p.prefill_s_per_token * n_pre
        if nd == 0 and n_pre:
            verify += self.T[1][1]          # a prefill-only step still pays one forward's fixed cost
        draft = g * self.Td[n_spec] if n_spec else 0.0
        catch_s = p.catchup_s(catch) if n_spec else 0.0
        total = sum(counts)
        verified = StepVerified(step=s.step, gamma=g, req_ids=s.req_ids, counts=tuple(counts),
                                tokens=self.tokens[:total], accepted=tuple(accepted), num_decode=nd)
        timed = StepTimed(step=s.step, batch_size=nd, gamma=g, step_time_s=verify + draft, tokens_emitted=emitted,
                          max_draft_lag=s.max_draft_lag, catchup_time_s=catch_s, catchup_tokens=catch if n_spec else 0,
                          accepted_per_pos=tuple(per_pos), num_drafts=n_spec if g else 0, num_prefill_tokens=n_pre,
                          draft_time_s=draft)
        return verify + draft + catch_s + p.step_overhead_s, (verified, timed)


    def _step_rows(self, s: StepScheduled, g: int, gammas: tuple[int, ...]):
        """A step with per-row γ_i and/or per-request acceptance: draft pass k runs the n_k rows with
        γ_i ≥ k; the verify forward costs T(B, 1 + Σ_i γ_i / B) (``verify_by_tokens``; the batch-level
        T(B, γ+1) when every row drafts γ)."""
        nd, p, rnd = s.num_decode, self.p, self.rng.random
        gam = row_gammas(g, gammas, s.speculate, nd)
        counts, accepted, catch = [], [], 0
        per_pos, reached = [0] * g, [0] * g
        for i in range(nd):
            gi = gam[i]
            acc = self.mix.vector_for(s.req_ids[i]) if self.mix is not None else self.acc
            a = 0
            if gi:
                while a < gi and rnd() < acc[a]:
                    per_pos[a] += 1
                    a += 1
                for k in range(min(a, gi - 1) + 1):
                    reached[k] += 1
                lag = s.starts[i] - s.draft_computed[i]
                if lag >= 2:
                    catch += lag
            counts.append(a + 1)
            accepted.append(a)
        emitted = sum(counts)
        n_pre = 0
        for j, done in enumerate(s.prefill_done):
            n_pre += len(s.chunk_ids[nd + j])
            counts.append(1 if done else 0)
            accepted.append(0)
        T, Td = self.T, self.Td
        layers = layer_counts(gam, g)
        verify = verify_by_tokens(T[nd], nd, sum(layers)) if nd else 0.0
        draft = sum(Td[n] for n in layers)
        verify += context_s(p, s.starts, nd) + p.prefill_s_per_token * n_pre
        if nd == 0 and n_pre:
            verify += T[1][1]
        n_spec = sum(1 for x in gam if x)
        catch_s = p.catchup_s(catch) if n_spec else 0.0
        per_row = bool(gammas)
        verified = StepVerified(step=s.step, gamma=g, req_ids=s.req_ids, counts=tuple(counts),
                                tokens=self.tokens[:sum(counts)], accepted=tuple(accepted), num_decode=nd,
                                gammas=gammas)
        timed = StepTimed(step=s.step, batch_size=nd, gamma=g, step_time_s=verify + draft, tokens_emitted=emitted,
                          max_draft_lag=s.max_draft_lag, catchup_time_s=catch_s, catchup_tokens=catch if n_spec else 0,
                          accepted_per_pos=tuple(per_pos), num_drafts=n_spec if g else 0, num_prefill_tokens=n_pre,
                          drafted_per_pos=layers if per_row else (), reached_per_pos=tuple(reached) if per_row else (),
                          draft_time_s=draft)
        return verify + draft + catch_s + p.step_overhead_s, (verified, timed)


class AcceptanceMix:
    """Per-request acceptance for the simulator (synthetic, labelled as such): request classes, each a
    weight and a per-position conditional acceptance vector; a request's class is drawn once from its id
    and the seed (the same requests get the same classes under every policy)."""

    def __init__(self, classes, seed: int = 0, gamma_max: int = 0) -> None:
        self.classes = [(float(w), tuple(v) + (v[-1],) * max(0, gamma_max - len(v))) for w, v in classes]
        self.seed = seed
        self.total = sum(w for w, _ in self.classes)
        self._of: dict[int, tuple[float, ...]] = {}

    def vector_for(self, req_id: int) -> tuple[float, ...]:
        v = self._of.get(req_id)
        if v is None:
            u = random.Random(self.seed * 1_000_003 + req_id).random() * self.total
            for w, v in self.classes:
                u -= w
                if u < 0:
                    break
            self._of[req_id] = v
        return v

    def mean(self) -> tuple[float, ...]:
        n = max(len(v) for _, v in self.classes)
        return tuple(sum(w * v[i] for w, v in self.classes) / self.total for i in range(n))

    @classmethod
    def from_trace(cls, steps, gamma_max: int, min_reached: int = 5) -> "AcceptanceMix":
        """One class per request of a recorded run (equal weights), its per-position conditional rates
        fitted from the StepVerified rows it drafted in (γ_i, accepted); a position it reached fewer than
        ``min_reached`` times takes the run's pooled rate there."""
        num: dict[int, list[int]] = {}
        den: dict[int, list[int]] = {}
        for v in steps:
            if not v.gamma:
                continue
            gam = v.gammas or (v.gamma,) * v.num_decode
            for rid, g, a in zip(v.req_ids, gam, v.accepted):
                if g <= 0:
                    continue
                n, d = num.setdefault(rid, [0] * gamma_max), den.setdefault(rid, [0] * gamma_max)
                for i in range(min(a, g - 1, gamma_max - 1) + 1):
                    d[i] += 1
                    n[i] += a > i
        if not den:
            raise ValueError("the trace has no drafting steps to fit per-request acceptance from")
        pooled = [sum(n[i] for n in num.values()) / max(1, sum(d[i] for d in den.values())) for i in range(gamma_max)]
        classes = []
        for rid, d in den.items():
            n = num[rid]
            classes.append((1.0, tuple(min(0.999, n[i] / d[i]) if d[i] >= min_reached else pooled[i]
                                       for i in range(gamma_max))))
        return cls(classes)

    @classmethod
    def parse(cls, spec: str) -> "AcceptanceMix":
        """``W:R1,R2,..;W:R1,..`` e.g. ``0.5:0.9;0.5:0.1`` (a single rate repeats over positions)."""
        classes = []
        for part in spec.split(";"):
            w, _, rates = part.partition(":")
            try:
                weight, vals = float(w), tuple(float(x) for x in rates.split(","))
            except ValueError:
                weight, vals = 0.0, ()
            if not vals or not all(0.0 <= x <= 1.0 for x in vals) or weight <= 0:
                raise ValueError(f"acceptance class {part!r}: want WEIGHT:R1[,R2..] with rates in [0, 1]")
            classes.append((weight, vals))
        return cls(classes)


class _HostStub:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class SimTransfer:
    """The weight mover's transfer worker on the virtual clock: completion after the profiled time."""

    def __init__(self, bus, profile: Profile) -> None:
        self.bus, self.p = bus, profile

    def offload(self, slot, done, *on_error) -> None:     # a simulated copy never fails: on_error unused
        t = self.bus.clock.t + self.p.offload_s
        self.bus.at(t, done, _HostStub(self.p.draft_bytes), self.p.offload_s)

    def reload(self, slot, host, done, *on_error) -> None:
        t = self.bus.clock.t + self.p.reload_s
        self.bus.at(t, done, self.p.draft_bytes, self.p.reload_s)

    def shutdown(self) -> None:
        pass


class SimCollector:
    """Arrival, first-token and finish times per request; output tokens; γ per decode step."""
    name: ClassVar[str] = "collector"
    subscribes = (SubmitRequest, TokensCommitted, StepTimed, TransferFinished)

    EARLY_STEPS = 200        # "first 200 steps" throughput: output tokens / time at the 200th decode step

    def __init__(self, on_finish=None, curve: bool = False) -> None:
        self.on_finish = on_finish
        self.curve: list[tuple[float, int]] | None = [] if curve else None     # (time, output tokens so far)
        self.early_tokens, self.early_t = 0, 0.0
        self.arrival: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.out_tokens = 0
        self.steps = self.gamma_sum = self.batch_sum = 0
        self.drafted = self.accepted = 0
        self.row_gamma: dict[int, int] = {}      # γ_i → decode rows that drafted it
        self.transfers = 0
        self.t_last = 0.0

    def on_start(self, now):
        return None

    def handle(self, msg, now):
        t = type(msg)
        if t is TokensCommitted:
            first = self.first
            nfin = 0
            for rid, n, fin in zip(msg.req_ids, msg.counts, msg.finish):
                if n and rid not in first:
                    first[rid] = now
                if fin:
                    self.done[rid] = now
                    nfin += 1
            self.out_tokens += len(msg.tokens)
            self.t_last = now
            if self.steps == self.EARLY_STEPS and not self.early_t:
                self.early_tokens, self.early_t = self.out_tokens, now
            if self.curve is not None:
                self.curve.append((now, self.out_tokens))
            if nfin and self.on_finish is not None:
                self.on_finish(nfin)
        elif t is StepTimed:
            if msg.batch_size:
                self.steps += 1
                self.gamma_sum += msg.gamma
                self.batch_sum += msg.batch_size
                self.drafted += sum(msg.drafted_per_pos) if msg.drafted_per_pos else msg.num_drafts * msg.gamma
                self._count_rows(msg)
                self.accepted += sum(msg.accepted_per_pos)
        elif t is SubmitRequest:
            self.arrival[msg.req_id] = now
        elif t is TransferFinished:
            self.transfers += 1
        return None

    def _count_rows(self, msg: StepTimed) -> None:
        """Add the step's rows per γ_i to ``row_gamma`` (keys 0..γ, zero counts included)."""
        rg, g = self.row_gamma, msg.gamma
        if msg.drafted_per_pos:
            for k, n in enumerate(gamma_histogram(msg.batch_size, g, msg.num_drafts, msg.drafted_per_pos)):
                rg[k] = rg.get(k, 0) + n
        elif g:                 # batch-level γ: num_drafts rows drafted γ, the rest 0 (gamma_histogram's counts)
            rg[0] = rg.get(0, 0) + (msg.batch_size - msg.num_drafts)
            for k in range(1, g):
                rg[k] = rg.get(k, 0)
            rg[g] = rg.get(g, 0) + msg.num_drafts
        else:
            rg[0] = rg.get(0, 0) + msg.batch_size
