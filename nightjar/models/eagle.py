"""EAGLE-3-style draft head: one decoder layer of the target's width that reads the target's own
hidden states and drafts over a reduced vocabulary.

Position i of the head takes the fused target features of position i (the residual stream after a
low, a middle and a high layer, standardised per dimension, then ``fc`` [nF*H -> H]) and the embedding
of token x_{i+1} (the target's embedding table, shared and frozen, not part of the head). Its output
state a_i (pre-norm, [H]) predicts x_{i+2} through ``lm_head`` over ``draft_vocab`` ids, which ``d2t``
maps back to target ids. Drafting beyond the committed tokens feeds a_i back in place of the fused
features of the next position (EAGLE-3's training-time test teaches the head that regime).

The head has its own (one-layer) paged KV cache and its own weights: the weight mover moves them like
any draft's. The features of the target come from ``LlamaModel.forward(..., capture=layers)``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from nightjar.models.config import ModelConfig
from nightjar.models.llama import (
    MLP,
    Attention,
    BatchLayout,
    RMSNorm,
    rope_inv_freq,
    set_cpu_fused,
    signed_sin,
    use_cpu_fused,
)

HEAD_FILE, HEAD_CONFIG = "head.safetensors", "head_config.json"


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int                 # the target's width H
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    feature_layers: tuple[int, ...]  # target layers (0-based) whose outputs are fused
    draft_vocab: int                 # Vd: size of the reduced vocabulary
    target_vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 8192
    kind: str = "eagle3-head"

    @classmethod
    def for_target(cls, t: ModelConfig, draft_vocab: int, feature_layers: tuple[int, ...] | None = None):
        """The target's attention/MLP shape; features after layers 1, L/2-1 and L-4 (EAGLE-3's choice)."""
        L = t.num_layers
        layers = feature_layers or tuple(sorted({min(1, L - 1), max(0, L // 2 - 1), max(0, L - 4)}))
        return cls(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_heads=t.num_heads,
                   num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, feature_layers=tuple(layers),
                   draft_vocab=draft_vocab, target_vocab=t.vocab_size, rms_eps=t.rms_eps,
                   rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, max_position=t.max_position)

    def layer_config(self) -> ModelConfig:
        """The ModelConfig of the head's one decoder layer (its vocabulary is the draft vocabulary)."""
        return ModelConfig(vocab_size=self.draft_vocab, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_eps=self.rms_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position=self.max_position, name=self.kind)

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        try:
            d = json.loads(text)
            d["feature_layers"] = tuple(d["feature_layers"])
            return cls(**d)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a draft head config ({type(e).__name__}: {e})") from None


