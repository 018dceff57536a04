"""Batcher.handle() driven directly: no event loop, no model."""
from __future__ import annotations

from nightjar.actors.batcher import Batcher
from nightjar.kernel.messages import (
    BlocksReserved,
    CancelRequest,
    FinishReason,
    ReleaseBlocks,
    RequestAdmitted,
    RequestsPreempted,
    SamplingSpec,
    StepScheduled,
    StepVerified,
    TokensCommitted,
)


def admit(b: Batcher, rid: int, n: int, max_tokens: int = 8, **kw):
    msg = RequestAdmitted(req_id=rid, prompt_ids=tuple(range(10, 10 + n)),
                          sampling=SamplingSpec(max_tokens=max_tokens, **kw))
    return b.handle(msg, 0.0)


def only(out, cls):
    return [m for m in (out or []) if isinstance(m, cls)]


def verify(b: Batcher, step: StepScheduled, toks_per_row, accepted=None, gamma=0):
    b.handle(BlocksReserved(step=step.step, gamma=gamma, block_tables=tuple((0,) * 4 for _ in step.req_ids),
                            num_free=b.num_free, num_total=100), 0.0)
    flat = tuple(t for row in toks_per_row for t in row)
    return b.handle(StepVerified(step=step.step, gamma=gamma, req_ids=step.req_ids,
                                 counts=tuple(map(len, toks_per_row)), tokens=flat,
                                 accepted=tuple(accepted or [0] * len(toks_per_row)), num_decode=step.num_decode), 0.0)


def test_a_new_request_is_scheduled_as_one_prefill_chunk():
    b = Batcher(num_blocks=100, block_size=4)
    (step,) = only(admit(b, 1, 10), StepScheduled)
    assert step.req_ids == (1,) and step.num_decode == 0 and step.chunk_ids == (tuple(range(10, 20)),)
    assert step.prefill_done == (True,)


def test_long_prompts_are_chunked_under_the_token_budget():
    b = Batcher(num_blocks=100, block_size=4, max_num_batched_tokens=6)
    (step,) = only(admit(b, 1, 10), StepScheduled)
    assert len(step.chunk_ids[0]) == 6 and step.prefill_done == (False,)
    out = verify(b, step, [[]])
    (nxt,) = only(out, StepScheduled)
    assert nxt.starts == (6,) and len(nxt.chunk_ids[0]) == 4 and nxt.prefill_done == (True,)


def test_decode_rows_come_first_and_feed_the_last_token():
    b = Batcher(num_blocks=100, block_size=4)
    (s1,) = only(admit(b, 1, 5), StepScheduled)
    admit(b, 2, 3)                                         # waits: one step in flight
    (s2,) = only(verify(b, s1, [[99]]), StepScheduled)
    assert s2.req_ids == (1, 2) and s2.num_decode == 1 and s2.chunk_ids[0] == (99,) and s2.starts[0] == 5


def test_accepted_drafts_advance_kv_and_draft_counters():
    b = Batcher(num_blocks=100, block_size=4)
    (s1,) = only(admit(b, 1, 5, max_tokens=50), StepScheduled)
    (s2,) = only(verify(b, s1, [[7]]), StepScheduled)
    assert s2.draft_computed == (0,) and s2.max_draft_lag == 5
    out = verify(b, s2, [[1, 2, 3]], accepted=[2], gamma=3)
    (tc,) = only(out, TokensCommitted)
    assert tc.num_computed == (6 + 2,) and tc.tokens == (1, 2, 3)
    seq = b.seqs[1]
    assert seq.draft_computed == 6 + 2 and len(seq.tokens) == 9


def test_steps_say_how_many_blocks_the_running_and_waiting_requests_may_still_take():
    b = Batcher(num_blocks=100, block_size=4, max_num_seqs=1)
    (s1,) = only(admit(b, 1, 5, max_tokens=50), StepScheduled)           # may reach 55 tokens: 14 blocks
    assert s1.blocks_to_finish == 14
    admit(b, 2, 7, max_tokens=1)                                          # waits for a batch slot: 2 blocks
    (s2,) = only(verify(b, s1, [[7]]), StepScheduled)                     # 4 of request 1's 14 held now
    assert s2.req_ids == (1,) and s2.num_waiting == 1 and s2.blocks_to_finish == 10 + 2


def test_stop_token_and_max_tokens_finish_and_release():
    b = Batcher(num_blocks=100, block_size=4, eos_ids=(2,))
    (s1,) = only(admit(b, 1, 5, max_tokens=3), StepScheduled)
    (s2,) = only(verify(b, s1, [[7]]), StepScheduled)
    out = verify(b, s2, [[8, 2, 9]], accepted=[2], gamma=2)
    (tc,) = only(out, TokensCommitted)
    assert tc.tokens == (8, 2) and tc.finish == (FinishReason.STOP,)
    assert only(out, ReleaseBlocks)[0].req_ids == (1,) and not b.seqs


