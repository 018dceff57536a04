"""Fused q/k/v + gate/up projections and oneDNN-packed CPU weights compute what the plain model does."""
from __future__ import annotations

import asyncio

import pytest
import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models import load_draft, load_model
from nightjar.models.cpu_linear import (
    ONEDNN,
    MirroredPackedLinear,
    PackedLinear,
    cpu_format,
    gemm_rows,
    packing_available,
)
from nightjar.models.llama import build_layout
from nightjar.models.loader import build_model, load_weights, read_safetensors_state
from tests.models.test_llama_parity import Runner, hf_logits, save_hf_llama

PACKING = packing_available(torch.bfloat16, torch.device("cpu"))   # oneDNN's layout, else bf16 panels
ONEDNN_HERE = cpu_format(torch.bfloat16, torch.device("cpu")) is ONEDNN


def _runs(model, seqs):
    """Prefill every sequence, then one decode and one 4-token verify chunk -> list of logits."""
    r = Runner(model, block_size=4, num_blocks=96)
    c = model.cfg
    r.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 4, 96, model.dtype)
    out = [r.run({i: (s[:-5], 0) for i, s in enumerate(seqs)}, {i: 1 for i in range(len(seqs))})]
    n = [len(s) - 5 for s in seqs]
    out.append(r.run({i: (s[n[i]: n[i] + 1], n[i]) for i, s in enumerate(seqs)}, {i: 1 for i in range(len(seqs))}))
    out.append(r.run({i: (s[n[i] + 1:], n[i] + 1) for i, s in enumerate(seqs)}, {i: 4 for i in range(len(seqs))}))
    return out


def _seqs(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (12, 20, 9)]


def test_loaded_models_are_fused_and_keep_hf_names_in_the_checkpoint(tmp_path):
    save_hf_llama(tmp_path)
    model = load_weights(tmp_path, torch.float32)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    assert mlp.gate_up_proj is not None and not hasattr(mlp, "up_proj")
    c = model.cfg
    assert attn.qkv_proj.weight.shape == (c.q_size + 2 * c.kv_size, c.hidden_size)


def test_fused_fp32_logits_equal_the_unfused_model_and_hf(tmp_path):
    hf = save_hf_llama(tmp_path, tie=True)
    cfg, state = read_safetensors_state(tmp_path)
    fused = build_model(cfg, dict(state), torch.float32)
    plain = build_model(cfg, dict(state), torch.float32, fuse=False)
    assert plain.layers[0].self_attn.qkv_proj is None
    seqs = _seqs()
    for a, b in zip(_runs(fused, seqs), _runs(plain, seqs)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    # the verify chunk of sequence 0 against HF: logits of its last 4 tokens
    assert torch.allclose(_runs(fused, seqs[:1])[2], hf_logits(hf, seqs[0])[-4:], atol=1e-4)


def test_fusion_is_idempotent_and_changes_no_weight_bytes(tmp_path):
    save_hf_llama(tmp_path)
    cfg, state = read_safetensors_state(tmp_path)
    plain = build_model(cfg, dict(state), torch.float32, fuse=False)
    before = plain.weight_bytes()
    plain.fuse_projections().fuse_projections()
    assert plain.weight_bytes() == before


@pytest.mark.skipif(not PACKING, reason="no packed bf16 layout on this CPU")
def test_packed_bf16_model_matches_the_unpacked_one(tmp_path):
    save_hf_llama(tmp_path, tie=True)
    cfg, state = read_safetensors_state(tmp_path)
    plain = build_model(cfg, dict(state), torch.bfloat16)
    packed = build_model(cfg, dict(state), torch.bfloat16)
    assert packed.pack_cpu_weights()
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.layers[1].mlp.down_proj, PackedLinear)
    assert packed.embed_tokens.weight is not None              # the tied embedding stays a plain tensor
    seqs = _seqs(7)
    for a, b in zip(_runs(packed, seqs), _runs(plain, seqs)):
        # bf16 with different accumulation orders: compare against the logits' own scale
        assert (a - b).abs().max() <= 0.03 * b.abs().max()
    # the packed LM head is an extra copy of the tied embedding, and it is counted
    lm = packed.lm_head
    assert packed.weight_bytes() == plain.weight_bytes() + lm.nbytes
    assert torch.equal(lm.dense_weight(), plain.lm_head.weight)


