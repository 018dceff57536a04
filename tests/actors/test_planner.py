"""The planner shell: prefill-only steps skip the policy, residency gates γ, observations flow."""
from __future__ import annotations

from nightjar.actors.planner import Planner
from nightjar.kernel.messages import DraftResidency, StepScheduled, StepTimed


def sched(num_decode, speculate=True):
    n = max(num_decode, 1)
    return StepScheduled(step=1, req_ids=tuple(range(n)), starts=(0,) * n, chunk_ids=((1,),) * n,
                         num_decode=num_decode, draft_computed=(0,) * num_decode,
                         speculate=(speculate,) * num_decode, prefill_done=(True,) * (n - num_decode))


def test_fixed_policy_plans_its_gamma_for_decode_steps():
    p = Planner("fixed:3", gamma_max=4, seed=0, has_draft=True)
    assert p.handle(sched(2), 0.0)[0].gamma == 3


def test_prefill_only_steps_and_non_speculating_rows_get_gamma_zero():
    p = Planner("fixed:3", gamma_max=4, seed=0, has_draft=True)
    assert p.handle(sched(0), 0.0)[0].gamma == 0
    assert p.handle(sched(2, speculate=False), 0.0)[0].gamma == 0


def test_an_absent_draft_forces_gamma_zero():
    p = Planner("fixed:3", gamma_max=4, seed=0, has_draft=True)
    p.handle(DraftResidency(resident=False, state="OFFLOADED"), 0.0)
    assert p.handle(sched(2), 0.0)[0].gamma == 0


def test_step_timings_reach_the_policy():
    p = Planner("nightjar", gamma_max=4, seed=0, has_draft=True)
    p.handle(StepTimed(step=1, batch_size=2, gamma=2, step_time_s=0.03, tokens_emitted=4, accepted_per_pos=(2, 1),
                       num_drafts=2), 0.0)
    assert p.prev_gamma == 2
    assert p.policy.snapshot()


def test_prompts_prefilled_while_the_draft_is_away_are_not_charged_after_it_returns():
    p = Planner("nightjar", gamma_max=4, seed=0, has_draft=True)
    mixed = StepScheduled(step=1, req_ids=(0, 1), starts=(5, 0), chunk_ids=((1,), (2,) * 30), num_decode=1,
                          draft_computed=(5,), speculate=(True,), prefill_done=(True,))
    p.handle(mixed, 0.0)
    assert p.pending == (0, 0)                     # a resident step hands the new prompt to the policy
    p.handle(DraftResidency(resident=False, state="OFFLOADED"), 0.0)
    p.handle(mixed, 0.0)
    assert p.pending == (0, 0)                     # offloaded: dropped, not saved for the first resident step
