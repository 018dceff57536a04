"""kv_store: Triton against the torch reference, and the reference against KVCache.write."""
import pytest
import torch

from nightjar.kvpool.cache import KVCache
from nightjar.triton_kernels.kv_store import kv_store_ref, kv_store_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def garbage_cache(n_blocks, bs, nkv, d, dtype, device, g):
    return (torch.randn(n_blocks, bs, nkv, d, generator=g) * 1e4).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stores_match_the_reference_and_skip_padded_slots(dtype, device):
    g = torch.Generator().manual_seed(0)
    n_blocks, bs, nkv, d, T = 6, 4, 2, 8, 21
    kv = torch.randn(T, 3 * nkv, d, generator=g).to(dtype).to(device)      # fused: strided k, v views
    k, v = kv[:, :nkv], kv[:, nkv: 2 * nkv]
    # distinct slots, as the engine writes them (two tokens on one slot would race on a GPU)
    others = [s for s in torch.randperm(n_blocks * bs, generator=g).tolist() if s not in (bs - 1, bs)]
    slots = torch.tensor(others[:T])
    slots[[0, 5, 20]] = -1                                                  # padding tokens
    slots[1], slots[2] = bs - 1, bs                                         # both sides of a block edge
    slots = slots.to(device)
    kc = garbage_cache(n_blocks, bs, nkv, d, dtype, device, g)
    vc = garbage_cache(n_blocks, bs, nkv, d, dtype, device, g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_store_triton(k, v, kc, vc, slots)
    kv_store_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    flat = kc.view(-1, nkv, d)
    assert torch.equal(flat[slots[1]], k[1])


def test_the_reference_matches_kvcache_write_on_one_segment():
    g = torch.Generator().manual_seed(1)
    cache = KVCache(2, 2, 8, 4, num_blocks=5, dtype=torch.float32, head_major=False)   # the kernels' layout
    k, v = torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    slots = torch.tensor([3, 4, 0, 19, 8, 9, 10])
    cache.write(1, k, v, slots)
    data = torch.zeros_like(cache.segments[0].data[1])
    kv_store_ref(k, v, data[0], data[1], slots)
    assert torch.equal(data, cache.segments[0].data[1])


def test_an_empty_batch_stores_nothing(device):
    kc = torch.zeros(2, 4, 1, 8, device=device)
    k = torch.zeros(0, 1, 8, device=device)
    kv_store_triton(k, k, kc, kc.clone(), torch.zeros(0, dtype=torch.int64, device=device))
    assert not kc.any()


def test_stores_into_a_grown_pool_land_in_the_segment_that_holds_each_block(device):
    g = torch.Generator().manual_seed(1)
    n_blocks, bs, nkv, d, n0 = 6, 4, 2, 8, 4                                # blocks 4, 5 are segment 1's
    k, v = (torch.randn(9, nkv, d, generator=g).to(device) for _ in range(2))
    slots = torch.tensor([0, 5, 15, 16, 17, 23, -1, 22, 3], device=device)  # both sides of block 4's edge
    kc, vc = garbage_cache(n_blocks, bs, nkv, d, torch.float32, device, g), \
        garbage_cache(n_blocks, bs, nkv, d, torch.float32, device, g)
    kc0, vc0, kc1, vc1 = kc[:n0].clone(), vc[:n0].clone(), kc[n0:].clone(), vc[n0:].clone()
    kv_store_ref(k, v, kc, vc, slots)
    kv_store_triton(k, v, kc0, vc0, slots, k_seg1=kc1, v_seg1=vc1, seg1_start=n0)
    assert torch.equal(torch.cat([kc0, kc1]), kc) and torch.equal(torch.cat([vc0, vc1]), vc)
