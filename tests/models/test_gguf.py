"""GGUF loading: tensor names, q/k un-permutation, dequantization, and the real SmolLM2 vs transformers."""
from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import torch

from nightjar.models.loader import load_weights, read_gguf_state

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of q/k, as llama.cpp's converter writes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    if hf.startswith("layers."):
        _, i, rest = hf.split(".", 2)
        mod, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{HF_TO_GGUF[mod]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_gguf(path, hf_model, qtype=Q.F32):
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy()
        if "q_proj" in name:
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif "k_proj" in name:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def test_f32_gguf_with_permuted_qk_gives_transformers_logits(tmp_path, hf_model):
    write_gguf(tmp_path / "m.gguf", hf_model)
    ours = load_weights(tmp_path / "m.gguf", torch.float32)
    from tests.models.test_llama_parity import Runner, hf_logits

    ids = list(range(3, 40))
    out = Runner(ours).run({0: (ids, 0)}, {0: len(ids)})
    assert torch.allclose(out, hf_logits(hf_model, ids), atol=1e-4)


@pytest.mark.parametrize("qtype,tol", [(Q.F16, 2e-3), (Q.BF16, 1e-2), (Q.Q8_0, 2e-2), (Q.Q4_0, 0.15), (Q.Q4_1, 0.15)])
def test_quantized_tensors_dequantize_close_to_the_original(tmp_path, hf_model, qtype, tol):
    write_gguf(tmp_path / "q.gguf", hf_model, qtype)
    _, state, _ = read_gguf_state(tmp_path / "q.gguf")
    ref = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    for name, t in state.items():
        assert t.shape == ref[name].shape, name
        err = (t - ref[name]).abs().max().item()
        assert err <= tol * 4, (name, err)          # 4 sigma of a N(0, 0.2) weight's quantization step


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_tensors_load_with_the_right_shape_and_values(tmp_path, qtype):
    block_bytes, block_elems = gguf.constants.GGML_QUANT_SIZES[qtype][1], 256
    rows, cols = 4, 512
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    d_off = 0 if qtype == Q.Q4_K else block_bytes - 2          # where the f16 scale(s) live
    for r in range(rows):
        for b in range(cols // block_elems):
            base = b * block_bytes + d_off
            raw[r, base: base + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            if qtype == Q.Q4_K:
                raw[r, base + 2: base + 4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from nightjar.models.loader import dequantize_tensor

    t = gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors[0]
    out = dequantize_tensor(t)
    assert out.shape == (rows, cols) and np.isfinite(out).all()
    assert np.array_equal(out, gguf.quants.dequantize(raw, qtype))
    assert np.abs(out).max() <= 0.01 * 127 * 32 * 1.01 and np.unique(out).size > 16


# ---- the real SmolLM2 ---------------------------------------------------------------------------
CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.",
    "Explain what a prime number is in one sentence.", "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish.", "What is 17 plus 25?",
    "Write a Python function that reverses a string.", "Why is the sky blue?",
]
TOKENIZER_TEXTS = [
    "Hello, world!", "  leading spaces and\ttabs\nnewlines", "Numbers 12345 and 3.14159, dates 2026-11-29",
    "Unicode: café, naïve, 東京, emoji 🎉", "<|im_start|>user\nhi<|im_end|>", "code: def f(x):\n    return x**2",
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_smol_tok(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def test_tokenizer_and_chat_template_match_transformers(smol_tokenizer, hf_smol_tok):
    for text in TOKENIZER_TEXTS:
        assert smol_tokenizer.encode(text) == hf_smol_tok.encode(text, add_special_tokens=False), text
        ids = smol_tokenizer.encode(text)
        assert smol_tokenizer.decode(ids, skip_special=False) == hf_smol_tok.decode(ids)
    for p in CHAT_PROMPTS[:4]:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]
        for m in (msgs, msgs[1:]):
            ref = hf_smol_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            assert smol_tokenizer.render_chat(m) == ref
            assert smol_tokenizer.encode_chat(m) == hf_smol_tok.encode(ref, add_special_tokens=False)


def test_greedy_48_tokens_match_transformers_on_eight_chat_prompts(smollm2_fp32, hf_smollm2):
    from nightjar.engine import Engine
    from nightjar.sampling import SamplingParams

    tok = smollm2_fp32.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]

    async def ours():
        async with Engine(policy="off", draft=None, loaded=(smollm2_fp32, None), dtype="float32") as eng:
            async def one(ids):
                out = []
                async for o in eng.generate(ids, SamplingParams(max_tokens=48, ignore_eos=True)):
                    out += o.token_ids
                return out
            return await asyncio.gather(*[one(p) for p in prompts])
    got = asyncio.run(ours())
    for ids, mine in zip(prompts, got):
        assert mine == hf_greedy(hf_smollm2, ids, 48)


def hf_greedy(model, ids, n):
    """Plain greedy with HF's KV cache, never stopping at EOS (like ignore_eos). The cache goes in and out as
    ``cache`` where the model's forward takes that (transformers 5.25, where ``past_key_values`` is deprecated and
    due to go in 5.40), else as ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, **{name: past}, use_cache=True)
            past = getattr(res, name)
            out.append(int(res.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out
