"""Fused CPU ops for the decoder step, compiled from ``cpu_fused.cpp`` on first use.

A decode step at one to a few rows is mostly call overhead: ~48 aten calls per layer around almost no
arithmetic (an ``rms_norm`` is ~11 aten ops, each tiny attention ``bmm`` 20-60 µs). The ops here do a
layer's norms, rope + KV store, paged attention and SiLU·up in five calls (docstring of the .cpp file). Four more
serve quantized models and greedy picks: ``int4_linear`` (an int4 layer up to 128 rows) and ``int4_weight_t`` (its
longer chunks), ``int8_linear`` (the int8 LM head, and a bf16 model's int8 layers where it runs on AMX tiles; all
three in models/quant.py) and ``argmax_rows`` (greedy picks over the vocabulary, actors/sampler.py
``argmax_last``); two serve bf16 layers on CPUs without bf16 arithmetic (AVX2): ``bf16_panels`` packs a weight and
``bf16_linear`` runs it (models/cpu_linear.py ``PANELS``). ``use_amx(on)`` chooses whether ``int4_linear`` and
``int8_linear`` run bf16 inputs on AMX tiles where the CPU has them (the default; ``NIGHTJAR_CPU_AMX=0`` turns it
off for the process) or on their vector kernels (benchmarks, tests).

The extension is built with the system C++ compiler through ``torch.utils.cpp_extension`` into
``~/.cache/nightjar/cpu_fused/<key>`` (``NIGHTJAR_CACHE`` moves ``~/.cache/nightjar``), once per source, torch
version and machine (``-march=native``); later processes load the built library. Without a compiler, or with
``NIGHTJAR_CPU_FUSED=0``, ``available()`` is False and the model keeps its torch ops (same results within
rounding: tests/models/test_cpu_fused.py). ``python -m nightjar.models.cpu_fused`` builds it ahead of time
(``make test`` and ``make serve`` do).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_fused.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]   # OpenMP for at::parallel_for (torch's own runtime, loaded)
_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    """The environment allows the fused ops (``NIGHTJAR_CPU_FUSED=0`` turns them off)."""
    return os.environ.get("NIGHTJAR_CPU_FUSED", "1") != "0"


def build_dir() -> Path:
    """Where this source, torch version and machine's build lives."""
    root = Path(os.environ.get("NIGHTJAR_CACHE", Path.home() / ".cache" / "nightjar"))
    parts = (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(), platform.machine().encode(),
             _cpu_flags().encode(), sys.version.encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return root / "cpu_fused" / key


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def available() -> bool:
    """The ops are loaded (built first if needed); False, logged once, when they cannot be."""
    if not enabled():
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
            if _state["ok"]:
                torch.ops.nightjar_cpu.use_amx(amx_enabled())
    return bool(_state["ok"])


def amx_enabled() -> bool:
    """The environment allows AMX tiles for the quantized ops (``NIGHTJAR_CPU_AMX=0`` turns them off)."""
    return os.environ.get("NIGHTJAR_CPU_AMX", "1") != "0"


def uses_amx() -> bool:
    """``int4_linear`` and ``int8_linear`` run bf16 inputs on AMX tiles in this process now (False where the
    environment, the machine, the build or Linux does not let them)."""
    return available() and bool(torch.ops.nightjar_cpu.uses_amx())


def lanes() -> int:
    """The fp32 lanes of the built ops' vectors: 16 where the build has AVX-512, else 8 (0 without the ops). Their
    int4 kernels read torch's int4 pack in blocks of 4 x lanes rows (quant.int4_block must agree)."""
    return int(torch.ops.nightjar_cpu.lanes()) if available() else 0


def _load() -> bool:
    if hasattr(torch.ops, "nightjar_cpu") and hasattr(torch.ops.nightjar_cpu, "rms_norm"):
        return True
    try:
        from torch.utils.cpp_extension import load

        out = build_dir()
        if not any(out.glob("*.so")):
            log.info("building the fused CPU ops into %s (once per machine, ~20 s)", out)
        out.mkdir(parents=True, exist_ok=True)
        _ninja_on_path()
        load(name="nightjar_cpu_fused", sources=[str(SOURCE)], build_directory=str(out),
             extra_cflags=CFLAGS, is_python_module=False, verbose=False)
        return True
    except Exception as e:   # no compiler, no ninja, a failed build: the torch ops serve instead
        log.warning("fused CPU ops unavailable; using torch ops: %s", _reason(e))
        return False


def _reason(e: Exception) -> str:
    """The compiler's first error line when there is one, else the exception's first line."""
    lines = str(e).splitlines() or [type(e).__name__]
    return next((ln.strip() for ln in lines if "error:" in ln), lines[0])[:300]


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; a venv's own (pip ``ninja``) counts too."""
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def main() -> int:
    """Build (or find) the ops and say so; never fails: without them the engine serves on torch ops."""
    state = "off (NIGHTJAR_CPU_FUSED=0)" if not enabled() else "ready" if available() else "unavailable"
    amx = ", AMX tiles for bf16 int4/int8 layers" if uses_amx() else ""
    print(f"fused CPU ops: {state}{amx} ({build_dir()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
