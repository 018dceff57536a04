"""Quantized linear layers for CPU in torch's packed layouts (``--quantization int8|int4|w4a8``).

int8: per-output-channel symmetric scales, ``aten._weight_int8pack_mm``. int4: groupwise (32 inputs per
group) scale and zero, ``aten._weight_int4pack_mm_for_cpu`` on the layout of
``aten._convert_weight_to_int4pack_for_cpu``; a weight is ``(q - 8) * scale + zero`` with q in 0..15.
Activations stay in the model's dtype (bf16, fp16 or fp32: the kernels take all three).

Each int4 group is quantized two ways, min/max affine (as GGUF Q4_1) and symmetric about zero (as GGUF
Q4_0), and keeps whichever reconstructs it better: on weights dequantized from a Q4_0 or Q4_1 GGUF one of
the two reproduces the file's own 4-bit codes, so the engine runs the file's codes, not a second
quantization (tests/models/test_quant.py checks this against the raw Q4_1 blocks). Q8_0's per-32-block
scales cannot be expressed by per-channel int8 scales: int8 requantizes.

The packed kernels are GEMV-shaped: their time grows about linearly in the rows M of x. Past
``PACKED_MAX_ROWS[mode]`` rows (prefill chunks, large batches) a layer dequantizes its weight once per call (in
the activations' dtype) and runs one dense GEMM instead.

Where the fused CPU ops build, an int4 layer runs ``int4_linear`` (models/cpu_fused.cpp) on the same packed
weight up to ``FUSED_INT4_MAX_ROWS`` rows instead of torch's kernel: one decode of a block (64 rows with AVX-512,
32 on AVX2, as torch packs them there) serves up to 6 rows of x (with bf16 activations on an AVX512-BF16 CPU, two
inputs per dot product; fp32 FMA otherwise; on AVX2 2 rows, or past 2 rows a group decoded once for tiles of 6),
so its time grows far more slowly in M, and a row's outputs never depend on the step's other rows. Where torch has
no fast bf16 GEMM (no oneDNN bf16 kernels: AVX2), bf16 inputs of every length take the fused ops. Where the CPU
has AMX and Linux grants the process its tiles, bf16 calls of every M run on them instead (a block's decoded
codes feed tile dot products for 16 rows at a time): 0.85x the vector kernel's speed at one row, 1.8x at 5,
3.6x at 16 (docs/benchmarks.md).

The LM head of a quantized model is an int8 copy (QuantHead: one fp32 scale per row) run by the fused CPU op
``int8_linear``, whose rows never depend on the step's other rows (bf16 rows on AMX tiles where int4 layers use
them: 0.95x the vector kernel's speed at one row, 1.8x at 5, 3.4x at 16); where that op does not build, the head
stays in the model's dtype (docs/quantization.md has the measurements). Where the ops' vectors are 8 lanes (AVX2:
no bf16 arithmetic, ``int8_linear`` widens codes to fp32), the head's codes are held in tiles of 4 rows read as one
stream (``tile_int8_rows``) by ``int8_linear_tiled``: ``int8_linear``'s numbers in 0.6-0.9x its time from 1 to
5 rows on an AVX2 EPYC. Where ``int8_linear`` runs on AMX tiles,
a bf16 model's int8 layers use it too, up to ``FUSED_INT8_MAX_ROWS`` rows (in place of torch's packed kernel), and
where torch has no fast bf16 GEMM, for every row count.

``w4a8`` (``--quantization w4a8``) keeps int4's weights and rounds each row of x to int8 per group of 32 inputs
in every call, as llama.cpp does for its Q4 files on CPU, so the fused ``int4_linear_a8`` multiplies codes and x
in integer dot products (AVX2's vpmaddubsw: 32 products an instruction) instead of decoding codes into fp32:
0.5-0.85x ``int4_linear``'s time from 1 to 16 rows on an AVX2 EPYC; its layers hold their codes and scales in the
order the op reads them (``int4_a8_pack``; ``torch_packed``/``torch_scales`` give torch's back). Its LM head rounds
x the same way (``int8_linear_a8``, codes held in tiles of 4 rows that are read as one stream). The rounding costs
accuracy (docs/quantization.md measures it); a layer the op cannot serve computes the same rounding in torch.

A draft may also be ``mixed`` (the default for a draft beside an unquantized target): its bf16 oneDNN-packed
layers each get an int8 copy that serves calls of up to ``MIXED_MAX_ROWS`` rows (RowSplitLinear), where
streaming half the bytes wins; bf16 serves larger calls, where the int8 kernels' time grows with rows. A
draft's outputs may then depend on how many rows a call has: drafts change how many tokens a verify accepts,
never which tokens it emits.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nightjar.models import cpu_fused, cpu_linear

MODES = ("none", "int8", "int4", "w4a8")
MIXED_MAX_ROWS = 3         # a mixed draft's int8 copies serve calls of up to this many rows (docs/quantization.md)
INT4_GROUP = 32            # GGUF's Q4 block; 576-wide models admit only 32 and 64 (K % group == 0)
PACKED_MAX_ROWS = {"int8": 16, "int4": 48}   # rows up to which the packed kernel beats dequantize + GEMM
                                            # (bench/quant_quality.py --sections kernels; docs/quantization.md)
FUSED_INT4_MAX_ROWS = 128  # the same for the fused int4_linear (cpu_fused), where it serves
FUSED_INT8_MAX_ROWS = 128  # bf16 int8 layers on int8_linear (cpu_fused) where it runs on AMX tiles, up to here
_FUSED_DTYPES = (torch.float32, torch.bfloat16)   # what the fused int4_linear and int8_linear ops take
_INNER_K_TILES = 2         # the packer's innerKTiles argument, as torchao passes it (the layout is in unpack_int4)


@functools.cache
def int4_block() -> int:
    """Rows per block of torch's CPU int4 pack on this machine: 64 where torch runs its AVX-512 kernels, 32 on
    AVX2 (byte j of a block's column holds rows j and j + block/2; unpack_int4). Read off the packer once: row 32
    of a 64-row weight is the high nibble of byte 0 in blocks of 64, the low nibble of block 1's first byte in 32."""
    w = torch.zeros(64, 16, dtype=torch.int32)
    w[32, 0] = 1
    flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, _INNER_K_TILES).reshape(-1)
    return 64 if int(flat[0]) == 0x10 else 32


