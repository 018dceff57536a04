"""Planner: a thin shell around a pure policy (``actors/policies.py``): one γ per step, or with a
per-request policy (``nightjar:per-request``) one γ_i per decode row (``StepPlanned.gammas``), learning
each request's acceptance from ``StepVerified``.

Besides B it hands the policy what the model-based planner prices: the draft lag split into prompt
tokens (the draft prefills every prompt under any γ>0) and generated tokens (what γ=0 steps left
behind), the prompt tokens entering decode this step, the queue, the pool's free blocks after the
previous step's reservation, and the decode rows' context (the KV a step reads costs apart from T(B, q)).

A policy that ``learns_periods`` (the model-based ``nightjar``) learns step times from each decode step's
wall-clock period, from its StepScheduled to the next one's (envelope times, so replay sees the same), less its
catch-up: what the step cost the engine, the bus and thread hand-offs included, which differ between a γ = 0
step (run ahead, actors/verifier.py) and a drafting one. A period is used only when the next step follows on
(some row goes on, the period under 3× the step's measured forward time + 20 ms); else that step's time is not learnt.

A γ = 0 decision of a policy that ``holds_zero`` (or with no draft to run) stands for the next step as well
(``StepPlanned.next_zero``): the verifier may start that step before this one commits (a run-ahead,
``actors/verifier.py``), so when it comes the planner plans γ = 0 whatever the policy would say then.
"""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from nightjar.actors.policies import PlannerState
from nightjar.actors.policy_factory import make_policy
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftResidency,
    StepPlanned,
    StepScheduled,
    StepTimed,
    StepVerified,
)


def follows_on(rows, next_req_ids, took: float, step_time_s: float) -> bool:
    """Whether a decode step's period ``took`` (seconds to the next StepScheduled, catch-up out) is its cost:
    some of its decode ``rows`` go on in the next step and the period is under 3× its forward + 20 ms (else the
    engine idled or waited between them)."""
    return not rows.isdisjoint(next_req_ids) and 0.0 < took <= 3.0 * step_time_s + 0.02


def context_tokens(s: StepScheduled) -> int:
    """Tokens of context the step's decode rows read (what their KV holds): the step-time model's context."""
    return sum(s.starts[:s.num_decode])


