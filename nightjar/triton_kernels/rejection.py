"""Sampling and lossless speculative verification (torch reference; runs on CPU and GPU).

Fixed-shape outputs: tokens ``[B, G+1]`` padded with -1 and accepted counts ``[B]``.
Greedy rows (temperature 0) accept while draft == target argmax. Random rows use standard
rejection sampling: accept x with prob min(1, p(x)/q(x)); on the first rejection resample from
norm(max(0, p - q)); when all drafts pass, add a bonus token from p.

Seeded rows use Gumbel-max instead (``gumbel_noise``/``seeded_scores``): the noise of output position t
depends on (seed, t) alone, the draft proposes argmax(log q + g) and the target's choice is
argmax(log p + g), so verifying them is verifying greedy rows on those scores. Every emitted token is
then the non-speculative seeded sample, whatever γ, batch or draft state.
"""
from __future__ import annotations

import torch


def transform_logits(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. logits [..., V]; params [...] -> [..., V].

    Rows with temperature 0 get a one-hot at the argmax (greedy).
    """
    V = logits.shape[-1]
    greedy = temp <= 0                                                     # [...]
    x = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(-1)
    if bool(((top_k <= 0) | (top_k >= V)).all()) and bool((top_p >= 1).all()):
        probs = x.softmax(-1)                       # no truncation: skip the full-vocabulary sort
    else:
        probs = _truncated_probs(x, top_k, top_p)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), onehot, probs)
    return probs


def _truncated_probs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     candidates: int = 1024) -> torch.Tensor:
    """Softmax over the top-k, then the smallest prefix holding top_p of the mass. x [..., V].

    Sorting the whole vocabulary is the slow part (about 2 ms a row on CPU), so the prefix is first
    looked for among the ``candidates`` largest logits; that answer is exact whenever the prefix ends
    inside them (the usual case), and the rows where it does not fall back to the full sort."""
    V = x.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V)).expand(x.shape[:-1])
    top_p = top_p.expand(x.shape[:-1])
    if candidates < V and x.numel() > 0:
        top_x, top_i = x.topk(candidates, dim=-1)                          # [..., C], descending
        # the norm (mass of all top-k entries) is exact when top-k ends inside C or there is no top-k
        inside_k, no_k = k <= candidates, k >= V
        kept_lse = _top_k_only(top_x, k).logsumexp(-1, keepdim=True)      # [..., 1]
        norm = torch.where(inside_k.unsqueeze(-1), kept_lse, x.logsumexp(-1, keepdim=True))
        cut, mass = _prefix_mask(top_x, k, top_p, norm)                    # [..., C], [...]
        covered = inside_k | (no_k & (mass > top_p))                       # the prefix closed inside C
        out = torch.zeros_like(x).scatter_(-1, top_i, top_x.masked_fill(cut, float("-inf")).softmax(-1))
        if not bool(covered.all()):                                        # long tails: sort those rows
            out[~covered] = _sorted_probs(x[~covered], k[~covered], top_p[~covered])
        return out
    return _sorted_probs(x, k, top_p)


def _sorted_probs(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)                      # [..., V]
    cut, _ = _prefix_mask(sorted_x, k, top_p, _top_k_only(sorted_x, k).logsumexp(-1, keepdim=True))
    return torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(cut, float("-inf")).softmax(-1))


def _top_k_only(sorted_x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Descending logits [..., C] with the entries past each row's top-k set to -inf."""
    ranks = torch.arange(sorted_x.shape[-1], device=sorted_x.device)
    return sorted_x.masked_fill(ranks >= k.unsqueeze(-1), float("-inf"))


def _prefix_mask(sorted_x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                 norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the descending logits sorted_x [..., C] fall outside top-k/top-p, given the log of the
    top-k mass ``norm`` [..., 1]; also the top-k mass these C entries hold [...]."""
    kept = _top_k_only(sorted_x, k)
    probs = (kept - norm).exp()
    cum = probs.cumsum(-1)                                                 # mass up to each entry
    drop = (kept == float("-inf")) | (cum - probs > top_p.unsqueeze(-1))   # top-k, top-p (keeps >= 1)
    return drop, cum[..., -1]


def sample_from(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, V], each from one uniform of its row's generator -> [B]."""
    u = torch.stack([_uniform(g, probs.device) for g in gens])                    # [B] float64
    return _inverse_cdf(probs, u)


def _uniform(gen: torch.Generator | None, device) -> torch.Tensor:
    return torch.rand((), generator=gen, dtype=torch.float64, device=device)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] (any positive scale), u [...] in [0, 1) -> token ids [...].

    A multinomial call per row re-validates and re-normalises 49k entries (about 1 ms on CPU); one
    float64 cumsum and a binary search give the same distribution. Zero-probability tokens are never
    chosen: the search returns the first entry whose cumulative mass exceeds the draw."""
    cdf = probs.double().cumsum(-1)                                                # [..., V]
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True)   # [..., 1]
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    off = probs.gather(-1, idx) <= 0                  # u * total rounded up to the total: past the end
    if bool(off.any()):
        last = (probs > 0).cumsum(-1).argmax(-1, keepdim=True)                     # last positive entry
        idx = torch.where(off, last, idx)
    return idx.squeeze(-1)


_TINY = torch.finfo(torch.float32).tiny      # u = 0 would give -inf and rule a token out


def gumbel_noise(seeds: list[int], vocab: int, device) -> torch.Tensor:
    """Gumbel(0, 1) noise [len(seeds), V]: row i comes from ``seeds[i]`` alone (one seed per output position)."""
    rows = []
    for seed in seeds:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        u = torch.rand(vocab, generator=gen, device=device).clamp_min_(_TINY)        # [V] in (0, 1)
        rows.append(u.log_().neg_().log_().neg_())                                  # -log(-log u)
    return torch.stack(rows)


def seeded_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log probs + noise [..., V]: its argmax is a sample of probs (Gumbel-max); zero mass stays -inf."""
    return probs.log() + noise


def rejection_sample_ref(
    target_probs: torch.Tensor,   # [B, G+1, V] p after the request's transform
    draft_tokens: torch.Tensor,   # [B, G] int64 (padded with -1 past num_draft)
    draft_probs: torch.Tensor | None,  # [B, G, V] q after the same transform (None when all greedy)
    num_draft: torch.Tensor,      # [B] int64, drafts per row (0..G)
    greedy: torch.Tensor,         # [B] bool
    gens: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts. Returns tokens [B, G+1] (-1 padded) and accepted counts [B]."""
    B, G1, _ = target_probs.shape
    out = torch.full((B, G1), -1, dtype=torch.int64, device=target_probs.device)
    accepted = torch.zeros(B, dtype=torch.int64, device=target_probs.device)
    argmax = target_probs.argmax(-1)                                       # [B, G+1]
    final_rows, final_dists, final_u = [], [], []          # random rows: one batched draw at the end
    for b in range(B):
        n = int(num_draft[b])
        if bool(greedy[b]):
            k = _greedy_accept(argmax[b], draft_tokens[b], n)
            out[b, : k + 1] = argmax[b, : k + 1]
        else:
            k, dist = _random_accept(target_probs[b], draft_tokens[b], draft_probs[b] if n else None, n, gens[b])
            out[b, :k] = draft_tokens[b, :k]
            final_rows.append(b); final_dists.append(dist); final_u.append(_uniform(gens[b], out.device))
        accepted[b] = k
    if final_rows:
        rows = torch.tensor(final_rows, device=out.device)
        out[rows, accepted[rows]] = _inverse_cdf(torch.stack(final_dists), torch.stack(final_u))
    return out, accepted


def _greedy_accept(argmax: torch.Tensor, drafts: torch.Tensor, n: int) -> int:
    match = (drafts[:n] == argmax[:n]).to(torch.int64)                     # [n]
    return int(match.cumprod(0).sum()) if n else 0


def _random_accept(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, n: int,
                   gen: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """p [G+1, V], q [G, V]. Returns (accepted, the distribution [V] of the token emitted after them:
    the residual max(0, p - q) at the first rejection, else p at the bonus position)."""
    for i in range(n):
        x = int(drafts[i])
        u = torch.rand((), generator=gen, device=p.device)
        if float(u) * float(q[i, x]) <= float(p[i, x]):                   # u < p/q without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        return i, residual if float(residual.sum()) > 0 else p[i]        # the draw scales by the total
    return n, p[n]
