"""Weight-only quantization (models/quant.py): the packed int8/int4 CPU kernels against a
dequantize-then-matmul reference, int4 codes equal to a Q4_1 GGUF's own blocks, the model pass, a
quantized draft through offload -> release -> reload, and every policy greedy-exact with a quantized
target (fp32 activations: the packed kernels take fp32, bf16 and fp16 alike)."""
from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

import nightjar.models.quant as quant
from nightjar.models import LoadedModel, cpu_fused
from nightjar.models.cpu_linear import ONEDNN, cpu_format
from nightjar.models.quant import QuantHead, QuantLinear, quantize_int4, quantize_model
from nightjar.sampling import SamplingParams
from tests.conftest import perturbed, random_model, tiny_config

SHAPES = [(64, 64), (96, 128), (48, 64), (160, 96)]     # out % 64 != 0 exercises the packer's tail layout


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernels_match_dequantize_then_matmul(mode, dtype):
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in SHAPES:
        lin = QuantLinear.from_weight(torch.randn(out_f, in_f, generator=g).to(dtype), mode)
        w = lin.dequantize().float()                                   # [out, in]
        for rows in (1, 5, quant.PACKED_MAX_ROWS[mode] + 7):           # packed kernel, and the GEMM path
            x = torch.randn(2, rows, in_f, generator=g).to(dtype)
            got = lin(x)
            assert got.shape == (2, rows, out_f) and got.dtype == dtype
            ref = x.float() @ w.T
            tol = 1e-5 if dtype == torch.float32 else 1e-2             # bf16: the output's own rounding
            assert torch.allclose(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (out_f, in_f, rows)


def test_quantization_error_is_bounded_by_one_step():
    """int8: half a step of max|row|/127; int4: at most one step of max|group|*2/15 (the symmetric
    scheme may clip its positive side by one step)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    err8 = (QuantLinear.from_weight(w, "int8").dequantize() - w).abs()
    assert (err8 <= w.abs().amax(1, keepdim=True) / 254 + 1e-6).all()
    err4 = (QuantLinear.from_weight(w, "int4").dequantize() - w).abs().view(64, 4, 32)
    assert (err4 <= w.abs().view(64, 4, 32).amax(-1, keepdim=True) * 2 / 15 + 1e-6).all()
    assert err4.mean() < 0.1 * w.abs().mean()


def test_int4_unpacking_inverts_the_cpu_packer():
    g = torch.Generator().manual_seed(2)
    for out_f, in_f in SHAPES:
        codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        assert torch.equal(quant.unpack_int4(packed, out_f, in_f).to(torch.int32), codes)
    # torch packs blocks of 64 rows with its AVX-512 kernels, 32 on AVX2; the fused int4 ops read 4 x their lanes
    assert quant.int4_block() in (32, 64)
    layer = QuantLinear.from_weight(torch.randn(64, 64, generator=g), "int4")
    assert layer.fused_int4 == (cpu_fused.available() and quant.int4_block() == 4 * cpu_fused.lanes())
    if cpu_fused.available():
        assert cpu_fused.lanes() in (8, 16)
    assert torch.allclose(layer.weight_t(torch.float32), layer.dequantize().t(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_int4_unpack_gives_the_torch_unpack_bit_for_bit(monkeypatch, dtype):
    """QuantLinear.weight_t (W^T for a long chunk's GEMM) through the fused CPU op and through torch ops."""
    from nightjar.models import cpu_fused

    if not cpu_fused.available():
        pytest.skip("the fused CPU ops did not build here")
    g = torch.Generator().manual_seed(4)
    for out_f, in_f in [(64, 64), (192, 128), (128, 96)]:
        lin = QuantLinear.from_weight(torch.randn(out_f, in_f, generator=g).to(dtype), "int4", 32)
        fused = lin.weight_t(dtype)
        monkeypatch.setenv("NIGHTJAR_CPU_FUSED", "0")           # available() is False: the torch unpack
        ref = lin.weight_t(dtype)
        monkeypatch.undo()
        assert fused.shape == (in_f, out_f) and torch.equal(fused, ref)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.nightjar_cpu.int4_weight_t(lin.qweight, lin.scales, 16)


def test_int4_keeps_q4_0_style_codes_exactly():
    """Weights (q - 8) * d per 32-group, as GGUF Q4_0 stores them, come back with the same codes."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(1, 16, (32, 64), generator=g)
    q[:, ::32] = 0                                                     # Q4_0: the largest magnitude is -8d
    d = torch.rand(32, 2, generator=g).repeat_interleave(32, 1) + 0.1
    codes, _ = quantize_int4((q - 8) * d, 32)
    assert torch.equal(codes.long(), q)


def test_int4_reproduces_the_codes_of_a_q4_1_gguf(smollm2_path):
    from gguf import GGUFReader

    from nightjar.models.loader import dequantize_tensor

    tensors = {t.name: t for t in GGUFReader(str(smollm2_path)).tensors}
    for name in ("blk.0.ffn_down.weight", "blk.7.attn_v.weight"):
        t = tensors[name]
        if t.tensor_type.name != "Q4_1":
            pytest.skip(f"{name} is {t.tensor_type.name}, not Q4_1")
        blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, 20)    # [rows, blocks, (d, m, 16 B)]
        qs = blocks[..., 4:]
        raw = np.concatenate((qs & 15, qs >> 4), -1).reshape(t.data.shape[0], -1)   # [rows, cols]
        codes, _ = quantize_int4(torch.from_numpy(dequantize_tensor(t).copy()), 32)
        assert np.array_equal(codes.numpy(), raw), name


def quantized(model, mode):
    m = copy.deepcopy(model)
    quantize_model(m, mode)
    return m


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_the_pass_replaces_every_layer_linear_and_weight_bytes_shrinks(mode):
    model = random_model(tiny_config(vocab=96, hidden=64), seed=4)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.layers.modules())
    before = model.weight_bytes()
    q = quantized(model, mode)
    assert sum(isinstance(m, QuantLinear) for m in q.layers.modules()) == n_linear
    assert not any(type(m) is torch.nn.Linear for m in q.layers.modules())
    layer_bytes = sum(m.weight.numel() * 4 for m in model.layers.modules() if type(m) is torch.nn.Linear)
    qbytes = sum(m.nbytes for m in q.modules() if isinstance(m, QuantLinear))
    head = q.lm_head
    if cpu_fused.available():                          # an int8 copy beside the embedding table it was tied to
        assert isinstance(head, QuantHead) and head.qweight.dtype == torch.int8 and head.scales.dtype == torch.float32
        assert q.embed_tokens.weight.dtype == torch.float32
        assert q.weight_bytes() == before - layer_bytes + qbytes + head.nbytes
    else:                                              # no int8_linear here: the head stays tied, unquantized
        assert head.weight is q.embed_tokens.weight
        assert q.weight_bytes() == before - layer_bytes + qbytes
    assert qbytes < layer_bytes / (3 if mode == "int8" else 4)
    assert all(not p.requires_grad for m in q.modules() if isinstance(m, QuantLinear) for p in m.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_head_gives_the_logits_of_its_dequantized_weight(monkeypatch, dtype):
    if not cpu_fused.available():
        pytest.skip("no fused CPU ops: the head stays unquantized")
    model = random_model(tiny_config(vocab=96, hidden=64), seed=5)
    w = model.lm_head.weight.detach().clone()
    head = QuantHead.from_weight(w)
    step = head.scales[:, None] / 2                                    # half a code step per row
    assert ((head.dequantize() - w).abs() <= step * 1.0001).all()
    x = torch.randn(2, 3, 64).to(dtype)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 96)
    ref = x.double() @ head.dequantize().double().T
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    monkeypatch.setattr(cpu_fused, "available", lambda: False)       # the torch fallback: the same numbers
    assert torch.allclose(head(x), got, rtol=1e-5, atol=1e-5)


async def test_a_quantized_draft_round_trips_offload_release_reload_exactly():
    from tests.transfer.test_transfer import logits_of, make_slot, round_trip, snapshot

    slot = make_slot()
    quantize_model(slot.model, "int4")
    before = logits_of(slot)
    weights, kv = snapshot(slot)
    nbytes, kv_bytes = slot.model.weight_bytes(), slot.cache.nbytes
    assert await round_trip(slot) == nbytes + kv_bytes
    got = dict(slot.model.named_parameters())
    assert any(p.dtype == torch.uint8 for p in got.values())
    for name, w in weights.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    assert slot.model.weight_bytes() == nbytes
    assert torch.equal(logits_of(slot), before)


POLICIES = ["off", "fixed:1", "fixed:2", "fixed:3", "fixed:4", "nightjar"]


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_every_policy_is_greedy_exact_with_a_quantized_target(make_engine, smol_tokenizer, mode):
    from tests.test_engine import generate_with, prompts_of_mixed_length

    cfg = tiny_config(eos=smol_tokenizer.eos_token_ids)
    base = random_model(cfg, seed=1)
    target = LoadedModel(quantized(base, mode), smol_tokenizer, f"tiny-{mode}")
    draft = LoadedModel(quantized(perturbed(base, 0.02, 2), mode), None, f"tiny-draft-{mode}")
    prompts = prompts_of_mixed_length(smol_tokenizer, n=12)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref, _ = generate_with(make_engine, "off", prompts, params, pair=(target, draft), max_num_seqs=1)
    for policy in POLICIES:
        for bs in (1, 7):
            got, stats = generate_with(make_engine, policy, prompts, params, pair=(target, draft),
                                       max_num_seqs=bs, gamma_max=4)
            assert got == ref, (mode, policy, bs)
            if policy.startswith("fixed"):
                assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_bad_or_unsupported_quantization_is_a_config_error(monkeypatch):
    from nightjar.config_check import check_config
    from nightjar.kernel.config import EngineConfig
    from nightjar.sampling import ConfigError

    with pytest.raises(ConfigError, match="choose from none, int8, int4") as e:
        check_config(EngineConfig(quantization="int3"), models=False)
    assert e.value.flag == "--quantization"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="CPU only") as e:
        check_config(EngineConfig(device="cuda", draft_quantization="int4"), models=False)
    assert e.value.flag == "--draft-quantization"
    check_config(EngineConfig(device="cuda"), models=False)           # none on CUDA is fine


def test_generate_with_int4_runs_the_q4_1_file_as_the_fp32_model_does(capsys, smollm2_fp32):
    """int4 keeps the file's codes: with fp32 activations its greedy answer is the unquantized fp32
    model's (the bf16 model ties its top two first tokens on this prompt: a bf16 answer would not do)."""
    import json

    from nightjar.cli import main
    from nightjar.engine import Engine, _collect

    prompt = "What is the capital of Italy?"
    assert main(["generate", prompt, "--quantization", "int4", "--dtype", "float32", "--policy", "off",
                 "--draft", "none", "--max-tokens", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]

    async def reference():
        async with Engine(policy="off", loaded=(smollm2_fp32, None), dtype="float32") as eng:
            return (await _collect(eng, [{"role": "user", "content": prompt}], SamplingParams(max_tokens=8))).token_ids
    assert got == asyncio.run(reference())


def test_the_pass_quantizes_onednn_packed_layers_too():
    from nightjar.models.cpu_linear import packing_available

    model = random_model(tiny_config(vocab=96, hidden=64), seed=6, dtype=torch.bfloat16).fuse_projections()
    if not model.pack_cpu_weights(mirror=True):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    assert packing_available(model.dtype, model.device)
    n = sum(1 for m in model.layers.modules() if hasattr(m, "packed"))
    assert quantize_model(model, "int4") == n > 0
    assert not any(hasattr(m, "packed") for m in model.layers.modules())


# ---- mixed: a bf16 draft's int8 copies for calls of few rows (models/quant.py RowSplitLinear) -------------
ONEDNN_HERE = cpu_format(torch.bfloat16, torch.device("cpu")) is ONEDNN


@pytest.mark.skipif(not cpu_fused.available(), reason="the fused CPU ops do not build here")
def test_mix_int8_leaves_layers_in_bf16_panels_alone():
    """Off AVX512-bf16 CPUs a draft's layers are bf16 panels, faster than torch's int8 kernel at 1-3 rows."""
    from nightjar.models.cpu_linear import PANELS, MirroredPackedLinear, pack_linears
    from nightjar.models.quant import mix_int8

    model = random_model(tiny_config(vocab=96, hidden=64), seed=6, dtype=torch.bfloat16).fuse_projections()
    assert pack_linears(model, mirror=True, fmt=PANELS) > 0
    assert mix_int8(model) == 0
    assert isinstance(model.layers[0].mlp.down_proj, MirroredPackedLinear)


def mixed_model(seed: int = 6, hidden: int = 64):
    """A bf16 tiny model, fused and oneDNN-packed as a draft is (mirrored), then mixed; skips without oneDNN."""
    from nightjar.models.quant import mix_int8

    model = random_model(tiny_config(vocab=96, hidden=hidden), seed=seed, dtype=torch.bfloat16).fuse_projections()
    if not (ONEDNN_HERE and model.pack_cpu_weights(mirror=True)):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    packed, before = sum(1 for m in model.modules() if hasattr(m, "packed")), model.weight_bytes()
    return model, mix_int8(model), packed, before


def test_a_mixed_draft_serves_calls_of_few_rows_from_int8_copies_and_larger_ones_in_bf16():
    from nightjar.models.quant import MIXED_MAX_ROWS, RowSplitLinear

    model, n, packed, before = mixed_model()
    split = [m for m in model.modules() if isinstance(m, RowSplitLinear)]
    assert n == len(split) == packed - (0 if cpu_fused.available() or not hasattr(model.lm_head, "packed") else 1)
    assert isinstance(model.lm_head, RowSplitLinear) == cpu_fused.available()
    assert all(isinstance(m.small, QuantHead if m is model.lm_head else QuantLinear) for m in split)
    assert all(m.small.mode == "int8" for m in split if isinstance(m.small, QuantLinear))
    assert model.weight_bytes() > before                       # the int8 copies beside the bf16 weights
    g = torch.Generator().manual_seed(0)
    for m in split:
        for rows in (1, MIXED_MAX_ROWS, MIXED_MAX_ROWS + 1, 16):
            x = torch.randn(rows, m.in_features, generator=g).to(torch.bfloat16)
            assert torch.equal(m(x), (m.small if rows <= MIXED_MAX_ROWS else m.large)(x)), (m, rows)
        x = torch.randn(2, m.in_features, generator=g).to(torch.bfloat16)
        small, large = m.small(x).float(), m.large(x).float()
        assert (small - large).abs().max() <= 0.05 * large.abs().max()       # int8's error, not another layer


def test_mixed_is_a_draft_s_quantization_and_the_default_beside_an_unquantized_target(smollm2_path):
    from nightjar.config_check import check_config
    from nightjar.kernel.config import EngineConfig
    from nightjar.models.quant import draft_mode, load_quantized
    from nightjar.sampling import ConfigError

    assert draft_mode("none", None) == "mixed" and draft_mode("int4", None) == "int4"
    assert draft_mode("none", "none") == "none" and draft_mode("int8", "mixed") == "mixed"
    check_config(EngineConfig(draft_quantization="mixed"), models=False)
    with pytest.raises(ConfigError, match="choose from none, int8, int4, w4a8; got 'mixed'") as e:
        check_config(EngineConfig(quantization="mixed"), models=False)
    assert e.value.flag == "--quantization"
    with pytest.raises(ValueError, match="a draft's quantization"):
        load_quantized(smollm2_path, "bfloat16", "cpu", "mixed")


async def test_a_mixed_draft_round_trips_offload_release_reload_exactly():
    from nightjar.actors.weights import DraftSlot
    from nightjar.kvpool.cache import KVCache
    from tests.transfer.test_transfer import BLOCK, logits_of, round_trip, snapshot

    model, _, _, _ = mixed_model(seed=5, hidden=32)
    c = tiny_config(vocab=96, hidden=32)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, 6, torch.bfloat16, "cpu")
    slot = DraftSlot(model, cache, torch.device("cpu"))
    before = logits_of(slot)
    weights, _ = snapshot(slot)
    nbytes = slot.model.weight_bytes()
    assert await round_trip(slot) == nbytes + cache.nbytes
    got = dict(slot.model.named_parameters())
    assert any(p.dtype == torch.int8 for p in got.values()) and any(p.dtype == torch.bfloat16 for p in got.values())
    for name, w in weights.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    assert slot.model.weight_bytes() == nbytes                  # the packed bf16 copies rebuilt
    assert torch.equal(logits_of(slot), before)


def _bf16_pair(smol_tokenizer):
    cfg = tiny_config(eos=smol_tokenizer.eos_token_ids)
    base = random_model(cfg, seed=1, dtype=torch.bfloat16).fuse_projections()
    return base, perturbed(base, 0.02, 2)


def _greedy_exact_across_policies(make_engine, smol_tokenizer, base, draft) -> None:
    """Every policy emits off's tokens with this bf16 target and draft, at one row and at seven."""
    from tests.test_engine import generate_with, prompts_of_mixed_length

    target, draft = LoadedModel(base, smol_tokenizer, "tiny-bf16"), LoadedModel(draft, None, "tiny-draft-bf16")
    prompts = prompts_of_mixed_length(smol_tokenizer, n=12)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(pair=(target, draft), dtype="bfloat16")
    ref, _ = generate_with(make_engine, "off", prompts, params, max_num_seqs=1, **kw)
    for policy in POLICIES:
        for bs in (1, 7):
            got, stats = generate_with(make_engine, policy, prompts, params, max_num_seqs=bs, gamma_max=4, **kw)
            assert got == ref, (policy, bs)
            if policy.startswith("fixed"):
                assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_every_policy_is_greedy_exact_with_a_mixed_draft(make_engine, smol_tokenizer):
    """A bf16 target and a mixed bf16 draft (oneDNN-packed layers with int8 copies)."""
    from nightjar.models.quant import mix_int8

    base, draft = _bf16_pair(smol_tokenizer)
    if not (ONEDNN_HERE and base.pack_cpu_weights() and draft.pack_cpu_weights(mirror=True)):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    assert mix_int8(draft) > 0
    _greedy_exact_across_policies(make_engine, smol_tokenizer, base, draft)


@pytest.mark.skipif(not cpu_fused.available(), reason="the fused CPU ops do not build here")
def test_every_policy_is_greedy_exact_with_bf16_panels(make_engine, smol_tokenizer):
    """A bf16 target and draft in 16-column panels (the layout of CPUs without oneDNN bf16 kernels, forced here so
    that every box runs it): rows never depend on the step, so every policy emits off's tokens."""
    from nightjar.models.cpu_linear import PANELS, pack_linears

    base, draft = _bf16_pair(smol_tokenizer)
    assert pack_linears(base, fmt=PANELS) > 0 and pack_linears(draft, mirror=True, fmt=PANELS) > 0
    _greedy_exact_across_policies(make_engine, smol_tokenizer, base, draft)
