"""Planner: a thin shell around a pure policy (``actors/policies.py``): one γ per step."""
from __future__ import annotations

from typing import ClassVar

from nightjar.actors.policies import PlannerState, StepResult, make_policy
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import DraftResidency, StepPlanned, StepScheduled, StepTimed


class Planner(Actor):
    name: ClassVar[str] = "planner"
    subscribes = (StepScheduled, StepTimed, DraftResidency)

    def __init__(self, policy: str, gamma_max: int, seed: int, has_draft: bool, **opts):
        super().__init__()
        self.policy = make_policy(policy, gamma_max=gamma_max, seed=seed, **opts)
        self.resident = has_draft
        self.prev_gamma = 0
        self.gamma_counts = [0] * (gamma_max + 1)

    def handle(self, msg, now):
        match msg:
            case StepScheduled():
                return [StepPlanned(step=msg.step, gamma=self._decide(msg))]
            case StepTimed():
                self._observe(msg)
            case DraftResidency():
                self.resident = msg.resident
        return None

    def _decide(self, s: StepScheduled) -> int:
        speculating = sum(s.speculate)
        if s.num_decode == 0 or speculating == 0:
            return 0            # prefill-only steps skip the planner
        state = PlannerState(draft_resident=self.resident, max_draft_lag=s.max_draft_lag,
                             prev_gamma=self.prev_gamma)
        gamma = self.policy.decide(s.num_decode, state) if self.resident else 0
        return gamma

    def _observe(self, t: StepTimed) -> None:
        if t.batch_size == 0:
            return
        self.prev_gamma = t.gamma
        self.gamma_counts[t.gamma] += 1
        self.policy.observe(StepResult(
            batch_size=t.batch_size, gamma=t.gamma, step_time_s=t.step_time_s,
            tokens_emitted=t.tokens_emitted, max_draft_lag=t.max_draft_lag,
            catchup_time_s=t.catchup_time_s, catchup_tokens=t.catchup_tokens,
            accepted_per_pos=t.accepted_per_pos, num_drafts=t.num_drafts,
        ))