def test_max_tokens_cuts_accepted_tokens():
    b = Batcher(num_blocks=100, block_size=4)
    (s1,) = only(admit(b, 1, 5, max_tokens=2), StepScheduled)
    (s2,) = only(verify(b, s1, [[7]]), StepScheduled)
    (tc,) = only(verify(b, s2, [[8, 9, 10]], accepted=[2], gamma=2), TokensCommitted)
    assert tc.tokens == (8,) and tc.finish == (FinishReason.LENGTH,)


def test_ignore_eos_keeps_going_past_eos():
    b = Batcher(num_blocks=100, block_size=4, eos_ids=(2,))
    (s1,) = only(admit(b, 1, 5, max_tokens=5, ignore_eos=True), StepScheduled)
    (tc,) = only(verify(b, s1, [[2]]), TokensCommitted)
    assert tc.finish == (FinishReason.NONE,)


def test_a_dry_pool_preempts_the_newest_request_by_recompute():
    b = Batcher(num_blocks=4, block_size=4)
    (s1,) = only(admit(b, 1, 4), StepScheduled)
    admit(b, 2, 4)
    b.handle(BlocksReserved(step=s1.step, gamma=0, block_tables=((0,),), num_free=3, num_total=4), 0.0)
    (s2,) = only(b.handle(StepVerified(step=1, gamma=0, req_ids=(1,), counts=(1,), tokens=(5,), accepted=(0,),
                                       num_decode=0), 0.0), StepScheduled)
    b.handle(BlocksReserved(step=s2.step, gamma=0, block_tables=((0, 1), (2,)), num_free=1, num_total=4), 0.0)
    b.num_free = 0
    b.seqs[1].tokens += [6, 7, 8]                           # pretend both need a new block
    b.seqs[1].num_computed = 7
    out = b.handle(StepVerified(step=2, gamma=0, req_ids=(1, 2), counts=(1, 1), tokens=(9, 9), accepted=(0, 0),
                                num_decode=1), 0.0)
    pre = only(out, RequestsPreempted)
    assert pre and pre[0].req_ids == (2,) and 2 in b.waiting and b.seqs[2].num_computed == 0
    assert b.num_preemptions == 1


def test_abort_of_a_waiting_request_finishes_it_at_once():
    b = Batcher(num_blocks=100, block_size=4)
    admit(b, 1, 4)
    admit(b, 2, 4)
    out = b.handle(CancelRequest(req_id=2), 0.0)
    (tc,) = only(out, TokensCommitted)
    assert tc.req_ids == (2,) and tc.finish == (FinishReason.ABORT,) and 2 not in b.seqs


def test_abort_of_a_row_in_flight_waits_for_the_step_to_finish():
    b = Batcher(num_blocks=100, block_size=4)
    (s1,) = only(admit(b, 1, 4), StepScheduled)
    assert not b.handle(CancelRequest(req_id=1), 0.0)
    out = verify(b, s1, [[5]])
    (tc,) = only(out, TokensCommitted)
    assert tc.finish == (FinishReason.ABORT,) and tc.tokens == () and only(out, ReleaseBlocks)


def test_after_a_run_ahead_the_next_step_is_its_decode_rows_and_a_new_request_waits_one_step():
    """StepVerified.ran_ahead: the verifier already started the next step with the rows that go on; the batcher
    schedules exactly that step (no prefill) and the prompt that arrived meanwhile goes in the one after."""
    b = Batcher(num_blocks=100, block_size=4)
    (s1,) = only(admit(b, 1, 5), StepScheduled)
    (s2,) = only(verify(b, s1, [[99]]), StepScheduled)
    admit(b, 2, 3)                                         # arrives while step 2 runs
    b.handle(BlocksReserved(step=s2.step, gamma=0, block_tables=((0, 1),), num_free=b.num_free, num_total=100), 0.0)
    out = b.handle(StepVerified(step=s2.step, gamma=0, req_ids=(1,), counts=(1,), tokens=(98,), accepted=(0,),
                                num_decode=1, ran_ahead=True), 0.0)
    (s3,) = only(out, StepScheduled)
    assert s3.req_ids == (1,) and s3.chunk_ids == ((98,),) and s3.starts == (6,) and s3.num_waiting == 1
    (s4,) = only(verify(b, s3, [[97]]), StepScheduled)
    assert s4.req_ids == (1, 2) and s4.num_decode == 1


def test_first_stop_is_the_batchers_rule():
    from nightjar.actors.stops import first_stop

    assert first_stop((5, 6, 7), 10, 2, 0, frozenset({6}), 100) == (2, FinishReason.STOP)
    assert first_stop((5, 6, 7), 10, 0, 3, frozenset({6}), 100) == (3, FinishReason.NONE)   # min_tokens
    assert first_stop((5, 6, 7), 10, 2, 0, frozenset(), 12) == (2, FinishReason.LENGTH)
    assert first_stop((6,), 10, 2, 0, frozenset(), 11) == (1, FinishReason.LENGTH)
