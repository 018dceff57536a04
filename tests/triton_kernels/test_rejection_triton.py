"""Rejection sampling kernel: exact agreement with the noise reference, agreement with the
engine's torch sampler (actors/sampler.py) where the outcome is deterministic, and the target distribution."""
import pytest
import torch

from nightjar.actors.sampler import rejection_sample
from nightjar.triton_kernels import rejection_triton as rt
from nightjar.triton_kernels.rejection_triton import (
    draw_noise,
    rejection_sample_noise_ref,
    rejection_sample_triton,
)


def probs(*shape, g, sharp=3.0):
    x = torch.rand(*shape, generator=g) ** sharp
    return x / x.sum(-1, keepdim=True)


def make_batch(B, G, V, *, seed=0, greedy=None, num_draft=None, device="cpu"):
    """Random p/q; drafts sampled from q, except that some greedy drafts copy the argmax."""
    g = torch.Generator().manual_seed(seed)
    p, q = probs(B, G + 1, V, g=g), probs(B, G, V, g=g)
    greedy = torch.tensor(greedy if greedy is not None else [b % 2 == 0 for b in range(B)])
    nd = torch.tensor(num_draft if num_draft is not None else [b % (G + 1) for b in range(B)])
    drafts = (torch.multinomial(q.view(-1, V), 1, generator=g).view(B, G) if G
              else torch.zeros(B, 0, dtype=torch.int64))
    copy = torch.rand(B, G, generator=g) < 0.6
    drafts = torch.where(copy & greedy[:, None], p[:, :G].argmax(-1), drafts)
    drafts = torch.where(torch.arange(G) < nd[:, None], drafts, -1)
    u, e = draw_noise([torch.Generator().manual_seed(100 + b) for b in range(B)],
                      (~greedy).tolist(), G, V, "cpu")
    to = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return to(p, drafts, q, nd, greedy, u, e)


