"""Shared fixtures: the real SmolLM2 (pulled by `make test`), tiny random models that share its
tokenizer, and engine factories. fp32 wherever exactness is asserted."""
from __future__ import annotations

import copy

import pytest
import torch

from nightjar.models import LlamaModel, LoadedModel, load_model
from nightjar.models.config import ModelConfig


@pytest.fixture(scope="session")
def smollm2_path():
    from nightjar.models import hub

    return hub.pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path) -> LoadedModel:
    return load_model(smollm2_path, "float32")


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_path):
    from gguf import GGUFReader

    from nightjar.models.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFReader(str(smollm2_path)))


def tiny_config(vocab: int = 49152, hidden: int = 64, layers: int = 2, heads: int = 4, kv: int = 2,
                eos=(2,)) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, rope_theta=10000.0,
                       max_position=4096, tie_embeddings=True, bos_token_id=1, eos_token_ids=eos, name="tiny")


def random_model(cfg: ModelConfig, seed: int, std: float = 0.5, dtype=torch.float32) -> LlamaModel:
    g = torch.Generator().manual_seed(seed)
    m = LlamaModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (std if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return m.to(dtype).eval()


def perturbed(model: LlamaModel, noise: float, seed: int) -> LlamaModel:
    """A copy of ``model`` with Gaussian noise added: a draft that agrees with it often, not always."""
    g = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            noise_cpu = torch.randn(p.shape, generator=g)                 # the same draws on any device
            p.add_(noise_cpu.to(p.device) * noise * p.std().clamp_min(1e-3))
    return m.eval()


@pytest.fixture(scope="session")
def tiny_pair(smol_tokenizer) -> tuple[LoadedModel, LoadedModel]:
    """A tiny random target with SmolLM2's tokenizer, and a perturbed copy of it as the draft."""
    cfg = tiny_config(eos=smol_tokenizer.eos_token_ids)
    target = random_model(cfg, seed=1)
    draft = perturbed(target, 0.02, 2)
    for m in (target, draft):          # as the engine serves a loaded model: fused projections, CPU fused ops
        m.fuse_projections().select_kernels()
    return LoadedModel(target, smol_tokenizer, "tiny"), LoadedModel(draft, None, "tiny-draft")


@pytest.fixture
def make_engine(tiny_pair):
    """Factory for engines on the tiny pair (fp32); extra kwargs go to Engine."""
    from nightjar.engine import Engine

    def make(policy: str = "off", pair=None, **kw) -> Engine:
        target, draft = pair or tiny_pair
        kw.setdefault("dtype", "float32")
        return Engine(policy=policy, loaded=(target, draft), **kw)
    return make