@pytest.mark.skipif(not PACKING, reason="no packed bf16 layout on this CPU")
def test_a_target_is_packed_but_a_draft_and_fp32_models_are_not(tmp_path):
    save_hf_llama(tmp_path)
    packed = lambda m: any(isinstance(x, PackedLinear) for x in m.modules())  # noqa: E731
    target = load_model(tmp_path, "bfloat16")
    assert packed(target.model)
    assert not packed(load_draft(tmp_path, target.config, "bfloat16").model)   # the weight mover moves it
    assert not packed(load_model(tmp_path, "float32").model)


@pytest.mark.skipif(not PACKING, reason="no packed bf16 layout on this CPU")
def test_packed_linear_rows_do_not_depend_on_the_batch():
    """A row's output is the same whether it runs alone or among 8 rows (decode vs verify shapes)."""
    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    lin = PackedLinear(w)
    x = torch.randn(8, 64).bfloat16()
    together = lin(x)                                           # [8, 96]
    alone = torch.cat([lin(x[i: i + 1]) for i in range(8)])     # [8, 96]
    assert torch.equal(together, alone)
    ref = x.float() @ w.float().T
    assert (together.float() - ref).abs().max() <= 0.01 * ref.abs().max()


def test_gemm_rows_rounds_row_counts_to_few_shapes():
    assert [gemm_rows(m) for m in (1, 3, 4, 16, 17, 32, 33, 250, 257, 300)] == [4, 4, 4, 16, 32, 32, 48, 256, 320, 320]
    assert len({gemm_rows(m) for m in range(1, 1025)}) == 13 + 15 + 12


@pytest.mark.skipif(not PACKING, reason="no packed bf16 layout on this CPU")
def test_a_draft_layer_pads_its_rows_and_returns_exactly_the_rows_asked():
    """MirroredPackedLinear runs ``gemm_rows`` rows (zeros after the inputs'): each row's output is the one it
    gets alone (rows are independent), for 2-D and 3-D inputs."""
    torch.manual_seed(1)
    w = torch.randn(96, 64).bfloat16()
    lin = MirroredPackedLinear(torch.nn.Parameter(w, requires_grad=False))
    x = torch.randn(37, 64).bfloat16()
    with torch.inference_mode():
        out = lin(x)                                                                   # 48 rows run
        assert out.shape == (37, 96)
        assert torch.equal(out[:5], lin(x[:5]))                                         # 16 rows run
        assert torch.equal(lin(x[:36].view(3, 12, 64)), out[:36].view(3, 12, 96))
    ref = x.float() @ w.float().T
    assert (out.float() - ref).abs().max() <= 0.01 * ref.abs().max()


@pytest.mark.skipif(not PACKING, reason="no packed bf16 layout on this CPU")
async def test_a_mirrored_packed_draft_survives_release_and_reload_exactly():
    """The draft keeps plain weights (the mover moves them) and a packed copy that release frees and
    a reload rebuilds: same logits after the cycle, and release reports the packed bytes too."""
    from nightjar.actors.weights import DraftSlot
    from nightjar.transfer.weights import DraftTransfer, release_draft
    from tests.conftest import random_model, tiny_config
    from tests.transfer.test_transfer import BLOCK, logits_of, offload, reload

    cfg = tiny_config(vocab=96, hidden=32, layers=2, heads=4, kv=2, eos=())
    model = random_model(cfg, seed=5).to(torch.bfloat16).fuse_projections()
    assert model.pack_cpu_weights(mirror=True)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, 6, torch.bfloat16)
    slot = DraftSlot(model, cache, torch.device("cpu"))
    before, held = logits_of(slot), model.weight_bytes()
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held > plain                                          # plain weights + packed copies
    tr = DraftTransfer(asyncio.get_running_loop())
    host, _, _ = await offload(tr, slot)
    freed = release_draft(slot)
    assert model.weight_bytes() == 0 and freed == held + cache_bytes(host)
    await reload(tr, slot, host)
    assert model.weight_bytes() == held
    assert torch.equal(logits_of(slot), before)
    tr.shutdown()