def engine_sample(p, d, q, nd, greedy):
    """The engine's torch sampler on the CPU, with its own uniforms."""
    u = torch.rand(p.shape[0], p.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return rejection_sample(p.cpu(), d.cpu(), None if q is None else q.cpu(), nd.cpu(), greedy.cpu(), u)


def run_poisoned(monkeypatch, *args):
    """Run the kernel with every output buffer pre-filled with garbage."""
    real_empty = torch.empty

    def poisoned_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(12345) if not t.is_floating_point() else t.fill_(float("nan"))

    with monkeypatch.context() as m:
        m.setattr(rt.torch, "empty", poisoned_empty)
        return rejection_sample_triton(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_greedy_and_random_rows_match_the_noise_reference(dtype, device, monkeypatch):
    p, d, q, nd, greedy, u, e = make_batch(8, 4, 40, device=device)
    p, q = p.to(dtype), q.to(dtype)
    out, acc = run_poisoned(monkeypatch, p, d, q, nd, greedy, u, e)
    want_out, want_acc = rejection_sample_noise_ref(p, d, q, nd, greedy, u, e)
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)
    assert out.shape == (8, 5) and ((out >= 0).sum(-1) == acc + 1).all()


def test_greedy_rows_match_the_engine_reference_exactly(device):
    p, d, q, nd, greedy, u, e = make_batch(6, 3, 30, seed=1, greedy=[True] * 6, device=device)
    out, acc = rejection_sample_triton(p, d, None, nd, greedy, None, None)
    want_out, want_acc = engine_sample(p, d, None, nd, greedy)
    assert torch.equal(out.cpu(), want_out) and torch.equal(acc.cpu(), want_acc)


def test_gamma_zero_emits_only_the_argmax_or_a_bonus_sample(device):
    p, d, q, nd, greedy, u, e = make_batch(4, 0, 16, seed=2, device=device)
    out, acc = rejection_sample_triton(p, d, q, nd, greedy, u, e)
    want_out, want_acc = rejection_sample_noise_ref(p, d, q, nd, greedy, u, e)
    assert torch.equal(out, want_out) and not acc.any() and out.shape == (4, 1)
    assert torch.equal(out[greedy, 0], p[greedy, 0].argmax(-1))


def test_all_drafts_accepted_gives_a_bonus_token(device):
    B, G, V = 4, 3, 12
    p, d, q, nd, greedy, u, e = make_batch(B, G, V, seed=3, greedy=[True, False, True, False],
                                           num_draft=[G] * B, device=device)
    d = torch.where(greedy[:, None], p[:, :G].argmax(-1), d)      # greedy drafts = target argmax
    q = p[:, :G].clone()                                          # p == q: random drafts always pass
    out, acc = rejection_sample_triton(p, d, q, nd, greedy, u, e)
    want_out, want_acc = rejection_sample_noise_ref(p, d, q, nd, greedy, u, e)
    assert torch.equal(out, want_out) and (acc == G).all()
    assert torch.equal(out[:, :G], d)
    assert torch.equal(out[greedy, G], p[greedy, G].argmax(-1))
    ref_out, ref_acc = engine_sample(p, d, q, nd, greedy)
    assert torch.equal(ref_acc, acc.cpu()) and torch.equal(ref_out[greedy.cpu()], out[greedy].cpu())


def test_all_drafts_rejected_resamples_from_the_residual_like_the_engine_reference(device):
    B, G, V = 4, 3, 10
    greedy = torch.tensor([False, True, False, True])
    p = torch.zeros(B, G + 1, V)
    p[:, :, 7] = 0.5
    p[:, :, 2] = 0.5
    q = torch.zeros(B, G, V)
    q[:, :, 0] = 0.5                                               # drafts: token 0, p(0) = 0
    q[:, :, 2] = 0.5                                               # residual max(p-q, 0) = one-hot 7
    d = torch.zeros(B, G, dtype=torch.int64)
    nd = torch.full((B,), G)
    u, e = draw_noise([torch.Generator().manual_seed(b) for b in range(B)], (~greedy).tolist(), G, V, "cpu")
    args = [x.to(device) for x in (p, d, q, nd, greedy, u, e)]
    out, acc = rejection_sample_triton(*args)
    want_out, want_acc = rejection_sample_noise_ref(*args)
    ref_out, ref_acc = engine_sample(p, d, q, nd, greedy)
    assert torch.equal(out, want_out) and not acc.any()
    assert torch.equal(out[~greedy].cpu(), ref_out[~greedy])      # random rows: token 7, then -1
    assert (out[~greedy, 0] == 7).all() and (out[:, 1:] == -1).all()
    assert (out[greedy, 0] == 2).all()                             # greedy: first argmax (tie -> 2)


def test_the_same_seeds_give_the_same_tokens(device):
    first = make_batch(6, 4, 32, seed=4, greedy=[False] * 6, num_draft=[4] * 6, device=device)
    again = make_batch(6, 4, 32, seed=4, greedy=[False] * 6, num_draft=[4] * 6, device=device)
    a, b = rejection_sample_triton(*first), rejection_sample_triton(*again)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_noise_reference_yields_the_target_distribution():
    # One draft per row drawn from q; the first emitted token must be distributed as p[0].
    N, V = 40000, 5
    g = torch.Generator().manual_seed(5)
    p1 = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    q1 = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    p = p1.expand(N, 2, V).contiguous()
    q = q1.expand(N, 1, V).contiguous()
    d = torch.multinomial(q1, N, replacement=True, generator=g).view(N, 1)
    u = torch.rand(N, 1, generator=g)
    e = torch.empty(N, V).exponential_(generator=g)
    out, acc = rejection_sample_noise_ref(p, d, q, torch.ones(N, dtype=torch.int64),
                                          torch.zeros(N, dtype=torch.bool), u, e)
    freq = torch.bincount(out[:, 0], minlength=V).float() / N
    assert (freq - p1).abs().max() < 0.012                         # ~5 sigma at N = 40000
    bonus = torch.bincount(out[acc == 1, 1], minlength=V).float() / int((acc == 1).sum())
    assert (bonus - p1).abs().max() < 0.03


@pytest.mark.gpu
def test_the_kernel_needs_no_host_sync_and_matches_at_vocab_scale():
    p, d, q, nd, greedy, u, e = make_batch(16, 5, 32000, seed=6, device="cuda")
    rejection_sample_triton(p, d, q, nd, greedy, u, e)           # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, acc = rejection_sample_triton(p, d, q, nd, greedy, u, e)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want_out, want_acc = rejection_sample_noise_ref(p, d, q, nd, greedy, u, e)
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)
