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


def test_a_gamma_zero_that_the_policy_holds_stands_for_the_next_step():
    """next_zero: the planner commits to γ = 0 for the next step (a run-ahead may have started it) and plans
    0 then even if the policy would draft; a policy that explores (bandit) makes no such promise."""
    from msgspec.structs import replace

    from nightjar.kernel.messages import DraftResidency as Res

    p = Planner("fixed:3", gamma_max=4, seed=0, has_draft=True)
    assert not p.handle(sched(2), 0.0)[0].next_zero                # γ = 3: no promise
    p.handle(Res(resident=False, state="OFFLOADED"), 0.0)
    got = p.handle(sched(2), 0.0)[0]
    assert got.gamma == 0 and got.next_zero                        # the draft is away: 0, held for step 2
    p.handle(Res(resident=True, state="RESIDENT"), 0.0)
    s2 = replace(sched(2), step=2)
    got = p.handle(s2, 0.0)[0]
    assert got.gamma == 0 and not got.next_zero and p.num_held == 1    # held; the policy's 3 comes next
    assert p.handle(replace(sched(2), step=3), 0.0)[0].gamma == 3
    off = Planner("off", gamma_max=4, seed=0, has_draft=False)
    assert off.handle(sched(2), 0.0)[0].next_zero
    bandit = Planner("banditspec", gamma_max=4, seed=0, has_draft=True)
    bandit.handle(Res(resident=False, state="OFFLOADED"), 0.0)
    assert bandit.handle(sched(2), 0.0)[0].next_zero                # no draft to run: 0 holds for any policy
    bandit.handle(Res(resident=True, state="RESIDENT"), 0.0)
    assert not any(bandit.handle(replace(sched(2), step=s), 0.0)[0].next_zero for s in range(3, 40))
