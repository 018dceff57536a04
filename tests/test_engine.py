"""The engine end to end on tiny fp32 models: lossless speculation, preemption, abort, crash-only stop."""
from __future__ import annotations

import asyncio

import pytest
import torch

from nightjar.data import load_prompts
from nightjar.engine import Engine
from nightjar.models import LoadedModel
from nightjar.sampling import EngineError, SamplingParams
from tests.conftest import random_model, tiny_config

POLICIES = ["off", "fixed:1", "fixed:3", "fixed:5"]


def prompts_of_mixed_length(tok, n=24):
    recs = load_prompts()
    picked = [recs[(i * 37) % len(recs)]["prompt"] for i in range(n)]
    out = [tok.encode_chat([{"role": "user", "content": p}]) for p in picked]
    out[0], out[1] = out[0][-3:], out[1][-1:]           # very short ones too
    return out


async def run_all(engine: Engine, prompts, params, stagger=0.003):
    async def one(i, ids):
        await asyncio.sleep(stagger * i)
        toks = []
        async for o in engine.generate(ids, params):
            toks += o.token_ids
        return toks
    return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])


async def pool_settled(engine: Engine, timeout: float = 10.0):
    """Wait until every finished request's blocks came back (releases travel over the bus)."""
    for _ in range(int(timeout / 0.005)):
        if engine.allocator.num_free == engine.allocator.num_total and not engine.allocator.seq_ids():
            return
        await asyncio.sleep(0.005)


def assert_pool_clean(engine: Engine):
    """Every request's blocks are back; only a draft tree's scratch blocks (actors/kv.py) stay held."""
    from nightjar.actors.kv import SCRATCH_SEQ

    a = engine.allocator
    a.check_integrity()
    held = len(a.block_table(SCRATCH_SEQ)) if a.has_seq(SCRATCH_SEQ) else 0
    assert a.num_free + held == a.num_total
    assert set(a.seq_ids()) <= {SCRATCH_SEQ}


def generate_with(make_engine, policy, prompts, params, **kw):
    async def main():
        async with make_engine(policy, **kw) as eng:
            res = await run_all(eng, prompts, params)
            await pool_settled(eng)
            assert_pool_clean(eng)
            return res, eng.stats
    return asyncio.run(main())


def test_greedy_tokens_are_identical_for_every_policy_and_batch_size(make_engine, smol_tokenizer):
    prompts = prompts_of_mixed_length(smol_tokenizer)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, max_num_seqs=1)
    for policy in POLICIES:
        for bs in (1, 7, 16):
            got, stats = generate_with(make_engine, policy, prompts, params, max_num_seqs=bs, gamma_max=5)
            assert got == ref, (policy, bs)
            if policy != "off":
                assert 0 < stats.accepted_tokens < stats.draft_tokens     # the draft is right only sometimes


