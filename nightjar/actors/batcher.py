"""Batcher: continuous batching (waiting/running), chunked prefill under a token budget,
preemption by recompute when the pool runs dry, stop conditions, and draft-lag bookkeeping.

One step is in flight at a time: schedule -> (planner, KV, draft, verifier) -> StepVerified -> commit. (The
verifier may start the next decode step before this commit, ``StepVerified.ran_ahead``; that step is then the
one scheduled next.)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from nightjar.actors.stops import first_stop, max_len_of, stop_ids_of
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    CancelRequest,
    FinishReason,
    PoolResized,
    ReleaseBlocks,
    RequestAdmitted,
    RequestsPreempted,
    SamplingSpec,
    StepScheduled,
    StepVerified,
    TokensCommitted,
)


@dataclass(slots=True)
class Seq:
    req_id: int
    sampling: SamplingSpec
    speculate: bool
    tokens: list[int]
    num_prompt: int
    arrival: int
    num_computed: int = 0        # tokens whose KV the target holds
    draft_computed: int = 0      # tokens whose KV the draft holds
    num_blocks: int = 0          # blocks the pool holds for it (mirror of the KV actor)
    running: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    max_len: int = 0             # token count it may reach: min(prompt + max_tokens, max_model_len)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def in_decode(self) -> bool:
        n = len(self.tokens)
        return self.num_computed >= n - 1 and n > self.num_prompt

    def prefill_end(self) -> int:
        """Where prefill stops: the whole prompt, or all but the last token after a recompute."""
        return len(self.tokens) - (1 if self.num_output else 0)


@dataclass(slots=True)
class _DecodeRows:
    """A step's decode rows as the batcher collects them: ids, Seq objects, blocks each needs (and
    their sum) and the StepScheduled columns (start, last token, draft KV, speculate, draft lags)."""
    ids: list[int] = field(default_factory=list)
    seqs: list[Seq] = field(default_factory=list)
    need: dict[int, int] = field(default_factory=dict)
    total: int = 0
    starts: list[int] = field(default_factory=list)
    chunks: list[tuple[int, ...]] = field(default_factory=list)
    dcs: list[int] = field(default_factory=list)
    specs: list[bool] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)


class Batcher(Actor):
    name: ClassVar[str] = "batcher"
    subscribes = (RequestAdmitted, CancelRequest, StepVerified, BlocksReserved, PoolResized)
    quiet = (BlocksReserved,)           # mirrored blocks are read at the step's StepVerified, handled after it

    def __init__(self, num_blocks: int, block_size: int, eos_ids: tuple[int, ...] = (),
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int = 2048):
        super().__init__()
        self.block_size, self.eos_ids = block_size, frozenset(eos_ids)
        self.max_num_seqs, self.budget, self.max_model_len = max_num_seqs, max_num_batched_tokens, max_model_len
        self.num_free = num_blocks
        self.seqs: dict[int, Seq] = {}
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self.step = 0
        self.inflight: StepScheduled | None = None
        self._rows: list[Seq] = []             # the Seq of each row of ``inflight``, in row order
        self.arrivals = 0
        self.num_preemptions = 0
        self.aborts: dict[int, FinishReason] = {}

    # ---- message dispatch ----------------------------------------------------------------------
    def handle(self, msg, now):
        match msg:
            case RequestAdmitted():
                self._admit(msg)
                return self._maybe_schedule()
            case CancelRequest():
                return self._abort(msg.req_id, msg.reason) + self._maybe_schedule()
            case BlocksReserved():
                self._mirror_blocks(msg)
            case StepVerified():
                return self._commit(msg) + self._maybe_schedule(msg.ran_ahead)
            case PoolResized():
                self.num_free += msg.delta
                return self._maybe_schedule()
        return None

    def _admit(self, msg: RequestAdmitted) -> None:
        sp = msg.sampling
        n = len(msg.prompt_ids)
        self.seqs[msg.req_id] = Seq(msg.req_id, sp, msg.speculate, list(msg.prompt_ids), n, self.arrivals,
                                    stop_ids=stop_ids_of(sp, self.eos_ids),
                                    max_len=max_len_of(n, sp, self.max_model_len))
        self.arrivals += 1
        self.waiting.append(msg.req_id)

    def _abort(self, req_id: int, reason: FinishReason) -> list:
        seq = self.seqs.get(req_id)
        if seq is None:
            return []
        if self.inflight is not None and req_id in self.inflight.req_ids:
            self.aborts[req_id] = reason        # the step in flight still uses its blocks: finish at commit
            return []
        return self._finish_now(seq, reason)

    def _finish_now(self, seq: Seq, reason: FinishReason) -> list:
        """Drop a request now (abort): release its blocks and tell clients."""
        self._drop(seq)
        delta = TokensCommitted(step=self.step, req_ids=(seq.req_id,), counts=(0,), tokens=(),
                                num_computed=(0,), finish=(int(reason),), num_prompt=(seq.num_prompt,))
        return [delta, ReleaseBlocks(req_ids=(seq.req_id,))]

    def _drop(self, seq: Seq) -> None:
        self.seqs.pop(seq.req_id, None)
        if seq.req_id in self.running:
            self.running.remove(seq.req_id)
        if seq.req_id in self.waiting:
            self.waiting.remove(seq.req_id)
        self.num_free += seq.num_blocks
        seq.num_blocks = 0

    def _mirror_blocks(self, msg: BlocksReserved) -> None:
        if self.inflight is None or msg.step != self.inflight.step:
            return
        seqs = self.seqs
        for rid, table in zip(self.inflight.req_ids, msg.block_tables):
            seq = seqs.get(rid)
            if seq is not None:
                seq.num_blocks = len(table)
        self.num_free = msg.num_free

    # ---- commit --------------------------------------------------------------------------------
    def _commit(self, msg: StepVerified) -> list:
        sched, self.inflight = self.inflight, None
        if sched is None or sched.step != msg.step:
            return []
        seqs, aborts = self.seqs, self.aborts
        if msg.req_ids is sched.req_ids:       # the rows _build_step scheduled: they stay in seqs until now
            rows = self._rows
        else:
            rows = [seqs.get(rid) for rid in msg.req_ids]        # None: the request is gone
        nd, accs, specs, starts, chunks = sched.num_decode, msg.accepted, sched.speculate, sched.starts, sched.chunk_ids
        gams = msg.gammas[: msg.num_decode]     # γ_i per decode row, else the batch γ
        if len(gams) < nd:
            gams += (msg.gamma,) * (nd - len(gams))
        ids, counts, toks, comp, fin, nprompt, done = [], [], [], [], [], [], []
        tokens, pos, i = msg.tokens, 0, -1
        for seq, rid, c in zip(rows, msg.req_ids, msg.counts):
            i += 1
            end = pos + c
            new = tokens[pos: end]
            pos = end
            if seq is None:
                continue
            st = seq.tokens
            n = len(st)
            if i < nd:                          # KV counters and draft lag before the new tokens
                a = accs[i]
                seq.num_computed = n + a
                g = gams[i]
                if g > 0 and specs[i]:
                    seq.draft_computed = n + (a if a < g else g - 1)
            else:
                seq.num_computed = starts[i] + len(chunks[i])
            if c < seq.max_len - n and (not seq.stop_ids or seq.stop_ids.isdisjoint(new)):
                kept, reason = new, 0                       # the common case: no stop, room left
            else:
                kept, reason = self._apply_stops(seq, new)
                reason = int(reason)
            st.extend(kept)
            if aborts and rid in aborts:
                kept, reason = (), int(aborts.pop(rid))
            ids.append(rid)
            counts.append(len(kept))
            toks.extend(kept)
            comp.append(seq.num_computed)
            fin.append(reason)
            nprompt.append(seq.num_prompt)
            if reason:
                done.append(rid)
        out = [TokensCommitted(step=msg.step, req_ids=tuple(ids), counts=tuple(counts), tokens=tuple(toks),
                               num_computed=tuple(comp), finish=tuple(fin), num_prompt=tuple(nprompt))]
        if not done:
            return out
        for rid in done:
            self._drop(seqs[rid])
        return out + [ReleaseBlocks(req_ids=tuple(done))]

    @staticmethod
    def _apply_stops(seq: Seq, new: tuple[int, ...]) -> tuple[tuple[int, ...], FinishReason]:
        k, reason = first_stop(new, len(seq.tokens), seq.num_output, seq.sampling.min_tokens, seq.stop_ids,
                               seq.max_len)
        return new[:k], reason

    # ---- scheduling ----------------------------------------------------------------------------
    def _maybe_schedule(self, ran_ahead: bool = False) -> list:
        """The next step, if none is in flight. After a step whose verifier already started the next one
        (``ran_ahead``: the rows that go on, one token each, in their slots) the decode rows alone, so that
        the step scheduled is the one started; a request that arrived meanwhile waits one step more."""
        if self.inflight is not None or not (self.running or self.waiting):
            return []
        out = self._finish_stranded()
        rows = self._decode_rows()
        preempted = ()
        if ran_ahead and rows.ids and not rows.total:
            prefill = []
        else:
            if rows.total > self.num_free and len(self.running) > 1:
                preempted = self._ensure_decode_fits(rows.need)
                rows = self._decode_rows([rid for rid in rows.ids if rid not in preempted])
            prefill = self._pick_prefill(rows.ids, rows.total)
        if preempted:
            out += [RequestsPreempted(req_ids=preempted), ReleaseBlocks(req_ids=preempted)]
        if rows.ids or prefill:
            self.inflight = self._build_step(rows, prefill)
            out.append(self.inflight)
        return out

    def _finish_stranded(self) -> list:
        """A lone running request that needs a block the whole pool cannot give ends with 'length'."""
        if len(self.running) != 1:
            return []
        seq = self.seqs[self.running[0]]
        if not seq.in_decode or self._blocks_for(seq, seq.num_computed + 1) <= self.num_free:
            return []
        return self._finish_now(seq, FinishReason.LENGTH)

    def _blocks_for(self, seq: Seq, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - seq.num_blocks)

    def _decode_rows(self, ids: list[int] | None = None) -> _DecodeRows:
        """The decode rows (running requests in decode, or ``ids``) with their StepScheduled columns and
        the blocks each needs for its next slot (``_blocks_for(seq, num_computed + 1)``, inlined)."""
        seqs, bs = self.seqs, self.block_size
        rows = _DecodeRows()
        decode, seq_rows, need, starts, chunks, dcs, specs, lags = (
            rows.ids, rows.seqs, rows.need, rows.starts, rows.chunks, rows.dcs, rows.specs, rows.lags)
        total = 0
        for r in self.running if ids is None else ids:
            s = seqs[r]
            t = s.tokens
            n, c = len(t), s.num_computed
            if ids is None and not (c >= n - 1 and n > s.num_prompt):       # Seq.in_decode, inlined
                continue
            decode.append(r)
            seq_rows.append(s)
            k = -(-(c + 1) // bs) - s.num_blocks
            k = k if k > 0 else 0
            need[r] = k
            total += k
            dc, sp = s.draft_computed, s.speculate
            starts.append(c)
            chunks.append((t[-1],))
            dcs.append(dc)
            specs.append(sp)
            if sp:
                lags.append(n - 1 - dc)
        rows.total = total
        return rows

    def _ensure_decode_fits(self, need: dict[int, int]) -> tuple[int, ...]:
        """Preempt (recompute) the newest running requests until every decode row has a slot; ``need``
        (blocks per decode row) loses the preempted rows. Returns the preempted ids."""
        preempted = []
        while True:
            if sum(need.values()) <= self.num_free or len(self.running) <= 1:
                return tuple(preempted)
            victim = self.seqs[max(self.running, key=lambda r: self.seqs[r].arrival)]
            self._preempt(victim)
            need.pop(victim.req_id, None)
            preempted.append(victim.req_id)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq.req_id)
        self.num_free += seq.num_blocks
        seq.num_blocks, seq.num_computed, seq.draft_computed, seq.running = 0, 0, 0, False
        self.waiting.appendleft(seq.req_id)
        self.num_preemptions += 1

    def _pick_prefill(self, decode: list[int], decode_blocks: int) -> list[tuple[int, int, int]]:
        """(req_id, start, length) prefill chunks: running partial prefills first, then FCFS waiting."""
        budget = self.budget - len(decode)
        free = self.num_free - decode_blocks
        if budget <= 0 or (len(decode) == len(self.running) and not self.waiting):
            return []
        in_decode = set(decode)
        chunks = []
        for rid in [r for r in self.running if r not in in_decode] + list(self.waiting):
            if budget <= 0 or (rid in self.waiting and len(self.running) >= self.max_num_seqs):
                break
            chunk = self._prefill_chunk(self.seqs[rid], budget, free)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk[2]
            free -= self._blocks_for(self.seqs[rid], chunk[1] + chunk[2])
            self._start_running(rid)
        return chunks

    def _prefill_chunk(self, seq: Seq, budget: int, free: int) -> tuple[int, int, int] | None:
        start = seq.num_computed
        length = min(seq.prefill_end() - start, budget)
        fits = (free * self.block_size + seq.num_blocks * self.block_size) - start
        length = min(length, fits)
        return (seq.req_id, start, length) if length > 0 else None

    def _start_running(self, rid: int) -> None:
        if rid in self.waiting:
            self.waiting.remove(rid)
            self.running.append(rid)
            self.seqs[rid].running = True

    def _build_step(self, rows: _DecodeRows, prefill: list[tuple[int, int, int]]) -> StepScheduled:
        """The step's StepScheduled: decode rows (last token, draft lag) then prefill chunks."""
        self.step += 1
        starts, chunks, self._rows, done = rows.starts, rows.chunks, rows.seqs, []
        rids = tuple(rows.ids)
        if prefill:
            S = self.seqs
            for r, s, n in prefill:
                q = S[r]
                t = q.tokens
                self._rows.append(q)
                starts.append(s)
                chunks.append(tuple(t[s: s + n]))
                done.append(s + n == len(t))
            rids += tuple(r for r, _, _ in prefill)
        return StepScheduled(step=self.step, req_ids=rids, starts=tuple(starts), chunk_ids=tuple(chunks),
                             num_decode=len(rows.ids), draft_computed=tuple(rows.dcs), speculate=tuple(rows.specs),
                             prefill_done=tuple(done), max_draft_lag=max(rows.lags, default=0),
                             num_waiting=len(self.waiting), blocks_to_finish=self._blocks_to_finish())

    def _blocks_to_finish(self) -> int:
        """Blocks the running and waiting requests may still take before each reaches its max_len (the pool's
        demand if none stops early): whether KV can run short at all (actors/weights.py). A request may
        wait for the prefill token budget or a batch slot while the pool has room for everything."""
        seqs, bs = self.seqs, self.block_size
        n = 0
        for ids in (self.running, self.waiting):      # ~6 µs per step at 64 requests
            for r in ids:
                q = seqs[r]
                k = (q.max_len + bs - 1) // bs - q.num_blocks
                if k > 0:
                    n += k
        return n

    # ---- introspection -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
