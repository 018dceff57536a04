"""The weight mover's reload rule, on its own (handle() called directly, no event loop, no model)."""
from __future__ import annotations

import itertools

from nightjar.actors.control import triggers_of
from nightjar.actors.weights import Triggers, WeightMover
from nightjar.kernel.config import EngineConfig
from nightjar.kernel.messages import (
    DraftResidency,
    FinishReason,
    RequestAdmitted,
    SamplingSpec,
    ShrinkPool,
    TokensCommitted,
)


def test_an_empty_pool_always_qualifies_for_reload_whatever_the_limits():
    grid = itertools.product((1, 8, 64, 256), (64, 512, 8192), (8, 16, 32), (4, 24, 101, 4000), (1, 91, 1540),
                             (0.05, 0.10, 0.20))
    for seqs, batched, bs, base, draft, frac in grid:
        cfg = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=batched, block_size=bs, low_free_frac=frac)
        t = triggers_of(draft, cfg)
        total = base + draft
        assert t.wants_reload(free=total, total=total, waiting=0), (seqs, batched, bs, base, draft, frac)
        assert not t.wants_reload(free=total, total=total, waiting=1)
        assert not t.wants_reload(free=draft, total=total, waiting=0)           # the base pool is all in use


def test_the_issue_case_reloads_once_about_half_the_base_pool_is_free():
    """The issue's case (--device-memory 340000000 before the packed copies counted): 101 base blocks, a 91-block
    draft, headroom 160."""
    t = triggers_of(91, EngineConfig())
    assert t.headroom_blocks == 160
    total = 101 + 91
    assert t.reload_headroom(101) == 0.9 * 101 / 2
    assert t.wants_reload(free=total - 40, total=total, waiting=0)
    assert not t.wants_reload(free=total - 60, total=total, waiting=0)
    # a big pool keeps the configured headroom
    big = Triggers(draft_blocks=91, headroom_blocks=160)
    assert big.reload_headroom(4000) == 160


def offloaded_mover() -> WeightMover:
    m = WeightMover(None, Triggers(draft_blocks=10), elastic=False)
    m.elastic, m.state = True, "OFFLOADED"
    return m


def committed(req_ids, finish):
    n = len(req_ids)
    return TokensCommitted(step=1, req_ids=tuple(req_ids), counts=(0,) * n, tokens=(), num_computed=(0,) * n,
                           finish=tuple(int(f) for f in finish))


def test_an_idle_engine_reloads_an_offloaded_draft_when_its_last_request_finishes():
    m = offloaded_mover()
    for rid in (1, 2):
        m.handle(RequestAdmitted(req_id=rid, prompt_ids=(1,), sampling=SamplingSpec()), 0.0)
    assert m.handle(committed([1, 2], [FinishReason.LENGTH, FinishReason.NONE]), 0.0) is None
    out = m.handle(committed([2], [FinishReason.ABORT]), 0.0)
    assert [type(x) for x in out] == [ShrinkPool, DraftResidency] and out[0].num_blocks == 10
    assert m.state == "SHRINKING"


def test_a_mover_without_elastic_memory_keeps_a_commanded_offload():
    m = offloaded_mover()
    m.elastic = False
    m.handle(RequestAdmitted(req_id=1, prompt_ids=(1,), sampling=SamplingSpec()), 0.0)
    assert m.handle(committed([1], [FinishReason.STOP]), 0.0) is None and m.state == "OFFLOADED"


def test_a_waiting_request_triggers_the_offload_only_with_offload_on_queue():
    on, off = Triggers(draft_blocks=10), Triggers(draft_blocks=10, offload_on_queue=False)
    assert on.wants_offload(0, free=50, total=100, waiting=1)            # plenty free, but a request waits
    assert not off.wants_offload(0, free=50, total=100, waiting=1)
    for t in (on, off):
        assert t.wants_offload(0, free=5, total=100, waiting=0)         # below τ_low: both
        assert not t.wants_offload(2, free=5, total=100, waiting=3)     # never while speculating
        assert not t.wants_offload(0, free=50, total=100, waiting=0)


def test_the_triggers_offload_only_when_the_requests_may_outgrow_the_free_blocks():
    t = Triggers(draft_blocks=10)
    assert t.wants_offload(0, free=5, total=100, waiting=0, to_finish=6)     # they may need 6 of 5: short
    assert not t.wants_offload(0, free=5, total=100, waiting=0, to_finish=5)  # every max_len fits: no gain
    assert t.wants_offload(0, free=5, total=100, waiting=0, to_finish=-1)    # unknown demand: τ_low alone
    assert t.wants_offload(0, free=50, total=100, waiting=1, to_finish=60)   # waiting, and the pool too small
    assert not t.wants_offload(0, free=50, total=100, waiting=1, to_finish=50)   # waiting for the prefill budget


def test_repeated_copy_failures_turn_elastic_memory_off_instead_of_retrying_forever():
    from nightjar.actors.control import StubSlot
    from nightjar.actors.weights import MAX_COPY_FAILURES
    from nightjar.kernel.messages import OffloadDraft, TransferFinished

    m = WeightMover(StubSlot(4096), Triggers(draft_blocks=10), elastic=True)
    failed = TransferFinished(kind="offload", nbytes=0, duration_s=0.0, error="MemoryError: no host memory")
    for i in range(MAX_COPY_FAILURES):
        assert m.handle(OffloadDraft(), 0.0) == [DraftResidency(resident=False, state="OFFLOADING")]
        assert m.handle(failed, 0.0) == [DraftResidency(resident=True, state="RESIDENT")]
        assert m.elastic == (i < MAX_COPY_FAILURES - 1)
