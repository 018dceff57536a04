"""Draft tree (actors/verifier.py, actors/draft_head.py): greedy rows send runner-up first drafts; a sibling
that is the target's token is taken with the token after it, and the output stays `off`'s."""
from __future__ import annotations

import pytest
import torch

from nightjar.actors.draft_head import HeadDraftExecutor
from nightjar.models import LoadedModel
from nightjar.models.eagle import DraftHead
from nightjar.sampling import SamplingParams
from tests.actors.test_draft_head import random_head, repeat_pair
from tests.test_engine import generate_with, prompts_of_mixed_length


@pytest.fixture(scope="module")
def head_pair(tiny_pair):
    target, _ = tiny_pair
    return target, LoadedModel(random_head(target.config), None, "tiny-head")


class DecoyHead(DraftHead):
    """A head whose top token is always ``decoy``: its own best guess comes second."""
    decoy = 0

    @torch.inference_mode()
    def forward(self, lay, cache, emb, g):
        a, logits = super().forward(lay, cache, emb, g)                   # logits [N, Vd]
        logits[:, self.decoy] = logits.max(-1).values + 1.0
        return a, logits


def decoy_pair(smol_tokenizer, decoy: int):
    target, oracle = repeat_pair(smol_tokenizer)
    head = oracle.model
    head.__class__ = DecoyHead
    head.decoy = decoy
    return target, LoadedModel(head, None, "decoy-oracle-head")


def test_the_sibling_after_a_decoy_is_taken_and_the_head_stays_aligned(make_engine, smol_tokenizer):
    """The oracle head drafts right only when fed the right features; a decoy beats it to d1 every time.
    With a tree its right guess is a sibling: taken on (almost) every drafting row, so c_j's features
    reached the head (a misaligned feature would make the next sibling wrong), and the tokens are `off`'s."""
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    pair0 = repeat_pair(smol_tokenizer)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=pair0)
    used = {t for p, r in zip(prompts, ref) for t in p + r}
    pair = decoy_pair(smol_tokenizer, next(t for t in range(3, 1000) if t not in used))
    kw = dict(pair=pair, max_num_seqs=3, draft_tree_batch=3, prompt_lookup=0)     # the head drafts every row
    got, stats = generate_with(make_engine, "fixed:2", prompts, params, draft_tree=2, **kw)
    assert got == ref
    assert stats.accepted_tokens == 0 and stats.num_drafts > 0                  # the chain never holds
    assert stats.tree_hits >= 0.75 * stats.num_drafts
    plain, pstats = generate_with(make_engine, "fixed:2", prompts, params, **kw)
    assert plain == ref and pstats.tree_hits == 0 and pstats.steps > stats.steps


def scripted(monkeypatch, refs: dict[tuple[int, ...], list[int]], vocab: int):
    """Make the head's pass-1 proposal scripted from `off`'s tokens: every chain draft wrong, the target's
    token the last of the row's siblings (so it sits in the second scratch pair when there are two)."""
    real = HeadDraftExecutor._propose_head

    def propose(self, rows, gamma):
        out, probs, catch, sibs = real(self, rows, gamma)
        for j, (_, rid, _, _) in enumerate(rows):
            m = self.mirrors[rid]
            ref = refs[tuple(m.tokens[: m.prompt_len])]
            k = m.num_output
            if k >= len(ref) or not sibs[j]:
                continue
            right = ref[k]
            out[j] = [(right + 1 + i) % vocab for i in range(len(out[j]))]
            sibs[j] = [(right + 7) % vocab] * (len(sibs[j]) - 1) + [right]
        return out, probs, catch, sibs
    monkeypatch.setattr(HeadDraftExecutor, "_propose_head", propose)


@pytest.mark.parametrize("policy,block_size", [("fixed:1", 4), ("fixed:3", 4), ("fixed:2", 16)])
def test_a_taken_sibling_s_kv_lands_in_the_row_s_own_slot(make_engine, head_pair, smol_tokenizer, monkeypatch,
                                                          policy, block_size):
    """On a target whose attention matters, every drafting row takes a sibling (scripted): each step then
    copies c_j's K and V from a scratch block into the row's slot n+1, across block boundaries (block size 4
    puts n at a block's first slot and n+1 in the next block often). A wrong copy would change later tokens."""
    prompts = prompts_of_mixed_length(smol_tokenizer, 6)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    kw = dict(pair=head_pair, max_num_seqs=3, block_size=block_size, num_blocks=256, prompt_lookup=0)
    ref, _ = generate_with(make_engine, "off", prompts, params, **kw)
    scripted(monkeypatch, {tuple(p): r for p, r in zip(prompts, ref)}, head_pair[0].config.vocab_size)
    got, stats = generate_with(make_engine, policy, prompts, params, draft_tree=2, draft_tree_batch=3, **kw)
    assert got == ref
    assert stats.accepted_tokens == 0 and stats.tree_hits > 0.8 * stats.num_drafts


@pytest.mark.parametrize("tree_batch", [1, 4])
def test_random_head_with_a_tree_is_greedy_exact(make_engine, head_pair, smol_tokenizer, tree_batch):
    """Siblings of a random head (rarely right), with batches above and below the tree's batch limit."""
    prompts = prompts_of_mixed_length(smol_tokenizer, 8)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=head_pair, max_num_seqs=4)
    got, _ = generate_with(make_engine, "nightjar", prompts, params, pair=head_pair, max_num_seqs=4,
                           draft_tree=3, draft_tree_batch=tree_batch)
    assert got == ref


def test_sampled_rows_send_no_siblings_and_seeded_output_is_unchanged(make_engine, head_pair, smol_tokenizer):
    """Siblings are for greedy rows only: seeded sampling gives the same tokens with and without a tree."""
    prompts = prompts_of_mixed_length(smol_tokenizer, 4)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    plain, _ = generate_with(make_engine, "fixed:2", prompts, params, pair=head_pair, max_num_seqs=4)
    tree, stats = generate_with(make_engine, "fixed:2", prompts, params, pair=head_pair, max_num_seqs=4,
                                draft_tree=2, draft_tree_batch=4)
    assert tree == plain and stats.tree_hits == 0


def test_a_tree_needs_a_draft_head(make_engine, smol_tokenizer):
    from nightjar.sampling import ConfigError

    with pytest.raises(ConfigError, match="draft_tree"):
        generate_with(make_engine, "fixed:2", prompts_of_mixed_length(smol_tokenizer, 2),
                      SamplingParams(max_tokens=2), draft_tree=2)
