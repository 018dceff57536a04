"""KV cache segments: writes and gathers across segments, tail migration, release and restore."""
from __future__ import annotations

import pytest
import torch

from nightjar.kvpool.cache import KVCache

LAYOUTS = pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "block-major"])


def filled(cache: KVCache, seed: int = 0) -> dict[int, torch.Tensor]:
    """Write a distinct vector into every slot of every block; return slot -> K row of layer 1."""
    g = torch.Generator().manual_seed(seed)
    T = cache.num_blocks * cache.block_size
    k = torch.randn(T, cache.num_kv_heads, cache.head_dim, generator=g)
    for layer in range(cache.num_layers):
        cache.write(layer, k + layer, -k, torch.arange(T))
    return {s: k[s] + 1 for s in range(T)}


@LAYOUTS
def test_writes_and_gathers_span_segments_without_copying_the_first(head_major):
    cache = KVCache(2, 2, 4, 4, num_blocks=3, dtype=torch.float32, head_major=head_major)
    first = cache.segments[0].data
    cache.add_segment(2)
    assert cache.segments[0].data is first and cache.num_blocks == 5
    rows = filled(cache)
    tables = torch.tensor([[4, 0, 3], [1, 2, 4]])
    k, v = cache.gather(1, tables)                                        # [2, 12, 2, 4]
    for b in range(2):
        for j, blk in enumerate(tables[b].tolist()):
            for o in range(4):
                assert torch.equal(k[b, j * 4 + o], rows[blk * 4 + o])
    assert torch.allclose(v[0, :4], -(k[0, :4] - 1))


@LAYOUTS
def test_migrate_moves_tail_blocks_into_the_first_segment_for_all_layers(head_major):
    cache = KVCache(3, 1, 2, 2, num_blocks=4, dtype=torch.float32, head_major=head_major)
    cache.add_segment(3)
    rows = filled(cache, seed=1)
    cache.migrate([(5, 1), (6, 3), (4, 0)])
    assert cache.drop_last_segment() == 3 and cache.num_blocks == 4
    for src, dst in [(5, 1), (6, 3), (4, 0)]:
        k, _ = cache.gather(1, torch.tensor([[dst]]))
        assert torch.equal(k[0, 0], rows[src * 2]) and torch.equal(k[0, 1], rows[src * 2 + 1])
    k2, _ = cache.gather(2, torch.tensor([[2]]))
    assert torch.equal(k2[0, 0], rows[4] + 1)                             # untouched block, layer 2


@LAYOUTS
def test_release_frees_the_bytes_and_restore_brings_the_data_back(head_major):
    cache = KVCache(2, 2, 4, 4, num_blocks=3, dtype=torch.float32, head_major=head_major)
    filled(cache)
    host = cache.to_host()
    before = cache.gather(0, torch.tensor([[2, 1]]))[0].clone()
    assert cache.release() == host[0].numel() * 4 and cache.nbytes == 0
    cache.restore(host)
    assert torch.equal(cache.gather(0, torch.tensor([[2, 1]]))[0], before)


@LAYOUTS
def test_a_gather_over_three_segments_equals_one_contiguous_cache_for_any_table(head_major):
    """Random tables over a grown pool read exactly what one big cache holding the same blocks reads,
    also when the table is larger than any earlier one (the reused buffers grow)."""
    grown = KVCache(2, 2, 4, 4, num_blocks=5, dtype=torch.float32, head_major=head_major)
    one = KVCache(2, 2, 4, 4, 12, torch.float32, head_major=head_major)
    grown.add_segment(3)
    grown.add_segment(4)
    filled(grown)
    filled(one)
    g = torch.Generator().manual_seed(1)
    for B, nb in ((3, 4), (1, 1), (6, 7)):
        tables = torch.randint(0, 12, (B, nb), generator=g)
        for layer in range(2):
            k, v = grown.gather(layer, tables)
            k1, v1 = one.gather(layer, tables)
            assert torch.equal(k, k1) and torch.equal(v, v1)


@LAYOUTS
def test_a_pool_with_a_reserve_grows_in_place_and_reads_as_one_cache(head_major):
    """Growing into the reserve makes a view of the first tensor (one-tensor reads); past the reserve a
    separate segment; shrink, regrow (zeroed) and every read equals one contiguous cache's."""
    grown = KVCache(2, 2, 4, 4, num_blocks=5, dtype=torch.float32, reserve_blocks=3, head_major=head_major)
    one = KVCache(2, 2, 4, 4, 12, torch.float32, head_major=head_major)
    first = grown.segments[0].data
    grown.add_segment(3)
    storage = first.untyped_storage().data_ptr()
    assert grown.segments[1].data.untyped_storage().data_ptr() == storage and grown.segments[0].data is first
    grown.add_segment(4)                                                  # past the reserve
    assert grown.segments[2].data.untyped_storage().data_ptr() != storage
    g = torch.Generator().manual_seed(2)

    def same():
        filled(grown)
        filled(one)
        for B, nb in ((3, 4), (5, 6)):
            tables = torch.randint(0, grown.num_blocks, (B, nb), generator=g)
            for layer in range(2):
                assert all(torch.equal(a, b) for a, b in zip(grown.gather(layer, tables), one.gather(layer, tables)))
    same()
    grown.drop_last_segment()
    before, _ = grown.gather(1, torch.tensor([[7]]))
    before = before.clone()
    grown.migrate([(7, 1)])
    grown.drop_last_segment()
    assert grown.num_blocks == 5 and grown.nbytes == first.numel() * 4
    assert torch.equal(grown.gather(1, torch.tensor([[1]]))[0], before)   # the live block moved below
    grown.add_segment(3)
    assert grown.segments[1].data.abs().sum() == 0                       # regrown blocks start zeroed
    one = KVCache(2, 2, 4, 4, 8, torch.float32, head_major=head_major)
    same()


@LAYOUTS
def test_copy_blocks_and_copy_slots_copy_every_layer_across_segments_and_move_nothing_else(head_major):
    cache = KVCache(3, 2, 4, 4, num_blocks=3, dtype=torch.float32, head_major=head_major)
    cache.add_segment(2)
    rows = filled(cache, seed=2)
    gen = cache.generation
    cache.copy_blocks([(4, 0)])                                           # segment 1 -> segment 0
    cache.copy_slots([(1, 19), (13, 6)])                                  # slot -> slot, both ways
    assert cache.generation == gen                                        # a copy moves no live block
    want = dict(rows)
    want.update({o: rows[16 + o] for o in range(4)})
    want[19], want[6] = want[1], rows[13]                                # slot 1 holds block 4's by now
    for layer in range(3):
        k, v = cache.gather(layer, torch.arange(5)[None])                 # [1, 20, nkv, d]
        for s in range(20):
            assert torch.allclose(k[0, s], want[s] - 1 + layer) and torch.allclose(v[0, s], 1 - want[s])
