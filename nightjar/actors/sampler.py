"""The model actors' sampler: logits transform, draws, and lossless speculative verification.

``verify`` is one fixed-shape call per step: tokens ``[B, G+1]`` padded with -1 and accepted counts
``[B]``, with no host sync inside (on CUDA the Triton kernel of triton_kernels/rejection_triton.py,
torch elsewhere). Greedy rows (temperature 0) accept while draft == target argmax. Random rows use
standard rejection sampling: accept x with prob min(1, p(x)/q(x)); on the first rejection resample
from norm(max(0, p - q)); when all drafts pass, add a bonus token from p.

Seeded rows use Gumbel-max instead (``gumbel_noise``/``seeded_scores``): the noise of output position t
depends on (seed, t) alone, the draft proposes argmax(log q + g) and the target's choice is
argmax(log p + g), so verifying them is verifying greedy rows on those scores. Every emitted token is
then the non-speculative seeded sample, whatever γ, batch or draft state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nightjar.kernel.messages import SamplingSpec
from nightjar.models import cpu_fused


def transform_logits(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, hints: SamplingHints | None = None) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. logits [..., V]; params [...] -> [..., V].

    Rows with temperature 0 get a one-hot at the argmax (greedy). ``hints`` (from the host-side specs)
    say whether any row truncates or is greedy, so the device is not asked."""
    V = logits.shape[-1]
    greedy = temp <= 0                                                     # [...]
    x = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(-1)
    hints = hints or SamplingHints.of_tensors(temp, top_k, top_p, V)
    if not hints.truncate:
        probs = x.softmax(-1)                       # no truncation: skip the full-vocabulary sort
    else:
        probs = _truncated_probs(x, top_k, top_p)
    if hints.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), onehot, probs)
    return probs


@dataclass(frozen=True)
class SamplingHints:
    """Host-side facts about a batch's sampling params, so transforms need not read them back."""
    truncate: bool          # some row has top-k < V or top-p < 1
    any_greedy: bool        # some row has temperature 0

    @staticmethod
    def of_specs(specs: list[SamplingSpec], vocab: int) -> SamplingHints:
        return SamplingHints(truncate=any(0 < s.top_k < vocab or s.top_p < 1 for s in specs),
                             any_greedy=any(s.temperature <= 0 for s in specs))

    @staticmethod
    def of_tensors(temp, top_k, top_p, vocab: int) -> SamplingHints:
        return SamplingHints(truncate=not (bool(((top_k <= 0) | (top_k >= vocab)).all()) and bool((top_p >= 1).all())),
                             any_greedy=bool((temp <= 0).any()))


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
    total = cdf[..., -1:].contiguous()                                             # [..., 1]
    idx = torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True)            # [..., 1]
    last = torch.searchsorted(cdf, total)             # the last positive entry (cdf reaches the total)
    return torch.minimum(idx, last).squeeze(-1)       # u * total rounded up to the total: past the end


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


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the same indices, first maximum, NaN as torch treats it): on CPU fp32 through the
    fused op (models/cpu_fused.py), over a 49k vocabulary ~11x faster than torch's on an AVX2 EPYC (129 -> 12 µs a
    row; the one-pass op it replaced took 7 µs on an AVX-512 Xeon, 184 on that EPYC), else torch's."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.dim() >= 1 and x.numel()
            and cpu_fused.available()):
        flat = torch.ops.nightjar_cpu.argmax_rows.default(x.reshape(-1, x.shape[-1]))         # [rows]
        return flat.view(x.shape[:-1])
    return x.argmax(-1)


def draw_uniforms(gens: list[torch.Generator | None], random_rows: list[bool], n: int, device) -> torch.Tensor:
    """uniforms [B, n] from each random row's generator; zeros (nothing drawn) for the other rows."""
    u = torch.zeros(len(gens), n, dtype=torch.float64, device=device)
    for b, (g, rand) in enumerate(zip(gens, random_rows)):
        if rand:
            u[b] = torch.rand(n, generator=g, dtype=torch.float64, device=device)
    return u


def verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           num_draft: torch.Tensor, greedy: torch.Tensor, gens: list[torch.Generator | None],
           random_rows: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every row's drafts in one call. Shapes as ``rejection_sample``; ``random_rows`` is the host's
    copy of ~greedy (it decides which generators draw). Returns tokens [B, G+1] and accepted [B]."""
    from nightjar.triton_kernels import use_triton

    B, G1, V = target_probs.shape
    if use_triton() and target_probs.is_cuda:
        from nightjar.triton_kernels.rejection_triton import draw_noise, rejection_sample_triton

        u, e = draw_noise(gens, random_rows, G1 - 1, V, target_probs.device)
        return rejection_sample_triton(target_probs, draft_tokens, draft_probs, num_draft, greedy, u, e)
    u = draw_uniforms(gens, random_rows, G1, target_probs.device)
    return rejection_sample(target_probs, draft_tokens, draft_probs, num_draft, greedy, u, any(random_rows),
                            not all(random_rows))


def rejection_sample(
    target_probs: torch.Tensor,   # [B, G+1, V] p after the request's transform (scores for greedy rows)
    draft_tokens: torch.Tensor,   # [B, G] int64 (padded with -1 past num_draft)
    draft_probs: torch.Tensor | None,  # [B, G, V] q after the same transform (None when all greedy)
    num_draft: torch.Tensor,      # [B] int64, drafts per row (0..G)
    greedy: torch.Tensor,         # [B] bool: accept while draft == argmax
    uniforms: torch.Tensor,       # [B, G+1] float64: u[:, i] decides draft i, u[:, G] draws the last token
    any_random: bool = True,      # host-side: False skips the residual and the draw
    any_greedy: bool = True,      # host-side: False skips the argmax
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised verification, no host sync. Returns tokens [B, G+1] (-1 padded) and accepted [B]."""
    B, G1, V = target_probs.shape
    G = G1 - 1
    p, rows = target_probs, torch.arange(B, device=target_probs.device)
    argmax = argmax_last(p) if any_greedy else torch.zeros(B, G1, dtype=torch.int64, device=p.device)  # [B, G+1]
    ok = draft_tokens == argmax[:, :G]                                             # [B, G]
    if draft_probs is not None and any_random:
        x = draft_tokens.clamp(min=0)[..., None]                                   # [B, G, 1]
        px = p[:, :G].gather(-1, x)[..., 0].double()
        qx = draft_probs.gather(-1, x)[..., 0].double()
        ok = torch.where(greedy[:, None], ok, uniforms[:, :G] * qx <= px)          # u < p/q without dividing
    live = torch.arange(G, device=p.device) < num_draft[:, None]                  # [B, G]
    k = (ok & live).long().cumprod(-1).sum(-1)                                     # [B] accepted
    last = argmax.gather(1, k[:, None])[:, 0]                                      # [B] greedy rows
    if any_random:
        w = _emit_dist(p, draft_probs, k, num_draft)                                # [B, V]
        if any_greedy:                 # greedy rows' draws are discarded: give them a valid distribution
            w = torch.where(greedy[:, None], torch.ones_like(w), w)
        last = torch.where(greedy, last, _inverse_cdf(w, uniforms[:, G]))
    pos = torch.arange(G1, device=p.device)
    padded = torch.cat((draft_tokens, draft_tokens.new_full((B, 1), -1)), 1)       # [B, G+1]
    out = torch.where(pos < k[:, None], padded, -1)
    out[rows, k] = last
    return out, k


def _emit_dist(p, q, k, num_draft) -> torch.Tensor:
    """The distribution [B, V] of the token a random row emits after its k accepted drafts: the residual
    max(0, p - q) at a rejection (p when that is all zero), p at the bonus position."""
    B, G1, V = p.shape
    rows = torch.arange(B, device=p.device)
    pk = p[rows, k]                                                                # [B, V]
    w = pk
    if q is not None and G1 > 1:
        res = (pk - q[rows, k.clamp(max=G1 - 2)]).clamp_min(0)
        use_res = (k < num_draft) & (res.amax(-1) > 0)
        w = torch.where(use_res[:, None], res, pk)
    return w
