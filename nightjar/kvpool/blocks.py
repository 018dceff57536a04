"""Host-side paged KV block allocator (stdlib only, no torch).

The pool is a list of contiguous *segments* of block ids; segment 0 is
``[0, num_blocks)`` and :meth:`BlockAllocator.grow` appends more.  Only the
last segment can be dropped again (:meth:`plan_shrink` / :meth:`apply_shrink`).

Allocation policy: every segment keeps its own free stack (a ``list`` popped
from the end) and blocks are taken from the lowest segment that has any free.
A fresh segment's stack is ``[end-1, ..., start]`` so ids come out in
ascending order; freed blocks are pushed back on top of their segment's
stack (LIFO), so after frees ordering within a segment is not sorted, but
live blocks still cluster in the low segments, which keeps shrinking cheap.

Each block carries a refcount (number of block-table references; no block is shared
today, so it is 0 or 1); a block is free iff its refcount is 0, which ``check_integrity`` verifies.
Allocation and release are O(1) per block (plus O(#segments) to find a
non-empty stack, and the number of segments is small).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from typing import Iterable, Sequence

__all__ = ["KVPoolError", "BlockAllocator"]


class KVPoolError(RuntimeError):
    """Misuse of the allocator: unknown seq, double free, out of blocks, ..."""


class _Seq:
    """Per-sequence state: block table plus committed-slot count (``frozen``: the table as a tuple,
    kept until the table changes)."""

    __slots__ = ("table", "committed", "frozen")

    def __init__(self, table: list[int] | None = None, committed: int = 0) -> None:
        self.table: list[int] = table if table is not None else []
        self.committed = committed
        self.frozen: tuple[int, ...] | None = None


class BlockAllocator:
    """Refcounted block allocator with per-sequence block tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise KVPoolError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self._bs = block_size
        self._segments: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._free_stacks: list[list[int]] = []
        self._live: list[set[int]] = []
        self._refcount: list[int] = []
        self._num_free = 0
        self._seqs: dict[int, _Seq] = {}
        self._add_segment(num_blocks)

    # ------------------------------------------------------------ properties
    @property
    def num_total(self) -> int:
        """Number of blocks that exist (sum of segment sizes)."""
        return len(self._refcount)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_total - self._num_free

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """``(start_id, num_blocks)`` per segment, in id order."""
        return tuple(self._segments)

    # ------------------------------------------------------------ internals
    def _add_segment(self, n: int) -> tuple[int, int]:
        start = self.num_total
        self._segments.append((start, n))
        self._starts.append(start)
        self._free_stacks.append(list(range(start + n - 1, start - 1, -1)))
        self._live.append(set())
        self._refcount.extend([0] * n)
        self._num_free += n
        return start, n

    def _seg_of(self, block: int) -> int:
        return bisect_right(self._starts, block) - 1

    def _seq(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KVPoolError(f"unknown seq {seq_id!r}") from None

    def _alloc(self, k: int) -> list[int]:
        """Pop ``k`` free blocks (caller checked availability), lowest segment first."""
        out: list[int] = []
        rc = self._refcount
        for stack, live in zip(self._free_stacks, self._live):
            while stack and len(out) < k:
                b = stack.pop()
                rc[b] = 1
                live.add(b)
                out.append(b)
            if len(out) == k:
                break
        self._num_free -= len(out)
        return out

    def _release(self, block: int) -> bool:
        """Drop one reference; return True if the block became free."""
        rc = self._refcount[block] - 1
        if rc < 0:
            raise KVPoolError(f"double free of block {block}")
        self._refcount[block] = rc
        if rc:
            return False
        seg = self._seg_of(block)
        self._live[seg].discard(block)
        self._free_stacks[seg].append(block)
        self._num_free += 1
        return True

    # ------------------------------------------------------------ per-seq accounting
    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks needed so ``seq_id`` covers ``num_tokens`` slots (seq may be new)."""
        if num_tokens < 0:
            raise KVPoolError(f"num_tokens must be >= 0, got {num_tokens}")
        seq = self._seqs.get(seq_id)
        have = len(seq.table) if seq is not None else 0
        return max(0, -(-num_tokens // self._bs) - have)

    def blocks_needed_rows(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[int]:
        """``blocks_needed`` for each (seq, num_tokens) pair, in one pass."""
        seqs, bs, out = self._seqs, self._bs, []
        for sid, n in zip(seq_ids, num_tokens):
            if n < 0:
                raise KVPoolError(f"num_tokens must be >= 0, got {n}")
            seq = seqs.get(sid)
            k = -(-n // bs) - (len(seq.table) if seq is not None else 0)
            out.append(k if k > 0 else 0)
        return out

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Grow ``seq_id``'s table to cover ``num_tokens`` slots; all-or-nothing."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self._num_free:
            raise KVPoolError(
                f"seq {seq_id!r}: need {need} blocks for {num_tokens} tokens, only {self._num_free} free")
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq()
        if need:
            seq.table.extend(self._alloc(need))
            seq.frozen = None

    def reserve_rows(self, seq_ids: Sequence[int], num_tokens: Sequence[int], extra: Sequence[int]) -> None:
        """``reserve`` each row that is new or short of blocks; ``extra``: each row's ``blocks_needed``
        for ``num_tokens``, computed before this call (each seq once)."""
        seqs = self._seqs
        for sid, n, e in zip(seq_ids, num_tokens, extra):
            if not e:
                if sid not in seqs:
                    seqs[sid] = _Seq()
                continue
            if e > self._num_free:
                raise KVPoolError(f"seq {sid!r}: need {e} blocks for {n} tokens, only {self._num_free} free")
            seq = seqs.get(sid)
            if seq is None:
                seq = seqs[sid] = _Seq()
            seq.table.extend(self._alloc(e))
            seq.frozen = None

    def commit(self, seq_id: int, num_tokens: int) -> None:
        """Record that slots ``[0, num_tokens)`` hold valid KV (non-decreasing, <= capacity)."""
        seq = self._seq(seq_id)
        cap = len(seq.table) * self._bs
        if not seq.committed <= num_tokens <= cap:
            raise KVPoolError(
                f"seq {seq_id!r}: commit {num_tokens} outside [{seq.committed}, {cap}]")
        seq.committed = num_tokens

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Set committed count back to ``num_tokens`` (0 <= n <= committed); frees nothing."""
        seq = self._seq(seq_id)
        if not 0 <= num_tokens <= seq.committed:
            raise KVPoolError(
                f"seq {seq_id!r}: rollback to {num_tokens} outside [0, {seq.committed}]")
        seq.committed = num_tokens

    def set_committed(self, seq_id: int, num_tokens: int) -> None:
        """``commit`` forward or ``rollback`` to ``num_tokens``; a no-op for an unknown (finished) seq."""
        seq = self._seqs.get(seq_id)
        if seq is None or num_tokens == seq.committed:
            return
        if not 0 <= num_tokens <= len(seq.table) * self._bs:
            raise KVPoolError(f"seq {seq_id!r}: commit {num_tokens} outside [0, {len(seq.table) * self._bs}]")
        seq.committed = num_tokens

    def set_committed_rows(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """``set_committed`` for each (seq, num_tokens) pair."""
        seqs, bs = self._seqs, self._bs
        for sid, n in zip(seq_ids, num_tokens):
            seq = seqs.get(sid)
            if seq is None or n == seq.committed:
                continue
            if not 0 <= n <= len(seq.table) * bs:
                raise KVPoolError(f"seq {sid!r}: commit {n} outside [0, {len(seq.table) * bs}]")
            seq.committed = n

    def num_committed(self, seq_id: int) -> int:
        return self._seq(seq_id).committed

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        seq = self._seq(seq_id)
        if seq.frozen is None:
            seq.frozen = tuple(seq.table)
        return seq.frozen

    def block_tables(self, seq_ids: Iterable[int]) -> tuple[tuple[int, ...], ...]:
        """``block_table`` of each seq, in order."""
        seqs = self._seqs
        out = []
        for sid in seq_ids:
            seq = seqs.get(sid)
            if seq is None or seq.frozen is None:
                out.append(self.block_table(sid))      # unknown (raises) or changed since last read
            else:
                out.append(seq.frozen)
        return tuple(out)

    def free(self, seq_id: int) -> int:
        """Drop ``seq_id`` and its references; return how many blocks became free."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KVPoolError(f"free of unknown seq {seq_id!r}")
        if len(self._segments) > 1:
            return sum(self._release(b) for b in reversed(seq.table))
        rc, live, stack, freed = self._refcount, self._live[0], self._free_stacks[0], 0
        for b in reversed(seq.table):            # _release, inlined for the single segment
            r = rc[b] - 1
            if r < 0:
                raise KVPoolError(f"double free of block {b}")
            rc[b] = r
            if not r:
                live.discard(b)
                stack.append(b)
                self._num_free += 1
                freed += 1
        return freed

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> tuple[int, ...]:
        return tuple(self._seqs)

    # ------------------------------------------------------------ elastic memory
    def grow(self, n: int) -> tuple[int, int]:
        """Append a segment of ``n`` free blocks ``[num_total, num_total + n)``."""
        if n <= 0:
            raise KVPoolError(f"grow needs n > 0, got {n}")
        return self._add_segment(n)

    def _free_below_boundary(self) -> int:
        return self._num_free - len(self._free_stacks[-1])

    def can_shrink(self) -> bool:
        """True if the last (non-zero) segment can be dropped."""
        return len(self._segments) > 1 and len(self._live[-1]) <= self._free_below_boundary()

    def plan_shrink(self) -> list[tuple[int, int]]:
        """``(src, dst)`` moves taking every live block of the last segment below it.

        Pure (changes nothing); O(tail live + pairs). Destinations are the blocks
        the allocator would hand out next.
        """
        if len(self._segments) < 2:
            raise KVPoolError("cannot shrink segment 0")
        srcs = sorted(self._live[-1])
        if len(srcs) > self._free_below_boundary():
            raise KVPoolError(
                f"shrink needs {len(srcs)} free blocks below {self._starts[-1]}, "
                f"only {self._free_below_boundary()}")
        dsts: list[int] = []
        for stack in self._free_stacks[:-1]:
            k = min(len(srcs) - len(dsts), len(stack))
            dsts.extend(reversed(stack[len(stack) - k:]))
        return list(zip(srcs, dsts))

    def _check_pairs(self, pairs: Sequence[tuple[int, int]]) -> None:
        if len(self._segments) < 2:
            raise KVPoolError("cannot shrink segment 0")
        boundary = self._starts[-1]
        srcs = {s for s, _ in pairs}
        dsts = {d for _, d in pairs}
        if len(srcs) != len(pairs) or len(dsts) != len(pairs):
            raise KVPoolError("shrink pairs have duplicate src or dst ids")
        if srcs != self._live[-1]:
            raise KVPoolError("shrink pairs must move exactly the live blocks of the last segment")
        bad = [d for d in dsts if not (0 <= d < boundary and self._refcount[d] == 0)]
        if bad:
            raise KVPoolError(f"shrink destinations not free below {boundary}: {sorted(bad)[:8]}")

    def _take_free(self, dsts: Iterable[int]) -> None:
        """Remove specific free ids from their stacks and mark them live."""
        by_seg: dict[int, set[int]] = {}
        for d in dsts:
            by_seg.setdefault(self._seg_of(d), set()).add(d)
        for seg, ids in by_seg.items():
            stack = self._free_stacks[seg]
            if set(stack[len(stack) - len(ids):]) == ids:
                del stack[len(stack) - len(ids):]
            else:
                stack[:] = [b for b in stack if b not in ids]
            self._live[seg] |= ids
            self._num_free -= len(ids)

    def apply_shrink(self, pairs: Sequence[tuple[int, int]]) -> int:
        """Remap tables/refcounts per ``pairs`` and drop the last segment; return its size."""
        pairs = list(pairs)
        self._check_pairs(pairs)
        self._take_free(d for _, d in pairs)
        remap = dict(pairs)
        for s, d in pairs:
            self._refcount[d] = self._refcount[s]
        for seq in self._seqs.values():
            seq.table[:] = [remap.get(b, b) for b in seq.table]
            seq.frozen = None
        start, n = self._segments.pop()
        self._starts.pop()
        self._live.pop()
        self._num_free -= len(self._free_stacks.pop())
        del self._refcount[start:]
        return n

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise :class:`KVPoolError` describing the first violated invariant."""
        self._check_segments()
        free_ids = self._check_free_lists()
        refs = self._check_tables()
        for b, rc in enumerate(self._refcount):
            if rc != refs.get(b, 0):
                raise KVPoolError(f"block {b}: refcount {rc} != {refs.get(b, 0)} table references")
            if (rc == 0) != (b in free_ids):
                raise KVPoolError(f"block {b}: refcount {rc} but free={b in free_ids}")
        used = sum(1 for rc in self._refcount if rc)
        if len(free_ids) + used != self.num_total or self._num_free != len(free_ids):
            raise KVPoolError(
                f"free {len(free_ids)} (counter {self._num_free}) + used {used} != total {self.num_total}")
        self._check_live_sets()

    def _check_segments(self) -> None:
        expect = 0
        for start, n in self._segments:
            if start != expect or n <= 0:
                raise KVPoolError(f"segments not contiguous from 0: {self._segments}")
            expect += n
        if expect != len(self._refcount) or self._starts != [s for s, _ in self._segments]:
            raise KVPoolError(f"segments {self._segments} disagree with {len(self._refcount)} blocks")

    def _check_free_lists(self) -> set[int]:
        seen: set[int] = set()
        for (start, n), stack in zip(self._segments, self._free_stacks):
            for b in stack:
                if b in seen:
                    raise KVPoolError(f"block {b} appears twice in the free lists")
                if not start <= b < start + n:
                    raise KVPoolError(f"free block {b} outside its segment [{start}, {start + n})")
                seen.add(b)
        return seen

    def _check_tables(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for sid, seq in self._seqs.items():
            if len(set(seq.table)) != len(seq.table):
                raise KVPoolError(f"seq {sid!r}: block table has duplicate ids {seq.table}")
            if any(not 0 <= b < self.num_total for b in seq.table):
                raise KVPoolError(f"seq {sid!r}: block id out of range [0, {self.num_total}): {seq.table}")
            if not 0 <= seq.committed <= len(seq.table) * self._bs:
                raise KVPoolError(
                    f"seq {sid!r}: committed {seq.committed} exceeds capacity {len(seq.table) * self._bs}")
            refs.update(seq.table)
        return refs

    def _check_live_sets(self) -> None:
        for (start, n), live in zip(self._segments, self._live):
            expect = {b for b in range(start, start + n) if self._refcount[b]}
            if live != expect:
                raise KVPoolError(f"segment {start}: live set {sorted(live)[:8]} != {sorted(expect)[:8]}")
