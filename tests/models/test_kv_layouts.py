"""Head-major (CPU) and block-major (CUDA, Triton) KV caches give the same attention and the same model."""
import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from nightjar.models.llama import kv_head_major, paged_attention
from tests.conftest import random_model, tiny_config


def twin_caches(L=2, nkv=2, d=8, bs=4, n=12, grow=0):
    """Two caches, one per layout, holding the same random K/V in every slot (and grown alike)."""
    caches = [KVCache(L, nkv, d, bs, n, torch.float32, head_major=h) for h in (True, False)]
    g = torch.Generator().manual_seed(0)
    for c in caches:
        if grow:
            c.add_segment(grow)
    T = (n + grow) * bs
    for layer in range(L):
        k, v = torch.randn(T, nkv, d, generator=g), torch.randn(T, nkv, d, generator=g)
        for c in caches:
            c.write(layer, k, v, torch.arange(T))
    return caches


def test_paged_attention_is_the_same_over_both_layouts_for_ragged_batches():
    # decode rows, a verify row (3 tokens) and two prefill chunks: several groups, padding, varied contexts
    chunks = [[1], [2], [3, 4, 5], [6] * 7, [7] * 2]
    starts = [9, 2, 5, 0, 11]
    tables = [(3, 0, 7), (1,), (5, 6), (2, 4), (8, 9, 10, 11)]
    for grow in (0, 4):
        head, block = twin_caches(grow=grow)
        if grow:                                  # some rows now read blocks of the grown segment
            move = {3: 12, 5: 13, 8: 14, 2: 15}
            tables = [tuple(move.get(b, b) for b in t) for t in tables]
        lay = build_layout(chunks, starts, tables, 4, logits_rows=[1] * 5)
        q = torch.randn(lay.num_tokens, 4, 8, generator=torch.Generator().manual_seed(1))
        for layer in range(2):
            torch.testing.assert_close(paged_attention(q, head, layer, lay, 0.3),
                                       paged_attention(q, block, layer, lay, 0.3), atol=1e-5, rtol=1e-5)


def test_long_prefill_rows_take_sdpa_one_by_one_on_head_major_and_match_the_matmuls():
    # two prefill chunks past SHORT_QUERY (ragged lengths and starts: masked block tails) beside a decode row;
    # head-major serves the long rows one SDPA call each, block-major the padded group by explicit matmuls
    chunks = [[1] * 20, [2], [3] * 33]
    starts = [0, 9, 3]
    tables = [(0, 1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15, 16)]
    lay = build_layout(chunks, starts, tables, 4, logits_rows=[1] * 3)
    (g,) = lay.long_groups
    assert g.Q == 33
    for grow in (0, 4):
        head, block = twin_caches(n=20, grow=grow)
        q = torch.randn(lay.num_tokens, 4, 8, generator=torch.Generator().manual_seed(2))
        for layer in range(2):
            torch.testing.assert_close(paged_attention(q, head, layer, lay, 0.3),
                                       paged_attention(q, block, layer, lay, 0.3), atol=1e-5, rtol=1e-5)


def test_a_model_gives_the_same_logits_over_both_layouts():
    model = random_model(tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2), seed=3, std=0.3)
    assert kv_head_major(model)                   # CPU, torch path
    c = model.cfg
    out = []
    for head_major in (True, False):
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 4, 16, torch.float32, head_major=head_major)
        pre = build_layout([[3, 1, 4, 1, 5, 9, 2], [6, 5]], [0, 0], [(0, 1), (5,)], 4, [1, 1])
        ver = build_layout([[2, 6, 5], [3]], [7, 2], [(0, 1, 2), (5,)], 4, [3, 1])   # verify + decode rows
        out.append(torch.cat([model(pre, cache), model(ver, cache)]))
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)
