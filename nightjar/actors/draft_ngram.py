"""The n-gram drafter (prompt lookup): ``--draft ngram`` instead of a draft model or head.

A request's drafts are the tokens that followed the latest earlier occurrence of its context's last n tokens,
n from ``max_n`` down to ``min_n`` (the longest suffix that occurred before wins), searched in the request's own
prompt and output. It has no weights and no KV cache, so there is nothing to offload, nothing goes stale while
γ = 0 and nothing needs catching up: the planner sees a drafter whose passes cost microseconds and whose
acceptance is whatever the requests repeat (high when an answer copies its prompt: code edits, extraction,
rewrites; low in open-ended chat). A row with no match proposes nothing that step (its γ_i is spent on nothing
and counts as a draft that was not accepted, so acceptance estimates include how often there is no match).

Verification is as for any drafter: greedy rows take the drafts the target's argmax agrees with; sampled rows
are verified by rejection sampling with q the one-hot distribution of the proposal (accept x with probability
p(x), else sample from p without x), which keeps the target's distribution; seeded rows compare with the
target's seeded sample.
"""
from __future__ import annotations

import time
from typing import ClassVar

import torch

from nightjar.actors.common import RequestMirrors, drafter_stays_quiet
from nightjar.actors.draft import DraftBuffers
from nightjar.actors.gamma_allocator import row_gammas
from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import BlocksReserved, RequestAdmitted, StepDrafted, StepScheduled, TokensCommitted

NAME = "ngram"
DEFAULT_N = (1, 3)      # (min_n, max_n), as vLLM's prompt_lookup_min / prompt_lookup_max; measured: docs/drafts.md
MAX_N = 16


def parse_ngram(spec: str | None) -> tuple[int, int] | None:
    """``ngram`` -> DEFAULT_N; ``ngram:MIN-MAX`` or ``ngram:N`` (MIN = MAX = N) -> (min_n, max_n); anything else
    (a model, a head, none) -> None. A malformed ``ngram:...`` raises ValueError saying what is allowed."""
    if spec is None or not str(spec).startswith(NAME) or str(spec)[len(NAME):len(NAME) + 1] not in ("", ":"):
        return None
    if spec == NAME:
        return DEFAULT_N
    lo, _, hi = str(spec)[len(NAME) + 1:].partition("-")
    try:
        n_min, n_max = int(lo), int(hi or lo)
    except ValueError:
        n_min = n_max = 0
    if not 1 <= n_min <= n_max <= MAX_N:
        raise ValueError(f"n-gram drafter: 'ngram', 'ngram:N' or 'ngram:MIN-MAX' with 1 <= MIN <= MAX <= {MAX_N}, "
                         f"got {spec!r}")
    return n_min, n_max


class NgramIndex:
    """Where each n-gram (min_n ≤ n ≤ max_n) of one token list last ended, among those with a token after them."""

    __slots__ = ("min_n", "max_n", "last", "done")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}     # n-gram -> index of its last token, latest occurrence
        self.done = 0                                   # n-grams ending before this index are in ``last``

    def _update(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a successor: those ending at done .. len(tokens) - 2."""
        end = len(tokens) - 1
        for e in range(self.done, end):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self.last[tuple(tokens[e - n + 1:e + 1])] = e
        self.done = max(self.done, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest matching suffix of ``tokens``
        (which only ever grows between calls); [] when no suffix of min_n or more tokens occurred. A match that
        ends d tokens before the end says the text repeats with period d: past the end the copy goes on from
        its own first tokens (``a b a b`` proposes ``a b a b ...``, not one token)."""
        self._update(tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self.last.get(tuple(tokens[L - n:]))
            if e is not None:
                out = tokens[e + 1:e + 1 + k]
                while len(out) < k:                 # index e + 1 + j >= L: the proposal's own token j - d
                    out.append(out[len(out) - (L - 1 - e)])
                return out
        return []


class PromptLookup:
    """An NgramIndex per request (built on first use, dropped by ``forget``), and how many proposals found a match:
    what both the n-gram drafter and a draft head's prompt lookup (actors/draft_head.py) draft from."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[int, NgramIndex] = {}
        self.matched = 0

    def propose(self, rid: int, tokens: list[int], k: int) -> list[int]:
        idx = self.index.get(rid)
        if idx is None:
            idx = self.index[rid] = NgramIndex(self.min_n, self.max_n)
        out = idx.propose(tokens, k)
        self.matched += bool(out)
        return out

    def forget(self, rid: int) -> None:
        self.index.pop(rid, None)


def one_hot_q(tokens: list[int], vocab_size: int, device) -> torch.Tensor:
    """The draft distribution of a proposal that is certain: one-hot rows [len(tokens), V] for rejection sampling."""
    return torch.nn.functional.one_hot(torch.tensor(tokens, device=device), vocab_size).float()


class NgramDraftExecutor(Actor):
    """Drafts by prompt lookup (module docstring) for the rows the step's BlocksReserved lets draft."""

    name: ClassVar[str] = "draft"
    subscribes = (RequestAdmitted, TokensCommitted, StepScheduled, BlocksReserved)
    quiet = subscribes                # it wakes to draft, or when a request finishes (stays_quiet)
    stays_quiet = staticmethod(drafter_stays_quiet)
    blocking = True                   # relays its drafts to the verifier on the compute thread (kernel/actor.py)

    def __init__(self, buffers: DraftBuffers, seed: int, vocab_size: int, device: torch.device | str,
                 n: tuple[int, int] = DEFAULT_N) -> None:
        super().__init__()
        self.buffers, self.vocab_size, self.device = buffers, vocab_size, device
        self.mirrors = RequestMirrors(seed, "draft", device)
        self.lookup = PromptLookup(*n)
        self.sched: StepScheduled | None = None

    def handle(self, msg, now):
        done = self.mirrors.observe(msg)
        if done is not None:
            for rid in done:
                self.lookup.forget(rid)
            return None
        match msg:
            case StepScheduled():
                self.sched = msg
            case BlocksReserved() if msg.gamma > 0 and self.sched and msg.step == self.sched.step:
                return [self._draft(msg.gamma, msg.gammas)]
        return None

    def _draft(self, gamma: int, per_row: tuple[int, ...]) -> StepDrafted:
        s = self.sched
        t0 = time.perf_counter()
        gams = row_gammas(gamma, per_row, s.speculate, s.num_decode)
        flat = [-1] * (s.num_decode * gamma)                  # [num_decode * γ], -1 where nothing is proposed
        probs: dict[int, torch.Tensor] = {}
        for row, g in enumerate(gams):
            if g <= 0:
                continue
            rid = s.req_ids[row]
            m = self.mirrors[rid]
            toks = self.lookup.propose(rid, m.tokens, g)
            flat[row * gamma:row * gamma + len(toks)] = toks
            if toks and not (m.greedy or m.seeded):
                probs[rid] = one_hot_q(toks, self.vocab_size, self.device)                 # [len, V]
        self.buffers.put(s.step, probs)
        return StepDrafted(step=s.step, gamma=gamma, draft_tokens=tuple(flat), handle=s.step,
                           draft_time_s=time.perf_counter() - t0, gammas=per_row)
