"""bf16 linear layers on CPU with each weight reordered once into a layout its kernel streams.

Two layouts, chosen per machine by ``cpu_format``:

- ``ONEDNN``, where oneDNN has bf16 kernels (AVX-512 CPUs; native with AVX512-bf16 or AMX): oneDNN's blocked layout
  (the one torch.compile's CPU "freezing" uses). ``F.linear`` on a plain bf16 weight re-reads it in row-major order
  every call and runs well below the memory copy rate at M = 1..16 rows; packed, measured on a 2-vCPU Xeon (torch
  2.13, bf16, p10 of 300 calls, M=1): 3072x576 207 -> 62 us, 576x1536 72 -> 28 us, the 49152x576 LM head 11.0 -> 1.3
  ms.
- ``PANELS``, on other CPUs (AVX2 only: no bf16 arithmetic) where the fused CPU ops build: panels of 16 output
  columns that ``nightjar_cpu.bf16_linear`` widens to fp32 in registers and reads once per 6 rows
  (models/cpu_fused.cpp). There torch's bf16 GEMM runs a GEMV per row; measured on a 2-vCPU AVX2 EPYC (median
  of 30 calls), 576x1536 at 1 / 4 / 16 rows 94 / 356 / 1418 us -> 46 / 57 / 178 us, the LM head 3.8 / 12.2 /
  48.3 ms -> 2.2 / 2.2 / 5.6 ms (docs/benchmarks.md, forty-seventh session).

A packed tensor is for inference only and does not move between devices (oneDNN's is opaque: no storage pointer,
not a parameter). Engines pack the target this way (its weights never move). The draft, whose plain weights the
weight mover offloads and reloads, uses MirroredPackedLinear: plain weight plus a packed copy that is dropped on
release and rebuilt after a reload (both counted in weight_bytes).
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

PACKED_MIN_ROWS = 4
"""Rows a packed model's forward pads its GEMMs up to (``LlamaModel.gemm_min_rows``). On a 2-vCPU EPYC
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
    """x [..., in] bf16 -> [..., out] through a oneDNN-packed weight, the rows padded with zeros to ``gemm_rows``."""
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
    """``m`` is a packed linear (plain or mirrored, in either layout)."""
    return isinstance(m, (PackedLinear, MirroredPackedLinear))


@functools.cache
def _linear():
    """oneDNN's packed linear as its ``.default`` overload (skips the op packet's per-call lookup)."""
    return torch.ops.mkldnn._linear_pointwise.default


class OneDnnFormat:
    """oneDNN's blocked bf16 layout (where ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 CPUs)."""

    name = "oneDNN-packed"
    min_rows = PACKED_MIN_ROWS      # a target forward pads its rows up to this (LlamaModel.gemm_min_rows)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)       # opaque [out, in]

    @staticmethod
    def run(x: torch.Tensor, packed: torch.Tensor, out_features: int, pad: bool) -> torch.Tensor:
        """x [..., in] -> [..., out]; ``pad``: rows padded to ``gemm_rows`` (a draft's, module docstring)."""
        return packed_linear(x, packed) if pad else _linear()(x, packed, None, "none", [], "")

    @staticmethod
    def dense(packed: torch.Tensor, out_features: int) -> torch.Tensor:
        return packed.to_dense()


