"""Verifier: one target forward over every row (prefill chunks, decode tokens, γ_i+1 verify tokens),
rejection sampling with a bonus token, and the step's measured timing. Rejected slots are rolled
back by counters (the batcher's num_computed); nothing is freed per rejected token."""
from __future__ import annotations

import time
from typing import ClassVar

import torch

from nightjar.actors.common import RequestMirrors, run_chunks, sampling_tensors, seeded_scores_of
from nightjar.actors.draft import DraftBuffers
from nightjar.actors.sampler import SamplingHints, argmax_last, sample_from, transform_logits, verify
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    RequestAdmitted,
    StepDrafted,
    StepScheduled,
    StepTimed,
    StepVerified,
    TokensCommitted,
)


class Verifier(Actor):
    name: ClassVar[str] = "verifier"
    subscribes = (RequestAdmitted, TokensCommitted, StepScheduled, BlocksReserved, StepDrafted)
    blocking = True

    def __init__(self, model, cache, block_size: int, buffers: DraftBuffers, seed: int,
                 synthetic_acceptance: float | None = None, capture: tuple[int, ...] = ()):
        super().__init__()
        self.capture = capture                      # target layers a draft head reads (models/eagle.py)
        self.synthetic = synthetic_acceptance       # like vLLM's synthetic rejection sampler: NOT lossless
        self.synth_gen = torch.Generator(device=model.device).manual_seed(seed) if synthetic_acceptance else None
        self.model, self.cache, self.block_size, self.buffers = model, cache, block_size, buffers
        self.mirrors = RequestMirrors(seed, "target", model.device)
        self.sched: StepScheduled | None = None
        self.reserved: BlocksReserved | None = None

    def handle(self, msg, now):
        if self.mirrors.observe(msg) is not None:
            return None
        match msg:
            case StepScheduled():
                self.sched, self.reserved = msg, None
            case BlocksReserved() if self.sched and msg.step == self.sched.step:
                self.reserved = msg
                if msg.gamma == 0:
                    return self._verify(None)
            case StepDrafted() if self.reserved and msg.step == self.sched.step:
                return self._verify(msg)
        return None

    def _rows(self, drafted: StepDrafted | None):
        """Chunks fed to the target, their start positions and the number of logits rows of each."""
        s, g = self.sched, (drafted.gamma if drafted else 0)
        chunks, nlog, drafts = [], [], []
        for row, chunk in enumerate(s.chunk_ids):
            if row < s.num_decode:
                d = [t for t in drafted.draft_tokens[row * g:(row + 1) * g] if t >= 0] if drafted else []
                chunks.append(list(chunk) + d)
                nlog.append(1 + len(d))
                drafts.append(d)
            else:
                chunks.append(list(chunk))
                nlog.append(1 if s.prefill_done[row - s.num_decode] else 0)
        return chunks, nlog, drafts

    def _verify(self, drafted: StepDrafted | None):
        t0 = time.perf_counter()
        chunks, nlog, drafts = self._rows(drafted)
        logits = run_chunks(self.model, self.cache, self.block_size, chunks, list(self.sched.starts),
                            list(self.reserved.block_tables), nlog, self.capture)         # [N, V]
        if self.capture:
            logits, feats = logits                                                        # feats [T, nF*H]
            self.buffers.put_features(self.sched.step, feats, tuple(map(len, chunks)))
        probs_q = self.buffers.take(drafted.handle) if drafted else {}
        toks, acc = self._decide_tokens(logits, nlog, drafts, probs_q, drafted.gamma if drafted else 0)
        dt = time.perf_counter() - t0
        return self._results(toks, acc, drafted, dt)

    def _decide_tokens(self, logits, nlog, drafts, probs_q, gamma):
        s = self.sched
        out, acc, pos = [], [], 0
        offsets = []
        for row in range(len(s.req_ids)):
            offsets.append(pos)
            pos += nlog[row]
        dec = list(range(s.num_decode))
        dec_out, dec_acc = self._verify_decode(logits, offsets, drafts, probs_q, gamma) if dec else ([], [])
        for row in range(len(s.req_ids)):
            if row < s.num_decode:
                out.append(dec_out[row])
                acc.append(dec_acc[row])
            elif nlog[row]:
                out.append([self._sample_one(logits[offsets[row]], s.req_ids[row])])
                acc.append(0)
            else:
                out.append([])
                acc.append(0)
        return out, acc

    def _verify_decode(self, logits, offsets, drafts, probs_q, gamma):
        """Verify the decode rows in one fixed-shape sampler call and one device-to-host copy."""
        s = self.sched
        B, G = s.num_decode, gamma
        rids = list(s.req_ids[:B])
        mirrors = [self.mirrors[r] for r in rids]
        if self.synthetic is None and all(m.greedy for m in mirrors):
            return _verify_greedy(logits, offsets[:B], drafts)
        idx = torch.tensor([[offsets[b] + min(i, len(drafts[b])) for i in range(G + 1)] for b in range(B)])
        tl = logits[idx]                                                              # [B, G+1, V]
        specs = [m.sampling for m in mirrors]
        hints = SamplingHints.of_specs(specs, tl.shape[-1])
        if all(m.greedy for m in mirrors):
            p = tl
        else:
            temp, top_k, top_p = sampling_tensors(specs, tl.device)
            p = transform_logits(tl, temp[:, None], top_k[:, None], top_p[:, None], hints)   # [B, G+1, V]
        self._seeded_rows_to_scores(p, mirrors, drafts)
        random_rows = [not (m.greedy or m.seeded) for m in mirrors]      # seeded rows verify like greedy
        greedy = torch.tensor([not r for r in random_rows], device=tl.device)
        dt = torch.tensor([d + [-1] * (G - len(d)) for d in drafts], dtype=torch.int64).view(B, G).to(tl.device)
        nd = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=tl.device)
        q = self._draft_probs(rids, probs_q, G, tl.shape[-1], tl.device) if probs_q else None
        if self.synthetic is not None:
            toks, acc = self._synthetic_accept(p, dt, nd)
        else:
            toks, acc = verify(p, dt, q, nd, greedy, [m.gen for m in mirrors], random_rows)
        rows = torch.cat((toks, acc[:, None]), 1).tolist()                             # the one copy
        return [[t for t in row[:-1] if t >= 0] for row in rows], [row[-1] for row in rows]

    @staticmethod
    def _seeded_rows_to_scores(p, mirrors, drafts) -> None:
        """Seeded rows of p [B, G+1, V] become Gumbel-max scores (in place) over the positions they verify;
        their argmax is the seeded sample, so they are verified like greedy rows."""
        for b, m in enumerate(mirrors):
            if m.seeded:
                n = len(drafts[b]) + 1
                p[b, :n] = seeded_scores_of(m, p[b, :n], m.num_output)

    def _synthetic_accept(self, p, drafts, nd):
        """Accept each draft with a set probability (benchmarks of the control plane on random weights)."""
        B, G = drafts.shape
        u = torch.rand((B, G), generator=self.synth_gen, device=p.device)                 # [B, G]
        ok = (u < self.synthetic) & (torch.arange(G, device=p.device) < nd.to(p.device)[:, None])
        acc = ok.to(torch.int64).cumprod(1).sum(1)                                         # [B]
        argmax = p.argmax(-1)                                                              # [B, G+1]
        out = torch.full((B, G + 1), -1, dtype=torch.int64, device=p.device)
        for b in range(B):
            k = int(acc[b])
            out[b, :k] = drafts[b, :k]
            out[b, k] = argmax[b, k]
        return out, acc

    @staticmethod
    def _draft_probs(rids, probs_q, G, V, device):
        q = torch.zeros((len(rids), G, V), device=device)
        for b, r in enumerate(rids):
            if r in probs_q:
                q[b, : probs_q[r].shape[0]] = probs_q[r]
        return q

    def _sample_one(self, logits, rid) -> int:
        m = self.mirrors[rid]
        if m.greedy:
            return int(argmax_last(logits))
        temp, top_k, top_p = sampling_tensors([m.sampling], logits.device)
        hints = SamplingHints.of_specs([m.sampling], logits.shape[-1])
        probs = transform_logits(logits[None], temp, top_k, top_p, hints)          # [1, V]
        if m.seeded:
            return int(seeded_scores_of(m, probs, m.num_output).argmax())
        return int(sample_from(probs, [m.gen])[0])

    def _results(self, toks, acc, drafted, verify_time):
        s = self.sched
        gamma = drafted.gamma if drafted else 0
        gammas = drafted.gammas if drafted else ()
        flat = [t for row in toks for t in row]
        per_pos = tuple(sum(1 for a in acc[: s.num_decode] if a > i) for i in range(gamma))
        verified = StepVerified(step=s.step, gamma=gamma, req_ids=s.req_ids, counts=tuple(map(len, toks)),
                                tokens=tuple(flat), accepted=tuple(acc), num_decode=s.num_decode, gammas=gammas)
        drafted_pp = reached_pp = ()
        if gammas:                       # per-row γ: who drafted / reached each position
            drafted_pp = tuple(sum(1 for g in gammas if g > i) for i in range(gamma))
            reached_pp = tuple(sum(1 for g, a in zip(gammas, acc) if g > i and a >= i) for i in range(gamma))
        timed = StepTimed(
            step=s.step, batch_size=s.num_decode, gamma=gamma,
            step_time_s=verify_time + (drafted.draft_time_s if drafted else 0.0),
            tokens_emitted=sum(len(t) for t in toks[: s.num_decode]), max_draft_lag=s.max_draft_lag,
            catchup_time_s=drafted.catchup_time_s if drafted else 0.0,
            catchup_tokens=drafted.catchup_tokens if drafted else 0, accepted_per_pos=per_pos,
            num_drafts=(sum(1 for g in gammas if g) if gammas else
                        sum(1 for i in range(s.num_decode) if s.speculate[i])) if gamma else 0,
            num_prefill_tokens=sum(len(c) for c in s.chunk_ids[s.num_decode:]),
            drafted_per_pos=drafted_pp, reached_per_pos=reached_pp,
            draft_time_s=drafted.draft_time_s if drafted else 0.0,
        )
        return [verified, timed]


def _verify_greedy(logits: torch.Tensor, offsets: list[int], drafts: list[list[int]]):
    """All-greedy decode rows: one argmax over the rows' logits [N, V], acceptance on the host. The tokens
    ``rejection_sample`` gives greedy rows (the drafts up to the first that is not the argmax, then the
    argmax there), without its dozen small tensor ops (~0.5 ms a step at one row)."""
    best = argmax_last(logits).tolist()                                      # [N]
    toks, acc = [], []
    for off, d in zip(offsets, drafts):
        k = 0
        while k < len(d) and d[k] == best[off + k]:
            k += 1
        toks.append(d[:k] + [best[off + k]])
        acc.append(k)
    return toks, acc
