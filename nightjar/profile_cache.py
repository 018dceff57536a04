"""This machine's cached planner profiles: ``--planner-profile auto`` / ``planner_profile="auto"``.

``cached_profile`` returns the cached ``nightjar profile`` JSON for a model, draft, dtype, quantization and
device on this machine (``$NIGHTJAR_CACHE``, else ``~/.cache/nightjar``, under ``profiles/``), measuring one
first when there is none: ``nightjar profile --quick --no-engine``, about 30 s here, in a child process (the
engine does not import the offline tools).
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from nightjar.sampling import ConfigError

# Bumped whenever the model's kernels or the measurement change what a profile says (2: fused projections,
# oneDNN-packed CPU weights; 3: the quick grid covers B <= 64, q <= 5 and is made monotone; 4: measured with
# no other live thread holding an OpenMP team, which had made small-B steps ~2x slower, see kernel/threads.py;
# 5: head-major CPU KV cache, attention over whole blocks: steps at B >= 16 8-18 % faster, kvpool/cache.py;
# 6: T_draft timed right after a target forward, as the engine runs it, 1.12-1.18x the back-to-back time;
# 7: fused CPU ops, models/cpu_fused.py: steps 0.58-0.88x, decode rows gaining more than verify rows;
# 8: a quantized model's LM head is int8 (models/quant.py QuantHead), ~1 ms less per step at a few rows;
# 9: int4 layers on the fused int4_linear up to 128 rows, verify steps at a few rows far cheaper;
# 10: fused paged attention in tasks of 64 positions (0.55-0.81x its time), int4 layers' Python glue cut:
# int4 B = 1 steps ~12 % faster, B = 16 verify steps ~15 %; 11: a draft head quantized with --draft-quantization,
# its pass at B = 1 1.41 -> 0.70 ms with int4; 12: the draft's quantization in the key, a bf16 target's draft
# mixed by default: int8 copies for calls of few rows, models/quant.py; 13: the cells of B <= 8 measured
# three times as often, offline/profile.py; 14: bf16-packed forwards of 1-3 tokens padded to 4 rows, B = 1-2
# steps 4-14 % faster, models/cpu_linear.py PACKED_MIN_ROWS; 15: the grid measures q = 4, γ = 3's verify, which
# the padding puts near q = 3 at one row, instead of interpolating it, offline/profile.py; 16: a bf16 model's int4
# layers and int8 head on AMX tiles where the CPU has them, models/cpu_fused.cpp: int4 steps of 5+ rows far cheaper;
# 17: fused paged attention 1.4-1.6x faster, the same numbers: steps of many rows or long contexts cheaper;
# 18: a bf16 model's int8 layers on int8_linear's AMX tiles, int8 steps of 4+ rows far cheaper; 19: the profile
# measures the seconds per token of context a row reads, offline/profile.py ``context_slope``; 20: prefill chunks'
# attention by SDPA on head-major caches, models/llama.py: the prompt price lower; 21: a draft's packed GEMMs
# run rounded row counts, models/cpu_linear.py ``gemm_rows``: a head's catch-up passes ~2x cheaper; 22: on CPUs
# without oneDNN bf16 kernels (AVX2), bf16 layers in 16-column panels (models/cpu_linear.py ``PANELS``) and attention
# on 8-lane vectors: steps of 4+ rows 3-7x cheaper there; 23: there too, int4 layers on the fused int4_linear and
# the int8 head 3x faster: int4 decode steps ~0.4x; 24: a w4a8 model's LM head rounds x to int8 too
# (``int8_linear_a8``) and its layers hold codes and scales as ``int4_linear_a8`` reads them: w4a8 steps of a
# few rows ~0.8x; 25: on AVX2 the greedy argmax over the vocabulary ~16x faster (184 -> 12 µs a row); 26: w4a8's
# LM head ~0.7x from 4 rows (no register spills); 27: there, other modes' int8 LM heads in tiles of 4 rows
# (``int8_linear_tiled``) 0.6-0.9x, so that a profile cached before is measured again
# instead of misleading the planner. Whether the fused CPU ops serve (``NIGHTJAR_CPU_FUSED``, a compiler) and
# whether they use AMX tiles (``NIGHTJAR_CPU_AMX``) is part of the key too.
KERNELS_VERSION = 27


def cache_path(model: str, draft: str | None, dtype: str, device: str = "cpu", quantization: str = "none",
               draft_quantization: str | None = None) -> Path:
    """Where the planner profile of this model, draft, dtype, quantization (the draft's as resolved by
    models/quant.py ``draft_mode``) and device on this machine is
    cached (``$NIGHTJAR_CACHE``, else ``~/.cache/nightjar``, under ``profiles/``). A shipped drafter's name
    ("default") is keyed by the drafter it names, so that another default is measured anew."""
    from nightjar.models import NAMED_DRAFTS, cpu_fused, parse_dtype
    from nightjar.models.llama import use_cpu_fused
    from nightjar.models.quant import draft_mode

    draft = f"shipped:{NAMED_DRAFTS[draft].name}" if draft in NAMED_DRAFTS else draft
    root = Path(os.environ.get("NIGHTJAR_CACHE") or Path.home() / ".cache" / "nightjar") / "profiles"
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    fused = device.startswith("cpu") and use_cpu_fused(torch.device("cpu"), parse_dtype(dtype))
    amx = fused and cpu_fused.uses_amx()
    machine = f"{platform.machine()}|{os.cpu_count()}|{_cpu_name()}|{torch.__version__}|{device}|{gpu}|{fused}|{amx}"
    dq = draft_mode(quantization, draft_quantization)
    spec = f"{model}|{draft}|{dtype}|{quantization}|{dq}|{KERNELS_VERSION}|{machine}"
    key = hashlib.sha256(spec.encode()).hexdigest()
    quant = "" if quantization == "none" else f"-{quantization}"
    return root / f"{Path(str(model)).stem}-{dtype}{quant}-{key[:16]}.json"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def measure(argv: list[str]) -> None:
    """``nightjar profile ARGV`` in a child process; a failure is a ConfigError on ``planner_profile``."""
    done = subprocess.run([sys.executable, "-m", "nightjar", "profile", *argv], stdout=subprocess.DEVNULL)
    if done.returncode:
        raise ConfigError("planner_profile", f"measuring the auto profile failed (`nightjar profile` exit "
                          f"{done.returncode})")


def cached_profile(model: str, draft: str | None, dtype: str, block_size: int = 16, device: str = "cpu",
                   log=print, quantization: str = "none", draft_quantization: str | None = None) -> str:
    """The cached profile's path, measured first (``--quick``, no engine run) when there is none."""
    from nightjar.models.quant import draft_mode

    dq = draft_mode(quantization, draft_quantization)
    path = cache_path(model, draft, dtype, device, quantization, dq)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"no planner profile for {model} ({dtype}, {quantization}, {device}) on this machine: "
            f"measuring one into {path}")
        measure(["--model", str(model), "--draft", str(draft or "none"), "--dtype", dtype, "--device", device,
                 "--quantization", quantization, "--draft-quantization", dq, "--block-size", str(block_size),
                 "--quick", "--no-engine",
                 "--out", str(path)])
    return str(path)
