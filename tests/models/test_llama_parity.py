"""Our varlen paged forward matches HF transformers' LlamaForCausalLM (fp32, within 1e-4)."""
from __future__ import annotations

import pytest
import torch

from nightjar.kvpool.blocks import BlockAllocator
from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from nightjar.models.loader import load_weights

transformers = pytest.importorskip("transformers")


def save_hf_llama(path, seed=0, tie=False, rope_scaling=None, shard=None, kv_heads=2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=512, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, rope_scaling=rope_scaling)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]                              # [S, V]


class Runner:
    """Feeds chunks through our model against a paged cache, like the engine does."""

    def __init__(self, model, block_size=4, num_blocks=64, shuffle_seed=None):
        c = model.cfg
        self.model, self.bs = model, block_size
        self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, block_size, num_blocks, torch.float32)
        self.alloc = BlockAllocator(num_blocks, block_size)
        if shuffle_seed is not None:             # scatter block placement
            g = torch.Generator().manual_seed(shuffle_seed)
            self.alloc.reserve(-1, block_size * num_blocks // 2)
            self.alloc.free(-1)
            junk = torch.randperm(num_blocks // 2, generator=g)[: num_blocks // 4].tolist()
            for j in junk:
                self.alloc.reserve(-2 - j, 1)

    def run(self, seqs: dict[int, tuple[list[int], int]], logits_rows: dict[int, int]):
        chunks, starts, tables, rows = [], [], [], []
        for sid, (chunk, start) in seqs.items():
            self.alloc.reserve(sid, start + len(chunk))
            chunks.append(chunk)
            starts.append(start)
            tables.append(self.alloc.block_table(sid))
            rows.append(logits_rows[sid])
        lay = build_layout(chunks, starts, tables, self.bs, rows)
        return self.model(lay, self.cache)


@pytest.mark.parametrize("variant", [
    dict(), dict(tie=True), dict(kv_heads=4), dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}),
])
def test_prefill_decode_and_verify_chunks_match_transformers(tmp_path, variant):
    hf = save_hf_llama(tmp_path, **variant)
    ours = load_weights(tmp_path, torch.float32)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)                                                     # [40, V]
    r = Runner(ours)
    pre = r.run({0: (ids[:30], 0)}, {0: 1})
    assert torch.allclose(pre[0], ref[29], atol=1e-4)
    dec = r.run({0: (ids[30:31], 30)}, {0: 1})
    assert torch.allclose(dec[0], ref[30], atol=1e-4)
    ver = r.run({0: (ids[31:36], 31)}, {0: 5})
    assert torch.allclose(ver, ref[31:36], atol=1e-4)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf = save_hf_llama(tmp_path / "one")
    hf.save_pretrained(tmp_path / "many", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    a, b = load_weights(tmp_path / "one", torch.float32), load_weights(tmp_path / "many", torch.float32)
    for (n1, p1), (n2, p2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_mixed_batch_rows_match_each_sequence_alone(tmp_path):
    hf = save_hf_llama(tmp_path)
    ours = load_weights(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 23, 17)]
    r = Runner(ours, shuffle_seed=5)
    r.run({i: (s[:-3], 0) for i, s in enumerate(seqs)}, {0: 0, 1: 1, 2: 1})
    out = r.run({0: (seqs[0][-3:-2], len(seqs[0]) - 3), 1: (seqs[1][-3:], len(seqs[1]) - 3),
                 2: (seqs[2][-3:-1], len(seqs[2]) - 3)}, {0: 1, 1: 3, 2: 2})
    ref = [hf_logits(hf, s) for s in seqs]
    expect = torch.cat([ref[0][-3:-2], ref[1][-3:], ref[2][-3:-1]])
    assert torch.allclose(out, expect, atol=1e-4)


def test_unknown_model_type_is_a_clear_error(tmp_path):
    import json

    save_hf_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Llama-family"):
        load_weights(tmp_path, torch.float32)
