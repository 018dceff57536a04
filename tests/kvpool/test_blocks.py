"""Tests for the host-side paged KV block allocator."""
from __future__ import annotations

import random

import pytest

from nightjar.kvpool.blocks import BlockAllocator, KVPoolError

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is optional
    given = None


def snapshot(a: BlockAllocator) -> tuple:
    """Everything observable about an allocator, for 'nothing changed' checks."""
    seqs = tuple((s, a.block_table(s), a.num_committed(s)) for s in a.seq_ids())
    return (a.num_total, a.num_free, a.num_used, a.segments, seqs)


# ---------------------------------------------------------------- construction / properties
def test_new_pool_is_all_free_in_one_segment():
    a = BlockAllocator(8, 4)
    assert (a.num_total, a.num_free, a.num_used, a.block_size) == (8, 8, 0, 4)
    assert a.segments == ((0, 8),)
    assert a.seq_ids() == ()
    a.check_integrity()


@pytest.mark.parametrize("blocks,bs", [(0, 4), (4, 0), (-1, 4)])
def test_constructor_rejects_non_positive_sizes(blocks, bs):
    with pytest.raises(KVPoolError):
        BlockAllocator(blocks, bs)


def test_module_does_not_import_torch():
    import nightjar.kvpool.blocks as mod
    assert "torch" not in vars(mod)
    src = open(mod.__file__).read()
    assert "import torch" not in src


# ---------------------------------------------------------------- reserve / blocks_needed
def test_blocks_needed_rounds_up_and_counts_only_extra_blocks():
    a = BlockAllocator(8, 4)
    assert a.blocks_needed(1, 0) == 0
    assert a.blocks_needed(1, 1) == 1
    assert a.blocks_needed(1, 4) == 1
    assert a.blocks_needed(1, 5) == 2
    a.reserve(1, 5)
    assert a.blocks_needed(1, 8) == 0
    assert a.blocks_needed(1, 9) == 1
    assert a.blocks_needed(1, 3) == 0


def test_blocks_needed_rejects_negative_token_count():
    with pytest.raises(KVPoolError):
        BlockAllocator(4, 4).blocks_needed(1, -1)


def test_reserve_hands_out_lowest_ids_first():
    a = BlockAllocator(8, 4)
    a.reserve(1, 9)
    a.reserve(2, 4)
    assert a.block_table(1) == (0, 1, 2)
    assert a.block_table(2) == (3,)
    assert (a.num_free, a.num_used) == (4, 4)
    a.check_integrity()


def test_reserve_is_idempotent_when_capacity_already_covers():
    a = BlockAllocator(8, 4)
    a.reserve(1, 6)
    a.reserve(1, 6)
    a.reserve(1, 2)
    assert a.block_table(1) == (0, 1)


def test_reserve_zero_tokens_registers_an_empty_sequence():
    a = BlockAllocator(4, 4)
    a.reserve(7, 0)
    assert a.has_seq(7) and a.block_table(7) == () and a.num_free == 4


def test_failed_reserve_changes_nothing():
    a = BlockAllocator(4, 4)
    a.reserve(1, 8)
    a.commit(1, 5)
    before = snapshot(a)
    with pytest.raises(KVPoolError):
        a.reserve(1, 17)
    with pytest.raises(KVPoolError):
        a.reserve(2, 9)
    assert snapshot(a) == before
    assert not a.has_seq(2)
    a.check_integrity()


def test_block_id_is_never_handed_out_twice():
    a = BlockAllocator(16, 1)
    for s in range(16):
        a.reserve(s, 1)
    ids = [a.block_table(s)[0] for s in range(16)]
    assert sorted(ids) == list(range(16))
    assert a.blocks_needed(99, 1) > a.num_free


# ---------------------------------------------------------------- commit / rollback
def test_commit_records_num_computed():
    a = BlockAllocator(4, 4)
    a.reserve(1, 6)
    a.commit(1, 3)
    assert a.num_committed(1) == 3
    a.commit(1, 8)
    assert a.num_committed(1) == 8


def test_commit_beyond_reserved_capacity_is_an_error():
    a = BlockAllocator(4, 4)
    a.reserve(1, 6)
    with pytest.raises(KVPoolError):
        a.commit(1, 9)
    assert a.num_committed(1) == 0


def test_commit_cannot_move_backwards():
    a = BlockAllocator(4, 4)
    a.reserve(1, 8)
    a.commit(1, 5)
    with pytest.raises(KVPoolError):
        a.commit(1, 4)