def cache_bytes(host) -> int:
    return sum(t.numel() * t.element_size() for t in host.kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_rope_gives_the_rotate_half_numbers_exactly(dtype):
    """The forward's rope (sign folded into the sine, a roll for rotate-half) equals HF's formula bit for bit."""
    from nightjar.models.llama import apply_rope, apply_rope_signed, signed_sin

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 64, generator=g).to(dtype)                               # [T, heads, d]
    ang = torch.rand(7, 1, 64, generator=g) * 6.0
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    assert torch.equal(apply_rope_signed(x, cos, signed_sin(sin)), apply_rope(x, cos, sin))


@pytest.mark.skipif(not ONEDNN_HERE, reason="no oneDNN bf16 kernels on this CPU (bf16 panels do not pad)")
def test_forwards_of_few_tokens_are_padded_and_compute_the_same_logits(tmp_path):
    """A packed model pads forwards of 1-3 tokens (and LM heads of 1-3 rows) with zero rows: the logits
    and the captured features are those of the unpadded forward, bit for bit (packed rows do not depend
    on the batch, test above); fp32 models do not pad."""
    from nightjar.models.cpu_linear import PACKED_MIN_ROWS

    save_hf_llama(tmp_path, tie=True)
    cfg, state = read_safetensors_state(tmp_path)
    padded, plain = (build_model(cfg, dict(state), torch.bfloat16) for _ in range(2))
    for m in (padded, plain):
        assert m.pack_cpu_weights()
        m.select_kernels()
    assert padded.gemm_min_rows == padded.head_min_rows == PACKED_MIN_ROWS
    plain.gemm_min_rows = plain.head_min_rows = 0
    assert build_model(cfg, dict(state), torch.float32).gemm_min_rows == 0
    seqs = _seqs(11)[:1]
    for a, b in zip(_runs(padded, seqs), _runs(plain, seqs)):      # prefill, 1-token decode, 4-token verify
        assert torch.equal(a, b)
    calls = []
    down = padded.layers[0].mlp.down_proj
    inner = down.forward
    down.forward = lambda x: calls.append(x.shape[0]) or inner(x)     # the fused path calls .forward itself
    outs = []
    for m in (padded, plain):
        r = Runner(m, block_size=4, num_blocks=96)
        r.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 96, torch.bfloat16)
        r.run({0: (seqs[0][:6], 0)}, {0: 1})
        r.alloc.reserve(0, 8)
        lay = build_layout([seqs[0][6:8]], [6], [r.alloc.block_table(0)], 4, [2])
        outs.append(m(lay, r.cache, capture=(0, 1)))               # a 2-token verify chunk, features kept
    assert calls[-1] == PACKED_MIN_ROWS
    (la, fa), (lb, fb) = outs
    assert fa.shape == (2, 2 * cfg.hidden_size) and torch.equal(fa, fb) and torch.equal(la, lb)


def test_cpu_format_takes_onednn_where_it_has_bf16_kernels_else_bf16_panels(monkeypatch):
    """oneDNN's layout on AVX512-bf16/AMX CPUs, 16-column panels for the fused bf16_linear elsewhere (AVX2), nothing
    for fp32 models or off the CPU; a packed target pads its forwards only in oneDNN's layout."""
    from nightjar.models import cpu_fused
    from nightjar.models.cpu_linear import PANELS
    from tests.conftest import random_model, tiny_config

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert cpu_format(torch.float32, cpu) is None and cpu_format(bf16, torch.device("meta")) is None
    if not cpu_fused.available():
        pytest.skip("the fused CPU ops do not build here")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu_format(bf16, cpu) is PANELS and PANELS.min_rows == 0
    model = random_model(tiny_config(vocab=96, hidden=64), seed=3, dtype=bf16).fuse_projections()
    assert model.pack_cpu_weights() and model.gemm_min_rows == model.head_min_rows == 0
    assert all(m.fmt is PANELS for m in model.modules() if isinstance(m, PackedLinear))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_format(bf16, cpu) is ONEDNN
