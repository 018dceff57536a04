"""Paged attention: the Triton kernel against its torch reference, and the reference against
the model's SDPA path."""
import math

import pytest
import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models.llama import build_layout
from nightjar.models.llama import paged_attention as llama_paged_attention
from nightjar.triton_kernels.paged_attention import paged_attention_ref, paged_attention_triton

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(qlens, ctxs, *, nkv=2, group=2, d=16, bs=4, dtype=torch.float32, device="cpu",
              seed=0, strided_q=False):
    """Random cache with shuffled block tables; sequence b has ctxs[b] tokens, last qlens[b] queried."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // bs) for c in ctxs]
    nb_max = max(per_seq) + 1                                                # +1 padding column
    n_blocks = sum(per_seq) + 3
    k_cache = torch.randn(n_blocks, bs, nkv, d, generator=g).to(dtype).to(device)
    v_cache = torch.randn(n_blocks, bs, nkv, d, generator=g).to(dtype).to(device)
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.zeros(len(ctxs), nb_max, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used: used + n].to(torch.int32)
        used += n
    T, nh = sum(qlens), nkv * group
    if strided_q:                                                            # q is a slice of fused qkv
        q = torch.randn(T, nh + 2 * nkv, d, generator=g).to(dtype).to(device)[:, :nh]
    else:
        q = torch.randn(T, nh, d, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, table.to(device), qsl, seq_lens


def run_both(case, scale):
    q = case[0]
    ref = paged_attention_ref(*case, scale)
    poisoned = torch.full_like(q, float("nan"))
    out = paged_attention_triton(*case, scale, out=poisoned)
    return ref, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_matches_the_reference_on_mixed_prefill_decode_and_verify_chunks(dtype, device):
    # prefill chunk across block boundaries, a first chunk, decode, verify (γ=3), an empty row
    case = make_case([6, 5, 1, 4, 0], [13, 5, 8, 12, 3], dtype=dtype, device=device, strided_q=True)
    ref, out = run_both(case, 0.25)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batches_at_block_boundaries_match_the_reference(dtype, device):
    # contexts exactly at, just past and just before a block edge; q_len = 1 everywhere
    case = make_case([1, 1, 1, 1], [4, 5, 7, 8], group=4, nkv=1, dtype=dtype, device=device, seed=1)
    ref, out = run_both(case, 0.3)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_long_prefill_chunks_spanning_several_query_tiles_match_the_reference(device):
    # T > 8B selects 64-row tiles; 70 queries need several tiles and two key tiles
    case = make_case([70, 3], [80, 9], nkv=1, group=2, d=24, bs=8, device=device, seed=2)
    ref, out = run_both(case, 1 / math.sqrt(24))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_a_single_sequence_batch_matches_the_reference(device):
    case = make_case([3], [10], nkv=2, group=1, device=device, seed=4)
    ref, out = run_both(case, 0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_the_reference_agrees_with_the_models_sdpa_paged_attention():
    nkv, group, d, bs, L = 2, 2, 16, 4, 2
    chunks = [[1] * 5, [2], [3] * 4]
    starts = [6, 9, 0]
    tables = [(3, 0, 7), (1, 5, 6), (2,)]
    cache = KVCache(L, nkv, d, bs, num_blocks=8, dtype=torch.float32, head_major=False)   # the kernels' layout
    g = torch.Generator().manual_seed(3)
    for layer in range(L):        # fill every block with data, so padding would show up
        cache.segments[0].data[layer].copy_(torch.randn(cache.segments[0].data[layer].shape, generator=g))
    lay = build_layout(chunks, starts, tables, bs, logits_rows=[1, 1, 1])
    q = torch.randn(lay.num_tokens, nkv * group, d, generator=g)
    want = llama_paged_attention(q, cache, 1, lay, 0.25)
    qlens = [len(c) for c in chunks]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    seq_lens = torch.tensor([s + n for s, n in zip(starts, qlens)])
    data = cache.segments[0].data[1]
    got = paged_attention_ref(q, data[0], data[1], lay.block_tables, qsl, seq_lens, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_shapes_match_the_reference_on_the_gpu(dtype):
    qlens = [1] * 8 + [5] * 8 + [200, 37]
    ctxs = [100, 2047, 16, 17, 500, 1, 64, 999] + [50, 600, 33, 5, 1000, 80, 16, 300] + [700, 37]
    case = make_case(qlens, ctxs, nkv=8, group=4, d=128, bs=16, dtype=dtype, device="cuda")
    ref, out = run_both(case, 1 / math.sqrt(128))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grown_pool_read_through_its_segment_table_matches_the_one_tensor_reference(dtype, device):
    """Blocks [0, 7) in one tensor, [7, n) in another allocation: the kernel adds segment 1's distance."""
    q, k, v, table, qsl, seq_lens = make_case([6, 1, 4], [13, 9, 12], dtype=dtype, device=device, seed=3)
    ref = paged_attention_ref(q, k, v, table, qsl, seq_lens, 0.25)
    assert (table >= 7).any() and ((table < 7) & (table > 0)).any()          # both segments are read
    k1, v1 = k[7:].clone(), v[7:].clone()                                     # a separate allocation each
    k0, v0 = k.clone(), v.clone()
    k0[7:], v0[7:] = float("nan"), float("nan")                              # segment 0 ends at block 7
    out = paged_attention_triton(q, k0[:7], v0[:7], table, qsl, seq_lens, 0.25,
                                 k_seg1=k1, v_seg1=v1, seg1_start=7)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