def test_rollback_frees_nothing():
    a = BlockAllocator(4, 4)
    a.reserve(1, 12)
    a.commit(1, 10)
    table = a.block_table(1)
    a.rollback(1, 2)
    assert a.num_committed(1) == 2
    assert a.block_table(1) == table and a.num_free == 1
    a.check_integrity()


def test_rollback_cannot_move_forward_or_below_zero():
    a = BlockAllocator(4, 4)
    a.reserve(1, 8)
    a.commit(1, 5)
    for bad in (6, -1):
        with pytest.raises(KVPoolError):
            a.rollback(1, bad)
    assert a.num_committed(1) == 5


@pytest.mark.parametrize("op", ["commit", "rollback", "num_committed", "block_table"])
def test_per_sequence_queries_on_unknown_seq_raise(op):
    a = BlockAllocator(4, 4)
    args = (0,) if op in ("commit", "rollback") else ()
    with pytest.raises(KVPoolError):
        getattr(a, op)(42, *args)


# ---------------------------------------------------------------- free
def test_free_returns_blocks_and_count():
    a = BlockAllocator(8, 4)
    a.reserve(1, 12)
    assert a.free(1) == 3
    assert a.num_free == 8 and not a.has_seq(1)
    a.check_integrity()


def test_freed_blocks_are_reused():
    a = BlockAllocator(4, 4)
    a.reserve(1, 16)
    a.free(1)
    a.reserve(2, 16)
    assert sorted(a.block_table(2)) == [0, 1, 2, 3]


def test_double_free_of_seq_is_an_error():
    a = BlockAllocator(4, 4)
    a.reserve(1, 4)
    a.free(1)
    with pytest.raises(KVPoolError):
        a.free(1)
    with pytest.raises(KVPoolError):
        a.free(123)


def test_seq_ids_and_has_seq_track_live_sequences():
    a = BlockAllocator(8, 4)
    for s in (3, 1, 2):
        a.reserve(s, 1)
    a.free(1)
    assert a.seq_ids() == (3, 2)
    assert a.has_seq(3) and not a.has_seq(1)


# ---------------------------------------------------------------- grow / shrink
def test_grow_appends_a_free_segment():
    a = BlockAllocator(4, 4)
    assert a.grow(3) == (4, 3)
    assert a.segments == ((0, 4), (4, 3))
    assert (a.num_total, a.num_free) == (7, 7)
    a.check_integrity()


def test_grow_rejects_non_positive_size():
    with pytest.raises(KVPoolError):
        BlockAllocator(4, 4).grow(0)


def test_allocation_prefers_lower_segments():
    a = BlockAllocator(2, 4)
    a.grow(2)
    a.reserve(1, 4)
    a.reserve(2, 12)
    assert a.block_table(1) == (0,)
    assert a.block_table(2) == (1, 2, 3)


def test_shrinking_segment_zero_is_an_error():
    a = BlockAllocator(4, 4)
    assert not a.can_shrink()
    with pytest.raises(KVPoolError):
        a.plan_shrink()
    with pytest.raises(KVPoolError):
        a.apply_shrink([])


def test_shrink_of_empty_tail_needs_no_moves():
    a = BlockAllocator(4, 4)
    a.grow(4)
    a.reserve(1, 8)
    assert a.can_shrink()
    assert a.plan_shrink() == []
    assert a.apply_shrink([]) == 4
    assert a.segments == ((0, 4),) and (a.num_total, a.num_free) == (4, 2)
    a.check_integrity()


def test_plan_shrink_is_pure_and_moves_only_blocks_above_boundary():
    a = BlockAllocator(4, 2)
    a.grow(4)
    a.reserve(1, 16)  # all 8 blocks
    a.free(1)
    a.reserve(2, 4)   # blocks 0, 1 (freed in order, so ascending again)
    a.reserve(3, 8)   # blocks 2, 3 low and 4, 5 in the tail
    a.free(2)
    before = snapshot(a)
    pairs = a.plan_shrink()
    assert snapshot(a) == before
    boundary = a.segments[-1][0]
    tail_live = {b for b in a.block_table(3) if b >= boundary}
    assert {s for s, _ in pairs} == tail_live
    assert all(s >= boundary and d < boundary for s, d in pairs)
    assert len({d for _, d in pairs}) == len(pairs)


def test_plan_shrink_fails_when_too_few_free_blocks_below_boundary():
    a = BlockAllocator(2, 4)
    a.grow(2)
    a.reserve(1, 16)
    a.free(1)
    a.reserve(2, 8)   # LIFO: takes low 2 again
    a.reserve(3, 8)   # tail 2
    assert not a.can_shrink()
    before = snapshot(a)
    with pytest.raises(KVPoolError):
        a.plan_shrink()
    assert snapshot(a) == before


