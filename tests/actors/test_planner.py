"""The planner shell: prefill-only steps skip the policy, residency gates γ, observations flow."""
from __future__ import annotations

import pytest

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


# ---- step periods (planner.py: a policy that learns_periods learns wall-clock step costs) ----------------
def decode_step(step: int, rows=(0, 1)) -> StepScheduled:
    n = len(rows)
    return StepScheduled(step=step, req_ids=tuple(rows), starts=(9,) * n, chunk_ids=((1,),) * n, num_decode=n,
                         draft_computed=(9,) * n, speculate=(True,) * n, prefill_done=())


def period_planner():
    p = Planner("nightjar", gamma_max=4, seed=0, has_draft=True)
    got = []
    p.policy.observe_period = lambda t, s, ctx: got.append((t.step, round(s, 6)))
    return p, got


def test_a_step_s_period_less_its_catch_up_reaches_the_policy_when_the_next_step_follows_on():
    p, got = period_planner()
    p.handle(decode_step(1), 10.0)
    p.handle(StepTimed(step=1, batch_size=2, gamma=1, step_time_s=0.010, tokens_emitted=3, catchup_time_s=0.001,
                       accepted_per_pos=(1,), num_drafts=2), 10.011)
    p.handle(decode_step(2, rows=(1, 7)), 10.0135)                  # row 1 goes on, row 7 is new
    assert got == [(1, 0.0125)] and p.periods_used == 1


@pytest.mark.parametrize("case", ["idle", "slow", "no_timing", "gap"])
def test_a_period_that_does_not_measure_the_step_is_not_learnt(case):
    p, got = period_planner()
    p.handle(decode_step(1), 10.0)
    if case != "no_timing":
        p.handle(StepTimed(step=1, batch_size=2, gamma=0, step_time_s=0.010, tokens_emitted=2), 10.010)
    nxt = {"idle": decode_step(2, rows=(5,)),          # nobody went on: the engine may have idled
           "slow": decode_step(2), "no_timing": decode_step(2), "gap": decode_step(3)}[case]
    p.handle(nxt, 10.5 if case == "slow" else 10.012)  # slow: 50x the step's model time
    assert got == []


def learn_alternating(by_period: bool, overhead: float = 1.4):
    """200 decode steps at B = 4 alternating γ = 0 / 1, equal model times, drafting steps' periods
    ``overhead``× longer, acceptance 0.25 -> (predicted T(γ=1) / T(γ=0), the γ then planned)."""
    from tests.actors.test_planner_v2 import CPU

    p = Planner("nightjar", gamma_max=1, seed=0, has_draft=True, profile=CPU.to_json())
    p.by_period = by_period
    t, model = 10.0, CPU.target_time(4, 1)
    for step in range(1, 201):
        g = step % 2
        p.handle(decode_step(step, rows=(0, 1, 2, 3)), t)
        p.handle(StepTimed(step=step, batch_size=4, gamma=g, step_time_s=model, tokens_emitted=4 + g,
                           accepted_per_pos=(1,) if g else (), num_drafts=4 if g else 0), t + model)
        t += model * (overhead if g else 1.0)
    ratio = p.policy.predict(4, 1)[0] / p.policy.predict(4, 0)[0]
    return ratio, p.handle(decode_step(201, rows=(0, 1, 2, 3)), t)[0].gamma, p


def test_the_model_policy_prices_each_gamma_by_its_periods():
    """Model times say a γ = 1 step costs what a γ = 0 step does; the periods say 40 % more (its hops). With
    periods the policy predicts γ = 1 40 % dearer and, at acceptance 0.25 (1.25 tokens a row), plans γ = 0;
    learning model times instead it would draft."""
    ratio, gamma, p = learn_alternating(by_period=True)
    assert ratio == pytest.approx(1.4, rel=0.05) and gamma == 0
    assert p.periods_used >= 195
    ratio, gamma, _ = learn_alternating(by_period=False)
    assert ratio == pytest.approx(1.0, rel=0.05) and gamma == 1
