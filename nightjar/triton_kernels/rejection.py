"""Sampling and lossless speculative verification (torch reference; runs on CPU and GPU).

Fixed-shape outputs: tokens ``[B, G+1]`` padded with -1 and accepted counts ``[B]``.
Greedy rows (temperature 0) accept while draft == target argmax. Random rows use standard
rejection sampling: accept x with prob min(1, p(x)/q(x)); on the first rejection resample from
norm(max(0, p - q)); when all drafts pass, add a bonus token from p.
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
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), V).to(probs.dtype)
    return torch.where(greedy.unsqueeze(-1), onehot, probs)


def _truncated_probs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax over the top-k, then the smallest prefix holding top_p of the mass. x [..., V]."""
    V = x.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V))
    sorted_x, order = x.sort(dim=-1, descending=True)                      # [..., V]
    ranks = torch.arange(V, device=x.device)
    drop = ranks >= k.unsqueeze(-1)                                        # top-k
    probs_sorted = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    cum = probs_sorted.cumsum(-1) - probs_sorted                           # mass before each token
    drop = drop | (cum > top_p.unsqueeze(-1))                              # top-p (keeps >= 1 token)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x.softmax(-1))


def sample_from(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, V] with each row's own generator -> [B]."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for b, g in enumerate(gens):
        out[b] = torch.multinomial(probs[b], 1, generator=g)[0]
    return out


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
    for b in range(B):
        n = int(num_draft[b])
        if bool(greedy[b]):
            k = _greedy_accept(argmax[b], draft_tokens[b], n)
            out[b, : k + 1] = argmax[b, : k + 1]
        else:
            k, last = _random_accept(target_probs[b], draft_tokens[b], draft_probs[b] if n else None, n, gens[b])
            out[b, :k] = draft_tokens[b, :k]
            out[b, k] = last
        accepted[b] = k
    return out, accepted


def _greedy_accept(argmax: torch.Tensor, drafts: torch.Tensor, n: int) -> int:
    match = (drafts[:n] == argmax[:n]).to(torch.int64)                     # [n]
    return int(match.cumprod(0).sum()) if n else 0


def _random_accept(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, n: int,
                   gen: torch.Generator | None) -> tuple[int, int]:
    """p [G+1, V], q [G, V]. Returns (accepted, the token emitted after them)."""
    for i in range(n):
        x = int(drafts[i])
        u = torch.rand((), generator=gen, device=p.device)
        if float(u) * float(q[i, x]) <= float(p[i, x]):                   # u < p/q without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if float(total) > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=gen)[0])
    return n, int(torch.multinomial(p[n], 1, generator=gen)[0])
