"""KV pool actor: owns the target's block allocator (and the cache's segments); reserves slots per
step (γ_i+1 lookahead per row), grows the pool by a segment and shrinks it by migrating only the tail. Both
resizes wait until no step is in flight (they land at that step's commit) and hold the cache's lock against a
run-ahead forward: a forward never sees the pool's layout change under it.

With a draft tree the pool holds ``scratch_blocks`` for good, as the pseudo sequence SCRATCH_SEQ, and names
them in every drafting step's BlocksReserved: the verifier's sibling rows write their KV there (actors/verifier.py)."""
from __future__ import annotations

import time
from typing import ClassVar

from nightjar.actors.gamma_allocator import row_gammas
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    GrowPool,
    PoolResized,
    ReleaseBlocks,
    ShrinkPool,
    StepPlanned,
    StepScheduled,
    TokensCommitted,
)
from nightjar.kernel.threads import on_fresh_thread
from nightjar.kvpool.blocks import BlockAllocator, KVPoolError

SCRATCH_SEQ = -1          # the allocator's sequence id of the draft tree's scratch blocks


class KVPoolActor(Actor):
    name: ClassVar[str] = "kv"
    subscribes = (StepScheduled, StepPlanned, TokensCommitted, ReleaseBlocks, GrowPool, ShrinkPool)
    quiet = (StepScheduled, TokensCommitted)          # stays_quiet

    def __init__(self, allocator: BlockAllocator, cache=None, scratch_blocks: int = 0):
        super().__init__()
        self.alloc, self.cache = allocator, cache      # cache is None in control-plane replay
        self.scratch_blocks = scratch_blocks
        if scratch_blocks:
            allocator.reserve(SCRATCH_SEQ, scratch_blocks * allocator.block_size)
        self.sched: StepScheduled | None = None
        self.inflight: int | None = None               # step whose slots are reserved and not committed
        self.pending_shrink = 0
        self.pending_grow = 0                          # blocks to add once no step is in flight

    def stays_quiet(self, msg) -> bool:
        """A step's commit waits for the next StepPlanned unless it frees blocks (a request finished: an idle
        engine's pool is then all free) or lets a pending resize run."""
        return isinstance(msg, StepScheduled) or not (any(msg.finish) or self.pending_grow or self.pending_shrink)

    def handle(self, msg, now):
        match msg:
            case StepScheduled():
                self.sched = msg
            case StepPlanned():
                self.inflight = msg.step
                return [self._reserve(msg.gamma, msg.gammas, msg.next_zero)]
            case TokensCommitted():
                self._commit(msg)
                if msg.step == self.inflight:
                    self.inflight = None
                    return (self._grow_if_pending() or []) + (self._shrink_if_pending() or []) or None
            case ReleaseBlocks():
                self._release(msg.req_ids)
            case GrowPool():                # like a shrink, between steps: never under a forward in flight
                self.pending_grow += msg.num_blocks
                return self._grow_if_pending() if self.inflight is None else None
            case ShrinkPool():
                self.pending_shrink = msg.num_blocks
                return self._shrink_if_pending() if self.inflight is None else None
        return None

    def _release(self, req_ids) -> None:
        for rid in req_ids:
            if self.alloc.has_seq(rid):
                self.alloc.free(rid)

    @staticmethod
    def _needs(s: StepScheduled, gammas: tuple[int, ...], ahead: int = 0) -> list[int]:
        """Slots each row must cover: its chunk's end, plus γ_i (+ ``ahead``) lookahead for a decode row."""
        nd = s.num_decode
        needs = [start + len(chunk) + g + ahead for start, chunk, g in zip(s.starts, s.chunk_ids, gammas)]
        if len(s.starts) > nd:
            needs += [start + len(chunk) for start, chunk in zip(s.starts[nd:], s.chunk_ids[nd:])]
        return needs

    def _reserve(self, gamma: int, per_row: tuple[int, ...] = (), next_zero: bool = False) -> BlocksReserved:
        """Reserve the step's slots (γ_i per row); when blocks run short, cap every row's γ_i one lower
        at a time (the batch-level γ is lowered for the whole step). With ``next_zero`` (γ = 0 planned for
        the next step too) each decode row also gets the slot of its next token, where the blocks allow."""
        alloc, s = self.alloc, self.sched
        gammas = row_gammas(gamma, per_row, s.speculate, s.num_decode)
        if next_zero and gamma == 0 and s.num_decode:
            needs = self._needs(s, gammas, 1)
            extra = alloc.blocks_needed_rows(s.req_ids, needs)
            if sum(extra) <= alloc.num_free:
                return self._reserved(gamma, gammas, needs, extra, per_row, True)
        while True:
            needs = self._needs(s, gammas)
            extra = alloc.blocks_needed_rows(s.req_ids, needs)
            if gamma == 0 or sum(extra) <= alloc.num_free:
                break
            gamma -= 1
            gammas = tuple(min(g, gamma) for g in gammas)
        if per_row:
            gamma = max(gammas, default=0)
        return self._reserved(gamma, gammas, needs, extra, per_row, False)

    def _reserved(self, gamma, gammas, needs, extra, per_row, next_zero: bool) -> BlocksReserved:
        alloc, s = self.alloc, self.sched
        alloc.reserve_rows(s.req_ids, needs, extra)
        return BlocksReserved(step=s.step, gamma=gamma,
                              block_tables=alloc.block_tables(s.req_ids),
                              num_free=alloc.num_free, num_total=alloc.num_total,
                              gammas=gammas if per_row and gamma else (), next_zero=next_zero,
                              scratch=alloc.block_table(SCRATCH_SEQ) if gamma and self.scratch_blocks else ())

    def _migrate_and_drop(self, pairs) -> None:
        with self.cache.lock:               # not while a run-ahead step (verifier) reads and writes the pool
            self.cache.migrate(pairs)
            self.cache.drop_last_segment()

    def _commit(self, msg: TokensCommitted) -> None:
        self.alloc.set_committed_rows(msg.req_ids, msg.num_computed)

    def _grow_if_pending(self) -> list[PoolResized] | None:
        n, self.pending_grow = self.pending_grow, 0
        return [self._grow(n)] if n else None

    def _add_segment(self, n: int) -> None:
        with self.cache.lock:               # not while a run-ahead step (verifier) reads the pool's layout
            self.cache.add_segment(n)
            self.cache.generation += 1

    def _grow(self, n: int) -> PoolResized:
        """A new segment: no copy of the existing cache."""
        t0 = time.perf_counter()
        if self.cache is not None:          # a fill of up to ~100 MB: not on the loop thread (kernel/threads.py)
            on_fresh_thread(self._add_segment, n)
        self.alloc.grow(n)
        return PoolResized(num_total=self.alloc.num_total, delta=n, duration_s=time.perf_counter() - t0)

    def _shrink_if_pending(self) -> list[PoolResized] | None:
        """Drop the last segment between steps: migrate its live blocks below the boundary first."""
        if not self.pending_shrink:
            return None
        self.pending_shrink = 0
        t0 = time.perf_counter()
        try:
            pairs = self.alloc.plan_shrink()
        except KVPoolError:
            return [PoolResized(num_total=self.alloc.num_total, delta=0)]       # refused: not enough room
        if self.cache is not None:
            on_fresh_thread(self._migrate_and_drop, pairs)
        removed = self.alloc.apply_shrink(pairs)
        return [PoolResized(num_total=self.alloc.num_total, delta=-removed, migrated=len(pairs),
                            duration_s=time.perf_counter() - t0)]
