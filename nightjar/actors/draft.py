"""Draft executor: catches up lagging draft KV, then runs the draft for the speculating rows, one
batched call per draft position k over the rows with γ_i ≥ k (per-row γ; batch-level: every
speculating row, γ times). Keeps the draft's own paged KV and the draft
probabilities (for rejection sampling) in a buffer the verifier reads by handle."""
from __future__ import annotations

import time
from typing import ClassVar

import torch

from nightjar.actors.common import RequestMirrors, drafter_stays_quiet, run_chunks, sampling_tensors, seeded_scores_of
from nightjar.actors.gamma_allocator import row_gammas
from nightjar.actors.sampler import SamplingHints, argmax_last, sample_from, transform_logits
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftQuiesced,
    DraftResidency,
    RequestAdmitted,
    RequestsPreempted,
    StepDrafted,
    StepScheduled,
    TokensCommitted,
)
from nightjar.kvpool.blocks import BlockAllocator


class DraftBuffers:
    """Device-side results referenced by handle from bus messages (never sent inside them)."""

    def __init__(self) -> None:
        self._bufs: dict[int, dict[int, torch.Tensor]] = {}
        self._feats: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}

    def put(self, handle: int, probs: dict[int, torch.Tensor]) -> None:
        self._bufs[handle] = probs

    def take(self, handle: int) -> dict[int, torch.Tensor]:
        return self._bufs.pop(handle, {})

    def put_features(self, step: int, feats: torch.Tensor, row_lens: tuple[int, ...]) -> None:
        """The target's captured features [T, nF*H] of a step (rows of ``row_lens`` tokens, in order), kept until
        the head executor takes them: its StepVerified is quiet (kernel/actor.py), so a run of steps may wait."""
        self._feats[step] = (feats, row_lens)

    def take_features(self, step: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """That step's features; those of earlier steps, never taken, are dropped with them."""
        for old in [s for s in self._feats if s < step]:
            del self._feats[old]
        return self._feats.pop(step, None)

    def has_features(self, step: int) -> bool:
        """Whether the verifier captured that step's features (settled once its StepVerified is published)."""
        return step in self._feats


class DraftExecutor(Actor):
    name: ClassVar[str] = "draft"
    subscribes = (RequestAdmitted, TokensCommitted, RequestsPreempted, StepScheduled, BlocksReserved, DraftResidency)
    quiet = (RequestAdmitted, TokensCommitted, RequestsPreempted, StepScheduled, BlocksReserved)   # stays_quiet
    stays_quiet = staticmethod(drafter_stays_quiet)
    blocking = True

    def __init__(self, slot, allocator: BlockAllocator, buffers: DraftBuffers, seed: int):
        super().__init__()
        self.slot = slot                  # DraftSlot: the model + KV cache while resident (weights actor)
        self.alloc, self.buffers = allocator, buffers
        self.mirrors = RequestMirrors(seed, "draft", slot.device)
        self.sched: StepScheduled | None = None
        self.resident = True

    def handle(self, msg, now):
        done = self.mirrors.observe(msg)
        if done is not None:
            self._forget(done)
            return None
        match msg:
            case DraftResidency():
                self.resident = msg.resident      # an offload starts: say so once nothing here touches the draft
                return [DraftQuiesced()] if not msg.resident and msg.state == "OFFLOADING" else None
            case RequestsPreempted():
                self._forget(msg.req_ids)
            case StepScheduled():
                self.sched = msg
            case BlocksReserved() if msg.gamma > 0 and self.sched and msg.step == self.sched.step:
                return [self._draft(msg.gamma, msg.gammas)]
        return None

    def _forget(self, req_ids) -> None:
        for rid in req_ids:
            if self.alloc.has_seq(rid):
                self.alloc.free(rid)

    def _rows(self, gammas: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """(row, req_id, draft_computed, γ_i) of the rows that draft this step."""
        s = self.sched
        return [(i, s.req_ids[i], s.draft_computed[i], gammas[i]) for i in range(s.num_decode) if gammas[i] > 0]

    def _prepare(self, rows) -> None:
        for _, rid, dc, g in rows:
            n = len(self.mirrors[rid].tokens)
            if self.alloc.has_seq(rid) and self.alloc.num_committed(rid) > dc:
                self.alloc.rollback(rid, dc)
            self.alloc.reserve(rid, n + g)

    def _draft(self, gamma: int, per_row: tuple[int, ...] = ()) -> StepDrafted:
        s = self.sched
        rows = self._rows(row_gammas(gamma, per_row, s.speculate, s.num_decode))
        self._prepare(rows)
        t0 = time.perf_counter()
        catch_tokens = self._catch_up(rows)
        t1 = time.perf_counter()
        tokens, probs = self._propose(rows)
        t2 = time.perf_counter()
        return self._drafted(gamma, rows, tokens, probs, t2 - t1, t1 - t0 if catch_tokens else 0.0,
                             catch_tokens, per_row)

    def _drafted(self, gamma, rows, tokens, probs, draft_s: float, catch_s: float, catch_tokens: int,
                 gammas: tuple[int, ...], siblings: tuple[int, ...] = (), looked: tuple[int, ...] = ()) -> StepDrafted:
        """The step's StepDrafted: per-row tokens flattened ([num_decode * γ], -1 padded); q probs kept
        in the buffer under the step's handle."""
        s = self.sched
        flat = [-1] * (s.num_decode * gamma)
        for (row, _, _, _), toks in zip(rows, tokens):
            flat[row * gamma: row * gamma + len(toks)] = toks
        self.buffers.put(s.step, probs)
        return StepDrafted(step=s.step, gamma=gamma, draft_tokens=tuple(flat), handle=s.step,
                           draft_time_s=draft_s, catchup_time_s=catch_s, catchup_tokens=catch_tokens, gammas=gammas,
                           siblings=siblings, looked=looked)

    def _catch_up(self, rows) -> int:
        """Prefill the draft KV of rows lagging by 2+ tokens, up to (not incl.) the last token."""
        lag = [(rid, dc, len(self.mirrors[rid].tokens) - 1) for _, rid, dc, _ in rows]
        lag = [(rid, dc, end) for rid, dc, end in lag if end - dc >= 2]
        if not lag:
            return 0
        chunks = [self.mirrors[rid].tokens[dc:end] for rid, dc, end in lag]
        run_chunks(self.slot.model, self.slot.cache, self.alloc.block_size, chunks, [dc for _, dc, _ in lag],
                   [self.alloc.block_table(rid) for rid, _, _ in lag], [0] * len(lag))
        for rid, _, end in lag:
            self.alloc.commit(rid, end)
        return sum(len(c) for c in chunks)

    def _propose(self, rows):
        """max γ_i batched draft calls; call i runs the rows with γ_j > i. Returns per-row draft tokens
        (γ_j each) and q probs [γ_j, V] of sampling rows."""
        rids = [rid for _, rid, _, _ in rows]
        gam = [g for _, _, _, g in rows]
        specs = [self.mirrors[r].sampling for r in rids]
        temp, top_k, top_p = sampling_tensors(specs, self.slot.device)
        greedy = [s.temperature <= 0 for s in specs]
        starts = [self.alloc.num_committed(r) for r in rids]
        chunks = [self.mirrors[r].tokens[s:] for r, s in zip(rids, starts)]
        out = [[] for _ in rids]
        qs: list[list[torch.Tensor]] = [[] for _ in rids]
        act = list(range(len(rids)))
        for i in range(max(gam, default=0)):
            act = [j for j in act if gam[j] > i]                                    # rows with γ_j > i
            sub = len(act) < len(rids)
            ix = torch.tensor(act) if sub else None
            logits = run_chunks(self.slot.model, self.slot.cache, self.alloc.block_size, [chunks[j] for j in act],
                                [starts[j] for j in act], [self.alloc.block_table(rids[j]) for j in act],
                                [1] * len(act))                                         # [R_i, V]
            nxt = self._pick(logits, [greedy[j] for j in act], *((temp[ix], top_k[ix], top_p[ix]) if sub else
                             (temp, top_k, top_p)), [rids[j] for j in act], [qs[j] for j in act], i)
            for j, tok in zip(act, nxt):
                out[j].append(tok)
                starts[j] += len(chunks[j])
                chunks[j] = [tok]
        for r, s in zip(rids, starts):
            self.alloc.commit(r, s)       # drafts d1..d_{γ_j-1} now sit in the draft KV
        probs = {r: torch.stack(q) for r, q in zip(rids, qs) if q}
        return out, probs

    def _pick(self, logits, greedy, temp, top_k, top_p, rids, qs, pass_i: int) -> list[int]:
        """Draft pass ``pass_i``'s tokens: argmax for greedy rows, Gumbel-max with the request's noise of
        that output position for seeded rows, a draw from q (kept in qs for verification) otherwise."""
        nxt = argmax_last(logits)                                                      # [R]
        rand = [j for j, g in enumerate(greedy) if not g]
        if not rand:
            return nxt.tolist()
        idx = torch.tensor(rand)
        hints = SamplingHints.of_specs([self.mirrors[rids[j]].sampling for j in rand], logits.shape[-1])
        q = transform_logits(logits[idx], temp[idx], top_k[idx], top_p[idx], hints)    # [r, V]
        for k, j in enumerate(rand):
            m = self.mirrors[rids[j]]
            if m.seeded:
                nxt[j] = seeded_scores_of(m, q[k:k + 1], m.num_output + pass_i).argmax()
        free = [k for k, j in enumerate(rand) if not self.mirrors[rids[j]].seeded]
        if free:
            nxt[idx[free]] = sample_from(q[free], [self.mirrors[rids[rand[k]]].gen for k in free])
            for k in free:
                qs[rand[k]].append(q[k])
        return nxt.tolist()
