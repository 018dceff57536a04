"""Admission.handle() driven directly (no event loop): what it admits, the exact status and message of each
rejection, the in-flight bound (429) and its release on finish, and abort forwarding."""
from __future__ import annotations

import pytest

from nightjar.actors.admission import Admission
from nightjar.kernel.messages import (
    AbortRequest,
    CancelRequest,
    FinishReason,
    RequestAdmitted,
    RequestRejected,
    SamplingSpec,
    SubmitRequest,
    TokensCommitted,
)

VOCAB, MAX_LEN = 100, 16


def submit(rid: int, prompt=(1, 2, 3), speculate: bool = True, **sampling) -> SubmitRequest:
    return SubmitRequest(req_id=rid, prompt_ids=tuple(prompt), sampling=SamplingSpec(**sampling), speculate=speculate)


def admitted(msg: SubmitRequest) -> list:
    return [RequestAdmitted(req_id=msg.req_id, prompt_ids=msg.prompt_ids, sampling=msg.sampling,
                            speculate=msg.speculate)]


def finished(*rids: int, finish=FinishReason.STOP) -> TokensCommitted:
    n = len(rids)
    return TokensCommitted(step=1, req_ids=rids, counts=(1,) * n, tokens=(5,) * n, num_computed=(4,) * n,
                           finish=(int(finish),) * n)


@pytest.mark.parametrize("msg", [
    submit(1),
    submit(2, speculate=False, max_tokens=1, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(99, 0)),
    submit(3, prompt=(0, VOCAB - 1), temperature=100.0, top_p=1.0, seed=2**63 - 1, min_tokens=16, max_tokens=16),
    submit(4, prompt=tuple(range(MAX_LEN - 1))),               # leaves room for exactly one token
], ids=["defaults", "sampled-no-speculation", "boundary-values", "longest-prompt"])
def test_a_valid_request_is_admitted_whole(msg):
    a = Admission(VOCAB, MAX_LEN, max_queue=4)
    assert a.handle(msg, 0.0) == admitted(msg)
    assert a.in_flight == {msg.req_id}


BAD = [
    (submit(1, prompt=()), "prompt is empty"),
    (submit(1, prompt=tuple(range(MAX_LEN))),
     f"prompt has {MAX_LEN} tokens; the context is {MAX_LEN} (prompt must leave room for 1 token)"),
    (submit(1, prompt=(1, -1)), f"prompt token ids must be in [0, {VOCAB})"),
    (submit(1, prompt=(1, VOCAB)), f"prompt token ids must be in [0, {VOCAB})"),
    (submit(1, max_tokens=0), "max_tokens must be >= 1"),
    (submit(1, temperature=-0.01), "temperature must be in [0, 100]"),
    (submit(1, temperature=100.5), "temperature must be in [0, 100]"),
    (submit(1, temperature=float("nan")), "temperature must be in [0, 100]"),
    (submit(1, top_p=0.0), "top_p must be in (0, 1]"),
    (submit(1, top_p=1.01), "top_p must be in (0, 1]"),
    (submit(1, top_p=float("nan")), "top_p must be in (0, 1]"),
    (submit(1, top_k=-1), "top_k must be >= 0 (0 disables it)"),
    (submit(1, min_tokens=-1), "min_tokens must be in [0, max_tokens]"),
    (submit(1, min_tokens=5, max_tokens=4), "min_tokens must be in [0, max_tokens]"),
    (submit(1, stop_token_ids=(3, VOCAB)), "stop_token_ids out of vocabulary"),
    (submit(1, stop_token_ids=(-1,)), "stop_token_ids out of vocabulary"),
    (submit(1, seed=-1), "seed must be in [0, 2**63)"),
    (submit(1, seed=2**63), "seed must be in [0, 2**63)"),
    (submit(1, prompt=(), max_tokens=0), "prompt is empty"),               # the first failing check is named
]


