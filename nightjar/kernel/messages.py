"""Typed bus messages: frozen msgspec Structs, one tagged union ``BusMsg``.

Rules: only scalars, str, tuples and nested frozen Structs; no tensors; one columnar message per
step; a request is sent whole once, deltas after. Facts are past tense, commands imperative.
"""
from __future__ import annotations

from enum import IntEnum

import msgspec


class Msg(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True, tag=True):
    """Base of every bus message."""


class FinishReason(IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4

    @property
    def label(self) -> str | None:
        return None if self is FinishReason.NONE else self.name.lower()


class SamplingSpec(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


# ---- external inputs -------------------------------------------------------------------------
class SubmitRequest(Msg, frozen=True):
    req_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    speculate: bool = True          # per-request opt-out of speculation


class AbortRequest(Msg, frozen=True):
    req_id: int
    reason: FinishReason = FinishReason.ABORT


# ---- admission ---------------------------------------------------------------------------------
class RequestAdmitted(Msg, frozen=True):
    req_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    speculate: bool = True


class CancelRequest(Msg, frozen=True):
    """Admission's forward of an abort, ordered after the request's RequestAdmitted."""
    req_id: int
    reason: FinishReason = FinishReason.ABORT


class RequestRejected(Msg, frozen=True):
    req_id: int
    status: int                     # HTTP-like: 400 bad input, 429 queue full, 503 stopping
    message: str


# ---- one step ----------------------------------------------------------------------------------
class StepScheduled(Msg, frozen=True):
    """Batcher's choice. Rows [0, num_decode) decode, the rest are prefill chunks."""
    step: int
    req_ids: tuple[int, ...]
    starts: tuple[int, ...]          # first position fed (== tokens in target KV)
    chunk_ids: tuple[tuple[int, ...], ...]   # tokens fed: decode rows hold the last token only
    num_decode: int
    draft_computed: tuple[int, ...]  # tokens already in the draft KV (decode rows)
    speculate: tuple[bool, ...]      # per decode row: may this row draft
    prefill_done: tuple[bool, ...]   # per row: does this chunk finish the prompt (needs a token)
    max_draft_lag: int = 0
    num_waiting: int = 0
    blocks_to_finish: int = -1       # blocks running + waiting requests may still take to reach max_len (-1: unknown)


class StepPlanned(Msg, frozen=True):
    """γ for the step: ``gamma`` = max γ_i; ``gammas`` one per decode row when the planner chose per-row
    draft lengths (0 for rows that do not draft), empty when every speculating row drafts ``gamma``."""
    step: int
    gamma: int
    gammas: tuple[int, ...] = ()
    next_zero: bool = False          # the next step plans γ = 0 too (its batch may start before this one commits)


class BlocksReserved(Msg, frozen=True):
    step: int
    gamma: int                       # may be lower than planned when blocks ran short
    block_tables: tuple[tuple[int, ...], ...]   # one per scheduled row
    num_free: int
    num_total: int
    gammas: tuple[int, ...] = ()     # per decode row, capped like gamma (empty: batch-level, see StepPlanned)
    next_zero: bool = False          # StepPlanned.next_zero, with a slot reserved for each decode row's next token
    scratch: tuple[int, ...] = ()    # γ > 0 with a draft tree: the blocks sibling rows may use (2 per sibling)


class StepDrafted(Msg, frozen=True):
    step: int
    gamma: int
    draft_tokens: tuple[int, ...]    # [num_decode * gamma] flattened, -1 past a row's γ_i / rows that did not draft
    handle: int                      # draft-prob buffer handle (sampling rows)
    draft_time_s: float
    catchup_time_s: float = 0.0
    catchup_tokens: int = 0
    gammas: tuple[int, ...] = ()     # per decode row (empty: batch-level)
    siblings: tuple[int, ...] = ()   # [num_decode * width] runner-up first drafts, -1 where none (draft tree)
    looked: tuple[int, ...] = ()     # decode rows that drafted by prompt lookup, not with the draft model


class StepVerified(Msg, frozen=True):
    """Verifier's result: per row, the tokens emitted (accepted drafts + 1) and accepted counts."""
    step: int
    gamma: int
    req_ids: tuple[int, ...]
    counts: tuple[int, ...]          # tokens emitted per row (0 for non-final prefill chunks)
    tokens: tuple[int, ...]          # flattened
    accepted: tuple[int, ...]        # accepted drafts per row
    num_decode: int
    gammas: tuple[int, ...] = ()     # per decode row γ_i drafted (empty: batch-level)
    ran_ahead: bool = False          # the verifier started the next step: its rows that go on, one token each
    tree_hits: tuple[int, ...] = ()  # per decode row: 1 where a sibling was the target's token (counted in accepted)


class StepTimed(Msg, frozen=True):
    """Measured quantities of one step (the planner's reward; replay re-feeds them)."""
    step: int
    batch_size: int
    gamma: int
    step_time_s: float
    tokens_emitted: int
    max_draft_lag: int = 0
    catchup_time_s: float = 0.0
    catchup_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    num_drafts: int = 0
    num_prefill_tokens: int = 0
    drafted_per_pos: tuple[int, ...] = ()    # per-row γ only: rows that drafted position i (= ran pass i+1)
    reached_per_pos: tuple[int, ...] = ()    # per-row γ only: rows that drafted position i with 0..i-1 accepted
    draft_time_s: float = 0.0        # the draft passes' part of step_time_s (0: γ = 0, or a trace from before)
    tree_hits: int = 0               # rows whose first draft missed and a sibling was the target's token
    lookup_drafts: int = 0           # batch-level γ: drafting rows whose drafts came from prompt lookup
    lookup_accepted_per_pos: tuple[int, ...] = ()    # ... and how many of them accepted position i


class TokensCommitted(Msg, frozen=True):
    """Batcher's per-step delta for clients: new tokens per request and finishes."""
    step: int
    req_ids: tuple[int, ...]
    counts: tuple[int, ...]
    tokens: tuple[int, ...]
    num_computed: tuple[int, ...]    # tokens now held in the target KV per request
    finish: tuple[int, ...]          # FinishReason per request
    num_prompt: tuple[int, ...] = ()


class RequestsPreempted(Msg, frozen=True):
    req_ids: tuple[int, ...]


class ReleaseBlocks(Msg, frozen=True):
    """Command to the KV pool: free these requests' blocks (finished, aborted or preempted)."""
    req_ids: tuple[int, ...]


# ---- draft residency and elastic memory --------------------------------------------------------
class OffloadDraft(Msg, frozen=True):
    reason: str = ""


class ReloadDraft(Msg, frozen=True):
    reason: str = ""


class DraftOffloaded(Msg, frozen=True):
    bytes_moved: int
    duration_s: float
    freed_blocks: int                # blocks the pool may grow by


class DraftReloaded(Msg, frozen=True):
    bytes_moved: int
    duration_s: float


class GrowPool(Msg, frozen=True):
    """Command to the KV pool: add a segment of this many blocks (the draft's freed bytes)."""
    num_blocks: int


class ShrinkPool(Msg, frozen=True):
    """Command to the KV pool: migrate the live blocks of the last segment below it, then drop it."""
    num_blocks: int


class TransferFinished(Msg, frozen=True):
    """A draft weight move finished (measured on the transfer worker), or failed (``error`` says why)."""
    kind: str                        # "offload" | "reload"
    nbytes: int
    duration_s: float
    error: str = ""


class PoolResized(Msg, frozen=True):
    num_total: int
    delta: int
    migrated: int = 0
    duration_s: float = 0.0


class DraftResidency(Msg, frozen=True):
    resident: bool
    state: str


class DraftQuiesced(Msg, frozen=True):
    """The draft executor has handled DraftResidency(resident=False, state="OFFLOADING"): it touches the
    draft's weights and caches no more until the draft is resident again, so the weight mover may copy them out
    and release them."""


# ---- lifecycle ---------------------------------------------------------------------------------
class EngineStopping(Msg, frozen=True):
    reason: str = ""


BusMsg = (
    SubmitRequest | AbortRequest | RequestAdmitted | CancelRequest | RequestRejected | StepScheduled | StepPlanned
    | BlocksReserved | StepDrafted | StepVerified | StepTimed | TokensCommitted | RequestsPreempted | ReleaseBlocks
    | OffloadDraft | ReloadDraft | DraftOffloaded | DraftReloaded | PoolResized | DraftResidency | DraftQuiesced
    | GrowPool | ShrinkPool | TransferFinished
    | EngineStopping
)
