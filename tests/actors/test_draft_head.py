"""A draft head (models/eagle.py) as the engine's drafter: greedy output identical to `off`, the head's
entries line up with the target's features and tokens, its KV is cut back after each step."""
from __future__ import annotations

import asyncio

import pytest
import torch

from nightjar.models import LoadedModel
from nightjar.models.eagle import DraftHead, HeadConfig
from nightjar.sampling import SamplingParams
from tests.test_engine import generate_with, prompts_of_mixed_length


def random_head(target_cfg, seed: int = 3, vocab: int = 4096) -> DraftHead:
    g = torch.Generator().manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(target_cfg, vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 if p.dim() > 1 else torch.ones(p.shape))
        head.d2t.copy_(torch.randperm(target_cfg.vocab_size, generator=g)[:vocab].sort().values)
    return head.eval()


@pytest.fixture(scope="module")
def head_pair(tiny_pair):
    target, _ = tiny_pair
    return target, LoadedModel(random_head(target.config), None, "tiny-head")


@pytest.mark.parametrize("policy", ["fixed:1", "fixed:3", "nightjar"])
def test_head_drafting_is_greedy_exact(make_engine, head_pair, smol_tokenizer, policy):
    prompts = prompts_of_mixed_length(smol_tokenizer, 10)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=head_pair, max_num_seqs=4)
    got, stats = generate_with(make_engine, policy, prompts, params, pair=head_pair, max_num_seqs=4, gamma_max=4)
    assert got == ref
    assert stats.draft_tokens > 0


def repeat_pair(smol_tokenizer):
    """A target whose layers add nothing (zero o_proj and MLP): every layer's state at i is embed(x_i)
    and it predicts x_{i+1} = x_i. The oracle head reads the first captured layer's state as its
    fused feature (fc = [I 0]), adds nothing, and scores with the target's tied head: it drafts x_i
    for x_{i+2}, right whenever x_{i+1} = x_i — from the second answer token on, if the head is fed
    the features of the right position. A one-position offset would draft x_{i-1} or x_{i+1}."""
    from tests.conftest import random_model, tiny_config

    cfg = tiny_config(eos=smol_tokenizer.eos_token_ids)
    target = random_model(cfg, seed=5)
    with torch.no_grad():
        for layer in target.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    head = DraftHead(HeadConfig.for_target(cfg, cfg.vocab_size))
    H = cfg.hidden_size
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, :H] = torch.eye(H)
        for norm in (head.embed_norm, head.feat_norm, head.post_attention_layernorm):
            norm.weight.fill_(1.0)
        head.norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
    return LoadedModel(target, smol_tokenizer, "repeat"), LoadedModel(head.eval(), None, "oracle-head")


def run_tapped(make_engine, policy, prompts, params, pair, tap, **kw):
    from tests.test_engine import run_all

    async def main():
        async with make_engine(policy, pair=pair, **kw) as eng:
            seen = tap(eng)
            res = await run_all(eng, prompts, params)
            return res, eng.stats, seen
    return asyncio.run(main())


def frontier_check(eng):
    """After every draft, the head's KV holds exactly its catch-up frontier (drafted entries cut back). Checked
    as ``_propose_head`` returns: a tap on StepDrafted could run after the same compute-thread call stored the
    step's verified features (the verifier's relay, kernel/actor.py), which moves the frontier on."""
    from nightjar.actors.draft_head import HeadDraftExecutor

    ex = next(a for a in eng.actors if isinstance(a, HeadDraftExecutor))
    seen, propose = [], ex._propose_head

    def checked(rows, gamma):
        got = propose(rows, gamma)
        for rid, c in ex.ctx.items():
            assert ex.alloc.num_committed(rid) <= c.fend - c.base
        seen.append(sum(ex.alloc.num_committed(r) == c.fend - c.base for r, c in ex.ctx.items()))
        return got
    ex._propose_head = checked
    return seen


