"""Quiet messages (kernel/actor.py): a step's bookkeeping waits in the mailboxes of the actors it does not
concern until a message that does arrives. A γ = 0 step wakes the verifier, batcher and planner once each (the
verifier one compute-thread job), the weight mover without elastic memory and the admission actor not at all,
and a drafter only in the steps it drafts in or when a request finishes (a head also for a prompt chunk). Tokens
stay `off`'s."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from nightjar.sampling import SamplingParams
from tests.actors.test_draft_head import head_pair  # noqa: F401  (fixture)
from tests.test_engine import assert_pool_clean, pool_settled, prompts_of_mixed_length, run_all


def counted_run(make_engine, policy, prompts, params, **kw):
    """(tokens per prompt, handle_batch calls per actor, engine steps)."""
    async def main():
        async with make_engine(policy, **kw) as eng:
            calls: Counter = Counter()
            for a in eng.actors:
                def counted(envs, orig=a.handle_batch, name=a.name):
                    calls[name] += 1
                    return orig(envs)
                a.handle_batch = counted
            res = await run_all(eng, prompts, params, stagger=0)
            await pool_settled(eng)
            assert_pool_clean(eng)
            return res, calls, eng.stats.steps
    return asyncio.run(main())


@pytest.mark.parametrize("inline", [False, True])
def test_a_gamma_0_step_wakes_each_actor_it_concerns_once(make_engine, smol_tokenizer, inline):
    prompts = prompts_of_mixed_length(smol_tokenizer, 3)[2:]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    _, calls, steps = counted_run(make_engine, "off", prompts, params, inline_compute=inline)
    assert steps >= 24
    for name in ("verifier", "batcher", "planner", "kv"):
        assert calls[name] <= steps + 2, (name, calls, steps)
    assert calls["weights"] <= 1 and calls["admission"] <= 2, calls


@pytest.mark.parametrize("drafter", ["independent", "head", "ngram"])
def test_a_drafter_wakes_in_the_steps_it_drafts_in_and_tokens_stay_off_s(make_engine, smol_tokenizer, tiny_pair,
                                                                          head_pair, drafter):  # noqa: F811
    pair = {"independent": tiny_pair, "head": head_pair, "ngram": (tiny_pair[0], None)}[drafter]
    kw = {"draft": "ngram"} if drafter == "ngram" else {}
    prompts = prompts_of_mixed_length(smol_tokenizer, 4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref, _, _ = counted_run(make_engine, "off", prompts, params, pair=pair, max_num_seqs=4)
    got, calls, steps = counted_run(make_engine, "fixed:2", prompts, params, pair=pair, max_num_seqs=4, **kw)
    assert got == ref
    assert calls["draft"] <= steps + len(prompts) + 2, (calls, steps)


def test_a_resident_head_runs_no_job_in_gamma_0_steps(make_engine, smol_tokenizer, head_pair):  # noqa: F811
    """At γ = 0 a decode step's StepVerified is quiet for the head too: it wakes for a prompt chunk or when a
    request finishes, and stores the features of the steps before then (tests/actors/test_draft_head.py checks
    they are the right ones)."""
    prompts = prompts_of_mixed_length(smol_tokenizer, 4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    _, calls, steps = counted_run(make_engine, "fixed:0", prompts, params, pair=head_pair, max_num_seqs=4)
    assert steps >= 20 and calls["draft"] <= 2 * len(prompts) + 2, (calls, steps)


def test_an_offloaded_head_gets_no_features_and_no_job_per_prompt_chunk(make_engine, smol_tokenizer, monkeypatch,
                                                                        head_pair):  # noqa: F811
    """While the head is offloaded the verifier captures no features (the head would store none) and a step with
    a prompt chunk leaves the head quiet: it wakes about once per finished request, not for every prompt chunk
    as well. Tokens stay `off`'s; after a reload the head drafts again."""
    from nightjar.actors.draft import DraftBuffers
    from nightjar.kernel.messages import OffloadDraft, ReloadDraft, StepVerified
    from tests.test_elastic import wait_for, wait_state

    prompts = prompts_of_mixed_length(smol_tokenizer, 10)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref, _, _ = counted_run(make_engine, "off", prompts, params, pair=head_pair, max_num_seqs=2)
    puts: list[int] = []
    put = DraftBuffers.put_features
    monkeypatch.setattr(DraftBuffers, "put_features", lambda self, step, f, lens: (puts.append(step),
                                                                                    put(self, step, f, lens)))

    async def main():
        async with make_engine("fixed:2", pair=head_pair, max_num_seqs=2) as eng:
            eng.bus.publish("test", [OffloadDraft(reason="test")])
            await wait_state(eng, "OFFLOADED")
            calls: Counter = Counter()
            draft = next(a for a in eng.actors if a.name == "draft")
            orig = draft.handle_batch

            def counted(envs):
                calls["draft"] += 1
                calls["prefill_steps_seen"] += sum(1 for e in envs if isinstance(e.msg, StepVerified)
                                                   and e.msg.num_decode < len(e.msg.req_ids))
                return orig(envs)
            draft.handle_batch = counted
            puts.clear()
            offloaded = await run_all(eng, prompts, params, stagger=0)
            wakes, captured = dict(calls), list(puts)
            eng.bus.publish("test", [ReloadDraft(reason="test")])
            await wait_state(eng, "RESIDENT")
            drafted = eng.stats.draft_tokens
            again = await run_all(eng, prompts[:2], params, stagger=0)
            await wait_for(lambda: eng.stats.draft_tokens > drafted, what="drafting after the reload")
            await pool_settled(eng)
            assert_pool_clean(eng)
            return offloaded, again, wakes, captured, eng.stats.steps
    offloaded, again, wakes, captured, steps = asyncio.run(main())
    assert offloaded == ref and again == ref[:2]
    assert captured == []
    assert wakes["draft"] <= len(prompts) + 1, (wakes, steps)      # 15 when every prompt chunk woke it
    assert wakes["prefill_steps_seen"] >= len(prompts) - 1, wakes     # the prompt chunks came, quietly
