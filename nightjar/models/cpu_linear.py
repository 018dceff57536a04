"""bf16 linear layers on CPU through oneDNN, with each weight reordered once into oneDNN's blocked layout.

``F.linear`` on a plain bf16 weight re-reads it in row-major order every call and runs well below the
memory copy rate at M = 1..16 rows; oneDNN's prepacked weight (the layout torch.compile's CPU "freezing"
uses) lets the AVX512-bf16/AMX kernels stream it. Measured on this 2-vCPU Xeon (torch 2.13, bf16, p10 of
300 calls, M=1): 3072x576 207 -> 62 us, 576x1536 72 -> 28 us, the 49152x576 LM head 11.0 -> 1.3 ms.

The packed tensor is opaque (no storage pointer, not a parameter): a packed model is for inference
only and does not move between devices. Engines pack the target this way (its weights never move). The
draft, whose plain weights the weight mover offloads and reloads, uses MirroredPackedLinear: plain weight
plus a packed copy that is dropped on release and rebuilt after a reload (both counted in weight_bytes).
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

PACKED_MIN_ROWS = 4
"""Rows a packed model's forward pads its GEMMs up to (``LlamaModel.gemm_min_rows``). On this 2-vCPU EPYC
(AVX512-bf16, oneDNN's brg_matmul) the 30 layers' packed projections of SmolLM2-135M, memory-bound, took
13.0-15.2 ms at 1-2 rows against 11.4-13.3 ms at 4 in two runs (11.1-14.0 at 3-6; from 7 rows compute
adds up), the LM head 2.4 against 2.0-2.3 ms: a padded row costs nothing there, and a B = 1-2 step of 1-3
tokens took 0.86-0.96x its unpadded time (docs/benchmarks.md, "Small forwards padded to four rows")."""


def gemm_rows(m: int) -> int:
    """The rows a draft's packed GEMM of ``m`` rows runs with (MirroredPackedLinear): at least PACKED_MIN_ROWS,
    then m up to 16, else m rounded up to a multiple of 16 (to 256) or of 64. oneDNN compiles a kernel per row
    count (0.6-1.1 ms the first time for one 3072 x 576 layer, the caches below), and a draft head's catch-up
    passes (a new prompt's entries beside the other rows') bring hundreds of row counts: a head pass of 41-80
    entries took 3.9 ms against 1.6 at 21-40, its MLP 1.25 against 0.34 ms; rounded, 2.0 ms and 0.47
    (docs/benchmarks.md, forty-fourth session). The target's layers keep exact row counts: a forward of 16 decode
    rows and a 17-300-token chunk measured level either way (its GEMMs are long; padding costs what not compiling
    saves)."""
    if m <= 16:
        return max(m, PACKED_MIN_ROWS)
    step = 16 if m <= 256 else 64
    return -(-m // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., in] bf16 -> [..., out] through a packed weight, the rows padded with zeros to ``gemm_rows``."""
    if x.dim() != 2:
        return packed_linear(x.reshape(-1, x.shape[-1]), packed).view(*x.shape[:-1], -1)
    m = x.shape[0]
    p = gemm_rows(m)
    if p != m:
        x = torch.cat((x, x.new_zeros(p - m, x.shape[1])))                      # [p, in]
    out = _linear()(x, packed, None, "none", [], "")                              # [p, out]
    return out if p == m else out[:m]                                             # [m, out]


ONEDNN_CACHE_CAPACITY = 512
"""Entries oneDNN's primitive cache and ideep's computation cache (oneDNN's C++ wrapper inside torch) may each
hold, unless the environment says otherwise (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).
Both default to 1024 and keep an entry per GEMM shape with its JIT-compiled kernel, ~0.3-0.45 MB each on
this box; a server that sees many row counts (prefill chunks, γ changes, catch-up passes) grew its RSS by
hundreds of MiB until they filled (docs/benchmarks.md, "Soak"). A shape neither cache holds costs ~0.5 ms
to compile again, so the bound is a trade: 256 each cost 5 % of throughput at 64 concurrent requests."""


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap both caches at ``capacity`` where the environment sets no capacity of its own. They read it at
    their first use, so this runs before any oneDNN op: when ``nightjar.models`` is imported."""
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(var, str(capacity))


def is_packed(m: nn.Module) -> bool:
    """``m`` is a oneDNN-packed linear (plain or mirrored)."""
    return isinstance(m, (PackedLinear, MirroredPackedLinear))


@functools.cache
def _linear():
    """oneDNN's packed linear as its ``.default`` overload (skips the op packet's per-call lookup)."""
    return torch.ops.mkldnn._linear_pointwise.default


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN bf16 kernels exist here (CPU with AVX512-bf16 or AMX) and the model runs bf16 on CPU."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W^T (no bias) with W [out, in] held in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)   # opaque [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16."""
        return _linear()(x, self.packed, None, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] as a plain tensor again (a copy)."""
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


class MirroredPackedLinear(nn.Module):
    """A packed linear that keeps its plain ``weight`` parameter: for a model whose weights move (the
    draft, offloaded and reloaded by the weight mover as plain tensors). The packed copy is rebuilt when
    the weight's storage changes (``refresh``; else lazily on the next call) and freed by ``drop``."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight                                     # [out, in], shared if tied
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self._source = -1
        self.refresh()

    def refresh(self) -> None:
        if self.weight.numel() == 0:                             # released: nothing to pack
            self.drop()
        elif self.packed is None or self._source != self.weight.data_ptr():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self._source = self.weight.data_ptr()

    def drop(self) -> int:
        freed, self.packed, self._source = self.nbytes, None, -1
        return freed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16."""
        if self.packed is None or self._source != self.weight.data_ptr():
            self.refresh()
        return packed_linear(x, self.packed)

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()


def pack_linears(model: nn.Module, mirror: bool = False) -> int:
    """Replace every plain bias-free ``nn.Linear`` in ``model`` by a packed one (MirroredPackedLinear
    with ``mirror``, which keeps the plain weight too); returns how many."""
    kind = MirroredPackedLinear if mirror else PackedLinear
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m.bias is None]
    for name, m in targets:
        model.set_submodule(name, kind(m.weight))
    return len(targets)


def _packed_modules(model: nn.Module) -> list:
    return [m for m in model.modules() if is_packed(m)]


def packed_bytes(model: nn.Module) -> int:
    return sum(m.nbytes for m in _packed_modules(model))


def refresh_packed(model: nn.Module) -> None:
    """After a model's weights moved: re-pack the mirrored layers now (off the step's critical path)."""
    for m in _packed_modules(model):
        if isinstance(m, MirroredPackedLinear):
            m.refresh()


def drop_packed(model: nn.Module) -> int:
    """Free the packed copies of mirrored layers (their weights are being released); returns bytes."""
    return sum(m.drop() for m in _packed_modules(model) if isinstance(m, MirroredPackedLinear))