def test_an_oracle_head_fed_the_right_positions_is_always_accepted(make_engine, smol_tokenizer):
    pair = repeat_pair(smol_tokenizer)
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=pair)
    assert all(len(set(r[1:])) == 1 for r in ref)                          # the target repeats itself
    got, stats, seen = run_tapped(make_engine, "fixed:3", prompts, params, pair, frontier_check, max_num_seqs=3,
                                  prompt_lookup=0)                         # the head drafts every row
    assert got == ref and sum(seen) > 0
    firsts = [p[-1] != r[0] for p, r in zip(prompts, ref)]                 # x_{P-1} != x_P: d1 misses once
    assert stats.draft_tokens - stats.accepted_tokens <= 3 * sum(firsts)
    assert stats.accepted_tokens >= 0.8 * stats.draft_tokens


class CycledGamma:
    """A batch-level policy stand-in: γ = 0 for three steps, then γ = 2, over and over."""
    name, uses_draft, elastic_memory, gamma_max = "cycled", True, False, 2

    def __init__(self):
        import itertools

        self.gammas = itertools.cycle((0, 0, 0, 2))

    def decide(self, batch_size, state):
        return next(self.gammas)

    def observe(self, result):
        pass

    def snapshot(self):
        return {"policy": self.name}


def test_features_of_gamma_0_steps_stored_late_still_line_up(make_engine, smol_tokenizer, monkeypatch):
    """The head stores the γ = 0 steps' features only at its next wake-up (its StepVerified is quiet): every
    step's features still reach the head's context, with no gap (a gap restarts the context), and the oracle
    head stays accepted after each γ = 0 run."""
    import nightjar.actors.planner as planner_mod
    from nightjar.actors.draft_head import HeadDraftExecutor

    gaps, extend = [], HeadDraftExecutor._extend

    def spied(self, rid, p0, k):
        c = self.ctx.get(rid)
        if c is not None and c.fend != p0:
            gaps.append((rid, c.fend, p0))
        return extend(self, rid, p0, k)

    pair = repeat_pair(smol_tokenizer)
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=pair)
    monkeypatch.setattr(planner_mod, "make_policy", lambda *a, **k: CycledGamma())
    monkeypatch.setattr(HeadDraftExecutor, "_extend", spied)
    got, stats = generate_with(make_engine, "nightjar", prompts, params, pair=pair, max_num_seqs=3, prompt_lookup=0,
                               gamma_max=2)
    assert got == ref and stats.draft_tokens > 20 and gaps == []
    assert stats.accepted_tokens >= 0.8 * stats.draft_tokens


def test_offload_reload_cycles_with_a_head_keep_greedy_tokens_and_restart_its_context(make_engine, smol_tokenizer):
    """Forced offload -> reload with requests in flight: the head's KV and features leave the device
    (counted in the budget), tokens stay `off`'s, and requests whose features have a gap start a fresh
    head context and draft again (the oracle head is then accepted again)."""
    from nightjar.kernel.messages import OffloadDraft, ReloadDraft
    from tests.test_elastic import wait_for, wait_state, wait_steps
    from tests.test_engine import assert_pool_clean, pool_settled, run_all

    pair = repeat_pair(smol_tokenizer)
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def cycled():
        async with make_engine("fixed:3", pair=pair, num_blocks=64, block_size=8, max_num_seqs=3,
                               prompt_lookup=0) as eng:
            before = eng.device_bytes()
            assert before["draft_kv"] == eng.memory.draft_kv_bytes > 0          # KV + features, budgeted
            job = asyncio.ensure_future(run_all(eng, prompts, params, stagger=0.002))
            await wait_steps(eng, 6)
            eng.bus.publish("test", [OffloadDraft(reason="test")])
            await wait_state(eng, "OFFLOADED")
            assert eng.device_bytes()["draft_kv"] == 0
            await wait_steps(eng, eng.stats.steps + 5)                           # γ=0 steps: a feature gap
            accepted = eng.stats.accepted_tokens
            eng.bus.publish("test", [ReloadDraft(reason="test")])
            await wait_state(eng, "RESIDENT")
            await wait_for(lambda: eng.stats.accepted_tokens > accepted or not eng.batcher.seqs, what="drafting")
            out = await job
            assert eng.stats.accepted_tokens > accepted                          # drafting resumed
            await pool_settled(eng)
            assert_pool_clean(eng)
            await wait_for(lambda: not eng.draft_allocator.seq_ids(), what="head blocks freed")
            return out
    assert asyncio.run(cycled()) == generate_with(make_engine, "off", prompts, params, pair=pair)[0]


