"""Batched greedy + random rejection sampling in Triton, deterministic given pre-drawn noise.

Same semantics as the engine's torch sampler (``actors/sampler.py``, ``rejection_sample``), with noise
of its own; randomness comes in as tensors instead of generators so nothing inside syncs with the host:

* ``uniforms [B, G]`` fp32 in [0, 1): draft i of a random row is accepted iff
  ``u[i] * q[i, x] <= p[i, x]`` (compared in fp64, like the ref's Python floats).
* ``exp_noise [B, V]`` fp32 Exp(1) draws: the one token a random row emits after its accepted
  drafts (recovered or bonus) is the exponential race ``argmax_v w[v] / E[v]``, a sample from
  ``w / sum(w)``. A row emits exactly one such token, so one noise row serves every position.
  ``w = max(p - q, 0)`` at a rejection (p when that is all zero), ``w = p`` for the bonus.

Greedy rows ignore the noise (``draw_noise`` draws none for them). Two launches:
``_candidates`` (grid ``(B, G+1)``) computes, for each position, the token the row would emit if
it stopped there (argmax for greedy rows, the race for random rows); ``_accept`` (grid ``(B,)``)
walks the drafts and writes tokens ``[B, G+1]`` (-1 padded) and accepted counts ``[B]``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def draw_noise(gens: list[torch.Generator | None], random_rows: list[bool], G: int, V: int,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """uniforms [B, G] and exp_noise [B, V] from each random row's generator (None = global).

    ``random_rows`` is the host's view of which rows sample (temperature > 0); greedy rows get
    zeros and draw nothing. ``gens`` must live on ``device``. No host sync.
    """
    B = len(gens)
    u = torch.zeros(B, G, dtype=torch.float32, device=device)
    e = torch.ones(B, V, dtype=torch.float32, device=device)
    for b, (g, rand) in enumerate(zip(gens, random_rows)):
        if rand:
            u[b] = torch.rand(G, generator=g, device=device)
            e[b].exponential_(generator=g)
    return u, e


def _race(w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of w / e, zero-weight tokens never win. Same rule as the kernel."""
    return torch.where(w > 0, w / e, torch.full_like(w, -1.0)).argmax(-1)


def rejection_sample_noise_ref(target_probs, draft_tokens, draft_probs, num_draft, greedy,
                               uniforms, exp_noise) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rejection_sample_triton (vectorised, no host sync). Shapes as the ref."""
    B, G1, V = target_probs.shape
    G = G1 - 1
    p = target_probs.float()
    pos = torch.arange(G1, device=p.device)                                 # [G+1]
    argmax = p.argmax(-1)                                                   # [B, G+1]
    x = draft_tokens.clamp(min=0).long()                                    # [B, G]
    live = pos[:G] < num_draft[:, None]                                     # [B, G]
    acc = draft_tokens == argmax[:, :G]
    if draft_probs is not None:
        q = draft_probs.float()
        px = p[:, :G].gather(-1, x[..., None])[..., 0].double()
        qx = q.gather(-1, x[..., None])[..., 0].double()
        acc = torch.where(greedy[:, None], acc, uniforms.double() * qx <= px)
    k = (acc & live).long().cumprod(-1).sum(-1)                             # [B]
    pk = p.gather(1, k.view(B, 1, 1).expand(B, 1, V))[:, 0]                 # [B, V]
    w = pk
    if draft_probs is not None:
        qk = q.gather(1, k.clamp(max=G - 1).view(B, 1, 1).expand(B, 1, V))[:, 0] if G else pk
        res = (pk - qk).clamp_min(0)
        use_res = (k < num_draft) & (res.amax(-1) > 0)
        w = torch.where(use_res[:, None], res, pk)
    last = torch.where(greedy, argmax.gather(1, k[:, None])[:, 0], _race(w, exp_noise.float()))
    padded = torch.cat((draft_tokens.long(), draft_tokens.new_full((B, 1), -1).long()), 1)
    out = torch.where(pos[None, :] < k[:, None], padded, -1)                # [B, G+1]
    out.scatter_(1, k[:, None], last[:, None])
    return out, k


@triton.jit
def _candidates(p_ptr, q_ptr, e_ptr, nd_ptr, greedy_ptr, cand_ptr, V, G,
                stride_pb, stride_pg, stride_qb, stride_qg, stride_eb,
                HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    i = tl.program_id(1)
    n = tl.load(nd_ptr + b).to(tl.int32)
    if i > n:
        return
    rand = tl.load(greedy_ptr + b) == 0                                    # scalar: random row
    use_q = rand & (i < n)                                                 # a rejection here resamples
    b64 = b.to(tl.int64)
    p_row = p_ptr + b64 * stride_pb + i * stride_pg
    q_row = q_ptr + b64 * stride_qb + i * stride_qg
    offs = tl.arange(0, BLOCK_V)
    best_p = tl.full([BLOCK_V], -float("inf"), tl.float32)                # per-lane running bests
    arg_p = tl.zeros([BLOCK_V], tl.int32)
    best_r = tl.full([BLOCK_V], -float("inf"), tl.float32)
    arg_r = tl.zeros([BLOCK_V], tl.int32)
    res_max = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        v = start + offs
        ok = v < V
        pv = tl.load(p_row + v, mask=ok, other=0.0).to(tl.float32)
        ev = tl.load(e_ptr + b64 * stride_eb + v, mask=_both(ok, rand), other=1.0).to(tl.float32)
        race = tl.where(pv > 0, tl.math.div_rn(pv, ev), -1.0)             # zero weight never wins
        sp = tl.where(ok, tl.where(rand, race, pv), -float("inf"))
        take = sp > best_p                                                 # strict: first index wins
        arg_p = tl.where(take, v, arg_p)
        best_p = tl.where(take, sp, best_p)
        if HAS_Q:
            qv = tl.load(q_row + v, mask=_both(ok, use_q), other=0.0).to(tl.float32)
            rv = tl.where(_both(ok, use_q), tl.maximum(pv - qv, 0.0), 0.0)
            sr = tl.where(ok, tl.where(rv > 0, tl.math.div_rn(rv, ev), -1.0), -float("inf"))
            take = sr > best_r
            arg_r = tl.where(take, v, arg_r)
            best_r = tl.where(take, sr, best_r)
            res_max = tl.maximum(res_max, rv)
    tok = _lane_argmax(best_p, arg_p)
    if HAS_Q:
        tok = tl.where(tl.max(res_max, 0) > 0, _lane_argmax(best_r, arg_r), tok)
    tl.store(cand_ptr + b * (G + 1) + i, tok.to(tl.int64))


@triton.jit
def _both(block_mask, flag):
    """block_mask & scalar flag. (`block & scalar` masks crash the 3.9 interpreter: 'mask has
    unsupported dtype'.)"""
    return (block_mask.to(tl.int32) * flag.to(tl.int32)) != 0


@triton.jit
def _lane_argmax(best, arg):
    """First index among the lanes holding the maximum (lanes hold disjoint index sets)."""
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, arg, 2147483647), 0)


