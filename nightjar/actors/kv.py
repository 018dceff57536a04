"""KV pool actor: owns the target's block allocator; reserves slots per step (γ+1 lookahead)."""
from __future__ import annotations

from typing import ClassVar

from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved, ReleaseBlocks, StepPlanned, StepScheduled, TokensCommitted,
)
from nightjar.kvpool.blocks import BlockAllocator


class KVPoolActor(Actor):
    name: ClassVar[str] = "kv"
    subscribes = (StepScheduled, StepPlanned, TokensCommitted, ReleaseBlocks)

    def __init__(self, allocator: BlockAllocator):
        super().__init__()
        self.alloc = allocator
        self.sched: StepScheduled | None = None

    def handle(self, msg, now):
        match msg:
            case StepScheduled():
                self.sched = msg
            case StepPlanned():
                return [self._reserve(msg.gamma)]
            case TokensCommitted():
                self._commit(msg)
            case ReleaseBlocks():
                for rid in msg.req_ids:
                    if self.alloc.has_seq(rid):
                        self.alloc.free(rid)
        return None

    def _needs(self, gamma: int) -> list[tuple[int, int]]:
        s = self.sched
        needs = []
        for row, rid in enumerate(s.req_ids):
            extra = gamma if row < s.num_decode and s.speculate[row] else 0
            needs.append((rid, s.starts[row] + len(s.chunk_ids[row]) + extra))
        return needs

    def _fits(self, needs: list[tuple[int, int]]) -> bool:
        return sum(self.alloc.blocks_needed(r, n) for r, n in needs) <= self.alloc.num_free

    def _reserve(self, gamma: int) -> BlocksReserved:
        """Reserve the step's slots; lower γ for the whole step when blocks run short."""
        while gamma > 0 and not self._fits(self._needs(gamma)):
            gamma -= 1
        for rid, n in self._needs(gamma):
            self.alloc.reserve(rid, n)
        s = self.sched
        return BlocksReserved(step=s.step, gamma=gamma,
                              block_tables=tuple(self.alloc.block_table(r) for r in s.req_ids),
                              num_free=self.alloc.num_free, num_total=self.alloc.num_total)

    def _commit(self, msg: TokensCommitted) -> None:
        for rid, n in zip(msg.req_ids, msg.num_computed):
            if not self.alloc.has_seq(rid):
                continue
            cur = self.alloc.num_committed(rid)
            if n > cur:
                self.alloc.commit(rid, n)
            elif n < cur:
                self.alloc.rollback(rid, n)
