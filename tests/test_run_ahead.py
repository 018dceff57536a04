"""Run-ahead (actors/verifier.py): with a compute thread the verifier starts the next greedy γ = 0 decode step
before the loop commits this one. The tokens are the serial engine's, the started steps are used (the stop rule
it predicts with is the batcher's), and a step that does not match (an abort) is dropped without harm."""
from __future__ import annotations

import asyncio

from nightjar.sampling import SamplingParams
from tests.test_engine import assert_pool_clean, pool_settled, prompts_of_mixed_length, run_all


def verifier_of(eng):
    return next(a for a in eng.actors if a.name == "verifier")


def run(make_engine, policy, prompts, params, **kw):
    async def main():
        async with make_engine(policy, **kw) as eng:
            res = await run_all(eng, prompts, params, stagger=0)
            await pool_settled(eng)
            assert_pool_clean(eng)
            v = verifier_of(eng)
            return res, v.ahead_used, v.ahead_dropped
    return asyncio.run(main())


def test_run_ahead_steps_give_the_serial_engines_tokens_and_none_is_dropped(make_engine, smol_tokenizer):
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    probe, _, _ = run(make_engine, "off", prompts[:1], SamplingParams(max_tokens=24, ignore_eos=True),
                      run_ahead=False)
    stops = probe[0][5:8]                    # tokens the tiny model does emit: rows stop at different steps
    params = SamplingParams(max_tokens=24, stop_token_ids=list(stops), min_tokens=3)
    ref, used, _ = run(make_engine, "off", prompts, params, max_num_seqs=4, run_ahead=False)
    assert used == 0
    got, used, dropped = run(make_engine, "off", prompts, params, max_num_seqs=4)
    assert got == ref
    assert any(len(r) < 24 for r in ref)                     # some rows did stop on a token
    assert used > 10 and dropped == 0
    inline, used, _ = run(make_engine, "off", prompts, params, max_num_seqs=4, inline_compute=True)
    assert inline == ref and used == 0                        # no compute thread: nothing runs ahead


def test_run_ahead_under_the_adaptive_planner_and_a_draft_stays_lossless(make_engine, smol_tokenizer):
    prompts = prompts_of_mixed_length(smol_tokenizer, 8)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref, _, _ = run(make_engine, "off", prompts, params, max_num_seqs=8, run_ahead=False)
    for policy in ("nightjar", "fixed:0", "table:1-2:2,3-:0"):
        got, _, _ = run(make_engine, policy, prompts, params, max_num_seqs=8, gamma_max=3)
        assert got == ref, policy


def test_an_abort_while_a_step_runs_ahead_drops_that_step_and_loses_nothing(make_engine, smol_tokenizer):
    prompts = prompts_of_mixed_length(smol_tokenizer, 4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref, _, _ = run(make_engine, "off", prompts, params, run_ahead=False)

    async def main():
        async with make_engine("off") as eng:
            async def one(i, ids):
                toks = []
                async for o in eng.generate(ids, params):
                    toks += o.token_ids
                    if i == 0 and len(toks) >= 6:
                        break                               # the stream's close aborts the request
                return toks
            res = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
            await pool_settled(eng)
            assert_pool_clean(eng)
            return res, verifier_of(eng)
    got, v = asyncio.run(main())
    assert got[1:] == ref[1:] and got[0] == ref[0][: len(got[0])]
    assert v.ahead_used > 10


# ---- the verifier alone: its run-ahead queued on a stand-in executor and run by hand ---------------------------
class HandQueue:
    """Stands in for the compute thread's executor: keeps submitted jobs until ``run``."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append((fn, args))

    def run(self):
        jobs, self.jobs = self.jobs, []
        for fn, args in jobs:
            fn(*args)


def verifier_rig(shrink_before_run: bool):
    """Prefill, one decode step that runs ahead, then the step it ran: (tokens of the three steps, verifier)."""
    import torch

    from nightjar.actors.draft import DraftBuffers
    from nightjar.actors.verifier import Verifier
    from nightjar.kernel.messages import (
        BlocksReserved,
        RequestAdmitted,
        SamplingSpec,
        StepScheduled,
        StepVerified,
        TokensCommitted,
    )
    from nightjar.kvpool.cache import KVCache
    from tests.actors.test_model_actors_handle import CFG
    from tests.conftest import random_model

    target = random_model(CFG, seed=1)
    cache = KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 4, 16, torch.float32)
    v = Verifier(target, cache, 4, DraftBuffers(), seed=0)
    v.executor = HandQueue()
    prompt, table = (3, 7, 1, 4, 9, 2, 5), ((0, 1, 2, 3),)
    v.handle(RequestAdmitted(req_id=1, prompt_ids=prompt, sampling=SamplingSpec(max_tokens=8)), 0.0)
    toks, n = [], len(prompt)

    def step(k, start, chunk, num_decode, next_zero):
        v.handle(StepScheduled(step=k, req_ids=(1,), starts=(start,), chunk_ids=(chunk,), num_decode=num_decode,
                               draft_computed=(0,) * num_decode, speculate=(False,) * num_decode,
                               prefill_done=() if num_decode else (True,)), 0.0)
        out = v.handle(BlocksReserved(step=k, gamma=0, block_tables=table, num_free=12, num_total=16,
                                      next_zero=next_zero), 0.0)
        ver = next(m for m in out if isinstance(m, StepVerified))
        toks.append(ver.tokens[0])
        v.handle(TokensCommitted(step=k, req_ids=(1,), counts=(1,), tokens=ver.tokens,
                                 num_computed=(start + len(chunk),), finish=(0,)), 0.0)
        return ver
    assert not step(1, 0, prompt, 0, False).ran_ahead                # a prefill step never runs ahead
    assert step(2, n, (toks[0],), 1, True).ran_ahead and len(v.executor.jobs) == 1
    if shrink_before_run:
        cache.generation += 1                                           # what a pool shrink's migration does
    v.executor.run()
    step(3, n + 1, (toks[1],), 1, False)
    return toks, v, target, prompt


def test_the_verifier_uses_its_run_ahead_and_skips_one_planned_before_blocks_moved():
    from tests.actors.test_model_actors_handle import greedy

    toks, v, target, prompt = verifier_rig(shrink_before_run=False)
    assert toks == greedy(target, prompt, 3) and (v.ahead_used, v.ahead_dropped) == (1, 0)
    toks, v, _, _ = verifier_rig(shrink_before_run=True)
    assert toks == greedy(target, prompt, 3) and (v.ahead_used, v.ahead_dropped) == (0, 1)