class PanelFormat:
    """Panels of 16 output columns for ``nightjar_cpu.bf16_linear`` (CPUs without bf16 arithmetic)."""

    name = "bf16 panels"
    min_rows = 0                    # a row costs what it computes: nothing to pad

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.nightjar_cpu.bf16_panels(weight.detach().contiguous())  # [ceil(out/16), in, 16]

    @staticmethod
    def run(x: torch.Tensor, packed: torch.Tensor, out_features: int, pad: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()                              # [M, in]
        return torch.ops.nightjar_cpu.bf16_linear(x2, packed, out_features).view(*x.shape[:-1], out_features)

    @staticmethod
    def dense(packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """Undo the packing: place 2i of a panel's 16 holds output i, place 2i + 1 output 8 + i."""
        nb, k, _ = packed.shape
        w = packed.view(nb, k, 8, 2).permute(0, 3, 2, 1)                          # [nb, 2, 8, in]
        return w.reshape(nb * 16, k)[:out_features].clone()                       # [out, in]


ONEDNN, PANELS = OneDnnFormat(), PanelFormat()


def onednn_bf16() -> bool:
    """oneDNN has bf16 kernels here (AVX-512 CPUs), so torch's bf16 GEMM is fast; without them it runs a GEMV a
    row."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_format(dtype: torch.dtype, device: torch.device) -> OneDnnFormat | PanelFormat | None:
    """The packed layout a bf16 CPU model's linear layers take here (module docstring), else None (fp32, GPU, or
    neither oneDNN bf16 kernels nor the fused CPU ops)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if onednn_bf16():
        return ONEDNN
    from nightjar.models import cpu_fused

    return PANELS if cpu_fused.available() else None


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """A bf16 CPU model's linear layers can be packed here (``cpu_format``)."""
    return cpu_format(dtype, device) is not None


def _format_for(weight: torch.Tensor, fmt):
    fmt = fmt or cpu_format(weight.dtype, weight.device)
    if fmt is None:
        raise ValueError(f"no packed layout for a {weight.dtype} weight on {weight.device} here (cpu_format)")
    return fmt


class PackedLinear(nn.Module):
    """y = x @ W^T (no bias) with W [out, in] held packed (``fmt``, by default this machine's ``cpu_format``)."""

    def __init__(self, weight: torch.Tensor, fmt: OneDnnFormat | PanelFormat | None = None):
        super().__init__()
        self.fmt = _format_for(weight, fmt)
        self.out_features, self.in_features = weight.shape
        self.packed = self.fmt.pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16."""
        return self.fmt.run(x, self.packed, self.out_features, pad=False)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] as a plain tensor again (a copy)."""
        return self.fmt.dense(self.packed, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt.name}"


class MirroredPackedLinear(nn.Module):
    """A packed linear that keeps its plain ``weight`` parameter: for a model whose weights move (the
    draft, offloaded and reloaded by the weight mover as plain tensors). The packed copy is rebuilt when
    the weight's storage changes (``refresh``; else lazily on the next call) and freed by ``drop``. In
    oneDNN's layout its calls run ``gemm_rows`` rows."""

    def __init__(self, weight: nn.Parameter, fmt: OneDnnFormat | PanelFormat | None = None):
        super().__init__()
        self.fmt = _format_for(weight, fmt)
        self.weight = weight                                     # [out, in], shared if tied
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self._source = -1
        self.refresh()

    def refresh(self) -> None:
        if self.weight.numel() == 0:                             # released: nothing to pack
            self.drop()
        elif self.packed is None or self._source != self.weight.data_ptr():
            self.packed = self.fmt.pack(self.weight)
            self._source = self.weight.data_ptr()

    def drop(self) -> int:
        freed, self.packed, self._source = self.nbytes, None, -1
        return freed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16."""
        if self.packed is None or self._source != self.weight.data_ptr():
            self.refresh()
        return self.fmt.run(x, self.packed, self.out_features, pad=True)

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()


def pack_linears(model: nn.Module, mirror: bool = False, fmt: OneDnnFormat | PanelFormat | None = None) -> int:
    """Replace every plain bias-free ``nn.Linear`` in ``model`` by a packed one (MirroredPackedLinear
    with ``mirror``, which keeps the plain weight too) in ``fmt`` (default ``cpu_format``); returns how many."""
    kind = MirroredPackedLinear if mirror else PackedLinear
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m.bias is None]
    for name, m in targets:
        model.set_submodule(name, kind(m.weight, fmt))
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