class Planner(Actor):
    name: ClassVar[str] = "planner"
    subscribes = (StepScheduled, StepTimed, DraftResidency, BlocksReserved, StepVerified)
    quiet = (StepTimed, DraftResidency, BlocksReserved, StepVerified)    # observed at the next StepScheduled

    def __init__(self, policy: str, gamma_max: int, seed: int, has_draft: bool, *, draft_blocks: int = 0,
                 max_batch: int = 1 << 30, profile=None, profile_scale: float = 1.0, **opts):
        super().__init__()
        self.policy = make_policy(policy, gamma_max=gamma_max, seed=seed, **opts)
        if profile is not None and hasattr(self.policy, "set_profile"):     # a step-time model (JSON dict)
            self.policy.set_profile(profile, profile_scale)
        self.resident = has_draft
        self.prev_gamma = 0
        self.draft_blocks, self.max_batch = draft_blocks, max_batch
        self.free_blocks, self.total_blocks = -1, 0
        self.prompt_len: dict[int, int] = {}     # req_id → tokens the target prefilled before decoding
        self.pending = (0, 0)                     # new prompts (tokens, count) not yet shown to the policy
        self.per_request = bool(getattr(self.policy, "per_request", False))
        self.row_stats = bool(getattr(self.policy, "observes_rows", False))   # per-request acceptance
        self.speculating: dict[int, tuple[bool, ...]] = {}   # step → its decode rows' speculate (batch γ)
        self.holds_zero = bool(getattr(self.policy, "holds_zero", False))
        self.zero_step = -1                       # the step this planner committed to γ = 0 (next_zero)
        self.num_held = 0                         # steps planned 0 by that commitment, the policy choosing γ > 0
        self.by_period = bool(getattr(self.policy, "learns_periods", False))
        self.last_sched: tuple[int, float, frozenset, int] | None = None    # (step, time, decode rows, context)
        self.last_timed: StepTimed | None = None
        self.periods_used = self.periods_skipped = 0

    def handle(self, msg, now):
        match msg:
            case StepScheduled():
                if self.by_period:
                    self._learn_period(msg, now)
                return [self._plan(msg)]
            case StepTimed():
                self._observe(msg)
            case StepVerified() if self.row_stats:
                self._observe_rows(msg)
            case BlocksReserved():
                self.free_blocks, self.total_blocks = msg.num_free, msg.num_total
            case DraftResidency():
                self.resident = msg.resident
        return None

    def _plan(self, s: StepScheduled) -> StepPlanned:
        g = self._decide(s)
        per_row = isinstance(g, tuple)
        top = max(g, default=0) if per_row else g
        held = self.zero_step == s.step
        holds = self.holds_zero or not self.resident or not any(s.speculate)
        nz = top == 0 and holds and self._may_run_ahead(s)
        self.zero_step = s.step + 1 if nz else -1
        if held and top:
            self.num_held += 1
            return StepPlanned(step=s.step, gamma=0)
        return StepPlanned(step=s.step, gamma=top, gammas=g if per_row and top else (), next_zero=nz)

    @staticmethod
    def _may_run_ahead(s: StepScheduled) -> bool:
        """Could the verifier start the next step early (decode rows only, nobody waiting)? Only then is γ = 0
        promised for it."""
        return 0 < s.num_decode == len(s.req_ids) and not s.num_waiting

    def _observe_rows(self, v: StepVerified) -> None:
        """Per-request acceptance: the rows' own γ_i, or (one γ per step) γ for the rows that could draft."""
        nd, spec = v.num_decode, self.speculating.pop(v.step, None)
        gammas = v.gammas
        if not gammas and v.gamma > 0 and spec is not None:
            gammas = tuple(v.gamma if sp else 0 for sp in spec)
        if gammas:                          # a sibling taken (draft tree) is not the chain's d1 accepted
            acc = tuple(a - h for a, h in zip(v.accepted, v.tree_hits)) if v.tree_hits else v.accepted[:nd]
            self.policy.observe_rows(v.req_ids[:nd], gammas, acc)

    def _new_prompts(self, s: StepScheduled) -> tuple[int, int]:
        """Record prompts whose prefill finishes this step: (tokens, count)."""
        tok = n = 0
        nd = s.num_decode
        for j, done in enumerate(s.prefill_done):
            if done:
                row = nd + j
                p = s.starts[row] + len(s.chunk_ids[row])
                self.prompt_len[s.req_ids[row]] = p
                tok, n = tok + p, n + 1
        if len(self.prompt_len) > 4 * (len(s.req_ids) + 64):     # forget finished requests
            live = set(s.req_ids)
            self.prompt_len = {r: p for r, p in self.prompt_len.items() if r in live}
            if self.row_stats:
                self.policy.req_accept.forget(live)
        return tok, n

    def _lags(self, s: StepScheduled) -> tuple[int, int]:
        """(generated-token lag, prompt lag) summed over speculating decode rows that must catch up."""
        gen = pr = 0
        plen = self.prompt_len
        for rid, start, dc, sp in zip(s.req_ids, s.starts, s.draft_computed, s.speculate):
            lag = start - dc
            if sp and lag >= 2:
                pp = min(max(plen.get(rid, 0) - dc, 0), lag)
                pr += pp
                gen += lag - pp
        return gen, pr

    def _row_lags(self, s: StepScheduled) -> list[int]:
        """Per decode row: the generated-token draft lag (prompt tokens excluded), 0 below 2."""
        plen, out = self.prompt_len, []
        for rid, start, dc in zip(s.req_ids, s.starts, s.draft_computed):
            lag = start - dc
            out.append(lag - min(max(plen.get(rid, 0) - dc, 0), lag) if lag >= 2 else 0)
        return out

    def _decide(self, s: StepScheduled) -> int | tuple[int, ...]:
        if s.prefill_done:
            tok, n = self._new_prompts(s)
            self.pending = (self.pending[0] + tok, self.pending[1] + n)
        if s.num_decode == 0 or not any(s.speculate):
            return 0            # prefill-only steps skip the planner
        if not self.resident:
            self.pending = (0, 0)       # prompts drafted in the catch-up after a reload, not as steady charge
            return 0
        (new_tok, new_n), self.pending = self.pending, (0, 0)
        gen, pr = self._lags(s) if s.max_draft_lag >= 2 else (0, 0)
        state = PlannerState(draft_resident=True, max_draft_lag=s.max_draft_lag, prev_gamma=self.prev_gamma,
                             lag_tokens=gen, prompt_lag_tokens=pr, new_prompt_tokens=new_tok,
                             new_prompts=new_n, num_waiting=s.num_waiting, free_blocks=self.free_blocks,
                             total_blocks=self.total_blocks, draft_blocks=self.draft_blocks,
                             max_batch=self.max_batch, context_tokens=context_tokens(s),
                             prefill_tokens=sum(map(len, s.chunk_ids[s.num_decode:])))
        if self.row_stats and not self.per_request:
            nd = s.num_decode
            state = replace(state, req_ids=s.req_ids[:nd], speculate=s.speculate[:nd])
            self.speculating[s.step] = state.speculate
            if len(self.speculating) > 64:                      # steps that never verified (aborted)
                self.speculating.pop(next(iter(self.speculating)))
        if self.per_request:
            lags = self._row_lags(s) if s.max_draft_lag >= 2 else None
            return self.policy.decide_rows(s.num_decode, state, s.req_ids, s.speculate, lags)
        return self.policy.decide(s.num_decode, state)

    def _observe(self, t: StepTimed) -> None:
        if t.batch_size == 0:
            return
        self.prev_gamma = t.gamma
        if self.by_period:
            self.last_timed = t
            self.policy.observe(t, learn_time=False)
        else:
            self.policy.observe(t)

    def _learn_period(self, s: StepScheduled, now: float) -> None:
        """Hand the policy the previous decode step's period if this step follows on from it (docstring)."""
        prev, t = self.last_sched, self.last_timed
        self.last_sched = (s.step, now, frozenset(s.req_ids[:s.num_decode]), context_tokens(s))
        if prev is None or t is None or t.step != prev[0] or s.step != prev[0] + 1:
            return
        took = now - prev[1] - t.catchup_time_s
        if not follows_on(prev[2], s.req_ids, took, t.step_time_s):
            self.periods_skipped += 1
            return
        self.periods_used += 1
        self.policy.observe_period(t, took, prev[3])
