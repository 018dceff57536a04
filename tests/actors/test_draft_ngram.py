"""The n-gram drafter (actors/draft_ngram.py): what it proposes, and that speculating with it is lossless
(greedy and seeded tokens equal ``off``'s; unseeded samples follow the target's distribution)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from nightjar.actors.draft_ngram import NgramIndex, parse_ngram
from nightjar.engine import Engine
from nightjar.models import LoadedModel
from nightjar.sampling import ConfigError, SamplingParams
from tests.test_engine import assert_pool_clean, exact_first3, pool_settled, prompts_of_mixed_length, small_pair
from tests.test_seeded_sampling import seeded_params


def test_the_longest_suffix_that_occurred_before_proposes_what_followed_its_latest_occurrence():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # suffix (2, 3) ended at 2 and 6; (5, 2, 3) never occurred before; the latest (2, 3) was followed by 8, 5, ...
    assert idx.propose(toks, 4) == [8, 5, 2, 3]
    assert idx.propose(toks, 2) == [8, 5]
    assert idx.propose(toks, 6) == [8, 5, 2, 3, 8, 5]      # past the end: the text repeats with period 4
    toks += [8]                                            # (2, 3, 8) occurred at 5..7: what followed it
    assert idx.propose(toks, 3) == [5, 2, 3]


def test_no_match_proposes_nothing_and_a_match_at_the_end_proposes_what_there_is():
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5], 3) == []           # no bigram repeats
    assert NgramIndex(1, 1).propose([7], 3) == []                        # nothing before the suffix
    assert NgramIndex(2, 2).propose([4, 4, 4], 5) == [4, 4, 4, 4, 4]     # (4, 4) ended at 1: period 1
    assert NgramIndex(1, 3).propose([7, 1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]     # period 3


def test_an_index_grown_step_by_step_proposes_what_a_fresh_one_does():
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6, (300,), generator=g).tolist()
    grown = NgramIndex(2, 4)
    for n in range(1, len(toks) + 1):
        want = NgramIndex(2, 4).propose(toks[:n], 5)
        assert grown.propose(toks[:n], 5) == want, n


def test_the_spec_parses_and_a_bad_one_says_what_is_allowed():
    assert parse_ngram("ngram") == (1, 3)
    assert parse_ngram("ngram:3") == (3, 3)
    assert parse_ngram("ngram:1-5") == (1, 5)
    for other in (None, "default", "none", "ngrams", "/models/ngram-draft"):
        assert parse_ngram(other) is None
    for bad in ("ngram:", "ngram:0", "ngram:4-2", "ngram:a-b", "ngram:1-99"):
        with pytest.raises(ValueError, match="MIN-MAX"):
            parse_ngram(bad)


@pytest.mark.parametrize("kw, field", [(dict(draft="ngram:5-2"), "draft"),
                                       (dict(draft="ngram", draft_quantization="int8"), "draft_quantization"),
                                       (dict(draft="ngram", draft_tree=2), "draft_tree")])
def test_options_the_ngram_drafter_cannot_take_fail_at_start(kw, field):
    async def main():
        async with Engine(policy="fixed:2", loaded=(small_pair(12)[0], None), dtype="float32", **kw):
            pass
    with pytest.raises(ConfigError) as e:
        asyncio.run(main())
    assert e.value.field == field


def loopy_prompts(n: int = 12, vocab: int = 12) -> list[list[int]]:
    """Prompts of mixed length over a 12-token vocabulary: a random model over so few tokens repeats itself, so
    the drafter finds matches (and misses) from the first steps on."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 40, (n,), generator=g)]


def run_engine(policy: str, prompts, params_of, **kw):
    """Every prompt through one engine on the small 12-token target: (tokens per prompt, stats); the pool ends
    clean."""
    async def main():
        async with Engine(policy=policy, loaded=(small_pair(12)[0], None), dtype="float32", **kw) as eng:
            async def one(i, ids):
                await asyncio.sleep(0.003 * i)
                return [t for o in [x async for x in eng.generate(ids, params_of(i))] for t in o.token_ids]
            out = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
            await pool_settled(eng)
            assert_pool_clean(eng)
            return out, eng.stats
    return asyncio.run(main())


