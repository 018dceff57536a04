"""Models: the Llama-family decoder, loaders, tokenizer, named models and the shipped draft."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from nightjar.models.config import ModelConfig
from nightjar.models.cpu_linear import bound_onednn_caches
from nightjar.models.eagle import is_head_dir, load_head
from nightjar.models.llama import BatchLayout, LlamaModel, build_layout
from nightjar.models.tokenizer import ChatTokenizer

log = logging.getLogger("nightjar.models")
bound_onednn_caches()

DRAFTS_DIR = Path(__file__).parent / "drafts"
HEAD_DRAFT_DIR = DRAFTS_DIR / "smollm2-135m-head"               # the EAGLE-3-style head (models/eagle.py)
INDEPENDENT_DRAFT_DIR = DRAFTS_DIR / "smollm2-135m-draft"       # a small Llama model of its own
# The drafters shipped for SmolLM2-135M, by name. "default" is the one that measured best on the held-out
# split (docs/drafts.md: acceptance and single-stream speed), the head.
NAMED_DRAFTS = {"default": HEAD_DRAFT_DIR, "head": HEAD_DRAFT_DIR, "independent": INDEPENDENT_DRAFT_DIR}


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: ChatTokenizer | None
    source: str

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def resolve_model_path(spec: str | Path, pull_if_missing: bool = True) -> Path:
    """A registered name (pulled on demand), a ``.gguf`` file or an HF checkpoint directory."""
    from nightjar.models import hub

    if str(spec) in hub.REGISTRY:
        path = hub.model_path(str(spec))
        if not path.exists():
            if not pull_if_missing:
                raise FileNotFoundError(f"model {spec!r} is not pulled; run `nightjar models pull {spec}`")
            path = hub.pull(str(spec))
        return path
    p = Path(spec).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"model {spec!r}: no such registered name, file or directory")
    return p


def load_model(spec: str | Path, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
               pack: bool = True) -> LoadedModel:
    """Load for inference: q/k/v and gate/up fused; with ``pack`` a bf16 CPU model also holds its
    projections in oneDNN's packed layout only (models/cpu_linear.py; a draft, whose weights move,
    is packed with ``mirror`` by load_draft instead)."""
    from nightjar.models.loader import build_model, read_gguf_state, read_safetensors_state
    from nightjar.models.tokenizer import tokenizer_from_dir, tokenizer_from_gguf

    path, dt = resolve_model_path(spec), parse_dtype(dtype)
    if path.suffix == ".gguf":
        cfg, state, reader = read_gguf_state(path)
        tok = tokenizer_from_gguf(reader)
    else:
        cfg, state = read_safetensors_state(path)
        tok = tokenizer_from_dir(path) if (path / "tokenizer.json").exists() else None
    model = build_model(cfg, state, dt, device)
    if pack:
        model.pack_cpu_weights()
    return LoadedModel(model, tok, str(path))


def random_draft_config(target: ModelConfig) -> ModelConfig:
    """A tiny draft shape sharing the target's vocabulary (for when no trained draft is shipped)."""
    return ModelConfig(vocab_size=target.vocab_size, hidden_size=128, intermediate_size=384,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_eps=target.rms_eps,
                       rope_theta=target.rope_theta, max_position=target.max_position,
                       tie_embeddings=True, bos_token_id=target.bos_token_id,
                       eos_token_ids=target.eos_token_ids, name="random-draft")


def shipped(directory: Path) -> bool:
    """Whether a shipped drafter's files are there (a model's config.json or a head's head_config.json)."""
    return (directory / "config.json").exists() or is_head_dir(directory)


def load_draft(spec: str | Path | None, target: ModelConfig, dtype: str | torch.dtype = "bfloat16",
               device: str = "cpu", seed: int = 0) -> LoadedModel | None:
    """``None``/"none" -> no draft; a shipped name (NAMED_DRAFTS; "default" is the head) -> that drafter (or a
    logged random one when its files are missing); "random" -> a random draft; else a path."""
    if spec in (None, "none", ""):
        return None
    if spec in NAMED_DRAFTS:
        if not shipped(NAMED_DRAFTS[spec]):
            return random_draft(target, dtype, device, seed)
        try:
            return load_draft(NAMED_DRAFTS[spec], target, dtype, device, seed)
        except ValueError as e:
            raise ValueError(f"{e} (the shipped {spec!r} drafter is made for SmolLM2-135M-Instruct: use a "
                             "draft made for this model, or none)") from None
    if spec == "random":
        return random_draft(target, dtype, device, seed)
    if is_head_dir(Path(spec)):
        head = load_head(Path(spec), target, parse_dtype(dtype), device).fuse_projections()
        head.pack_cpu_weights(mirror=True)
        head.select_kernels()
        return LoadedModel(head, None, str(Path(spec).resolve()))
    loaded = load_model(spec, dtype, device, pack=False)
    if loaded.config.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary {loaded.config.vocab_size} != target's {target.vocab_size}")
    loaded.model.pack_cpu_weights(mirror=True)        # plain weights stay the parameters: they move
    return loaded


def random_draft(target: ModelConfig, dtype, device: str, seed: int) -> LoadedModel:
    log.warning("draft: no trained draft shipped; using a RANDOMLY INITIALISED draft (acceptance will be ~0)")
    torch.manual_seed(seed)
    cfg = random_draft_config(target)
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    model = model.to(device=device, dtype=parse_dtype(dtype)).eval().fuse_projections()
    model.pack_cpu_weights(mirror=True)
    return LoadedModel(model, None, "random")


__all__ = ["BatchLayout", "LlamaModel", "LoadedModel", "ModelConfig", "build_layout", "load_draft",
           "load_model", "parse_dtype", "resolve_model_path"]
