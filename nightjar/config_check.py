"""Validate an EngineConfig at the edge (CLI, server start, embedded Engine) before anything loads: each
mistake becomes a ConfigError naming the field (the CLI prints it as its flag) and the allowed values."""
from __future__ import annotations

from nightjar.kernel.config import EngineConfig
from nightjar.sampling import ConfigError

DTYPES = ("bfloat16", "float32", "float16")
QUANTIZATIONS = ("none", "int8", "int4", "w4a8")
MAX_GAMMA = 16
POSITIVE = ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_queue",
            "persist_steps", "trace_max_bytes", "draft_tree_batch")
MAX_TREE = 8
MAX_LOOKUP = 3


def check_config(cfg: EngineConfig, models: bool = True) -> None:
    """Raise the first ConfigError of ``cfg``; ``models`` also checks that the model and draft exist."""
    for check in (_numbers, _dtype_device, _policy, _planner_profile, _ngram) + ((_models,) if models else ()):
        check(cfg)


def _numbers(c: EngineConfig) -> None:
    for name in POSITIVE:
        if getattr(c, name) < 1:
            raise ConfigError(name, f"must be a positive integer, got {getattr(c, name)}")
    for name in ("num_blocks", "device_memory"):
        if getattr(c, name) is not None and getattr(c, name) <= 0:
            raise ConfigError(name, f"must be > 0, got {getattr(c, name)}")
    if not 0 <= c.gamma_max <= MAX_GAMMA:
        raise ConfigError("gamma_max", f"must be in 0..{MAX_GAMMA}, got {c.gamma_max}")
    if not 0 <= c.prompt_lookup <= MAX_LOOKUP:
        raise ConfigError("prompt_lookup", f"must be in 0..{MAX_LOOKUP} (0: off), got {c.prompt_lookup}")
    if not 0 <= c.draft_tree <= MAX_TREE:
        raise ConfigError("draft_tree", f"must be in 0..{MAX_TREE}, got {c.draft_tree}")
    if not 0 <= c.low_free_frac < 1:
        raise ConfigError("low_free_frac", f"must be in [0, 1), got {c.low_free_frac}")
    if c.synthetic_acceptance is not None and not 0 <= c.synthetic_acceptance <= 1:
        raise ConfigError("synthetic_acceptance", f"must be in [0, 1], got {c.synthetic_acceptance}")


def _dtype_device(c: EngineConfig) -> None:
    import torch

    if c.dtype not in DTYPES:
        raise ConfigError("dtype", f"choose from {', '.join(DTYPES)}; got {c.dtype!r}")
    try:
        dev = torch.device(c.device)
    except RuntimeError:
        raise ConfigError("device", f"'cpu' or 'cuda[:N]', got {c.device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"'cpu' or 'cuda[:N]', got {c.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but this machine has no CUDA device")
    for name, modes in (("quantization", QUANTIZATIONS), ("draft_quantization", QUANTIZATIONS + ("mixed",))):
        mode = getattr(c, name)
        if mode is not None and mode not in modes:
            raise ConfigError(name, f"choose from {', '.join(modes)}; got {mode!r}")
        if mode not in (None, "none") and dev.type != "cpu":
            raise ConfigError(name, f"{mode} runs on CPU only (torch's packed CPU kernels); use none on {c.device}")
    if not isinstance(c.enforce_eager, bool):
        raise ConfigError("enforce_eager", f"must be true or false, got {c.enforce_eager!r}")


def _policy(c: EngineConfig) -> None:
    from nightjar.actors.policy_factory import make_policy

    try:
        make_policy(c.policy, c.gamma_max, c.seed)
    except ValueError as e:
        raise ConfigError("policy", str(e)) from None


def _planner_profile(c: EngineConfig) -> None:
    import json

    from nightjar.actors.step_profile import Profile

    if c.planner_profile in (None, "auto"):      # "auto": resolved (and measured if need be) by the engine
        return
    try:
        with open(c.planner_profile) as f:
            Profile.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("planner_profile", f"not a `nightjar profile` JSON file: {e}") from None


def _ngram(c: EngineConfig) -> None:
    """``ngram[:MIN-MAX]`` (actors/draft_ngram.py): well formed, and no option that only a drafter with weights
    takes."""
    from nightjar.actors.draft_ngram import parse_ngram

    try:
        if parse_ngram(c.draft) is None:
            return
    except ValueError as e:
        raise ConfigError("draft", str(e)) from None
    if c.draft_quantization not in (None, "none"):
        raise ConfigError("draft_quantization", "the n-gram drafter has no weights to quantize")
    if c.draft_tree:
        raise ConfigError("draft_tree", "needs a draft head (--draft default or a head directory), not the n-gram "
                          "drafter")


def _models(c: EngineConfig) -> None:
    from nightjar.actors.draft_ngram import parse_ngram
    from nightjar.models import NAMED_DRAFTS, resolve_model_path

    for name, spec in (("model", c.model), ("draft", c.draft)):
        if name == "draft" and (spec in (None, "", "none", "random") or spec in NAMED_DRAFTS
                                or parse_ngram(spec) is not None):
            continue
        try:
            resolve_model_path(spec)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(name, str(e)) from None
