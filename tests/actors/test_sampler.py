"""The model actors' torch sampler: the top-k/top-p fast path equals the full sort, inverse-CDF and
Gumbel-max draws follow the distribution and never pick a zero-probability token, and verification
emits p's distribution whatever the draft."""
from __future__ import annotations

import pytest
import torch

from nightjar.actors.sampler import (
    _inverse_cdf,
    _sorted_probs,
    argmax_last,
    draw_uniforms,
    gumbel_noise,
    rejection_sample,
    sample_from,
    seeded_scores,
    transform_logits,
    verify,
)


def _logits(B, G1, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 8.0, B)[:, None, None]                       # flat rows to peaked rows
    return torch.randn((B, G1, V), generator=g) * scale                      # [B, G+1, V]


def test_top_p_fast_path_equals_the_full_sort_for_flat_and_peaked_rows():
    B, G1, V = 8, 3, 5000
    x = _logits(B, G1, V)
    temp = torch.full((B, 1), 0.8)
    for top_k, top_p in [(0, 0.9), (0, 0.5), (50, 0.95), (3000, 0.99), (20, 1.0), (0, 0.0)]:
        tk, tp = torch.full((B, 1), top_k), torch.full((B, 1), top_p)
        got = transform_logits(x, temp, tk, tp)                              # [B, G+1, V]
        k = torch.where(tk <= 0, torch.full_like(tk, V), tk).expand(B, G1)
        want = _sorted_probs(x / 0.8, k, tp.expand(B, G1))
        assert torch.allclose(got, want, atol=1e-6), (top_k, top_p)
        assert torch.allclose(got.sum(-1), torch.ones(B, G1), atol=1e-5)


def test_greedy_rows_stay_one_hot_beside_truncated_rows():
    x = _logits(4, 1, 3000)[:, 0]                                             # [4, V]
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7])
    probs = transform_logits(x, temp, torch.zeros(4, dtype=torch.int64), torch.full((4,), 0.9))
    assert torch.equal(probs[0].nonzero().view(-1), x[0].argmax().view(1))
    assert torch.equal(probs[2].nonzero().view(-1), x[2].argmax().view(1))
    assert (probs[1] > 0).sum() > 1


def test_inverse_cdf_follows_the_distribution_and_skips_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    draws = _inverse_cdf(p.expand(n, -1), u)                                  # [n]
    freq = torch.bincount(draws, minlength=6).double() / n
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, p.double(), atol=0.015)
    edge = _inverse_cdf(p.expand(3, -1), torch.tensor([0.0, 0.999999999, 1.0], dtype=torch.float64))
    assert edge.tolist() == [1, 4, 4]                                         # u = 1 clamps to the last positive


def test_sample_from_is_reproducible_per_generator():
    probs = torch.softmax(_logits(5, 1, 1000)[:, 0], -1)
    a = sample_from(probs, [torch.Generator().manual_seed(s) for s in range(5)])
    b = sample_from(probs, [torch.Generator().manual_seed(s) for s in range(5)])
    assert torch.equal(a, b)


def test_verification_emits_the_target_distribution_whatever_the_draft():
    V, G, n = 5, 2, 20000
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.0]] * (G + 1)).expand(n, G + 1, V)    # [n, G+1, V]
    q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]] * G).expand(n, G, V)              # [n, G, V]
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q[0, 0], n * G, replacement=True, generator=gen).view(n, G)
    u = torch.rand(n, G + 1, dtype=torch.float64, generator=gen)
    toks, acc = rejection_sample(p, drafts, q, torch.full((n,), G), torch.zeros(n, dtype=torch.bool), u)
    for pos in range(G + 1):                     # every emitted position, given it was reached
        reached = toks[:, pos] >= 0
        freq = torch.bincount(toks[reached, pos], minlength=V).float() / int(reached.sum())
        assert torch.allclose(freq, p[0, 0], atol=0.02), (pos, freq)
    assert ((toks >= 0).sum(-1) == acc + 1).all() and 0 < acc.float().mean() < G


def test_greedy_rows_accept_the_matching_prefix_and_add_the_argmax():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))     # [B, G+1, V]
    argmax = logits.argmax(-1)
    drafts = argmax[:, :3].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % 50                                       # row 0: reject at 1
    nd = torch.tensor([3, 3, 2])                                                  # row 2: two drafts
    toks, acc = verify(logits, drafts, None, nd, torch.ones(3, dtype=torch.bool), [None] * 3, [False] * 3)
    assert acc.tolist() == [1, 3, 2]
    assert toks[0].tolist() == [argmax[0, 0].item(), argmax[0, 1].item(), -1, -1]
    assert toks[1].tolist() == argmax[1].tolist() and toks[2, :3].tolist() == argmax[2, :3].tolist()


def test_only_random_rows_draw_from_their_generators():
    gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(1)]
    u = draw_uniforms(gens, [True, False, True], 4, "cpu")
    assert torch.equal(u[0], u[2]) and not u[1].any() and (u[0] > 0).all()


def test_gumbel_max_follows_the_distribution_and_skips_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 20000
    noise = gumbel_noise(list(range(n)), 6, "cpu")                             # [n, V], one seed a row
    draws = seeded_scores(p.expand(n, -1), noise).argmax(-1)                  # [n]
    freq = torch.bincount(draws, minlength=6).double() / n
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, p.double(), atol=0.015)