def test_an_offload_waits_for_the_head_to_stop_writing_its_cache(make_engine, smol_tokenizer, monkeypatch):
    """The head writes its cache after every verified step, γ = 0 ones too. With each write slowed to 50 ms,
    the copy and release of an offload would run while a write is under way (the engine stopped on a
    zero-size storage: this test without the wait); the weight mover waits for the draft executor's
    DraftQuiesced instead."""
    import time

    from nightjar.kernel.messages import OffloadDraft, ReloadDraft
    from nightjar.kvpool.cache import HeadCache
    from tests.test_elastic import wait_state, wait_steps
    from tests.test_engine import run_all

    write = HeadCache.write_features

    def slow_write(self, g, slots):
        time.sleep(0.05)                   # the head decided to write (it is resident); the write comes later
        write(self, g, slots)
    monkeypatch.setattr(HeadCache, "write_features", slow_write)
    pair = repeat_pair(smol_tokenizer)
    prompts = prompts_of_mixed_length(smol_tokenizer, 3)
    params = SamplingParams(max_tokens=32, ignore_eos=True)

    async def cycled():
        async with make_engine("fixed:0", pair=pair, num_blocks=64, block_size=8, max_num_seqs=3) as eng:
            job = asyncio.ensure_future(run_all(eng, prompts, params, stagger=0))
            for _ in range(2):
                await wait_steps(eng, eng.stats.steps + 3)
                eng.bus.publish("test", [OffloadDraft(reason="test")])
                await wait_state(eng, "OFFLOADED")
                eng.bus.publish("test", [ReloadDraft(reason="test")])
                await wait_state(eng, "RESIDENT")
            return await job, eng.weights.num_offloads
    got, offloads = asyncio.run(cycled())
    assert offloads == 2
    assert got == generate_with(make_engine, "off", prompts, params, pair=pair)[0]


def test_seeded_tokens_with_a_head_equal_off_and_unseeded_sampling_runs(make_engine, head_pair, smol_tokenizer):
    from tests.test_seeded_sampling import generate

    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    ref, _ = generate(make_engine, "off", prompts, head_pair, max_num_seqs=1)
    got, stats = generate(make_engine, "fixed:3", prompts, head_pair, max_num_seqs=6)
    assert got == ref and stats.draft_tokens > 0
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9)   # q from the head
    out, stats = generate_with(make_engine, "fixed:2", prompts, params, pair=head_pair, max_num_seqs=6)
    assert all(len(o) == 12 for o in out) and stats.draft_tokens > 0
    pair = repeat_pair(smol_tokenizer)                      # a head whose seeded drafts are accepted
    ref, _ = generate(make_engine, "off", prompts, pair, max_num_seqs=1)
    got, stats = generate(make_engine, "fixed:3", prompts, pair, max_num_seqs=6, prompt_lookup=0)
    assert got == ref and stats.accepted_tokens > 0


def test_greedy_picks_on_the_draft_vocabulary_equal_the_full_vocabularys_first_maximum(tiny_pair):
    from types import SimpleNamespace

    from nightjar.actors.draft_head import HeadDraftExecutor

    target, _ = tiny_pair
    head = random_head(target.config, vocab=16)
    small = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    small[1, 4] = small[1, 9] = small[1].max() + 1                          # a tie: the lower draft id wins
    full = small.new_full((3, target.config.vocab_size), float("-inf"))
    full[:, head.d2t] = small
    seen = []
    ex = SimpleNamespace(slot=SimpleNamespace(model=head), _pick=lambda logits, *a: seen.append(logits) or [-1])
    pick = HeadDraftExecutor._pick_small
    assert pick(ex, small, [True] * 3, None, None, None, [], [], 0) == full.argmax(-1).tolist()
    assert not seen
    pick(ex, small, [True, False, True], None, None, None, [], [], 0)       # a sampling row: the full vocabulary
    assert torch.equal(seen.pop(), full)
    shuffled = random_head(target.config, vocab=16)
    shuffled.d2t.copy_(head.d2t.flip(0))                                    # not ascending: no shortcut
    ex.slot.model = shuffled
    pick(ex, small, [True] * 3, None, None, None, [], [], 0)
    assert seen and seen[0].shape == full.shape