def test_inline_compute_runs_the_forwards_on_the_loops_thread_with_the_same_tokens(make_engine, smol_tokenizer,
                                                                                  monkeypatch):
    """--inline-compute: no compute thread; the verifier's forwards run on the event loop's own thread."""
    import threading

    from nightjar.actors.verifier import Verifier

    prompts = prompts_of_mixed_length(smol_tokenizer, 8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref, _ = generate_with(make_engine, "fixed:2", prompts, params, max_num_seqs=4)
    threads: set[int] = set()
    handle = Verifier.handle_batch

    def spy(self, envs):
        threads.add(threading.get_ident())
        return handle(self, envs)

    async def main():
        async with make_engine("fixed:2", max_num_seqs=4, inline_compute=True) as eng:
            assert eng._executor is None
            return await run_all(eng, prompts, params)
    monkeypatch.setattr(Verifier, "handle_batch", spy)
    assert asyncio.run(main()) == ref
    assert threads == {threading.get_ident()}            # asyncio.run's loop runs on this thread


def test_preemption_under_a_tiny_pool_completes_every_request_with_the_same_tokens(make_engine, smol_tokenizer):
    prompts = [p[:40] for p in prompts_of_mixed_length(smol_tokenizer, 12)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params)

    async def main():
        async with make_engine("fixed:3", num_blocks=12, block_size=8, max_num_seqs=8) as eng:
            res = await run_all(eng, prompts, params, stagger=0)
            assert eng.batcher.num_preemptions > 0
            await pool_settled(eng)
            assert_pool_clean(eng)
            return res
    assert asyncio.run(main()) == ref


def test_abort_mid_generation_frees_the_requests_blocks(make_engine, smol_tokenizer):
    async def main():
        async with make_engine("fixed:2") as eng:
            ids = smol_tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story."}])
            got = []
            async for o in eng.generate(ids, SamplingParams(max_tokens=500, ignore_eos=True)):
                got += o.token_ids
                if len(got) >= 5:
                    break                                   # closing the stream aborts the request
            for _ in range(100):
                await asyncio.sleep(0.01)
                if eng.allocator.num_free == eng.allocator.num_total:
                    break
            assert_pool_clean(eng)
            other = [o async for o in eng.generate(ids, SamplingParams(max_tokens=3))]
            assert other[-1].finish_reason == "length"
    asyncio.run(main())


def test_explicit_abort_finishes_the_stream_with_abort(make_engine, smol_tokenizer):
    async def main():
        async with make_engine("off") as eng:
            ids = smol_tokenizer.encode("hello there")
            reasons, sent = [], False
            async for o in eng.generate(ids, SamplingParams(max_tokens=500, ignore_eos=True), request_id=77):
                if o.num_output_tokens >= 3 and not sent:
                    await eng.abort(77)
                    sent = True
                reasons.append(o.finish_reason)
            assert reasons[-1] == "abort"
            await pool_settled(eng)
            assert_pool_clean(eng)
    asyncio.run(main())


def test_an_actor_that_raises_stops_the_engine_and_fails_pending_requests(make_engine, smol_tokenizer):
    async def main():
        eng = make_engine("fixed:2")
        await eng.start()
        verifier = next(a for a in eng.actors if a.name == "verifier")
        calls = {"n": 0}
        real = verifier.handle

        def flaky(msg, now):
            calls["n"] += 1
            if calls["n"] > 12:
                raise RuntimeError("injected failure")
            return real(msg, now)
        verifier.handle = flaky
        ids = smol_tokenizer.encode("hello")

        async def consume():
            async for _ in eng.generate(ids, SamplingParams(max_tokens=1000, ignore_eos=True)):
                pass
        results = await asyncio.wait_for(asyncio.gather(*[consume() for _ in range(3)], return_exceptions=True), 20)
        assert all(isinstance(r, EngineError) for r in results)
        assert "injected failure" in str(results[0]) and not eng.healthy
        with pytest.raises(EngineError):
            async for _ in eng.generate(ids, SamplingParams(max_tokens=2)):
                pass
        await eng.stop()
    asyncio.run(main())


def test_stop_strings_cut_the_text_even_across_token_boundaries(make_engine, smol_tokenizer):
    async def main():
        async with make_engine("fixed:3") as eng:
            ids = smol_tokenizer.encode("hello")
            full = [o async for o in eng.generate(ids, SamplingParams(max_tokens=30, ignore_eos=True))][-1].text
            stop = full[7:11]
            outs = [o async for o in eng.generate(ids, SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))]
            text = "".join(o.text_delta for o in outs)
            assert text == full[: full.index(stop)] and outs[-1].finish_reason == "stop"
            await pool_settled(eng)
            assert_pool_clean(eng)
    asyncio.run(main())


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(make_engine, smol_tokenizer):
    from nightjar.sampling import RequestError

    async def main():
        async with make_engine("off", max_model_len=64) as eng:
            for ids, sp in [([], SamplingParams()), ([5] * 80, SamplingParams()), ([10**6], SamplingParams()),
                            ([5], SamplingParams(max_tokens=0)), ([5], SamplingParams(top_p=0.0))]:
                with pytest.raises(RequestError) as e:
                    async for _ in eng.generate(ids, sp):
                        pass
                assert e.value.status == 400
            outs = [o async for o in eng.generate([5, 6], SamplingParams(max_tokens=3))]
            assert outs[-1].num_output_tokens == 3 and eng.healthy
    asyncio.run(main())


# ---- sampling losslessness on a vocabulary small enough to enumerate ------------------------
def small_pair(vocab=12):
    cfg = tiny_config(vocab=vocab, hidden=32, layers=2, heads=4, kv=2, eos=())
    target = random_model(cfg, seed=11, std=0.6)
    draft = random_model(cfg, seed=12, std=0.6)
    return LoadedModel(target, None, "t"), LoadedModel(draft, None, "d")