def test_apply_shrink_remaps_tables_and_keeps_low_blocks_in_place():
    a = BlockAllocator(4, 2)
    a.grow(4)
    a.reserve(1, 6)   # 0,1,2
    a.reserve(2, 8)   # 3,4,5,6
    a.free(1)
    pairs = a.plan_shrink()
    remap = dict(pairs)
    want = {s: tuple(remap.get(b, b) for b in a.block_table(s)) for s in a.seq_ids()}
    assert a.apply_shrink(pairs) == 4
    assert {s: a.block_table(s) for s in a.seq_ids()} == want
    assert a.block_table(2)[0] == 3
    assert a.num_used == 4 and a.num_total == 4
    a.check_integrity()
    assert a.free(2) == 4


def test_apply_shrink_rejects_bad_pairs_without_changing_anything():
    a = BlockAllocator(4, 2)
    a.grow(2)
    a.reserve(1, 12)  # 0..5, two live blocks in the tail
    a.free(1)
    a.reserve(1, 4)   # LIFO -> ids 0, 1
    a.reserve(2, 8)   # 2, 3, 4, 5
    a.rollback(1, 0)
    a.free(1)         # 0, 1 free
    good = a.plan_shrink()
    before = snapshot(a)
    bad_sets = [
        good[:1],                                  # misses a live tail block
        [(good[0][0], good[0][1]), (good[1][0], good[0][1])],  # duplicate dst
        [(good[0][0], 2), (good[1][0], good[1][1])],           # dst in use
        [(good[0][0], 5), (good[1][0], good[1][1])],           # dst above boundary
    ]
    for bad in bad_sets:
        with pytest.raises(KVPoolError):
            a.apply_shrink(bad)
        assert snapshot(a) == before
    a.apply_shrink(good)
    a.check_integrity()


def test_grow_shrink_grow_cycles_repeatedly():
    a = BlockAllocator(4, 4)
    for i in range(5):
        assert a.grow(4) == (4, 4)
        a.reserve(i, 12)       # 0, 1, 2
        a.reserve(100 + i, 8)  # 3 and tail block 4
        a.free(i)
        a.apply_shrink(a.plan_shrink())
        a.free(100 + i)
        a.check_integrity()
    assert a.segments == ((0, 4),) and a.num_free == 4


def test_multiple_segments_shrink_from_the_top():
    a = BlockAllocator(2, 1)
    a.grow(2)
    a.grow(2)
    assert a.segments == ((0, 2), (2, 2), (4, 2))
    a.reserve(9, 1)   # 0
    a.reserve(1, 4)   # 1, 2, 3, 4
    a.free(9)
    pairs = a.plan_shrink()
    assert pairs == [(4, 0)]
    a.apply_shrink(pairs)
    assert a.segments == ((0, 2), (2, 2))
    assert a.block_table(1) == (1, 2, 3, 0)
    assert not a.can_shrink()
    a.free(1)
    a.apply_shrink(a.plan_shrink())
    assert a.segments == ((0, 2),)
    a.check_integrity()


# ---------------------------------------------------------------- integrity checker
def test_check_integrity_detects_refcount_corruption():
    a = BlockAllocator(4, 4)
    a.reserve(1, 4)
    a._refcount[0] = 2
    with pytest.raises(KVPoolError, match="refcount"):
        a.check_integrity()


def test_check_integrity_detects_block_both_free_and_used():
    a = BlockAllocator(4, 4)
    a.reserve(1, 4)
    a._free_stacks[0].append(0)
    with pytest.raises(KVPoolError):
        a.check_integrity()


def test_check_integrity_detects_duplicate_in_free_list():
    a = BlockAllocator(4, 4)
    a._free_stacks[0].append(1)
    with pytest.raises(KVPoolError, match="twice"):
        a.check_integrity()


def test_check_integrity_detects_committed_over_capacity():
    a = BlockAllocator(4, 4)
    a.reserve(1, 4)
    a._seqs[1].committed = 5
    with pytest.raises(KVPoolError, match="committed"):
        a.check_integrity()


def test_check_integrity_detects_out_of_range_block_id():
    a = BlockAllocator(4, 4)
    a.reserve(1, 4)
    a._seqs[1].table.append(17)
    with pytest.raises(KVPoolError, match="out of range"):
        a.check_integrity()


# ---------------------------------------------------------------- property tests
def slots(a: BlockAllocator, s: int, start: int, end: int) -> list[int]:
    """Flat slot ids of token positions [start, end) of sequence s, through its block table."""
    table, bs = a.block_table(s), a.block_size
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