@triton.jit
def _accept(p_ptr, q_ptr, d_ptr, u_ptr, nd_ptr, greedy_ptr, cand_ptr, out_ptr, acc_ptr, G,
            stride_pb, stride_pg, stride_qb, stride_qg, stride_db, stride_ub,
            HAS_Q: tl.constexpr, BLOCK_G: tl.constexpr):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    n = tl.load(nd_ptr + b).to(tl.int32)
    rand = tl.load(greedy_ptr + b) == 0
    g = tl.arange(0, BLOCK_G)                                              # [BG] >= G+1 lanes
    live = g < n
    d = tl.load(d_ptr + b64 * stride_db + g, mask=live, other=-1).to(tl.int64)
    x = tl.maximum(d, 0)
    cand = tl.load(cand_ptr + b * (G + 1) + g, mask=live, other=-1)
    ok = d == cand                                                         # greedy: draft == argmax
    if HAS_Q:
        px = tl.load(p_ptr + b64 * stride_pb + g * stride_pg + x, mask=_both(live, rand), other=0.0)
        qx = tl.load(q_ptr + b64 * stride_qb + g * stride_qg + x, mask=_both(live, rand), other=0.0)
        u = tl.load(u_ptr + b64 * stride_ub + g, mask=_both(live, rand), other=1.0)
        keep = u.to(tl.float64) * qx.to(tl.float32).to(tl.float64) <= px.to(tl.float32).to(tl.float64)
        ok = tl.where(rand, keep, ok)
    k = tl.min(tl.where(live & (ok.to(tl.int32) == 0), g, n), 0)           # first rejection, else n
    last = tl.load(cand_ptr + b * (G + 1) + k)
    tok = tl.where(g == k, last, tl.where(g < k, d, -1))
    tl.store(out_ptr + b * (G + 1) + g, tok, mask=g < G + 1)
    tl.store(acc_ptr + b, k.to(tl.int64))


def rejection_sample_triton(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                            draft_probs: torch.Tensor | None, num_draft: torch.Tensor,
                            greedy: torch.Tensor, uniforms: torch.Tensor | None,
                            exp_noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns tokens [B, G+1] (-1 padded) and accepted [B]. Noise may be None when all greedy.

    target_probs [B, G+1, V], draft_tokens [B, G], draft_probs [B, G, V] (None when all greedy),
    num_draft [B] (0..G), greedy [B] bool, uniforms [B, G], exp_noise [B, V].
    """
    B, G1, V = target_probs.shape
    G = G1 - 1
    dev = target_probs.device
    assert target_probs.stride(2) == 1 and (draft_probs is None or draft_probs.stride(2) == 1)
    has_q = draft_probs is not None and G > 0        # with no drafts there is nothing to reject
    q = draft_probs if has_q else target_probs
    if uniforms is None or uniforms.numel() == 0:    # keep every pointer valid (loads are masked)
        uniforms = torch.zeros(B, 1, dtype=torch.float32, device=dev)
    if exp_noise is None:
        exp_noise = torch.ones(B, V, dtype=torch.float32, device=dev)
    if G == 0:
        draft_tokens = torch.full((B, 1), -1, dtype=torch.int64, device=dev)
    greedy_u8 = greedy.to(torch.uint8)
    cand = torch.empty(B, G1, dtype=torch.int64, device=dev)
    out = torch.empty(B, G1, dtype=torch.int64, device=dev)
    accepted = torch.empty(B, dtype=torch.int64, device=dev)
    _candidates[(B, G1)](
        target_probs, q, exp_noise, num_draft, greedy_u8, cand, V, G,
        target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1), exp_noise.stride(0),
        HAS_Q=has_q, BLOCK_V=min(triton.next_power_of_2(V), 1024),
    )
    _accept[(B,)](
        target_probs, q, draft_tokens, uniforms, num_draft, greedy_u8, cand, out, accepted, G,
        target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1),
        draft_tokens.stride(0), uniforms.stride(0),
        HAS_Q=has_q, BLOCK_G=max(16, triton.next_power_of_2(G1)),
    )
    return out, accepted
