"""Admission: validate requests at the edge and bound the number in flight (backpressure)."""
from __future__ import annotations

from typing import ClassVar

from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    AbortRequest,
    CancelRequest,
    RequestAdmitted,
    RequestRejected,
    SamplingSpec,
    SubmitRequest,
    TokensCommitted,
)


def context_limit(max_model_len: int, pool_tokens: int | None = None) -> int:
    """The context the engine always honours: max_model_len, capped by the base KV pool (the pool with
    the draft resident; it only grows beyond that while the draft is offloaded)."""
    return max_model_len if pool_tokens is None else min(max_model_len, pool_tokens)


def validate(prompt_ids: tuple[int, ...], sp: SamplingSpec, vocab_size: int, max_model_len: int,
             pool_tokens: int | None = None) -> str | None:
    """The reason a request cannot run, or None."""
    if not prompt_ids:
        return "prompt is empty"
    limit = context_limit(max_model_len, pool_tokens)
    if len(prompt_ids) >= limit:
        return f"prompt has {len(prompt_ids)} tokens; the context is {limit} (prompt must leave room for 1 token)"
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    return validate_sampling(sp, vocab_size)


def validate_sampling(sp: SamplingSpec, vocab_size: int) -> str | None:
    checks = [
        (sp.max_tokens < 1, "max_tokens must be >= 1"),
        (not 0.0 <= sp.temperature <= 100.0, "temperature must be in [0, 100]"),
        (not 0.0 < sp.top_p <= 1.0, "top_p must be in (0, 1]"),
        (sp.top_k < 0, "top_k must be >= 0 (0 disables it)"),
        (sp.min_tokens < 0 or sp.min_tokens > sp.max_tokens, "min_tokens must be in [0, max_tokens]"),
        (any(t < 0 or t >= vocab_size for t in sp.stop_token_ids), "stop_token_ids out of vocabulary"),
        (sp.seed is not None and not 0 <= sp.seed < 2**63, "seed must be in [0, 2**63)"),
    ]
    return next((why for bad, why in checks if bad), None)


class Admission(Actor):
    name: ClassVar[str] = "admission"
    subscribes = (SubmitRequest, TokensCommitted, AbortRequest)
    quiet = (TokensCommitted,)          # finished ids only matter to the next submit or abort, handled after them

    def __init__(self, vocab_size: int, max_model_len: int, max_queue: int, pool_tokens: int | None = None):
        super().__init__()
        self.vocab_size, self.max_model_len, self.max_queue = vocab_size, max_model_len, max_queue
        self.pool_tokens = pool_tokens
        self.in_flight: set[int] = set()

    def handle(self, msg, now):
        match msg:
            case SubmitRequest():
                return [self._submit(msg)]
            case AbortRequest() if msg.req_id in self.in_flight:
                return [CancelRequest(req_id=msg.req_id, reason=msg.reason)]
            case TokensCommitted():
                self.in_flight.difference_update(r for r, f in zip(msg.req_ids, msg.finish) if f)
        return None

    def _submit(self, msg: SubmitRequest):
        why = validate(msg.prompt_ids, msg.sampling, self.vocab_size, self.max_model_len, self.pool_tokens)
        if msg.req_id in self.in_flight:
            why = f"request id {msg.req_id} is already in flight"
        if why:
            return RequestRejected(req_id=msg.req_id, status=400, message=why)
        if len(self.in_flight) >= self.max_queue:
            return RequestRejected(req_id=msg.req_id, status=429,
                                   message=f"server busy: {self.max_queue} requests in flight")
        self.in_flight.add(msg.req_id)
        return RequestAdmitted(req_id=msg.req_id, prompt_ids=msg.prompt_ids, sampling=msg.sampling,
                               speculate=msg.speculate)
