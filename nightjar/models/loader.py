"""Weight loaders: GGUF (via the ``gguf`` package) and HF safetensors directories (single or sharded)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from nightjar.models.config import ModelConfig, config_from_hf, load_hf_config
from nightjar.models.llama import LlamaModel, rope_inv_freq

log = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        return f"layers.{m[1]}.{_GGUF_LAYER_NAMES[m[2]]}.{m[3]}"
    base, _, kind = name.rpartition(".")
    if base not in _GGUF_TOP_NAMES:
        raise KeyError(f"unknown GGUF tensor {name!r}")
    return f"{_GGUF_TOP_NAMES[base]}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (GGUF -> HF layout). w [rows, cols]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture", "llama")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (Llama family only)")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    scaling = None
    if g("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))),
        hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")), num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position=int(g("context_length", 2048)), tie_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (), name=str(_field(reader, "general.name", "gguf")),
    )


def dequantize_tensor(t) -> np.ndarray:
    """Any GGUF tensor (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K/...) -> float32 [rows, cols]."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if t.tensor_type == Q.F32:
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        arr = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
    return arr.reshape([int(x) for x in reversed(t.shape)])


def read_gguf_state(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    """Config, HF-named fp32 state dict and the open reader of a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    state = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        w = dequantize_tensor(t)
        if ".q_proj." in name:
            w = unpermute_qk(w, cfg.num_heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, cfg.num_kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return cfg, state, reader


def read_safetensors_state(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (``model.`` prefix stripped) from an HF checkpoint directory."""
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = load_hf_config(d / "config.json")
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    state = {}
    for f in files:
        for k, v in load_file(str(d / f)).items():
            state[k.removeprefix("model.")] = v
    return cfg, state


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = "cpu", fuse: bool = True) -> LlamaModel:
    """A model from an HF-named state dict; ``fuse`` merges q/k/v and gate/up after loading."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    if cfg.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    model.inv_freq = rope_inv_freq(cfg)
    model = model.to(device).eval()
    if fuse:
        model.fuse_projections()
    model.select_kernels()
    return model


def load_weights(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> LlamaModel:
    """A model from a ``.gguf`` file or an HF checkpoint directory."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        cfg, state, _ = read_gguf_state(p)
    elif p.is_dir() and (p / "config.json").exists():
        cfg, state = read_safetensors_state(p)
    else:
        raise FileNotFoundError(f"{p} is neither a .gguf file nor a directory with config.json")
    return build_model(cfg, state, dtype, device)


__all__ = ["load_weights", "read_gguf_state", "read_safetensors_state", "build_model", "config_from_hf"]