@functools.cache
def _int8_linear():
    """``int8_linear``'s ``.default`` overload, resolved once."""
    return torch.ops.nightjar_cpu.int8_linear.default


@functools.cache
def _int4_linear():
    """The fused op's ``.default`` overload, resolved once (the op packet's per-call lookup costs ~1.5 µs)."""
    return torch.ops.nightjar_cpu.int4_linear.default


@functools.cache
def _int4_linear_a8():
    """``int4_linear_a8``'s ``.default`` overload, resolved once."""
    return torch.ops.nightjar_cpu.int4_linear_a8.default


class QuantLinear(nn.Module):
    """y = x @ W^T with W [out, in] held as int8 (+ per-row scale) or packed int4 (+ group scale/zero).

    ``qweight`` and ``scales`` are frozen parameters, so ``model.parameters()`` (the draft weight mover),
    ``model.to(dtype)`` (scales follow the activations' dtype) and ``weight_bytes`` all see them. ``act8`` (int4
    only, ``--quantization w4a8``): every call rounds x to int8 per group first (``round_int8_groups``).
    """

    def __init__(self, mode: str, in_features: int, out_features: int, qweight: torch.Tensor,
                 scales: torch.Tensor, group_size: int = 0, act8: bool = False, a8_layout: bool = False):
        super().__init__()
        self.mode, self.in_features, self.out_features, self.group_size = mode, in_features, out_features, group_size
        self.act8 = act8 and mode == "int4"
        self.a8_layout = a8_layout and self.act8    # as int4_linear_a8 reads them: qweight in int4_a8_pack's order,
        #                                             scales per 8 rows: 8 scales, then 8 zeros
        self.qweight = nn.Parameter(qweight, requires_grad=False)   # int8 [out, in] | uint8 [out, in/2]
        self.scales = nn.Parameter(scales, requires_grad=False)     # [out] | [in/group, out, 2] (scale, zero)
        self._select_kernel()

    @classmethod
    def from_weight(cls, w: torch.Tensor, mode: str, group_size: int = INT4_GROUP) -> QuantLinear:
        """Quantize a float weight [out, in]; scales keep ``w``'s dtype. ``w4a8``: int4 weights, act8."""
        out_f, in_f = w.shape
        if mode == "int8":
            q, s = quantize_int8(w)
            return cls(mode, in_f, out_f, q, s)
        if mode in ("int4", "w4a8"):
            codes, sz = quantize_int4(w, group_size)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INNER_K_TILES)
            a8 = mode == "w4a8" and _fused_int4_layout() and out_f % int4_block() == 0
            if a8:
                packed = torch.ops.nightjar_cpu.int4_a8_pack(packed)
                sz = sz.view(-1, out_f // 8, 8, 2).transpose(2, 3).contiguous().view(sz.shape)   # 8 s, then 8 z
            return cls("int4", in_f, out_f, packed, sz, group_size, act8=mode == "w4a8", a8_layout=a8)
        raise ValueError(f"unknown quantization {mode!r}; use one of {MODES}")

    use_fused = True        # False: torch's packed kernels even where int4_linear / int8_linear could serve

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype. A decode step makes ~120 of these calls, so the fused int4
        path reads plain attributes (nn.Module's parameter lookup costs ~1 µs a read)."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.act8:
            return self.forward_a8(x)
        any_rows = self.fused_any_rows and x.dtype == torch.bfloat16
        if (self.fused_int4 and self.use_fused and (x.shape[0] <= FUSED_INT4_MAX_ROWS or any_rows)
                and x.dtype in _FUSED_DTYPES):
            p = self._parameters
            return _int4_linear()(x.contiguous(), p["qweight"], p["scales"], self.group_size)   # [M, out]
        if (self.fused_int8 and self.use_fused and (x.shape[0] <= FUSED_INT8_MAX_ROWS or any_rows)
                and x.dtype == torch.bfloat16):
            p = self._parameters
            return _int8_linear()(x.contiguous(), p["qweight"], p["scales"], True)       # [M, out] in x's dtype
        if x.shape[0] > PACKED_MAX_ROWS[self.mode]:
            return self.dense_mm(x)                                      # [M, out]
        if self.mode == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales.to(x.dtype))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales.to(x.dtype))

    def forward_a8(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] rounded to int8 per group, times the dequantized weight -> [M, out] in x's dtype: on the fused
        op (integer dot products) where it serves, else through ``round_int8_groups`` and a dense product (the same
        numbers up to fp32 rounding: odd layer sizes, a machine without the op)."""
        if self.fused_int4 and self.a8_layout and x.dtype in _FUSED_DTYPES:
            p = self._parameters
            return _int4_linear_a8()(x.contiguous(), p["qweight"], p["scales"], self.group_size)   # [M, out]
        xr = round_int8_groups(x, self.group_size)                                    # [M, in] fp32
        return F.linear(xr, self.dequantize(torch.float32)).to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)           # .to(dtype) / .to(device) change what the fused op takes
        self._select_kernel()
        return out

    def _select_kernel(self) -> None:
        """``fused_int4``: the fused ``int4_linear`` can serve this layer (rows independent of the step; 1.2-2.2x
        torch's kernel from 1 to 48 rows, docs/quantization.md) for inputs of up to FUSED_INT4_MAX_ROWS rows
        in a dtype it takes. ``fused_int8``: ``int8_linear`` serves a bf16 model's int8 layer up to
        FUSED_INT8_MAX_ROWS rows where it runs on AMX tiles (rows independent of the step; 2.8-4x torch's kernel
        from 5 to 32 rows, 0.74x at one). ``fused_any_rows``: torch has no fast bf16 GEMM here (no oneDNN bf16
        kernels: AVX2), so the dequantized dense GEMM of long bf16 inputs would be far slower (docs/quantization.md):
        the fused ops serve bf16 inputs of every length, and int8 layers take ``int8_linear`` (0.9-1.45x the speed
        of torch's int8 kernel there from 1 to 48 rows). Decided when the layer is made, moved or cast, as the model's
        own fused ops are."""
        on_cpu = self.qweight.device.type == "cpu"
        self.fused_int4 = (self.mode == "int4" and self.out_features % int4_block() == 0 and on_cpu
                           and self.scales.dtype in _FUSED_DTYPES and _fused_int4_layout())
        self.fused_any_rows = on_cpu and cpu_fused.available() and not cpu_linear.onednn_bf16()
        self.fused_int8 = (self.mode == "int8" and on_cpu and self.scales.dtype == torch.bfloat16
                           and ((self.in_features % 32 == 0 and cpu_fused.uses_amx()) or self.fused_any_rows))

    def codes(self) -> torch.Tensor:
        """The integer codes [out, in]: int8 values, or int4 values 0..15 (as uint8)."""
        if self.mode == "int8":
            return self.qweight
        return unpack_int4(self.torch_packed(), self.out_features, self.in_features)

    def torch_scales(self) -> torch.Tensor:
        """An int4 layer's scales [in/g, out, 2] as torch's kernel reads them, (scale, zero) pairs."""
        if not self.a8_layout:
            return self.scales
        sz = self.scales
        return sz.view(sz.shape[0], -1, 2, 8).transpose(2, 3).contiguous().view(sz.shape)

    def torch_packed(self) -> torch.Tensor:
        """An int4 layer's codes in torch's pack (``qweight`` itself unless it is in int4_a8_pack's order)."""
        if not self.a8_layout:
            return self.qweight
        perm = _a8_pack_order()                                         # [quad bytes]
        return self.qweight.view(-1, perm.numel())[:, perm.argsort()].view(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] the kernels compute with (formed in fp32, returned in ``dtype``, by default the
        scales' dtype)."""
        dtype = dtype or self.scales.dtype
        if self.mode == "int8":
            return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)
        n, k, g = self.out_features, self.in_features, self.group_size
        q = self.codes().view(n, k // g, g).float()                   # [out, in/g, g]
        sz = self.torch_scales().transpose(0, 1).float()              # [out, in/g, 2]
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(n, k).to(dtype)

    def dense_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] -> [M, out] through the weight dequantized in x2's dtype and one GEMM (long chunks)."""
        if self.mode == "int8":
            w = self.qweight.to(x2.dtype).mul_(self.scales.to(x2.dtype)[:, None])            # [out, in]
            return F.linear(x2, w)
        return x2 @ self.weight_t(x2.dtype)

    def weight_t(self, dtype: torch.dtype) -> torch.Tensor:
        """int4 W^T [in, out] in ``dtype``, contiguous: the packed rows (blocks of B = ``int4_block()``: byte j holds
        rows j and j + B/2) unpack into W^T without a transposing copy; w = q * s + (z - 8 s) in one fused op."""
        n, k, g, bn = self.out_features, self.in_features, self.group_size, int4_block()
        if n % bn or self.a8_layout:
            return self.dequantize().to(dtype).t().contiguous()
        if self.qweight.device.type == "cpu" and self.scales.dtype == dtype and _fused_int4_layout():
            # the same numbers in one pass instead of the six torch ops below (~4x faster)
            return torch.ops.nightjar_cpu.int4_weight_t.default(self.qweight, self.scales, g)
        b = self.qweight.view(n // bn, k, bn // 2).transpose(0, 1)      # [in, blocks, B/2]
        q = torch.stack((b & 15, b >> 4), dim=2).to(dtype).view(k // g, g, n)   # [in/g, g, out]
        sz = self.scales.float()                                         # [in/g, out, 2]
        s = sz[..., 0].to(dtype)[:, None, :].contiguous()               # [in/g, 1, out]
        z = (sz[..., 1] - 8 * sz[..., 0]).to(dtype)[:, None, :]
        return torch.addcmul(z, q, s).view(k, n)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.qweight, self.scales))

    def extra_repr(self) -> str:
        g = f", group={self.group_size}" if self.mode == "int4" else ""
        a = ", int8 activations" if self.act8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}{g}{a}"


class QuantHead(nn.Module):
    """The LM head as int8 codes [V, h] with one fp32 scale per row; returns fp32 logits. A separate copy
    when the head is tied: the embedding keeps its table for lookups. ``act8`` (``--quantization w4a8``): x is
    rounded to int8 per group of ``INT4_GROUP`` inputs as the layers round it, and the codes are held in tiles of
    4 rows (``tile_int8_rows``) for ``int8_linear_a8`` (integer dot products, the tiles read as one stream).
    ``tiled`` without ``act8``: the same tiles for ``int8_linear_tiled`` (where ``fp32_head_tiles``)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, act8: bool = False, tiled: bool = False):
        super().__init__()
        self.out_features, self.in_features = scales.shape[0], qweight.shape[1]
        self.act8 = act8
        self.tiled = bool(tiled) or act8
        self.qweight = nn.Parameter(qweight, requires_grad=False)   # int8 [V, h]; tiled: tile_int8_rows's [V', h]
        self.scales = nn.Parameter(scales, requires_grad=False)     # fp32 [V] (cast_floats leaves them)

    @classmethod
    def from_weight(cls, w: torch.Tensor, act8: bool = False) -> QuantHead:
        """Symmetric int8 per row (max |w| -> 127), fp32 scales; ``act8`` where the rows' length is whole groups;
        the codes in tiles where ``act8`` or ``fp32_head_tiles()`` (and the rows' length is whole chunks of 32)."""
        q, s = quantize_int8(w.detach().float())
        act8 = act8 and q.shape[1] % INT4_GROUP == 0
        tiled = act8 or (q.shape[1] % 32 == 0 and fp32_head_tiles())
        return cls(tile_int8_rows(q) if tiled else q, s, act8, tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> fp32 logits [..., V]."""
        x2 = x.reshape(-1, self.in_features).contiguous()             # [M, h]
        if cpu_fused.available() and self.act8:
            y = torch.ops.nightjar_cpu.int8_linear_a8.default(x2, self.qweight, self.scales, INT4_GROUP)
        elif cpu_fused.available() and self.tiled:
            y = torch.ops.nightjar_cpu.int8_linear_tiled.default(x2, self.qweight, self.scales)
        elif cpu_fused.available():
            y = torch.ops.nightjar_cpu.int8_linear.default(x2, self.qweight, self.scales)
        else:                                                          # the op went away after loading: slow
            xr = round_int8_groups(x2, INT4_GROUP) if self.act8 else x2.float()   # [M, h] fp32
            y = F.linear(xr, self.dequantize())
        return y.view(*x.shape[:-1], self.out_features)

    def codes(self) -> torch.Tensor:
        """The int8 codes [V, h] in row order."""
        return untile_int8_rows(self.qweight, self.out_features) if self.tiled else self.qweight

    def dequantize(self) -> torch.Tensor:
        """The weight [V, h] in fp32."""
        return self.codes().float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.qweight, self.scales))

    def extra_repr(self) -> str:
        a = ", int8 activations" if self.act8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{a}"


HEAD_TILE = 4   # rows per tile of a tiled head's codes (NT in models/cpu_fused.cpp)


def fp32_head_tiles() -> bool:
    """An LM head without act8 holds its codes in tiles for ``int8_linear_tiled``: where the fused ops build with
    8-lane vectors (AVX2), whose ``int8_linear`` has no bf16 path and reads a tile's 4 rows as 4 streams (~0.55x
    the copy rate there)."""
    return cpu_fused.available() and cpu_fused.lanes() == 8


def tile_int8_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K % 32 == 0) -> [N', K], N' = N rounded up to HEAD_TILE (zero rows past N): in each
    tile of HEAD_TILE rows, the rows' 32-input chunks alternate (chunk c of row j at c * 4 * 32 + j * 32 in the
    tile), the layout ``int8_linear_a8`` reads."""
    n, k = q.shape
    pad = -n % HEAD_TILE
    q = torch.cat((q, q.new_zeros(pad, k))) if pad else q
    t = q.view(-1, HEAD_TILE, k // 32, 32).transpose(1, 2)                       # [N'/4, K/32, 4, 32]
    return t.contiguous().view(-1, k)


def untile_int8_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``tile_int8_rows``'s inverse: [N', K] -> the first n rows [n, K]."""
    k = t.shape[1]
    return t.view(-1, k // 32, HEAD_TILE, 32).transpose(1, 2).reshape(-1, k)[:n]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> int8 codes [out, in], per-row scales [out] (symmetric, max |w| -> 127)."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / 127).clamp_min(1e-12)           # [out]
    q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def round_int8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, in] -> fp32 [M, in]: each row's groups of ``group`` inputs rounded to d q, q = round(x / d) in
    [-127, 127], d = max |x| / 127 (as ``int4_linear_a8`` rounds them; llama.cpp's Q8 blocks)."""
    xg = x.float().reshape(x.shape[0], -1, group)                    # [M, in/g, g]
    amax = xg.abs().amax(dim=-1, keepdim=True).double()               # [M, in/g, 1]
    # divisions in fp64, then rounded: fp32's correctly rounded quotient, as the op's (torch's fp32 127 / amax came
    # out an ulp off it for amax = 2.515625, which moved a code that lay near .5)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)).float()
    return (torch.round(xg * inv) * (amax / 127).float()).reshape(x.shape)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> codes [out, in] (uint8 0..15) and scales_and_zeros [in/group, out, 2] (w's dtype).

    Per group, the better of min/max affine and symmetric (zero = 0) quantization by squared error.
    """
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f"int4: in_features {in_f} is not a multiple of the group size {group}")
    wg = w.detach().float().view(out_f, in_f // group, group)         # [out, G, g]
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)     # [out, G, 1]
    s_aff = ((hi - lo) / 15).clamp_min(1e-12)
    peak = torch.where(hi.abs() > lo.abs(), hi, lo)                    # signed value of largest magnitude
    s_sym = torch.where(peak == 0, torch.ones_like(peak), -peak / 8)
    fits = [_fit_int4(wg, s_aff, lo + 8 * s_aff, w.dtype), _fit_int4(wg, s_sym, torch.zeros_like(s_sym), w.dtype)]
    take = fits[1][3] < fits[0][3]                                     # [out, G, 1]: the symmetric fit is better
    q = torch.where(take, fits[1][0], fits[0][0])
    s, z = torch.where(take, fits[1][1], fits[0][1]), torch.where(take, fits[1][2], fits[0][2])
    sz = torch.cat((s, z), dim=-1).transpose(0, 1).contiguous()      # [G, out, 2]
    return q.view(out_f, in_f).to(torch.uint8), sz.to(w.dtype)


def _fit_int4(wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype):
    """Codes of wg [out, G, g] on the grid (q - 8) * s + z (s, z rounded to ``dtype`` as the kernel sees
    them) and each group's squared error [out, G, 1]. In-place arithmetic: fresh buffers are slow here."""
    s, z = s.to(dtype).float(), z.to(dtype).float()
    q = (wg - z).div_(s).add_(8).round_().clamp_(0, 15)
    err = (q - 8).mul_(s).add_(z).sub_(wg).pow_(2).sum(-1, keepdim=True)
    return q, s, z, err


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Undo ``_convert_weight_to_int4pack_for_cpu`` (torch 2.13): uint8 [n, k/2] -> codes [n, k] (uint8).

    Rows go in blocks of B = ``int4_block()`` (64, or 32 on AVX2): byte (k_i, j) holds row j (low nibble) and row
    j + B/2 (high). A tail of n % B rows pairs neighbouring rows: byte (k_i, j) holds rows 2j (low) and 2j+1 (high).
    """
    flat, bn = packed.reshape(-1), int4_block()
    nb = n // bn * bn
    head = flat[: nb * k // 2].view(n // bn, k, bn // 2)              # [blocks, k, B/2]
    q = torch.cat((head & 15, head >> 4), dim=-1).permute(0, 2, 1).reshape(nb, k)
    if nb == n:
        return q
    tail = flat[nb * k // 2:].view(k, (n - nb) // 2)                  # [k, r/2]
    qt = torch.stack((tail & 15, tail >> 4), dim=-1).reshape(k, n - nb).t()
    return torch.cat((q, qt))


def _fused_int4_layout() -> bool:
    """The fused ``int4_linear`` / ``int4_weight_t`` serve: they build here and read torch's pack in this machine's
    blocks (``int4_block``: 64 rows with AVX-512, 32 on AVX2, where the ops' vectors have 16 or 8 lanes)."""
    return cpu_fused.available() and int4_block() == 4 * cpu_fused.lanes()


@functools.cache
def _a8_pack_order() -> torch.Tensor:
    """Where int4_a8_pack takes each byte of a quad of columns of a block from: out[i] = in[order[i]]
    ([2 int4_block()] bytes)."""
    n = int4_block()                                                    # one block of rows, 4 columns: 2 n bytes
    ident = torch.arange(2 * n, dtype=torch.uint8).view(n, 2)
    return torch.ops.nightjar_cpu.int4_a8_pack(ident).flatten().long()


def _linear_weight(m: nn.Module) -> torch.Tensor | None:
    """The dense [out, in] weight of a bias-free linear layer (plain or oneDNN-packed), else None."""
    from nightjar.models.cpu_linear import MirroredPackedLinear, PackedLinear

    if (type(m) is nn.Linear and m.bias is None) or isinstance(m, MirroredPackedLinear):
        return m.weight.detach()
    if isinstance(m, PackedLinear):
        return m.dense_weight()
    return None


def quantize_model(model: nn.Module, mode: str, group_size: int = INT4_GROUP, head: bool = True) -> int:
    """Replace every bias-free linear layer inside ``model.layers`` (a draft head's: every one but its LM head)
    by a QuantLinear; returns how many. With ``head`` (and the fused CPU ops built) the LM head becomes a
    QuantHead (int8 in both modes, as GGUF files keep theirs in Q8_0 beside Q4 layers). The embedding and
    norms keep their dtype. Runs after loading (and after fusion)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; use one of {MODES}")
    if mode == "none":
        return 0
    if model.device.type != "cpu":
        raise ValueError(f"quantization {mode} runs on CPU only (torch's packed CPU kernels)")
    root = model.layers if hasattr(model, "layers") else model
    swaps = [(name, w) for name, m in root.named_modules()
             if m is not model.lm_head and (w := _linear_weight(m)) is not None]
    for name, w in swaps:
        root.set_submodule(name, QuantLinear.from_weight(w, mode, group_size))
    if head and cpu_fused.available() and (w := _linear_weight(model.lm_head)) is not None:
        model.lm_head = QuantHead.from_weight(w, act8=mode == "w4a8")
    return len(swaps)


class RowSplitLinear(nn.Module):
    """A mixed draft's layer (module docstring): ``small`` (int8: QuantLinear, or QuantHead for the LM head) for
    calls of up to ``max_rows`` rows, ``large`` (the bf16 MirroredPackedLinear, whose plain weight the weight
    mover moves) beyond."""

    def __init__(self, small: nn.Module, large: nn.Module, max_rows: int = MIXED_MAX_ROWS):
        super().__init__()
        self.small, self.large, self.max_rows = small, large, max_rows
        self.in_features, self.out_features = large.in_features, large.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] (bf16; fp32 from an int8 LM head)."""
        return self.small(x) if x.numel() <= self.max_rows * self.in_features else self.large(x)


def mix_int8(model: nn.Module) -> int:
    """Give each of a draft's oneDNN-packed bf16 layers an int8 copy for calls of few rows (RowSplitLinear);
    the LM head's is a QuantHead where the fused CPU ops build. Returns how many layers. Layers in bf16 panels
    (CPUs without bf16 arithmetic) stay as they are: there torch's packed int8 kernel is the slower one."""
    from nightjar.models.cpu_linear import ONEDNN, MirroredPackedLinear

    head = getattr(model, "lm_head", None)
    swaps = [(name, m) for name, m in model.named_modules() if isinstance(m, MirroredPackedLinear)
             and m.fmt is ONEDNN and (m is not head or cpu_fused.available())]
    for name, m in swaps:
        w = m.weight.detach()                                                  # [out, in] bf16
        small = QuantHead.from_weight(w.float()) if m is head else QuantLinear.from_weight(w, "int8")
        small.use_fused = False        # one to three rows: torch's packed int8 kernel is the faster there
        model.set_submodule(name, RowSplitLinear(small, m))
    return len(swaps)


def draft_mode(quantization: str, draft_quantization: str | None) -> str:
    """The draft's quantization: as asked, else the target's, else ``mixed`` (module docstring)."""
    if draft_quantization is not None:
        return draft_quantization
    return quantization if quantization != "none" else "mixed"


def quantized_modes(model: nn.Module) -> set[str]:
    return {m.mode for m in model.modules() if isinstance(m, QuantLinear)}


def cast_floats(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating-point parameters (layer scales included) to ``dtype``; codes, buffers (RoPE) and the int8
    head's fp32 scales stay (a row's scale multiplies its whole logit: bf16's 8 bits would shift it ~0.2 %)."""
    keep = {id(m.scales) for m in model.modules() if isinstance(m, QuantHead)}
    for p in model.parameters():
        if p.is_floating_point() and id(p) not in keep:
            p.data = p.data.to(dtype)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m._select_kernel()                      # the fused int4 op takes fp32 and bf16 scales only
    return model


def load_quantized(spec, dtype: str | torch.dtype, device: str, mode: str, draft_for=None, seed: int = 0):
    """Load a target (``draft_for=None``) or a draft for ``draft_for`` (a ModelConfig) with weight-only
    ``mode`` quantization of its layers: loaded in fp32 (so int4 recovers a Q4_0/Q4_1 file's own codes),
    quantized, then cast to ``dtype``. The LM head is then oneDNN-packed where that applies (mirrored for a
    draft: its plain weights stay the parameters the weight mover moves). A draft's ``mixed``: loaded as it is,
    then ``mix_int8``."""
    from nightjar.models import load_draft, load_model, parse_dtype

    if mode == "mixed":
        if draft_for is None:
            raise ValueError("mixed is a draft's quantization, not a target's")
        loaded = load_draft(spec, draft_for, dtype, device, seed)
        if loaded is not None:
            mix_int8(loaded.model)                  # only its oneDNN-packed layers: none off AVX512-bf16 CPUs
        return loaded
    if mode == "none":
        if draft_for is not None:
            return load_draft(spec, draft_for, dtype, device, seed)
        return load_model(spec, dtype, device)
    if draft_for is not None:
        loaded = load_draft(spec, draft_for, torch.float32, device, seed)
        if loaded is None:
            return None
    else:
        loaded = load_model(spec, torch.float32, device)
    quantize_model(loaded.model, mode)
    cast_floats(loaded.model, parse_dtype(dtype))
    loaded.model.pack_cpu_weights(mirror=draft_for is not None)   # the bf16 LM head (layers are quantized)
    return loaded