@pytest.mark.parametrize("policy", ["fixed:1", "fixed:4", "nightjar", "nightjar:per-request"])
def test_greedy_tokens_with_the_ngram_drafter_are_offs(policy):
    prompts = loopy_prompts()
    params = lambda i: SamplingParams(max_tokens=40, ignore_eos=True)  # noqa: E731
    ref, _ = run_engine("off", prompts, params, max_num_seqs=1)
    for bs in (1, 7):
        got, stats = run_engine(policy, prompts, params, draft="ngram:1-3", max_num_seqs=bs)
        assert got == ref, (policy, bs)
        assert 0 < stats.accepted_tokens < stats.draft_tokens, (policy, bs)


def test_seeded_tokens_with_the_ngram_drafter_are_offs():
    prompts = loopy_prompts(8)
    ref, _ = run_engine("off", prompts, seeded_params, max_num_seqs=1)
    assert len({tuple(r) for r in ref}) == len(ref)
    got, stats = run_engine("fixed:3", prompts, seeded_params, draft="ngram:1-3", max_num_seqs=8)
    assert got == ref
    assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("policy", ["fixed:2", "nightjar"])
def test_a_recorded_ngram_run_replays_with_zero_divergence_and_full_replay_gives_its_tokens(make_engine, tiny_pair,
                                                                                           tmp_path, policy):
    from nightjar.offline.replay import full_replay, replay_file
    from tests.offline.test_replay import record_run

    path = tmp_path / "run.njtrace"
    record_run(make_engine, path, policy, pair=(tiny_pair[0], None), draft="ngram:1-3")
    res = replay_file(str(path))
    assert res.ok, res.summary()
    assert res.checked["batcher"] > 10 and res.checked["planner"] > 5
    full = full_replay(str(path), loaded=(tiny_pair[0], None))
    assert full.ok and full.exact >= 2, full.details


def test_a_head_with_prompt_lookup_stays_exact_and_looks_up_the_rows_that_repeat(make_engine, smol_tokenizer):
    """The head executor's prompt lookup (actors/draft_head.py): on a target that repeats itself, with a random
    head (its own drafts rarely right), rows draft by lookup and are accepted; greedy and seeded tokens are
    `off`'s, alone and batched."""
    from nightjar.actors.draft_head import HeadDraftExecutor
    from tests.actors.test_draft_head import random_head, repeat_pair
    from tests.test_engine import run_all
    from tests.test_seeded_sampling import run_seeded

    target = repeat_pair(smol_tokenizer)[0]
    pair = (target, LoadedModel(random_head(target.config), None, "random-head"))
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def main(policy, seeded, bs, **kw):
        async with make_engine(policy, pair=pair, max_num_seqs=bs, **kw) as eng:
            out = await (run_seeded(eng, prompts) if seeded else run_all(eng, prompts, params))
            ex = next((a for a in eng.actors if isinstance(a, HeadDraftExecutor)), None)
            return out, eng.stats, ex.lookup.matched if ex and ex.lookup else 0
    for seeded in (False, True):
        ref, _, _ = asyncio.run(main("off", seeded, 1))
        for policy, bs in (("fixed:3", 1), ("fixed:3", 6), ("nightjar", 6)):
            got, stats, looked = asyncio.run(main(policy, seeded, bs))
            assert got == ref, (policy, bs, seeded)
            assert looked > 0 and stats.accepted_tokens > 0, (policy, bs, seeded)
            if not seeded:
                assert stats.accepted_tokens >= 0.5 * stats.draft_tokens     # the lookups are right


