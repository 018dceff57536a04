"""Verifier: one target forward over every row (prefill chunks, decode tokens, γ_i+1 verify tokens),
rejection sampling with a bonus token, and the step's measured timing. Rejected slots are rolled
back by counters (the batcher's num_computed); nothing is freed per rejected token.

Run-ahead (on a compute thread, ``run_ahead``): after a greedy γ = 0 decode step whose planner holds γ = 0 for
the next step (``BlocksReserved.next_zero``: decode rows only, nobody waiting, each row's next slot reserved), the
verifier queues the next step's forward on its own thread before it returns this one: the rows that do not
stop (``actors/stops.py``), each fed its new token. The forward runs while the event loop commits this step and
schedules the next (``StepVerified.ran_ahead`` tells the batcher to schedule exactly those rows); when that step's
BlocksReserved comes and matches the forward's rows, positions, tokens and blocks, its tokens are the step's,
else the forward is dropped (its writes lie in the rows' own blocks at the slot the step rewrites). The
forward holds the cache's lock, which a pool shrink's migration takes too, and is skipped if blocks moved
since it was planned (``KVCache.generation``).

Draft tree (StepDrafted.siblings, greedy rows only): a row fed x_n at position n with chain d1..dγ may also
send siblings c_j, runner-up first drafts. Each becomes a row of its own, [x_n, c_j] at positions n, n+1, on
the row's blocks up to the one holding n, that one replaced by a copy in a scratch block (BlocksReserved.scratch,
its slots before n copied first) and a second scratch block when n+1 starts a new one. When the target's token
at n is not d1 but some c_j, the row emits c_j and the target's token after it (from c_j's row): c_j's K and V
are copied into the row's own slot n+1, its captured features replace d1's, and the row counts one accepted
draft (StepVerified.accepted; ``tree_hits`` says which rows took a sibling). Sampled rows never use siblings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from nightjar.actors.common import RequestMirrors, run_chunks, sampling_tensors, seeded_scores_of
from nightjar.actors.draft import DraftBuffers
from nightjar.actors.sampler import SamplingHints, argmax_last, sample_from, transform_logits, verify
from nightjar.actors.stops import first_stop, max_len_of, stop_ids_of
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftResidency,
    RequestAdmitted,
    StepDrafted,
    StepScheduled,
    StepTimed,
    StepVerified,
    TokensCommitted,
)


@dataclass(slots=True)
class RunAhead:
    """A decode step the verifier started before the step it follows committed (module docstring)."""
    step: int
    req_ids: tuple[int, ...]
    starts: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    tables: tuple[tuple[int, ...], ...]      # each row's blocks up to the one its position lies in
    generation: int = 0                       # the cache's block layout it was planned on
    capture: tuple[int, ...] = ()             # the layers whose features it captures (the head resident)
    tokens: list[int] | None = None           # its greedy tokens, one per row, once run
    feats: Any = None                         # captured target features (a draft head's), once run
    time_s: float = 0.0
    error: BaseException | None = None


@dataclass
class SiblingRows:
    """The sibling rows of a drafting step (module docstring), in the order they follow the step's own rows."""
    rows: list[int] = field(default_factory=list)                 # the decode row each belongs to
    tokens: list[int] = field(default_factory=list)               # its sibling c_j
    starts: list[int] = field(default_factory=list)               # n: it feeds [x_n, c_j]
    tables: list[tuple[int, ...]] = field(default_factory=list)
    slots: list[tuple[int, int]] = field(default_factory=list)    # (its slot of n+1, the row's slot of n+1)
    copies: list[tuple[int, int]] = field(default_factory=list)   # (row's block, scratch block) before the forward


