"""KVPoolActor.handle() driven directly."""
from __future__ import annotations

from nightjar.actors.kv import KVPoolActor
from nightjar.kernel.messages import ReleaseBlocks, StepPlanned, StepScheduled, TokensCommitted
from nightjar.kvpool.blocks import BlockAllocator


def step(rows, num_decode, speculate=None):
    return StepScheduled(step=1, req_ids=tuple(r for r, _, _ in rows), starts=tuple(s for _, s, _ in rows),
                         chunk_ids=tuple(c for _, _, c in rows), num_decode=num_decode,
                         draft_computed=(0,) * num_decode, speculate=speculate or (True,) * num_decode,
                         prefill_done=(True,) * (len(rows) - num_decode))


def test_reserves_gamma_plus_one_slots_for_decode_rows():
    kv = KVPoolActor(BlockAllocator(10, 4))
    kv.handle(step([(1, 5, (9,)), (2, 0, (1, 2, 3))], num_decode=1), 0.0)
    (res,) = kv.handle(StepPlanned(step=1, gamma=3), 0.0)
    assert res.gamma == 3 and len(res.block_tables[0]) == 3 and len(res.block_tables[1]) == 1   # 5+1+3 = 9 slots


def test_lowers_gamma_when_blocks_run_short():
    kv = KVPoolActor(BlockAllocator(2, 4))
    kv.handle(step([(1, 5, (9,))], num_decode=1), 0.0)
    (res,) = kv.handle(StepPlanned(step=1, gamma=4), 0.0)
    assert res.gamma == 2 and res.num_free == 0


def test_commit_counts_and_release_free_everything():
    alloc = BlockAllocator(10, 4)
    kv = KVPoolActor(alloc)
    kv.handle(step([(1, 0, (1, 2, 3, 4, 5))], num_decode=0), 0.0)
    kv.handle(StepPlanned(step=1, gamma=0), 0.0)
    kv.handle(TokensCommitted(step=1, req_ids=(1,), counts=(1,), tokens=(6,), num_computed=(5,), finish=(0,)), 0.0)
    assert alloc.num_committed(1) == 5
    kv.handle(ReleaseBlocks(req_ids=(1,)), 0.0)
    alloc.check_integrity()
    assert alloc.num_free == 10


def test_a_held_gamma_zero_reserves_each_decode_rows_next_slot_when_blocks_allow():
    kv = KVPoolActor(BlockAllocator(10, 4))
    kv.handle(step([(1, 7, (9,)), (2, 0, (1, 2, 3))], num_decode=1), 0.0)
    (res,) = kv.handle(StepPlanned(step=1, gamma=0, next_zero=True), 0.0)
    assert res.next_zero and len(res.block_tables[0]) == 3 and len(res.block_tables[1]) == 1   # 7+1+1 = 9 slots
    tight = KVPoolActor(BlockAllocator(2, 4))
    tight.handle(step([(1, 7, (9,))], num_decode=1), 0.0)
    (res,) = tight.handle(StepPlanned(step=1, gamma=0, next_zero=True), 0.0)
    assert not res.next_zero and len(res.block_tables[0]) == 2                                # 8 slots only


def test_a_grow_waits_until_no_step_is_in_flight():
    """The pool's layout changes only between steps (a grow under a forward in flight made greedy tokens differ
    in tests/triton_kernels/test_cuda_graph.py's offload cycle): a GrowPool during a step lands at its commit."""
    from nightjar.kernel.messages import GrowPool, PoolResized

    alloc = BlockAllocator(10, 4)
    kv = KVPoolActor(alloc)
    assert [type(m) for m in kv.handle(GrowPool(num_blocks=4), 0.0)] == [PoolResized]     # idle: at once
    assert alloc.num_total == 14
    kv.handle(step([(1, 5, (9,))], num_decode=1), 0.0)
    kv.handle(StepPlanned(step=1, gamma=0), 0.0)
    assert kv.handle(GrowPool(num_blocks=2), 0.0) is None and alloc.num_total == 14         # step 1 in flight
    out = kv.handle(TokensCommitted(step=1, req_ids=(1,), counts=(1,), tokens=(6,), num_computed=(6,),
                                    finish=(0,)), 0.0)
    assert [(type(m), m.delta) for m in out] == [(PoolResized, 2)] and alloc.num_total == 16


def test_a_draft_tree_s_scratch_blocks_stay_held_and_are_named_in_drafting_steps_only():
    from nightjar.actors.kv import SCRATCH_SEQ

    kv = KVPoolActor(BlockAllocator(10, 4), scratch_blocks=4)
    assert kv.alloc.num_free == 6 and len(kv.alloc.block_table(SCRATCH_SEQ)) == 4
    kv.handle(step([(1, 5, (9,))], num_decode=1), 0.0)
    (res,) = kv.handle(StepPlanned(step=1, gamma=2), 0.0)
    assert res.scratch == kv.alloc.block_table(SCRATCH_SEQ) and not set(res.scratch) & set(res.block_tables[0])
    kv.handle(TokensCommitted(step=1, req_ids=(1,), counts=(1,), tokens=(3,), num_computed=(6,), finish=(1,)), 0.0)
    kv.handle(ReleaseBlocks(req_ids=(1,)), 0.0)
    kv.handle(step([(2, 5, (9,))], num_decode=1), 0.0)
    (res,) = kv.handle(StepPlanned(step=1, gamma=0), 0.0)
    assert res.scratch == () and kv.alloc.has_seq(SCRATCH_SEQ)
