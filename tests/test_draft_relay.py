"""The draft executor hands its StepDrafted straight to the verifier on the compute thread (kernel/actor.py
relay, actors/verifier.py accepts_relay), and a head's executor takes the verifier's StepVerified back in the
same call: drafting steps skip two hops through the event loop, and the head's features need no job of their
own. Tokens stay the serial path's, with an independent draft and a head, on a compute thread and inline, and
the steps are relayed."""
from __future__ import annotations

import asyncio

import pytest

from nightjar.kernel.messages import StepDrafted, StepVerified
from nightjar.sampling import SamplingParams
from tests.actors.test_draft_head import head_pair  # noqa: F401  (fixture)
from tests.test_engine import assert_pool_clean, pool_settled, prompts_of_mixed_length, run_all


def run(make_engine, policy, prompts, params, **kw):
    """(tokens per prompt, drafting steps seen on the bus, steps the verifier took by relay, every StepVerified
    came after its StepDrafted)."""
    async def main():
        async with make_engine(policy, **kw) as eng:
            drafted, order_ok = set(), []

            def tap(env):
                if isinstance(env.msg, StepDrafted):
                    drafted.add(env.msg.step)
                elif isinstance(env.msg, StepVerified) and env.msg.gamma > 0:
                    order_ok.append(env.msg.step in drafted)
            eng.bus.add_tap(tap)
            res = await run_all(eng, prompts, params, stagger=0)
            await pool_settled(eng)
            assert_pool_clean(eng)
            v = next(a for a in eng.actors if a.name == "verifier")
            return res, len(drafted), v.drafts_relayed, all(order_ok)
    return asyncio.run(main())


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("drafter", ["independent", "head"])
def test_relayed_drafting_steps_give_off_s_tokens(make_engine, smol_tokenizer, head_pair, drafter, inline):  # noqa: F811
    pair = head_pair if drafter == "head" else None
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref, _, _, _ = run(make_engine, "off", prompts, params, pair=pair, max_num_seqs=4)
    got, drafted, relayed, ordered = run(make_engine, "fixed:2", prompts, params, pair=pair, max_num_seqs=4,
                                         inline_compute=inline)
    assert got == ref
    assert drafted > 5 and ordered
    assert relayed >= 0.8 * drafted            # the verifier is nearly always ready: it attaches first


@pytest.mark.parametrize("inline", [False, True])
def test_relayed_steps_still_store_the_head_s_features(make_engine, smol_tokenizer, inline):
    """The head executor stores the target's features from the StepVerified of a relayed step, which it takes
    back from the verifier in the same call (kernel/actor.py): an oracle head, accepted only when its features
    sit at the right positions, stays accepted."""
    from tests.actors.test_draft_head import repeat_pair

    pair = repeat_pair(smol_tokenizer)
    prompts = prompts_of_mixed_length(smol_tokenizer, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref, _, _, _ = run(make_engine, "off", prompts, params, pair=pair)

    async def main():
        async with make_engine("fixed:3", pair=pair, max_num_seqs=4, inline_compute=inline) as eng:
            res = await run_all(eng, prompts, params, stagger=0)
            by_name = {a.name: a for a in eng.actors}
            return res, eng.stats, by_name["verifier"].drafts_relayed, by_name["draft"].verified_relayed
    got, stats, relayed, taken_back = asyncio.run(main())
    assert got == ref and relayed > 5 and taken_back >= 0.8 * relayed
    assert stats.accepted_tokens >= 0.8 * stats.draft_tokens