class Verifier(Actor):
    name: ClassVar[str] = "verifier"
    subscribes = (RequestAdmitted, TokensCommitted, StepScheduled, BlocksReserved, StepDrafted, DraftResidency)
    quiet = (RequestAdmitted, TokensCommitted, StepScheduled, DraftResidency)   # bookkeeping: in the forward job
    blocking = True

    def __init__(self, model, cache, block_size: int, buffers: DraftBuffers, seed: int,
                 synthetic_acceptance: float | None = None, capture: tuple[int, ...] = (), *,
                 eos_ids: tuple[int, ...] = (), max_model_len: int = 1 << 30, run_ahead: bool = False):
        super().__init__()
        self.eos_ids, self.max_model_len = frozenset(eos_ids), max_model_len
        self.run_ahead, self.executor = run_ahead, None        # executor: the compute thread's, from run()
        self.ahead: RunAhead | None = None
        self.ahead_used = self.ahead_dropped = 0
        self.drafts_relayed = 0                     # StepDrafted handed over by the draft executor (accepts_relay)
        self.capture = capture                      # target layers a draft head reads (models/eagle.py)
        self.draft_resident = True                  # DraftResidency: no features are captured for an absent head
        self.synthetic = synthetic_acceptance       # like vLLM's synthetic rejection sampler: NOT lossless
        self.synth_gen = torch.Generator(device=model.device).manual_seed(seed) if synthetic_acceptance else None
        self.model, self.cache, self.block_size, self.buffers = model, cache, block_size, buffers
        self.mirrors = RequestMirrors(seed, "target", model.device)
        self.sched: StepScheduled | None = None
        self.reserved: BlocksReserved | None = None

    async def run(self, executor=None) -> None:
        self.executor = executor if self.run_ahead else None
        await super().run(executor)

    def accepts_relay(self, msg) -> bool:
        """The draft executor may hand its StepDrafted straight over, in its own call on the compute thread
        (kernel/actor.py), when this verifier has handled that step's BlocksReserved and nothing waits in its
        mailbox: what would have reached it first has."""
        s, r = self.sched, self.reserved
        ok = (isinstance(msg, StepDrafted) and s is not None and r is not None and msg.step == s.step == r.step
              and not len(self.mailbox))
        self.drafts_relayed += ok
        return ok

    def handle(self, msg, now):
        if self.mirrors.observe(msg) is not None:
            return None
        match msg:
            case DraftResidency():
                self.draft_resident = msg.resident
            case StepScheduled():
                self.sched, self.reserved = msg, None
            case BlocksReserved() if self.sched and msg.step == self.sched.step:
                self.reserved = msg
                if msg.gamma == 0:
                    return self._verify(None)
            case StepDrafted() if self.reserved and msg.step == self.sched.step:
                return self._verify(msg)
        return None

    def _capture(self, drafting: bool) -> tuple[int, ...]:
        """The layers to capture: a head's, while it is resident or its drafts are verified. An offloaded head
        stores no features (actors/draft_head.py), so none are captured for it and its StepVerified stays
        quiet (no compute-thread job of the head per prompt-chunk step)."""
        return self.capture if self.draft_resident or drafting else ()

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
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            if ahead.error is not None:
                raise ahead.error
            if drafted is None and self._matches(ahead):
                self.ahead_used += 1
                return self._from_ahead(ahead)
            self.ahead_dropped += 1
        t0 = time.perf_counter()
        chunks, nlog, drafts = self._rows(drafted)
        sib = self._sibling_rows(drafted, drafts) if drafted and drafted.siblings and self.synthetic is None else None
        fed, starts, tables, flog = chunks, list(self.sched.starts), list(self.reserved.block_tables), nlog
        if sib is not None:                 # sibling rows after the step's own (module docstring)
            self.cache.copy_blocks(sib.copies)
            fed = chunks + [[self.sched.chunk_ids[r][0], t] for r, t in zip(sib.rows, sib.tokens)]
            starts, tables, flog = starts + sib.starts, tables + sib.tables, nlog + [1] * len(sib.rows)
        capture = self._capture(drafted is not None)
        logits = run_chunks(self.model, self.cache, self.block_size, fed, starts, tables, flog,
                            capture)                                                      # [N, V]
        feats = None
        if capture:
            logits, feats = logits                                                        # feats [T, nF*H]
        probs_q = self.buffers.take(drafted.handle) if drafted else {}
        toks, acc = self._decide_tokens(logits, nlog, drafts, probs_q, drafted.gamma if drafted else 0)
        hits = self._take_siblings(sib, logits, sum(nlog), toks, acc, feats, chunks) if sib else ()
        if feats is not None:
            self.buffers.put_features(self.sched.step, feats, tuple(map(len, chunks)))
        dt = time.perf_counter() - t0
        return self._results(toks, acc, drafted, dt, drafted is None and self._start_ahead(toks), hits)

    # ---- draft tree (module docstring) -----------------------------------------------------------
    def _sibling_rows(self, drafted: StepDrafted, drafts: list[list[int]]) -> SiblingRows | None:
        """The step's sibling rows: greedy decode rows that drafted, while the scratch blocks last."""
        s, r, bs = self.sched, self.reserved, self.block_size
        w, out, scratch = len(drafted.siblings) // s.num_decode, SiblingRows(), list(r.scratch)
        for row in range(s.num_decode):
            m = self.mirrors.reqs.get(s.req_ids[row])
            if not drafts[row] or m is None or not m.greedy or len(s.chunk_ids[row]) != 1:
                continue
            n, table = s.starts[row], r.block_tables[row]
            for tok in drafted.siblings[row * w:(row + 1) * w]:
                if tok < 0 or len(scratch) < 2:
                    continue
                a, b = scratch.pop(0), scratch.pop(0)
                bn, bn1 = n // bs, (n + 1) // bs
                out.rows.append(row)
                out.tokens.append(tok)
                out.starts.append(n)
                out.tables.append(tuple(table[:bn]) + ((a,) if bn1 == bn else (a, b)))
                own = (a if bn1 == bn else b) * bs + (n + 1) % bs
                out.slots.append((own, table[bn1] * bs + (n + 1) % bs))
                if n % bs:
                    out.copies.append((table[bn], a))
        return out if out.rows else None

    @torch.inference_mode()               # feats is the forward's (an inference tensor), changed in place
    def _take_siblings(self, sib: SiblingRows, logits, first: int, toks, acc, feats, chunks) -> tuple[int, ...]:
        """Rows whose first draft missed and whose target token is one of their siblings take it and the token
        after it (module docstring). ``first``: the sibling rows' first logits row. Returns tree_hits."""
        nd = self.sched.num_decode
        hits, moves = [0] * nd, []
        row_off = [0]
        for c in chunks:
            row_off.append(row_off[-1] + len(c))
        feat0 = row_off[-1]                                                  # sibling k's tokens: feat0 + 2k, +1
        for k, (row, tok) in enumerate(zip(sib.rows, sib.tokens)):
            if acc[row] or hits[row] or toks[row][0] != tok:
                continue
            hits[row], acc[row] = 1, 1
            toks[row] = [tok, int(argmax_last(logits[first + k]))]
            moves.append(sib.slots[k])
            if feats is not None:
                feats[row_off[row] + 1] = feats[feat0 + 2 * k + 1]
        self.cache.copy_slots(moves)
        return tuple(hits)

    # ---- run-ahead (module docstring) ------------------------------------------------------------
    def _start_ahead(self, toks: list[list[int]]) -> bool:
        """Queue the next step's forward on this thread when this γ = 0 step allows one (module docstring)."""
        a = self._next_step(toks)
        if a is None:
            return False
        try:
            self.executor.submit(self._run_ahead, a)
        except RuntimeError:                # the engine is stopping: its executor takes no more work
            return False
        self.ahead = a
        return True

    def _next_step(self, toks: list[list[int]]) -> RunAhead | None:
        """The next step's rows (those that go on, one token each) if it may start now, else None."""
        s, r = self.sched, self.reserved
        if (self.executor is None or not r.next_zero or not s.num_decode or s.num_decode != len(s.req_ids)
                or self.synthetic is not None):         # next_zero: the planner's promise (nobody waiting too)
            return None
        bs, ids, starts, chunks, tables = self.block_size, [], [], [], []
        for rid, start, row, table in zip(s.req_ids, s.starts, toks, r.block_tables):
            m = self.mirrors.reqs.get(rid)
            if m is None or not m.greedy:
                return None
            tok = row[0]
            if self._stops(m, tok):
                continue
            k = (start + 1) // bs + 1                       # blocks up to the one holding the next position
            if k > len(table):
                return None
            ids.append(rid)
            starts.append(start + 1)
            chunks.append((tok,))
            tables.append(table[:k])
        if not ids:
            return None
        return RunAhead(s.step + 1, tuple(ids), tuple(starts), tuple(chunks), tuple(tables), self.cache.generation,
                        self._capture(False))

    def _stops(self, m, tok: int) -> bool:
        """Does the request stop at ``tok`` (the batcher's rule, actors/stops.py)?"""
        got = m.extra.get("stop")
        if got is None:
            sp = m.sampling
            got = m.extra["stop"] = (stop_ids_of(sp, self.eos_ids), max_len_of(m.prompt_len, sp, self.max_model_len))
        stop_ids, max_len = got
        return bool(first_stop((tok,), len(m.tokens), m.num_output, m.sampling.min_tokens, stop_ids, max_len)[1])

    def _run_ahead(self, a: RunAhead) -> None:
        """The forward of a run-ahead step (queued on the compute thread; its result waits in ``a``)."""
        t0 = time.perf_counter()
        try:
            with self.cache.lock:
                if self.cache.generation != a.generation:       # a shrink moved blocks since: not run
                    return
                out = run_chunks(self.model, self.cache, self.block_size, [list(c) for c in a.chunks],
                                 list(a.starts), list(a.tables), [1] * len(a.chunks), a.capture)
            if a.capture:
                out, a.feats = out                                                         # feats [B, nF*H]
            a.tokens = argmax_last(out).tolist()                                           # out [B, V]
            a.time_s = time.perf_counter() - t0
        except BaseException as e:          # raised by the step that meets it (crash-only)
            a.error = e

    def _matches(self, a: RunAhead) -> bool:
        """Is the scheduled step (γ = 0) the one ``a`` ran: rows, positions, tokens and blocks?"""
        s, r = self.sched, self.reserved
        if (s.step != a.step or s.req_ids != a.req_ids or s.starts != a.starts or s.chunk_ids != a.chunks
                or s.num_decode != len(a.req_ids) or r.gamma != 0 or a.tokens is None):
            return False
        return all(t[: len(ta)] == ta for t, ta in zip(r.block_tables, a.tables))

    def _from_ahead(self, a: RunAhead):
        """This step's results from its run-ahead forward, and maybe the next run-ahead."""
        s = self.sched
        if a.feats is not None:
            self.buffers.put_features(s.step, a.feats, (1,) * len(a.req_ids))
        toks = [[t] for t in a.tokens]
        return self._results(toks, [0] * len(toks), None, a.time_s, self._start_ahead(toks))

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

    def _results(self, toks, acc, drafted, verify_time, ran_ahead: bool = False, hits: tuple[int, ...] = ()):
        s = self.sched
        gamma = drafted.gamma if drafted else 0
        gammas = drafted.gammas if drafted else ()
        flat = [t for row in toks for t in row]
        chain = [a - h for a, h in zip(acc, hits)] + acc[len(hits):] if hits else acc     # without sibling hits
        per_pos = tuple(sum(1 for a in chain[: s.num_decode] if a > i) for i in range(gamma))
        verified = StepVerified(step=s.step, gamma=gamma, req_ids=s.req_ids, counts=tuple(map(len, toks)),
                                tokens=tuple(flat), accepted=tuple(acc), num_decode=s.num_decode, gammas=gammas,
                                ran_ahead=ran_ahead, tree_hits=hits)
        drafted_pp = reached_pp = ()
        if gammas:                       # per-row γ: who drafted / reached each position
            drafted_pp = tuple(sum(1 for g in gammas if g > i) for i in range(gamma))
            reached_pp = tuple(sum(1 for g, a in zip(gammas, chain) if g > i and a >= i) for i in range(gamma))
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
            draft_time_s=drafted.draft_time_s if drafted else 0.0, tree_hits=sum(hits),
            **_lookup_split(drafted, chain),
        )
        return [verified, timed]


def _lookup_split(drafted: StepDrafted | None, chain: list[int]) -> dict:
    """StepTimed's share of a batch-level step's drafts that came from prompt lookup (StepDrafted.looked): how
    many rows, and how many of them accepted each position, so the planner can learn their acceptance apart."""
    if drafted is None or not drafted.looked or drafted.gammas:
        return {}
    rows = drafted.looked
    return {"lookup_drafts": len(rows),
            "lookup_accepted_per_pos": tuple(sum(1 for r in rows if chain[r] > i) for i in range(drafted.gamma))}


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