class Model:
    """Drives an allocator with random ops and a simulated slot->value KV cache.

    The value at token position ``p`` of sequence ``s`` is ``(s, p)``.
    """

    def __init__(self, rng: random.Random, num_blocks: int, bs: int) -> None:
        self.rng, self.a = rng, BlockAllocator(num_blocks, bs)
        self.cache: dict[int, tuple[int, int]] = {}
        self.next_id = 0

    def write(self, s: int, start: int, end: int) -> None:
        for p, slot in zip(range(start, end), slots(self.a, s, start, end)):
            self.cache[slot] = (s, p)

    def verify(self) -> None:
        self.a.check_integrity()
        for s in self.a.seq_ids():
            n = self.a.num_committed(s)
            got = [self.cache.get(x) for x in slots(self.a, s, 0, n)]
            assert got == [(s, p) for p in range(n)], f"seq {s} KV corrupted"

    def op_step(self) -> None:
        """Reserve ahead gamma+1 slots for a (maybe new) seq, then commit part."""
        a, rng = self.a, self.rng
        live = a.seq_ids()
        if live and rng.random() < 0.7:
            s = rng.choice(live)
        else:
            s, self.next_id = self.next_id, self.next_id + 1
        c = a.num_committed(s) if a.has_seq(s) else 0
        target = c + rng.randint(1, 3 * a.block_size)
        if a.blocks_needed(s, target) > a.num_free:
            before = snapshot(a)
            with pytest.raises(KVPoolError):
                a.reserve(s, target)
            assert snapshot(a) == before
            return
        a.reserve(s, target)
        new = rng.randint(c, target)
        a.commit(s, new)
        self.write(s, c, new)

    def op_rollback(self) -> None:
        if self.a.seq_ids():
            s = self.rng.choice(self.a.seq_ids())
            self.a.rollback(s, self.rng.randint(0, self.a.num_committed(s)))

    def op_free(self) -> None:
        if self.a.seq_ids():
            s = self.rng.choice(self.a.seq_ids())
            freed, used = self.a.free(s), self.a.num_used
            assert freed >= 0 and used + freed <= self.a.num_total

    def op_grow(self) -> None:
        if len(self.a.segments) < 5:
            start, n = self.a.grow(self.rng.randint(1, 6))
            assert start + n == self.a.num_total

    def op_shrink(self) -> None:
        a = self.a
        if not a.can_shrink():
            if len(a.segments) > 1:
                with pytest.raises(KVPoolError):
                    a.plan_shrink()
            return
        boundary, size = a.segments[-1]
        below = {s: [b for b in a.block_table(s) if b < boundary] for s in a.seq_ids()}
        pairs = a.plan_shrink()
        assert all(src >= boundary > dst for src, dst in pairs)
        for src, dst in pairs:  # the caller's K/V copy
            for off in range(a.block_size):
                v = self.cache.get(src * a.block_size + off)
                if v is not None:
                    self.cache[dst * a.block_size + off] = v
        for x in [x for x in self.cache if x >= boundary * a.block_size]:
            del self.cache[x]  # that memory is gone
        assert a.apply_shrink(pairs) == size
        for s, blocks in below.items():  # blocks below the boundary did not move
            assert [b for b in a.block_table(s) if b < boundary and b not in dict(pairs).values()] == blocks

    def run(self, steps: int) -> None:
        ops = [self.op_step] * 6 + [self.op_rollback, self.op_free, self.op_free,
                                    self.op_grow, self.op_shrink, self.op_shrink]
        for _ in range(steps):
            self.rng.choice(ops)()
            self.verify()


@pytest.mark.parametrize("seed", range(25))
def test_random_op_sequences_keep_integrity_and_kv_contents(seed):
    rng = random.Random(seed)
    Model(rng, num_blocks=rng.randint(1, 12), bs=rng.choice([1, 2, 4, 16])).run(400)


def test_random_op_sequences_exercise_shrink_with_moves():
    moved = 0
    for seed in range(40):
        m = Model(random.Random(1000 + seed), num_blocks=8, bs=2)
        orig = m.a.apply_shrink
        def counting(pairs, orig=orig):
            nonlocal moved
            moved += len(list(pairs))
            return orig(pairs)
        m.a.apply_shrink = counting
        m.run(200)
    assert moved > 0


if given is not None:
    @settings(max_examples=60, deadline=None)
    @given(seed=st.integers(0, 2**32 - 1), blocks=st.integers(1, 10), bs=st.sampled_from([1, 3, 8]))
    def test_hypothesis_random_op_sequences_keep_integrity(seed, blocks, bs):
        Model(random.Random(seed), num_blocks=blocks, bs=bs).run(120)
