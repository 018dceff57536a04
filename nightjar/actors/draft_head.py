"""The draft executor for an EAGLE-style draft head (models/eagle.py) instead of an independent draft.

Head entry i reads the target's features of position i and the token x_{i+1}; its output predicts
x_{i+2}. Per request the executor keeps the head's context as a run of absolute positions
[base, fend): the fused target features of every committed position since ``base`` sit in the head
cache (HeadCache, same blocks as its KV), written after each verified step (``StepVerified``: the fed
token and the accepted drafts of a decode row, a prefill row's whole chunk). Head-local position
j = absolute base + j (RoPE is relative, so a context that starts late is the same computation minus
the missing entries).

Drafting a row with n committed tokens (features known for positions < n-1, so fend == n-1):
pass 1 runs the head over the entries not yet in its KV (the catch-up: usually the 1 + accepted
positions of the last step, more after γ=0 steps) and drafts d1 from the last one; pass k >= 2 feeds
the previous pass's output state as the feature with token d_{k-1}. Afterwards the head's KV is cut
back to the catch-up frontier: entries built on drafted features are never kept.

Draft tree (``tree`` = width > 0): when the step has at most ``tree_batch`` decode rows, each greedy drafting row
also sends the head's ``tree`` runner-up tokens of pass 1 (StepDrafted.siblings); the verifier checks them
beside the chain, in the scratch blocks the KV pool names (BlocksReserved.scratch, 2 per sibling).

Prompt lookup (``lookup`` = N > 0): a drafting row whose context's last N to 3 tokens occurred earlier in the
request drafts what followed their latest occurrence (actors/draft_ngram.py) instead of the head's chain, and
the head does not run for it that step (its entries wait for the next pass 1 that drafts the row, whose catch-up
covers them). Teacher forced on the held-out split this raised tokens per γ = 4 round from 1.73 to 2.01
(docs/drafts.md).

A gap in a request's features (the head was offloaded, or the request was preempted and re-prefilled)
restarts its head context at the first position that has features; a request without features does
not draft until it has some. While the head is not resident nothing is written.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from nightjar.actors.common import sampling_tensors
from nightjar.actors.draft import DraftExecutor
from nightjar.actors.draft_ngram import PromptLookup, one_hot_q
from nightjar.actors.gamma_allocator import row_gammas
from nightjar.actors.sampler import argmax_last
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftResidency,
    RequestAdmitted,
    RequestsPreempted,
    StepDrafted,
    StepScheduled,
    StepVerified,
    TokensCommitted,
)
from nightjar.kvpool.blocks import KVPoolError
from nightjar.models.llama import build_layout


@dataclass
class HeadContext:
    base: int        # absolute position of head-local 0
    fend: int        # features stored for absolute positions [base, fend)


class HeadDraftExecutor(DraftExecutor):
    name: ClassVar[str] = "draft"
    subscribes = (RequestAdmitted, TokensCommitted, RequestsPreempted, StepScheduled, BlocksReserved,
                  StepVerified, DraftResidency)
    quiet = DraftExecutor.quiet + (StepVerified,)       # stays_quiet

    def __init__(self, slot, allocator, buffers, seed: int, embed: torch.nn.Module, tree: int = 0,
                 tree_batch: int = 2, lookup: int = 0):
        super().__init__(slot, allocator, buffers, seed)
        self.lookup = PromptLookup(lookup, max(lookup, 3)) if lookup else None    # module docstring; 0: off
        self.embed = embed                # the target's token embedding (shared, never moved)
        self.ctx: dict[int, HeadContext] = {}
        self.tree, self.tree_batch = tree, tree_batch
        self.scratch: tuple[int, ...] = ()
        self.verified_relayed = 0                 # StepVerified taken back from the verifier (accepts_relay)

    def accepts_relay(self, msg) -> bool:
        """The verifier's StepVerified of the step this executor drafted, taken back in the same call on the
        compute thread (kernel/actor.py) when nothing waits in the mailbox: the features are stored before the
        call returns, not in a job of their own after the step commits."""
        ok = (isinstance(msg, StepVerified) and self.sched is not None and msg.step == self.sched.step
              and not len(self.mailbox))
        self.verified_relayed += ok
        return ok

    def stays_quiet(self, msg) -> bool:
        """A decode-only step's features are stored at the next wake-up (a drafting step, a finished request, a
        prompt), so γ = 0 decode steps run no job of the head; a prompt's features are large, so a step with a
        prefill row wakes it, unless the verifier captured none (the head not resident: actors/verifier.py). The
        buffers are read, not this actor's state: a step's features are put before its StepVerified is published
        and taken only when that message is handled, so the answer is settled at publish."""
        if isinstance(msg, StepVerified):
            return msg.num_decode == len(msg.req_ids) or not self.buffers.has_features(msg.step)
        return super().stays_quiet(msg)

    def handle(self, msg, now):
        match msg:
            case StepVerified() if self.sched is not None and msg.step == self.sched.step:
                self._store(msg)
                return None
            case BlocksReserved():
                self.scratch = msg.scratch
        return super().handle(msg, now)

    def _forget(self, req_ids) -> None:
        super()._forget(req_ids)
        for rid in req_ids:
            self.ctx.pop(rid, None)
            if self.lookup is not None:
                self.lookup.forget(rid)

    # ---- features of committed positions ------------------------------------------------------
    def _store(self, v: StepVerified) -> None:
        """Fuse and keep the target features of the step's committed positions (head resident only)."""
        got = self.buffers.take_features(v.step)
        if got is None or not self.resident:
            return
        feats, lens = got
        s, rows, idx, off = self.sched, [], [], 0
        for row, (rid, n) in enumerate(zip(s.req_ids, lens)):
            keep = 1 + v.accepted[row] if row < s.num_decode else n
            if rid in self.mirrors.reqs and self._extend(rid, s.starts[row], keep):
                rows.append((rid, s.starts[row], keep))
                idx.extend(range(off, off + keep))
            off += n
        if not rows:
            return
        head = self.slot.model
        g = head.fuse(feats[torch.tensor(idx, device=feats.device)])                  # [K, H]
        self.slot.cache.write_features(g, self._slots(rows))

    def _extend(self, rid: int, p0: int, k: int) -> bool:
        """Make room for features of absolute positions [p0, p0+k); restart the context on a gap."""
        c = self.ctx.get(rid)
        if c is None or c.fend != p0:
            if self.alloc.has_seq(rid):
                self.alloc.free(rid)
            c = self.ctx[rid] = HeadContext(p0, p0)
        try:
            self.alloc.reserve(rid, p0 + k - c.base)
        except KVPoolError:                 # the head's pool is full: this request stops drafting
            self._forget([rid])
            return False
        c.fend = p0 + k
        return True

    def _slots(self, rows) -> torch.Tensor:
        """Cache slots of absolute positions [p0, p0+k) of each (rid, p0, k) -> [sum k] int64."""
        return self._local_slots([(rid, p0 - self.ctx[rid].base, k) for rid, p0, k in rows])

    # ---- drafting -----------------------------------------------------------------------------
    def _room(self, rid: int, g: int) -> bool:
        """The row has features up to its last committed token and head blocks for γ_i drafts."""
        c = self.ctx.get(rid)
        if c is None or c.fend != len(self.mirrors[rid].tokens) - 1 or c.fend <= c.base:
            return False
        try:
            self.alloc.reserve(rid, c.fend - c.base + g - 1)
        except KVPoolError:
            return False
        return True

    def _draft(self, gamma: int, per_row: tuple[int, ...] = ()) -> StepDrafted:
        s = self.sched
        gams = list(row_gammas(gamma, per_row, s.speculate, s.num_decode))
        for i in range(s.num_decode):
            if gams[i] and not self._room(s.req_ids[i], gams[i]):
                gams[i] = 0                    # no features yet (or no room): this row does not draft
        rows = self._rows(tuple(gams))
        t0 = time.perf_counter()
        looked = self._look_up(rows)
        head_rows = [r for r, lk in zip(rows, looked) if not lk]
        tokens, probs, catch, sibs = self._propose_head(head_rows, gamma) if head_rows else ([], {}, (0, 0.0), [])
        if len(head_rows) < len(rows):
            tokens, sibs = self._merge_looked(rows, looked, tokens, sibs, probs)
        t1 = time.perf_counter()
        uniform = all(g == gamma or not sp for g, sp in zip(gams, s.speculate)) and not per_row
        return self._drafted(gamma, rows, tokens, probs, t1 - t0 - catch[1], catch[1], catch[0],
                             () if uniform else tuple(gams), self._flat_siblings(rows, sibs),
                             tuple(row for (row, _, _, _), lk in zip(rows, looked) if lk))

    def _look_up(self, rows) -> list[list[int]]:
        """Prompt lookup's drafts per drafting row ([] where the head drafts: no match, or lookup off)."""
        if self.lookup is None:
            return [[] for _ in rows]
        return [self.lookup.propose(rid, self.mirrors[rid].tokens, g) for _, rid, _, g in rows]

    def _merge_looked(self, rows, looked, head_tokens, head_sibs, probs):
        """Per-row tokens and siblings in ``rows`` order: the looked-up rows' drafts (their q, for random sampling
        rows, the one-hot of the proposal, added to ``probs``) and the head's for the others."""
        tokens, sibs, it = [], [], iter(zip(head_tokens, head_sibs))
        for (_, rid, _, _), lk in zip(rows, looked):
            if not lk:
                t, sb = next(it)
                tokens.append(t)
                sibs.append(sb)
                continue
            tokens.append(lk)
            sibs.append([])
            m = self.mirrors[rid]
            if not (m.greedy or m.seeded):
                probs[rid] = one_hot_q(lk, self.slot.model.hc.target_vocab, self.slot.device)      # [len, V]
        return tokens, sibs

    def _tree_rows(self, rids: list[int]) -> int:
        """How many of the drafting rows (in order) may send siblings: greedy ones, while the scratch lasts."""
        if not self.tree or self.sched.num_decode > self.tree_batch:
            return 0
        room = len(self.scratch) // (2 * self.tree)
        return min(room, sum(1 for r in rids if self.mirrors[r].greedy))

    def _flat_siblings(self, rows, sibs: list[list[int]]) -> tuple[int, ...]:
        """StepDrafted.siblings: [num_decode * tree], -1 where a row sent none; () when no row did."""
        if not any(sibs):
            return ()
        w, flat = self.tree, [-1] * (self.sched.num_decode * self.tree)
        for (row, _, _, _), sb in zip(rows, sibs):
            flat[row * w: row * w + len(sb)] = sb
        return tuple(flat)

    def _siblings(self, small: torch.Tensor, firsts: list[int], tree_ok: list[bool]) -> list[list[int]]:
        """Pass 1's runner-up tokens of each tree row (draft-vocabulary logits [R, Vd]; ``firsts`` its drafted
        d1, target ids)."""
        if not any(tree_ok):
            return [[] for _ in firsts]
        top = self.slot.model.to_target_ids(small.topk(self.tree + 1, dim=-1).indices).tolist()   # [R, tree+1]
        return [[t for t in row if t != d][: self.tree] if ok else [] for row, d, ok in zip(top, firsts, tree_ok)]

    def _propose_head(self, rows, gamma: int):
        """γ_i head passes per row; pass 1 also catches up. Returns (tokens per row, q probs of random
        sampling rows, (catch-up entries, their estimated share of pass 1's time), siblings per row)."""
        rids = [rid for _, rid, _, _ in rows]
        gam = [g for _, _, _, g in rows]
        specs = [self.mirrors[r].sampling for r in rids]
        temp, top_k, top_p = sampling_tensors(specs, self.slot.device)
        greedy = [sp.temperature <= 0 for sp in specs]
        n_tree = self._tree_rows(rids)
        tree_ok = [g and sum(greedy[: j + 1]) <= n_tree for j, g in enumerate(greedy)]
        front = [self.ctx[r].fend - self.ctx[r].base for r in rids]          # head-local catch-up frontier
        starts = [self.alloc.num_committed(r) for r in rids]
        out, qs, sibs = [[] for _ in rids], [[] for _ in rids], [[] for _ in rids]
        act, feat, t_first, n_first, catch = list(range(len(rids))), None, 0.0, 0, 0
        for i in range(max(gam)):
            t = time.perf_counter()
            act2 = [j for j in act if gam[j] > i]
            sel = torch.tensor([act.index(j) for j in act2]) if feat is not None and len(act2) < len(act) else None
            act = act2
            if i == 0:
                chunks = [self._catch_up_tokens(rids[j], starts[j]) for j in act]
                n_first = sum(len(c) for c in chunks)
                catch = sum(max(0, len(c) - 1 - gamma) for c in chunks)   # beyond what one step leaves
                g = self.slot.cache.read_features(self._local_slots([(rids[j], starts[j], len(c))
                                                                    for j, c in zip(act, chunks)]))
            else:
                chunks = [[out[j][-1]] for j in act]
                g = feat if sel is None else feat[sel]
            feat, small = self._head_pass(rids, act, chunks, starts, g)
            ix = torch.tensor(act) if len(act) < len(rids) else None
            nxt = self._pick_small(small, [greedy[j] for j in act], *((temp[ix], top_k[ix], top_p[ix])
                                   if ix is not None else (temp, top_k, top_p)), [rids[j] for j in act],
                                   [qs[j] for j in act], i)
            for j, c, tok in zip(act, chunks, nxt):
                out[j].append(tok)
                starts[j] += len(c)
            if i == 0:
                sibs = self._siblings(small, nxt, tree_ok)                      # pass 1 runs every row
                t_first = time.perf_counter() - t
        for r, f in zip(rids, front):
            self.alloc.set_committed(r, f)       # drop the entries built on drafted features
        share = t_first * catch / n_first if n_first else 0.0
        probs = {r: torch.stack(q) for r, q in zip(rids, qs) if q}
        return out, probs, (catch, share), sibs

    def _catch_up_tokens(self, rid: int, start: int) -> list[int]:
        """Tokens x_{i+1} of the head entries i from head-local ``start`` to the frontier."""
        c, toks = self.ctx[rid], self.mirrors[rid].tokens
        return toks[c.base + start + 1: c.fend + 1]

    def _local_slots(self, rows) -> torch.Tensor:
        """Slots of head-local positions [j0, j0+k) for (rid, j0, k) rows -> [sum k]."""
        bs, out = self.alloc.block_size, []
        for rid, j0, k in rows:
            table = self.alloc.block_table(rid)
            out.extend(table[j // bs] * bs + j % bs for j in range(j0, j0 + k))
        return torch.tensor(out, dtype=torch.int64, device=self.slot.device)

    def _head_pass(self, rids, act, chunks, starts, g):
        """One head call over the active rows' entries -> (output state of each row's last entry [R, H],
        draft-vocabulary logits [R, Vd] fp32)."""
        head = self.slot.model
        lay = build_layout(chunks, [starts[j] for j in act], [self.alloc.block_table(rids[j]) for j in act],
                           self.alloc.block_size, [1] * len(act), device=head.device)
        emb = self.embed(lay.input_ids)                                              # [T, H]
        a, small = head(lay, self.slot.cache, emb, g.to(head.dtype))                  # [T, H], [R, Vd]
        return a[lay.logits_index], small

    def _pick_small(self, small: torch.Tensor, greedy: list[bool], temp, top_k, top_p, rids, qs, pass_i: int):
        """``_pick`` over draft-vocabulary logits [R, Vd]: all-greedy passes take the argmax there (``d2t`` is
        ascending, so it is the full vocabulary's first maximum); a pass with a sampling row expands to the
        full vocabulary [R, V] (-inf outside the draft's), where q must live for verification."""
        head = self.slot.model
        if all(greedy) and head.d2t_ascending:
            return head.to_target_ids(argmax_last(small)).tolist()
        full = small.new_full((small.shape[0], head.hc.target_vocab), float("-inf"))  # [R, V]
        full[:, head.d2t] = small
        return self._pick(full, greedy, temp, top_k, top_p, rids, qs, pass_i)