class DraftHead(nn.Module):
    """The head's weights and its forward passes (inference over the paged cache; training in
    nightjar/training/eagle.py uses the same submodules densely)."""

    def __init__(self, hc: HeadConfig):
        super().__init__()
        self.hc, self.cfg = hc, hc.layer_config()
        H, F = hc.hidden_size, hc.feature_size
        self.register_buffer("feat_shift", torch.zeros(F))            # per-dim standardisation of the
        self.register_buffer("feat_scale", torch.ones(F))             # raw features (outlier dims)
        self.fc = nn.Linear(F, H, bias=False)
        self.embed_norm = RMSNorm(H, hc.rms_eps)
        self.feat_norm = RMSNorm(H, hc.rms_eps)
        self.self_attn = Attention(self.cfg, 0)
        c = self.cfg                                                    # q/k/v read [embed | feature]
        self.self_attn.q_proj = nn.Linear(2 * H, c.q_size, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, c.kv_size, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, c.kv_size, bias=False)
        self.post_attention_layernorm = RMSNorm(H, hc.rms_eps)
        self.mlp = MLP(self.cfg)
        self.norm = RMSNorm(H, hc.rms_eps)
        self.lm_head = nn.Linear(H, hc.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.arange(hc.draft_vocab))      # [Vd] draft id -> target id
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype         # (the linear layers may hold quantized codes: models/quant.py)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Raw target features [T, nF*H] -> fused features g [T, H] (the head's dtype)."""
        z = (feats.float() - self.feat_shift) * self.feat_scale
        return self.fc(z.to(self.dtype))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]   # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                    # [T, 1, d]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def block(self, emb: torch.Tensor, g: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer: emb [T, H] (token x_{i+1}), g [T, H] (features of i) -> a [T, H].
        ``attend(x2)`` runs attention on the normed [T, 2H] input (paged or dense)."""
        x2 = torch.cat((self.embed_norm(emb), self.feat_norm(g)), dim=-1)        # [T, 2H]
        x = g + attend(x2)
        return x + self.mlp(self.post_attention_layernorm(x))

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """a [N, H] -> draft-vocabulary logits [N, Vd] fp32."""
        return self.lm_head(self.norm(a)).float()

    @torch.inference_mode()
    def forward(self, lay: BatchLayout, cache, emb: torch.Tensor, g: torch.Tensor):
        """Paged inference: emb/g [T, H] for the layout's tokens -> (a [T, H], logits [N, Vd] fp32 of
        ``lay.logits_index`` rows)."""
        cos, sin = self.rope(lay.positions)
        sin = signed_sin(sin)                                     # the form Attention.forward takes
        a = self.block(emb, g, lambda x2: self.self_attn(x2, cos, sin, lay, cache))
        return a, self.logits(a[lay.logits_index])

    def fuse_projections(self) -> DraftHead:
        self.self_attn.fuse()
        self.mlp.fuse()
        return self

    def select_kernels(self, cpu_fused: bool | None = None) -> bool:
        """The fused CPU ops for inference where they build (``LlamaModel.select_kernels``); returns them on."""
        on = use_cpu_fused(self.device, self.dtype) if cpu_fused is None else cpu_fused
        set_cpu_fused(self, on)
        return on

    def pack_cpu_weights(self, mirror: bool = True) -> bool:
        from nightjar.models.cpu_linear import pack_linears, packing_available

        if not packing_available(self.dtype, self.device):
            return False
        pack_linears(self, mirror=mirror)
        return True

    def weight_bytes(self) -> int:
        from nightjar.models.cpu_linear import packed_bytes

        own = sum(p.numel() * p.element_size() for p in self.parameters())
        return own + sum(b.numel() * b.element_size() for b in self.buffers()) + packed_bytes(self)

    @cached_property
    def d2t_ascending(self) -> bool:
        """Whether ``d2t`` is sorted by target id (training makes it so): the draft vocabulary's first maximum is
        then the full vocabulary's, so greedy drafting may take its argmax without expanding the logits."""
        return bool((self.d2t[1:] > self.d2t[:-1]).all())

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (any shape)."""
        return self.d2t[draft_ids]


def save_head(head: DraftHead, directory: Path, card: str | None = None) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / HEAD_CONFIG).write_text(head.hc.to_json())
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(directory / HEAD_FILE))
    if card is not None:
        (directory / "README.md").write_text(card)


def is_head(model) -> bool:
    """Whether a loaded draft is a DraftHead (not an independent Llama draft)."""
    return isinstance(model, DraftHead)


def is_head_dir(path: Path) -> bool:
    return (Path(path) / HEAD_CONFIG).exists()


def load_head(directory: Path, target: ModelConfig, dtype: torch.dtype, device="cpu") -> DraftHead:
    """A saved head, checked against the target it drafts for; weights in ``dtype`` (buffers keep
    theirs: fp32 standardisation, int64 ids)."""
    from safetensors.torch import load_file

    hc = HeadConfig.from_json((Path(directory) / HEAD_CONFIG).read_text())
    if hc.target_vocab != target.vocab_size or hc.hidden_size != target.hidden_size:
        raise ValueError(f"draft head {directory}: made for vocab {hc.target_vocab} / width {hc.hidden_size}, "
                         f"the target has {target.vocab_size} / {target.hidden_size}")
    if max(hc.feature_layers) >= target.num_layers:
        raise ValueError(f"draft head {directory}: reads layer {max(hc.feature_layers)}, "
                         f"the target has {target.num_layers}")
    head = DraftHead(hc)
    head.load_state_dict(load_file(str(Path(directory) / HEAD_FILE)))
    for name, p in head.named_parameters():
        p.data = p.data.to(device=device, dtype=dtype)
    for name, b in head.named_buffers():
        b.data = b.data.to(device=device)
    return head.eval()