@pytest.mark.parametrize("msg,why", BAD, ids=[f"{i}:{w.split()[0]}" for i, (_, w) in enumerate(BAD)])
def test_bad_input_is_rejected_with_400_and_a_one_line_reason_and_takes_no_slot(msg, why):
    a = Admission(VOCAB, MAX_LEN, max_queue=1)
    assert a.handle(msg, 0.0) == [RequestRejected(req_id=1, status=400, message=why)]
    assert a.in_flight == set()
    assert "\n" not in why


def test_the_base_kv_pool_caps_the_context():
    a = Admission(VOCAB, MAX_LEN, max_queue=4, pool_tokens=8)
    assert a.handle(submit(1, prompt=range(8)), 0.0) == [RequestRejected(
        req_id=1, status=400, message="prompt has 8 tokens; the context is 8 (prompt must leave room for 1 token)")]
    ok = submit(2, prompt=range(7))
    assert a.handle(ok, 0.0) == admitted(ok)


def test_a_full_queue_rejects_with_429_until_a_request_finishes():
    a = Admission(VOCAB, MAX_LEN, max_queue=2)
    for rid in (1, 2):
        assert a.handle(submit(rid), 0.0) == admitted(submit(rid))
    busy = [RequestRejected(req_id=3, status=429, message="server busy: 2 requests in flight")]
    assert a.handle(submit(3), 0.0) == busy
    assert a.handle(submit(3, prompt=()), 0.0)[0].status == 400            # input is checked first
    # a commit that finishes nothing frees nothing; a finish (any reason) frees that request's slot
    assert a.handle(TokensCommitted(step=1, req_ids=(1, 2), counts=(1, 1), tokens=(5, 6), num_computed=(4, 4),
                                    finish=(0, 0)), 0.0) is None
    assert a.handle(submit(3), 0.0) == busy
    assert a.handle(finished(2, finish=FinishReason.LENGTH), 0.0) is None
    assert a.in_flight == {1}
    assert a.handle(submit(4), 0.0) == admitted(submit(4))
    assert a.handle(submit(5), 0.0)[0] == RequestRejected(req_id=5, status=429,
                                                          message="server busy: 2 requests in flight")


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.STOP])
def test_an_abort_of_a_request_in_flight_is_forwarded_as_a_cancel_with_its_reason(reason):
    a = Admission(VOCAB, MAX_LEN, max_queue=1)
    a.handle(submit(7), 0.0)
    assert a.handle(AbortRequest(req_id=7, reason=reason), 0.0) == [CancelRequest(req_id=7, reason=reason)]
    assert a.in_flight == {7}                     # the slot is freed by the batcher's finish, not the abort
    assert a.handle(submit(8), 0.0)[0].status == 429
    a.handle(finished(7, finish=FinishReason.ABORT), 0.0)
    assert a.handle(AbortRequest(req_id=7), 0.0) is None                   # finished: nothing to cancel
    assert a.handle(submit(8), 0.0) == admitted(submit(8))


def test_aborts_of_unknown_or_rejected_requests_are_dropped():
    a = Admission(VOCAB, MAX_LEN, max_queue=1)
    assert a.handle(AbortRequest(req_id=1), 0.0) is None
    a.handle(submit(2, prompt=()), 0.0)                                    # rejected: never in flight
    assert a.handle(AbortRequest(req_id=2), 0.0) is None
    assert a.handle(finished(9), 0.0) is None and a.in_flight == set()      # a finish of an unknown id is harmless


def test_a_request_id_already_in_flight_is_rejected():
    a = Admission(VOCAB, MAX_LEN, max_queue=4)
    a.handle(submit(1), 0.0)
    (out,) = a.handle(submit(1, prompt=(4, 5)), 0.0)
    assert isinstance(out, RequestRejected) and out.req_id == 1 and out.status == 400
    assert "1" in out.message and "\n" not in out.message