def exact_first3(model, prompt, temp, vocab):
    """Exact joint distribution of the first three sampled tokens -> per-position marginals [3, V]."""
    from nightjar.kvpool.blocks import BlockAllocator  # noqa: F401
    from tests.models.test_llama_parity import Runner

    def probs(seqs):
        r = Runner(model, block_size=4, num_blocks=4 * len(seqs) + 8)
        out = r.run({i: (s, 0) for i, s in enumerate(seqs)}, {i: 1 for i in range(len(seqs))})
        return (out / temp).softmax(-1)
    p1 = probs([prompt])[0]                                                         # [V]
    p2 = probs([prompt + [a] for a in range(vocab)])                                # [V, V]
    p3 = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    joint = p1[:, None, None] * p2[:, :, None] * p3                                 # [V, V, V]
    return torch.stack([joint.sum((1, 2)), joint.sum((0, 2)), joint.sum((0, 1))])


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-gumbel", "unseeded-rejection"])
def test_speculative_sampling_keeps_the_target_distribution_of_the_first_three_tokens(seeded):
    vocab, n, temp = 12, 1500, 1.0
    pair = small_pair(vocab)
    prompt = [3, 7, 1, 4]
    exact = exact_first3(pair[0].model, prompt, temp, vocab)

    async def sample(policy):
        async with Engine(policy=policy, loaded=pair, dtype="float32", max_num_seqs=64, max_queue=10**6) as eng:
            async def one(seed):
                toks = []
                sp = SamplingParams(max_tokens=3, temperature=temp, seed=seed if seeded else None)
                async for o in eng.generate(prompt, sp):
                    toks += o.token_ids
                return toks
            res = await asyncio.gather(*[one(s) for s in range(n)])
            return torch.tensor(res), eng.stats
    got, stats = asyncio.run(sample("fixed:3"))
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    for pos in range(3):
        counts = torch.bincount(got[:, pos], minlength=vocab).float()
        expected = exact[pos] * n
        keep = expected >= 5                                 # chi-square needs expected counts >= 5
        chi2 = (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 4.5 * (2 * dof) ** 0.5, (pos, chi2, dof)   # ~p < 1e-4 for these dof
        tv = 0.5 * (counts / n - exact[pos]).abs().sum().item()
        assert tv < 0.06, (pos, tv)


def test_seeded_sampling_is_reproducible(make_engine, smol_tokenizer):
    async def main():
        async with make_engine("fixed:3") as eng:
            ids = smol_tokenizer.encode("seeded")
            sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
            a = [t for o in [x async for x in eng.generate(ids, sp)] for t in o.token_ids]
            b = [t for o in [x async for x in eng.generate(ids, sp)] for t in o.token_ids]
            assert a == b
    asyncio.run(main())


def test_a_request_larger_than_the_pool_ends_with_length_instead_of_hanging(make_engine, smol_tokenizer):
    from nightjar.sampling import RequestError

    async def main():
        async with make_engine("fixed:2", num_blocks=4, block_size=8) as eng:
            with pytest.raises(RequestError, match="the context is 32"):      # the base pool: 4 x 8 tokens
                async for _ in eng.generate([5] * 40, SamplingParams(max_tokens=4)):
                    pass
            outs = [o async for o in eng.generate([5] * 20, SamplingParams(max_tokens=100, ignore_eos=True))]
            assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens < 100
            await pool_settled(eng)
            assert_pool_clean(eng)
    asyncio.run(main())


def test_synthetic_acceptance_accepts_drafts_at_the_set_rate(make_engine, smol_tokenizer):
    async def main(rate):
        async with make_engine("fixed:3", synthetic_acceptance=rate) as eng:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            await run_all(eng, prompts_of_mixed_length(smol_tokenizer, 4), params)
            return eng.stats
    full, none = asyncio.run(main(1.0)), asyncio.run(main(0.0))
    assert full.accepted_tokens == full.draft_tokens > 0
    assert none.accepted_tokens == 0 and none.draft_tokens > 0


def test_greedy_tokens_do_not_depend_on_block_size_or_placement(make_engine, smol_tokenizer):
    prompts = prompts_of_mixed_length(smol_tokenizer, 16)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, max_num_seqs=1, block_size=16)
    for bs in (4, 32):
        got, _ = generate_with(make_engine, "fixed:2", prompts, params, max_num_seqs=16, block_size=bs)
        assert got == ref, bs

    async def fragmented():                      # interleaved, non-contiguous block placement
        async with make_engine("off", block_size=4) as eng:
            eng.allocator.reserve(-1, 4 * 64)
            for i in range(-2, -40, -1):
                eng.allocator.reserve(i, 4)
            eng.allocator.free(-1)
            return await run_all(eng, prompts, params)
    assert asyncio.run(fragmented()) == ref


@pytest.mark.parametrize("policy", ["dsd", "banditspec", "table:mlc", "nightjar", "nightjar-nooffload",
                                    "nightjar:harmonic"])
def test_adaptive_policies_are_greedy_exact_too(make_engine, smol_tokenizer, policy):
    prompts = prompts_of_mixed_length(smol_tokenizer, 12)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params)
    got, stats = generate_with(make_engine, policy, prompts, params)
    assert got == ref and stats.draft_tokens > 0


def test_a_request_id_already_in_flight_fails_alone(make_engine, smol_tokenizer):
    from nightjar.sampling import RequestError

    async def main():
        async with make_engine("fixed:2") as eng:
            ids = smol_tokenizer.encode("hello")
            first = eng.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True), request_id=77)
            out = [await first.__anext__()]
            with pytest.raises(RequestError, match="already in flight"):
                async for _ in eng.generate(ids, SamplingParams(max_tokens=2), request_id=77):
                    pass
            out += [o async for o in first]
            assert sum(len(o.token_ids) for o in out) == 8 and out[-1].finish_reason == "length"
    asyncio.run(main())