def test_the_rows_that_looked_up_are_reported_apart_for_the_planner(make_engine, smol_tokenizer):
    """StepDrafted.looked names the decode rows that drafted by prompt lookup (the lookup's match count is theirs,
    step by step) and StepTimed.lookup_* carries their count and accepted positions, a part of the step's own
    (policy_model.LookupSplit learns from it); per-row γ steps report none."""
    from nightjar.actors.draft_head import HeadDraftExecutor
    from nightjar.kernel.messages import StepDrafted, StepTimed
    from tests.actors.test_draft_head import random_head, repeat_pair
    from tests.test_engine import run_all

    target = repeat_pair(smol_tokenizer)[0]
    pair = (target, LoadedModel(random_head(target.config), None, "random-head"))
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    drafted, timed = {}, {}

    def tap(env):
        if isinstance(env.msg, StepDrafted):
            drafted[env.msg.step] = env.msg
        elif isinstance(env.msg, StepTimed) and env.msg.gamma:
            timed[env.msg.step] = env.msg

    async def main():
        async with make_engine("fixed:3", pair=pair, max_num_seqs=6) as eng:
            eng.bus.add_tap(tap)
            await run_all(eng, prompts, SamplingParams(max_tokens=24, ignore_eos=True))
            return next(a for a in eng.actors if isinstance(a, HeadDraftExecutor)).lookup.matched
    matched = asyncio.run(main())
    assert matched > 0 and sum(len(d.looked) for d in drafted.values()) == matched
    assert 0 < sum(len(d.looked) for d in drafted.values()) < sum(t.num_drafts for t in timed.values())
    for step, t in timed.items():
        d = drafted[step]
        assert t.lookup_drafts == len(d.looked) and all(0 <= r < t.batch_size for r in d.looked)
        if d.looked:
            assert len(t.lookup_accepted_per_pos) == t.gamma
            assert all(0 <= x <= y for x, y in zip(t.lookup_accepted_per_pos, t.accepted_per_pos))
            assert t.lookup_accepted_per_pos[0] <= t.lookup_drafts


def test_the_lookup_split_counts_the_looked_up_rows_chains_and_skips_per_row_steps():
    from nightjar.actors.verifier import _lookup_split
    from nightjar.kernel.messages import StepDrafted

    d = StepDrafted(step=1, gamma=3, draft_tokens=(0,) * 9, handle=1, draft_time_s=0.0, looked=(0, 2))
    assert _lookup_split(d, [3, 0, 1]) == {"lookup_drafts": 2, "lookup_accepted_per_pos": (2, 1, 1)}
    assert _lookup_split(StepDrafted(step=1, gamma=3, draft_tokens=(0,) * 9, handle=1, draft_time_s=0.0),
                         [3, 0, 1]) == {}
    per_row = StepDrafted(step=1, gamma=3, draft_tokens=(0,) * 9, handle=1, draft_time_s=0.0, looked=(0,),
                          gammas=(3, 0, 1))
    assert _lookup_split(per_row, [3, 0, 1]) == {} and _lookup_split(None, []) == {}


@pytest.mark.parametrize("drafter", ["ngram", "head+lookup"])
def test_unseeded_samples_with_prompt_lookup_follow_the_targets_distribution(drafter):
    """Rejection sampling against the proposal's one-hot q, from the n-gram drafter and from a head's prompt
    lookup: the first three tokens' marginals are the target's (chi-square and total variation, as for a draft
    model in tests/test_engine.py)."""
    from tests.actors.test_draft_head import random_head

    vocab, n, temp = 12, 1500, 1.0
    target = small_pair(vocab)[0]
    prompt = [3, 7, 1, 3, 7, 1, 3]                 # repeats: lookups from the first step on
    exact = exact_first3(target.model, prompt, temp, vocab)
    kw = (dict(draft="ngram:1-3", loaded=(target, None)) if drafter == "ngram" else
          dict(loaded=(target, LoadedModel(random_head(target.config, vocab=vocab), None, "h")), prompt_lookup=1))

    async def sample():
        async with Engine(policy="fixed:3", dtype="float32", max_num_seqs=64, max_queue=10**6, **kw) as eng:
            async def one():
                toks = []
                async for o in eng.generate(prompt, SamplingParams(max_tokens=3, temperature=temp)):
                    toks += o.token_ids
                return toks
            res = await asyncio.gather(*[one() for _ in range(n)])
            return torch.tensor(res), eng.stats
    got, stats = asyncio.run(sample())
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    for pos in range(3):
        counts = torch.bincount(got[:, pos], minlength=vocab).float()
        expected = exact[pos] * n
        keep = expected >= 5
        chi2 = (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 4.5 * (2 * dof) ** 0.5, (pos, chi2, dof)
        assert 0.5 * (counts / n - exact[pos]).abs().sum().item() < 0.06, pos
