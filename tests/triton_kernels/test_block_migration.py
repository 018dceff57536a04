"""Block migration: Triton against the torch reference and KVCache.migrate."""
import pytest
import torch

from nightjar.kvpool.cache import KVCache
from nightjar.triton_kernels.block_migration import migrate_blocks_ref, migrate_blocks_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copies_every_layer_and_both_k_and_v_like_the_reference(dtype, device):
    g = torch.Generator().manual_seed(0)
    data = torch.randn(3, 2, 10, 4, 2, 8, generator=g).to(dtype).to(device)    # [L, 2, n, bs, nkv, d]
    pairs = [(9, 0), (7, 2), (8, 5)]                                         # tail -> free low blocks
    want = data.clone()
    migrate_blocks_ref(want, pairs)
    migrate_blocks_triton(data, torch.tensor(pairs, dtype=torch.int32, device=device))
    assert torch.equal(data, want)
    assert torch.equal(data[:, :, 0], data[:, :, 9]) and torch.equal(data[:, :, 1], want[:, :, 1])


def test_blocks_larger_than_one_chunk_are_copied_whole(device):
    g = torch.Generator().manual_seed(1)
    data = torch.randn(1, 2, 3, 16, 4, 160, generator=g).to(device)          # 10240 > 8192 elements
    want = data.clone()
    migrate_blocks_ref(want, [(2, 0)])
    migrate_blocks_triton(data, [(2, 0)])
    assert torch.equal(data, want)


def test_no_pairs_is_a_no_op(device):
    data = torch.randn(1, 2, 3, 4, 1, 8, device=device)
    before = data.clone()
    migrate_blocks_triton(data, [])
    migrate_blocks_ref(data, [])
    assert torch.equal(data, before)


def test_the_reference_matches_kvcache_migrate():
    cache = KVCache(2, 2, 8, 4, num_blocks=6, dtype=torch.float32, head_major=False)   # the kernels' layout
    cache.segments[0].data.copy_(torch.randn(cache.segments[0].data.shape))
    data = cache.segments[0].data.clone()
    cache.migrate([(5, 1), (4, 0)])
    migrate_blocks_ref(data, [(5, 1), (4, 0)])
    assert torch.equal(data, cache.segments[0].data)