def test_gumbel_noise_of_a_row_depends_on_its_seed_alone():
    a = gumbel_noise([5, 6, 7], 1000, "cpu")
    assert torch.equal(a[1], gumbel_noise([6], 1000, "cpu")[0])
    assert torch.equal(a[2], gumbel_noise([9, 7], 1000, "cpu")[1])
    assert not torch.equal(a[0], a[1]) and torch.isfinite(a).all()


def test_coupled_drafts_are_accepted_exactly_when_they_equal_the_targets_choice():
    """Gumbel coupling: a draft q drawn with the target's noise is accepted with probability
    sum_v P(argmax(log q + g) = argmax(log p + g) = v), at least the overlap-free lower bound."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    q = torch.tensor([0.3, 0.3, 0.2, 0.2])
    n = 20000
    noise = gumbel_noise(list(range(n)), 4, "cpu")
    same = (seeded_scores(p.expand(n, -1), noise).argmax(-1) == seeded_scores(q.expand(n, -1), noise).argmax(-1))
    rate, optimal = same.double().mean().item(), torch.minimum(p, q).sum().item()    # min(1, p/q) rule: 0.8
    assert 0.6 < rate < optimal


def test_verification_emits_the_target_distribution_when_the_draft_lives_on_a_reduced_vocabulary():
    """A draft head's q is zero outside its draft vocabulary (ids 0..3 of 6 here); p has mass on the rest
    too: the residual distribution supplies those tokens and the output still follows p."""
    V, G, n = 6, 3, 30000
    p = torch.tensor([[0.05, 0.3, 0.1, 0.15, 0.25, 0.15]] * (G + 1)).expand(n, G + 1, V)   # [n, G+1, V]
    q = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0, 0.0]] * G).expand(n, G, V)                # [n, G, V]
    gen = torch.Generator().manual_seed(4)
    drafts = torch.multinomial(q[0, 0], n * G, replacement=True, generator=gen).view(n, G)
    u = torch.rand(n, G + 1, dtype=torch.float64, generator=gen)
    toks, acc = rejection_sample(p, drafts, q, torch.full((n,), G), torch.zeros(n, dtype=torch.bool), u)
    for pos in range(G + 1):
        reached = toks[:, pos] >= 0
        freq = torch.bincount(toks[reached, pos], minlength=V).float() / int(reached.sum())
        assert torch.allclose(freq, p[0, 0], atol=0.02), (pos, freq)
    assert 0 < acc.float().mean() < G


@pytest.mark.parametrize("vocab", [1, 17, 49152, 49157])
def test_argmax_last_is_torch_argmax_ties_nan_and_minus_inf_included(vocab):
    """The fused argmax (CPU fp32, models/cpu_fused.py) returns torch.argmax's indices: first maximum, the first
    NaN of a row that has one, 0 for a row of -inf, with +inf and signed zeros; other dtypes and strided tensors
    take torch's."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 3, (2, 6, vocab), generator=g).float()            # many ties
    x[0, 1, vocab // 2] = float("nan")
    x[0, 2].fill_(float("-inf"))
    x[1, 3, -1] = float("nan")
    x[1, 4] = torch.randn(vocab, generator=g)
    x[0, 5, -1] = float("inf")                                              # the maximum in the last place
    x[1, 5] = torch.where(torch.rand(vocab, generator=g) < 0.5, -0.0, 0.0)  # -0.0 and 0.0 tie
    x[1, 2] = -torch.arange(vocab, dtype=torch.float32)                      # the maximum in the first place
    assert torch.equal(argmax_last(x), x.argmax(-1))
    assert torch.equal(argmax_last(x[0, 4]), x[0, 4].argmax(-1))          # one row, 0-d result
    assert torch.equal(argmax_last(x.transpose(0, 1)), x.transpose(0, 1).argmax(-1))
    assert torch.equal(argmax_last(x.double()), x.double().argmax(-1))


def test_the_verifiers_all_greedy_host_path_gives_rejection_samplings_tokens():
    """Verifier._verify_decode takes ``_verify_greedy`` when every row is greedy: its rows' logits packed as the
    target returns them ([sum of 1 + drafts, V]) must give what rejection_sample gives on the padded batch."""
    from nightjar.actors.verifier import _verify_greedy

    g = torch.Generator().manual_seed(3)
    B, G, V = 9, 4, 40
    logits = torch.randn(B, G + 1, V, generator=g)                                 # [B, G+1, V]
    argmax = logits.argmax(-1)
    nd = torch.randint(0, G + 1, (B,), generator=g)
    drafts = torch.where(torch.rand(B, G, generator=g) < 0.7, argmax[:, :G], torch.randint(0, V, (B, G), generator=g))
    drafts = torch.where(torch.arange(G) < nd[:, None], drafts, -1)
    toks, acc = rejection_sample(logits, drafts, None, nd, torch.ones(B, dtype=torch.bool), torch.zeros(B, G + 1),
                                 any_random=False)
    rows = [d[:n].tolist() for d, n in zip(drafts, nd.tolist())]
    packed = torch.cat([logits[b, : n + 1] for b, n in enumerate(nd.tolist())])    # [sum(nd + 1), V]
    offsets = (torch.cumsum(nd + 1, 0) - (nd + 1)).tolist()
    got_toks, got_acc = _verify_greedy(packed, offsets, rows)
    assert got_acc == acc.tolist() and 0 < sum(got_acc) < int(nd.sum())
    assert got_toks == [[t for t in row if t >= 0] for row in toks.tolist()]
