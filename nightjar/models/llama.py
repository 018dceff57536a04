"""Llama-family decoder that runs one flattened varlen batch over a paged KV cache.

Every sequence contributes a query chunk (a prefill chunk, 1 decode token or γ+1 verify tokens) and
attends to its own paged KV. Layers loop once per call over the whole flattened batch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from nightjar.models.config import ModelConfig

SHORT_QUERY = 16          # rows with at most this many query tokens share one attention group
FUSED_DTYPES = (torch.float32, torch.bfloat16)   # the dtypes the fused CPU ops take (models/cpu_fused.py)


class AttnGroup:
    """Rows attended together, padded to the group's longest query Q and context K.

    Decode and verify rows (Q <= SHORT_QUERY) never pad up to a long prefill chunk. The index tensors and the
    mask are built on first use: the fused CPU attention reads the layout's flat tensors instead, so a step of
    short rows on it never builds them (~60 µs a step at B = 1, more with the batch).
    """

    def __init__(self, rows: list[int], qlens: list[int], starts: list[int], offsets: list[int],
                 table: torch.Tensor, device):
        self.rows = rows
        self.Q = max(qlens[b] for b in rows)                   # the longest query
        self.K = max(starts[b] + qlens[b] for b in rows)        # the longest context
        self.dense = False             # the group is the whole batch, every row Q tokens: q is [b*Q] in order
        self._src = (qlens, starts, offsets, table, device)
        self._masks: dict = {}         # heads per kv head -> [b, 1, Q*g, K]

    @cached_property
    def _indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qlens, _, offsets, _, device = self._src
        q_index = torch.full((len(self.rows), self.Q), offsets[-1], dtype=torch.int64)
        tok, flat = [], []
        for i, b in enumerate(self.rows):
            q_index[i, : qlens[b]] = torch.arange(offsets[b], offsets[b + 1])
            tok.extend(range(offsets[b], offsets[b + 1]))
            flat.extend(range(i * self.Q, i * self.Q + qlens[b]))
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return as_t(tok), q_index.to(device), as_t(flat)

    @property
    def token_index(self) -> torch.Tensor:
        """[t] int64 into T: the group's query tokens, in flat order."""
        return self._indices[0]

    @property
    def q_index(self) -> torch.Tensor:
        """[b, Q] int64 into T, padding points at T (a zero row)."""
        return self._indices[1]

    @property
    def flat_index(self) -> torch.Tensor:
        """[t] int64 into b*Q: where each of the group's tokens sits."""
        return self._indices[2]

    @cached_property
    def attn_mask(self) -> torch.Tensor:
        """[b, 1, Q, K] bool, True = attend."""
        qlens, starts, _, _, device = self._src
        rows = self.rows
        qpos = torch.arange(self.Q).view(1, self.Q, 1) + torch.tensor([starts[b] for b in rows]).view(-1, 1, 1)
        kpos = torch.arange(self.K).view(1, 1, self.K)                                       # [1, 1, K]
        ctx = torch.tensor([starts[b] + qlens[b] for b in rows]).view(-1, 1, 1)              # [b, 1, 1]
        return ((kpos <= qpos) & (kpos < ctx)).unsqueeze(1).to(device)                      # [b, 1, Q, K]

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """[b, nb] int64."""
        table, device = self._src[3], self._src[4]
        return table[self.rows].to(device)

    def blocked(self, gq: int) -> torch.Tensor:
        """Where attention is NOT allowed, repeated for the gq query heads that share a KV head
        -> [b, 1, Q*gq, K] bool (built once per step: every layer uses it)."""
        m = self._masks.get(gq)
        if m is None:
            B, _, Q, K = self.attn_mask.shape
            m = ~self.attn_mask.unsqueeze(3).expand(B, 1, Q, gq, K).reshape(B, 1, Q * gq, K)
            self._masks[gq] = m
        return m

    def row_mask(self, b: int, block_size: int) -> torch.Tensor:
        """Row b's own mask over its own blocks, no padding to the group: [1, 1, q, nb*bs] bool (True = attend:
        keys up to the query's position, none past the row's context), built once per step."""
        m = self._masks.get(("row", b))
        if m is None:
            qlens, starts, _, _, device = self._src
            q, s = qlens[b], starts[b]
            nb = -(-(s + q) // block_size)
            kpos = torch.arange(nb * block_size).view(1, -1)                                # [1, nb*bs]
            qpos = torch.arange(s, s + q).view(-1, 1)                                       # [q, 1]
            m = self._masks[("row", b)] = ((kpos <= qpos) & (kpos < s + q)).view(1, 1, q, -1).to(device)
        return m

    def blocked_padded(self, gq: int, kp: int) -> torch.Tensor:
        """``blocked(gq)`` as [1, b, Q*gq, kp], positions K..kp-1 (the rest of the last block) blocked
        too: head-major attention reads whole blocks, as a slice of them would cost a copy per matmul."""
        m = self._masks.get((gq, kp))
        if m is None:
            m = self.blocked(gq).transpose(0, 1)                                # [1, b, Q*gq, K]
            pad = kp - m.shape[-1]
            if pad > 0:
                m = torch.cat((m, m.new_ones(*m.shape[:-1], pad)), dim=-1)
            self._masks[(gq, kp)] = m
        return m


@dataclass
class BatchLayout:
    """Host-built description of one varlen batch (tensors live on the model's device). T = query tokens."""

    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64, absolute position of each query token
    slot_mapping: torch.Tensor   # [T] int64, cache slot (block * block_size + offset) to write
    block_tables: torch.Tensor   # [B, nb] int64, padded with 0
    query_start_loc: torch.Tensor  # [B+1] int64: row b owns query tokens [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor       # [B] int64: context length of row b after this chunk
    groups: list[AttnGroup]
    logits_index: torch.Tensor   # [N] int64 into T: rows whose logits are returned

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def long_groups(self) -> list[AttnGroup]:
        """The groups of rows with more than SHORT_QUERY query tokens (prefill chunks), found once per step."""
        return [g for g in self.groups if g.Q > SHORT_QUERY]


def build_layout(
    chunks: list[list[int]], starts: list[int], block_tables: list[tuple[int, ...]], block_size: int,
    logits_rows: list[int], device: torch.device | str = "cpu",
) -> BatchLayout:
    """Describe a batch: sequence b feeds tokens ``chunks[b]`` at positions ``starts[b]..``.

    ``logits_rows[b]`` is how many trailing tokens of chunk b need logits (1 for prefill/decode,
    γ+1 for verify, 0 for a prefill chunk that is not the last one).
    """
    qlens = [len(c) for c in chunks]
    offsets = [0]
    for q in qlens:
        offsets.append(offsets[-1] + q)
    ids, pos, slots, logit_rows = [], [], [], []
    for b, (chunk, s) in enumerate(zip(chunks, starts)):
        bt = block_tables[b]
        ids.extend(chunk)
        pos.extend(range(s, s + len(chunk)))
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(s, s + len(chunk)))
        logit_rows.extend(range(offsets[b + 1] - logits_rows[b], offsets[b + 1]))
    table = _tables(block_tables, [s + q for s, q in zip(starts, qlens)], block_size)     # [B, nb]
    short = [b for b, q in enumerate(qlens) if q <= SHORT_QUERY]
    long = [b for b, q in enumerate(qlens) if q > SHORT_QUERY]
    groups = [AttnGroup(rows, qlens, starts, offsets, table, device) for rows in (short, long) if rows]
    if len(groups) == 1 and len(set(qlens)) == 1:
        groups[0].dense = True
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return BatchLayout(input_ids=as_t(ids), positions=as_t(pos), slot_mapping=as_t(slots),
                       block_tables=table.to(device), query_start_loc=as_t(offsets),
                       seq_lens=as_t([s + q for s, q in zip(starts, qlens)]), groups=groups,
                       logits_index=as_t(logit_rows))


