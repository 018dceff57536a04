"""Llama-family model configuration, read from HF ``config.json`` or GGUF metadata."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 2048
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` of a LlamaForCausalLM with this shape."""
        eos = list(self.eos_token_ids)
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        }


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a config from an HF ``config.json`` dictionary (Llama family)."""
    arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
    if d.get("model_type", "llama") not in ("llama", "mistral", "smollm", "granite") and "Llama" not in arch:
        raise ValueError(f"unsupported model_type {d.get('model_type')!r}: Nightjar runs Llama-family decoders")
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    rope = d.get("rope_scaling") or None
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    if rope is None and isinstance(d.get("rope_parameters"), dict):
        rp = d["rope_parameters"]
        rope = rp if rp.get("rope_type", "default") != "default" else None
    return ModelConfig(
        vocab_size=int(d["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads), rms_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta), rope_scaling=rope,
        max_position=int(d.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"), eos_token_ids=_eos_tuple(d.get("eos_token_id")),
        name=str(d.get("_name_or_path") or arch),
    )


def load_hf_config(path: str | Path) -> ModelConfig:
    return config_from_hf(json.loads(Path(path).read_text()))
