"""When a request stops: the one rule the batcher commits by and the verifier predicts with (a run-ahead step
leaves out the rows that stop; actors/verifier.py)."""
from __future__ import annotations

from nightjar.kernel.messages import FinishReason, SamplingSpec


def stop_ids_of(sp: SamplingSpec, eos_ids: frozenset[int]) -> frozenset[int]:
    """Token ids that end the request: its stop tokens, and the model's EOS unless it ignores EOS."""
    return frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos_ids)


def max_len_of(num_prompt: int, sp: SamplingSpec, max_model_len: int) -> int:
    """Tokens the request may reach, prompt included."""
    return min(num_prompt + sp.max_tokens, max_model_len)


def first_stop(new, num_tokens: int, num_output: int, min_tokens: int, stop_ids: frozenset[int],
               max_len: int) -> tuple[int, FinishReason]:
    """How many of the ``new`` tokens a request holding ``num_tokens`` (``num_output`` generated) keeps, and
    why it stops there: at a stop id once past ``min_tokens``, or at ``max_len`` tokens (NONE: it goes on)."""
    room = max_len - num_tokens
    for i, tok in enumerate(new):
        if tok in stop_ids and num_output + i + 1 > min_tokens:
            return i + 1, FinishReason.STOP
        if i + 1 >= room:
            return i + 1, FinishReason.LENGTH
    return len(new), FinishReason.NONE