def _tables(block_tables: list[tuple[int, ...]], ctx: list[int], block_size: int) -> torch.Tensor:
    """[B, nb] int64: each row's blocks for its context, padded with 0 (one tensor built from one list)."""
    nb = max(1, -(-max(ctx) // block_size))
    flat = []
    for bt, k in zip(block_tables, ctx):
        row = list(bt[: min(nb, -(-k // block_size))])
        flat.extend(row + [0] * (nb - len(row)))
    return torch.tensor(flat, dtype=torch.int64).view(len(block_tables), nb)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, h] with zero rows appended up to ``rows`` -> [rows, h]."""
    return torch.cat((x, x.new_zeros(rows - x.shape[0], x.shape[1])))


def _fusable(x: torch.Tensor) -> bool:
    """The fused CPU ops take x: 2-D token-major, contiguous, a dtype they cover, no autograd (inference)."""
    return x.dim() == 2 and x.dtype in FUSED_DTYPES and x.is_contiguous() and not torch.is_grad_enabled()


@functools.cache
def fused_ops() -> SimpleNamespace:
    """The fused CPU ops' ``.default`` overloads (models/cpu_fused.py), resolved once: calling an overload
    skips the op packet's per-call overload lookup (~1.5 µs; ~270 calls a step)."""
    ops = torch.ops.nightjar_cpu
    names = ("rms_norm", "add_rms_norm", "silu_mul", "rope_store", "paged_attention")
    return SimpleNamespace(**{n: getattr(ops, n).default for n in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_fused = False         # set by LlamaModel.select_kernels (models/cpu_fused.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One fused op. It accumulates in fp32 and rounds once after scaling, where HF rounds the
        normalised value to the input dtype first and then scales: the same in fp32, within one
        rounding of it in bf16 (and measured closer to an fp32 reference)."""
        if self.cpu_fused and _fusable(x):
            return torch.ops.nightjar_cpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, this norm of it) for a residual add followed by the norm: one call when fused."""
        if self.cpu_fused and _fusable(x) and a.is_contiguous():
            return torch.ops.nightjar_cpu.add_rms_norm(a, x, self.weight, self.eps)
        x = x + a
        return x, self(x)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with optional linear or llama3 scaling (as HF computes them)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type") or sc.get("type")
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        inv = _llama3_scale(inv, sc)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv


def _llama3_scale(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, 1, d] (rotate-half convention, as HF Llama)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., d] with its first half negated, for ``apply_rope_signed`` (made once per step)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` with the sign folded into the sine: rotate-half is (-x2, x1) = roll(x, d/2) * (-1, 1),
    so the same numbers in 4 ops instead of 7 (the forward runs this once per layer)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.qkv_proj: nn.Module | None = None     # set by fuse(): one [q+2kv, h] projection
        self.use_kernels = False       # set by LlamaModel.select_kernels (Triton on CUDA)
        self.cpu_fused = False         # set by LlamaModel.select_kernels (models/cpu_fused.py)

    def fuse(self) -> None:
        """Replace q/k/v by one projection whose rows are q, k, v stacked (same numbers, one GEMM)."""
        if self.qkv_proj is None:
            self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., h] -> q [..., q_size], k [..., kv_size], v [..., kv_size]."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        c = self.cfg
        return self.qkv_proj(x).split((c.q_size, c.kv_size, c.kv_size), dim=-1)

    def forward(self, x, cos, sin_signed, lay: BatchLayout, cache) -> torch.Tensor:
        """x [T, h]; cos, sin_signed [T, 1, d] (``signed_sin``) -> [T, h]."""
        c = self.cfg
        T = x.shape[0]
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        fused = self.cpu_fused and self.qkv_proj is not None and x.dtype in FUSED_DTYPES
        by_slot = cache.layer_slots(self.layer) if fused else None
        if by_slot is not None:
            return self.o_proj(self._fused(x, cos, sin_signed, lay, cache, by_slot).reshape(T, c.q_size))
        if self.qkv_proj is None:
            q, k, v = self.qkv(x)
            qk = torch.cat((q.view(T, nh, d), k.view(T, nkv, d)), dim=1)        # [T, nh+nkv, d]
        else:
            qkv = self.qkv_proj(x)                                              # [T, (nh+2nkv)*d]
            qk, v = qkv[:, : c.q_size + c.kv_size].view(T, nh + nkv, d), qkv[:, c.q_size + c.kv_size:]
        qk = apply_rope_signed(qk, cos, sin_signed)                             # one rotation for q and k
        q, k = qk[:, :nh], qk[:, nh:]                                           # [T, nh, d], [T, nkv, d]
        v = v.reshape(T, nkv, d)                                                # [T, nkv, d]
        scale = 1.0 / math.sqrt(c.head_dim)
        if self.use_kernels and len(cache.segments) <= 2 and not cache.head_major:
            out = self._kernel_attention(q, k, v, lay, cache, scale)
        else:
            cache.write(self.layer, k, v, lay.slot_mapping)
            out = paged_attention(q, cache, self.layer, lay, scale)  # [T, nh, d]
        return self.o_proj(out.reshape(T, c.q_size))

    def _fused(self, x, cos, sin_signed, lay: BatchLayout, cache, by_slot) -> torch.Tensor:
        """The fused CPU path: rope + KV store in one call, paged attention of the decode/verify rows (at most
        SHORT_QUERY queries) in one more, a prefill row's long query by ``_attend`` (SDPA over the gathered
        blocks) -> [T, nh, d]. Each row takes the same path whatever else is in the step. ``by_slot`` is this
        layer's [2, nkv, S, d] cache view."""
        ops, scale = fused_ops(), 1.0 / math.sqrt(self.cfg.head_dim)
        qkv = self._modules["qkv_proj"].forward(x)                                   # [P, q + 2 kv]
        if qkv.shape[0] != lay.slot_mapping.shape[0]:
            qkv = qkv[: lay.slot_mapping.shape[0]]                                   # [T, ...]: padding rows off
        q = ops.rope_store(qkv, cos, sin_signed, by_slot, lay.slot_mapping, self.cfg.num_heads)    # [T, nh, d]
        if len(lay.long_groups) == len(lay.groups):
            return paged_attention(q, cache, self.layer, lay, scale)
        out = ops.paged_attention(q, by_slot, lay.block_tables, lay.query_start_loc, lay.seq_lens,
                                  cache.block_size, scale, SHORT_QUERY)
        for g in lay.long_groups:
            out[g.token_index] = _attend(q, cache, self.layer, g, scale)
        return out

    def forward_fused(self, x, cos, sin_signed, lay: BatchLayout, cache, by_slot) -> torch.Tensor:
        """``forward`` where ``LlamaModel.fused_path`` holds, its projections called by their ``forward``
        (no nn.Module dispatch): x [P, h] -> [P, h]. ``by_slot``: this layer's cache view, taken when the
        forward began. x may carry zero rows after its T tokens (``LlamaModel.gemm_min_rows``): the
        projections run on all P rows, rope, the KV store and attention on the T tokens."""
        out = self._fused(x, cos, sin_signed, lay, cache, by_slot)                      # [T, nh, d]
        o = out.reshape(out.shape[0], self.cfg.q_size)                                  # [T, q]
        if o.shape[0] != x.shape[0]:
            o = _pad_rows(o, x.shape[0])                                                # [P, q]
        return self._modules["o_proj"].forward(o)

    def _kernel_attention(self, q, k, v, lay: BatchLayout, cache, scale: float) -> torch.Tensor:
        """The Triton path (GPU): KV store + varlen paged attention over the pool's one or two segments (a grown
        pool: the second one's blocks through the kernels' segment table, triton_kernels/segments.py)."""
        from nightjar.triton_kernels.kv_store import kv_store_triton
        from nightjar.triton_kernels.paged_attention import paged_attention_triton

        segs = cache.segments
        data = segs[0].data[self.layer]                            # [2, n, bs, nkv, d]
        grown = {}
        if len(segs) == 2:
            d1 = segs[1].data[self.layer]                          # [2, n1, bs, nkv, d]
            grown = {"k_seg1": d1[0], "v_seg1": d1[1], "seg1_start": segs[1].start}
        kv_store_triton(k, v, data[0], data[1], lay.slot_mapping, **grown)
        return paged_attention_triton(q, data[0], data[1], lay.block_tables, lay.query_start_loc,
                                      lay.seq_lens, scale, **grown)


def kv_head_major(model) -> bool:
    """The KV layout ``model``'s attention should read (kvpool/cache.py): head-major for the torch path on
    CPU; block-major for the Triton kernels (CUDA, or forced under the interpreter in tests) and on CUDA."""
    attn = model.self_attn if hasattr(model, "self_attn") else model.layers[0].self_attn
    return model.device.type == "cpu" and not attn.use_kernels


def paged_attention(q: torch.Tensor, cache, layer: int, lay: BatchLayout, scale: float) -> torch.Tensor:
    """Torch reference paged attention for varlen queries. q [T, nh, d] -> [T, nh, d].

    Short groups by grouped-query matmuls, not SDPA: on CPU, SDPA's flash kernel cost ~5 ms per layer at
    B=32, Q=1, K=256 where these two bmm cost ~0.5 ms (measured, bf16, 2 cores); long groups on a head-major
    cache by SDPA row by row, which serves many queries a row better (``_attend_rows_sdpa``).
    """
    if len(lay.groups) == 1:
        return _attend(q, cache, layer, lay.groups[0], scale)
    out = torch.empty_like(q)
    for g in lay.groups:
        out[g.token_index] = _attend(q, cache, layer, g, scale)
    return out


def _attend(q: torch.Tensor, cache, layer: int, g: AttnGroup, scale: float) -> torch.Tensor:
    """One group's attention -> [t, nh, d] for the group's tokens in flat order."""
    B, Q, K = len(g.rows), g.Q, g.K
    T, nh, d = q.shape
    if cache.head_major and Q > SHORT_QUERY:
        return _attend_rows_sdpa(q, cache, layer, g, scale)
    if g.dense:
        qp = q.view(B, Q, nh, d)                                  # [B, Q, nh, d]: no padding to add
    else:
        qp = torch.cat((q, q.new_zeros(1, nh, d)))[g.q_index]     # [B, Q, nh, d]
    tables = g.block_tables[:, : -(-K // cache.block_size)]
    if cache.head_major:
        out = _attend_head_major(qp, cache, layer, tables, g, scale)
    else:
        out = _attend_block_major(qp, cache, layer, tables, g, K, scale)
    return out if g.dense else out[g.flat_index]


def _attend_head_major(qp, cache, layer: int, tables, g: AttnGroup, scale: float) -> torch.Tensor:
    """qp [B, Q, nh, d] over a head-major cache: batch dims (kv head, row), contiguous K and V of whole blocks
    (Kp = nb*bs >= K positions, the tail masked) -> [B*Q, nh, d]."""
    B, Q, nh, d = qp.shape
    kh, vh = cache.gather_heads(layer, tables)                    # [nkv, B, nb*bs, d] each
    nkv = kh.shape[0]
    gq = nh // nkv
    qh = qp.view(B, Q, nkv, gq, d).permute(2, 0, 1, 3, 4).reshape(nkv, B, Q * gq, d)
    scores = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale      # [nkv, B, Q*g, Kp]: whole blocks
    probs = scores.masked_fill_(g.blocked_padded(gq, kh.shape[2]), float("-inf")).softmax(-1).to(qp.dtype)
    out = torch.matmul(probs, vh)                                 # [nkv, B, Q*g, d]
    return out.view(nkv, B, Q, gq, d).permute(1, 2, 0, 3, 4).reshape(B * Q, nh, d)


def _attend_rows_sdpa(q: torch.Tensor, cache, layer: int, g: AttnGroup, scale: float) -> torch.Tensor:
    """A long group (prefill chunks) over a head-major cache, row by row through SDPA's fused CPU kernel on the
    group's one gather: SDPA serves many queries a row 2.5-3x faster than the matmuls, and no row pads to the
    group's longest query or context (docs/benchmarks.md, forty-fourth session) -> [t, nh, d] in the group's
    flat order."""
    kh, vh = cache.gather_heads(layer, g.block_tables[:, : -(-g.K // cache.block_size)])   # [nkv, B, Kp, d]
    outs = [_sdpa_row(q, kh[:, i: i + 1], vh[:, i: i + 1], g, b, cache.block_size, scale)
            for i, b in enumerate(g.rows)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _sdpa_row(q: torch.Tensor, kh, vh, g: AttnGroup, b: int, block_size: int, scale: float) -> torch.Tensor:
    """Row b's queries (q [T, nh, d]) over its own blocks (kh, vh [nkv, 1, Kp, d], the first nb*bs read)
    -> [q_b, nh, d]."""
    qlens, _, offsets, _, _ = g._src
    mask = g.row_mask(b, block_size)                                                   # [1, 1, q_b, nb*bs]
    n = mask.shape[-1]
    qb = q[offsets[b]: offsets[b] + qlens[b]].unsqueeze(0).transpose(1, 2)           # [1, nh, q_b, d]
    out = F.scaled_dot_product_attention(qb, kh[:, :, :n].transpose(0, 1), vh[:, :, :n].transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)   # [1, nh, q_b, d]
    return out[0].transpose(0, 1)                                                      # [q_b, nh, d]


def _attend_block_major(qp, cache, layer: int, tables, g: AttnGroup, K: int, scale: float) -> torch.Tensor:
    """qp [B, Q, nh, d] over a block-major cache (CUDA eager) -> [B*Q, nh, d]."""
    B, Q, nh, d = qp.shape
    kc, vc = cache.gather(layer, tables)                          # [B, nb*bs, nkv, d]
    nkv = kc.shape[2]
    gq = nh // nkv
    qg = qp.view(B, Q, nkv, gq, d).permute(0, 2, 1, 3, 4).reshape(B, nkv, Q * gq, d)
    kt = kc[:, :K].permute(0, 2, 3, 1)                            # [B, nkv, d, K]
    scores = torch.matmul(qg, kt).float() * scale                 # [B, nkv, Q*g, K]
    probs = scores.masked_fill_(g.blocked(gq), float("-inf")).softmax(-1).to(qp.dtype)
    out = torch.matmul(probs, vc[:, :K].transpose(1, 2))          # [B, nkv, Q*g, d]
    return out.view(B, nkv, Q, gq, d).permute(0, 2, 1, 3, 4).reshape(B * Q, nh, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by fuse(): one [2*inter, h] projection
        self.cpu_fused = False                      # set by LlamaModel.select_kernels (models/cpu_fused.py)

    def fuse(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gu = self.gate_up_proj(x)                                 # [..., 2*inter]
        if self.cpu_fused and _fusable(gu):
            return self.down_proj(torch.ops.nightjar_cpu.silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)                            # [..., inter] each
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` on the fused CPU ops with no nn.Module dispatch: x [T, h] -> [T, h]."""
        m = self._modules
        return m["down_proj"].forward(fused_ops().silu_mul(m["gate_up_proj"].forward(x)))   # via [T, inter]


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose output rows are ``parts``' rows in order."""
    w = torch.cat([p.weight.detach() for p in parts])             # [sum(out), in]
    fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=parts[0].weight.requires_grad)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x, cos, sin, lay, cache):
        a = self.self_attn(self.input_layernorm(x), cos, sin, lay, cache)
        x, h = self.post_attention_layernorm.add_forward(a, x)       # x + a, and its norm
        return x + self.mlp(h)

    def forward_fused(self, x, cos, sin, lay, cache, by_slot):
        """``forward`` where ``LlamaModel.fused_path`` holds: the same ops, every submodule reached through
        ``_modules`` and called by its ``forward`` (nn.Module's per-call dispatch and attribute lookups cost
        0.7-2 ms a step at B = 1 on the 30-layer target, bench/step_times.py --variants modules,served).
        ``by_slot``: this layer's cache view, taken when the forward began."""
        ops, m = fused_ops(), self._modules
        ln1, ln2 = m["input_layernorm"], m["post_attention_layernorm"]
        a = m["self_attn"].forward_fused(ops.rms_norm(x, ln1.weight, ln1.eps), cos, sin, lay, cache, by_slot)
        x, h = ops.add_rms_norm(a, x, ln2.weight, ln2.eps)              # x + a, and its norm
        return x + m["mlp"].forward_fused(h)


def use_cpu_fused(device: torch.device, dtype: torch.dtype) -> bool:
    """The fused CPU ops (models/cpu_fused.py) serve a model on ``device`` in ``dtype``: a CPU where they build,
    fp32 or bf16."""
    from nightjar.models import cpu_fused

    return device.type == "cpu" and dtype in FUSED_DTYPES and cpu_fused.available()


def set_cpu_fused(model: nn.Module, on: bool) -> None:
    """Switch every norm, attention and MLP of ``model`` to the fused CPU ops (or back). They run only
    without autograd (inference), on 2-D token-major inputs: anything else keeps the torch ops."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, Attention, MLP)):
            m.cpu_fused = on


class LlamaModel(nn.Module):
    """Parameter names follow HF's ``LlamaForCausalLM`` so state dicts load as they are."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gemm_min_rows = 0      # the fused path pads a forward's rows up to this (pack_cpu_weights)
        self.head_min_rows = 0      # and the LM head's

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def select_kernels(self, triton: bool | None = None, cpu_fused: bool | None = None) -> bool:
        """The one switch: Triton kernels on CUDA (unless NIGHTJAR_TRITON=0); on CPU the fused C++ ops
        where they build (unless NIGHTJAR_CPU_FUSED=0, models/cpu_fused.py), else torch references.
        Returns whether Triton is on."""
        if triton is None:
            from nightjar.triton_kernels import use_triton

            triton = use_triton() and self.device.type == "cuda"
        if cpu_fused is None:
            cpu_fused = use_cpu_fused(self.device, self.dtype) and not triton
        for layer in self.layers:
            layer.self_attn.use_kernels = triton
        set_cpu_fused(self, cpu_fused)
        return triton

    def fuse_projections(self) -> LlamaModel:
        """q/k/v and gate/up become one GEMM each (after loading: checkpoints keep HF's names)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def pack_cpu_weights(self, mirror: bool = False) -> bool:
        """On a bf16 CPU model, hold every projection and the LM head packed in this machine's layout
        (oneDNN's, or 16-column panels where oneDNN has no bf16 kernels; inference only; see
        models/cpu_linear.py). ``mirror`` keeps the plain weights as the parameters (a draft's, which move).
        Returns whether it packed."""
        from nightjar.models.cpu_linear import cpu_format, is_packed, pack_linears

        fmt = cpu_format(self.dtype, self.device)
        if fmt is None:
            return False
        pack_linears(self, mirror=mirror, fmt=fmt)
        self.gemm_min_rows = fmt.min_rows if is_packed(self.layers[0].mlp.down_proj) else 0
        self.head_min_rows = fmt.min_rows if is_packed(self.lm_head) else 0
        return True

    def weight_bytes(self) -> int:
        """Bytes of the weights as held: parameters (tied ones once) plus any packed copies."""
        from nightjar.models.cpu_linear import packed_bytes

        seen, total = set(), 0
        for p in self.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total + packed_bytes(self)

    def fused_path(self, x: torch.Tensor, cache) -> bool:
        """Every layer of this forward may take ``DecoderLayer.forward_fused``: the fused CPU ops are on,
        projections fused, x [T, h] token-major in a dtype they take, and the cache head-major."""
        first = self.layers[0]
        return (first.self_attn.cpu_fused and first.mlp.cpu_fused and first.input_layernorm.cpu_fused
                and first.self_attn.qkv_proj is not None and first.mlp.gate_up_proj is not None
                and _fusable(x) and cache.layer_slots(0) is not None)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]   # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                    # [T, 1, d]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(self, lay: BatchLayout, cache, capture: tuple[int, ...] = ()):
        """Run the batch; returns logits [N, vocab] (fp32) for ``lay.logits_index`` rows. With
        ``capture`` (layer indices) also the residual stream after those layers for every token:
        (logits, features [T, len(capture)*h]) — a draft head's input (models/eagle.py)."""
        x = self.embed_tokens(lay.input_ids)                      # [T, h]
        cos, sin = self.rope(lay.positions)
        sin = signed_sin(sin)
        kept = []
        slots = cache.slots_by_layer() if self.fused_path(x, cache) else None     # one view per layer
        T = x.shape[0]
        if slots and T < self.gemm_min_rows:
            x = _pad_rows(x, self.gemm_min_rows)                  # [P, h]: zero rows after the T tokens
        for i, layer in enumerate(self.layers):
            x = layer.forward_fused(x, cos, sin, lay, cache, slots[i]) if slots else layer(x, cos, sin, lay, cache)
            if i in capture:
                kept.append(x[:T])
        h = self.norm(x[lay.logits_index])                        # [N, h]
        n = h.shape[0]
        if n < self.head_min_rows and _fusable(h):                # inference only, as the layers' padding
            logits = self.lm_head(_pad_rows(h, self.head_min_rows))[:n].float()
        else:
            logits = self.lm_head(h).float()                      # [N, V]
        return (logits, torch.cat(kept, dim=-1)) if capture else logits
