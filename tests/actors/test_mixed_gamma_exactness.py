"""Per-row γ_i in one step (issue 17): the draft executor runs pass k only on rows with γ_i ≥ k, the
verifier checks rows of different lengths, and with greedy sampling (fp32) every row emits exactly the
target's argmax continuation, whatever the mix of γ_i.

The harness drives DraftExecutor.handle() and Verifier.handle() directly (the bus's messages, no event
loop) on the tiny random fp32 pair of test_model_actors_handle. Seven rows sit in decode with a fixed
context; every step re-verifies the same context with another γ vector (rejected and re-drafted slots are
rolled back by counters, as in the engine), so each combination is checked against one precomputed
oracle per row: the target's and the draft's argmax continuations.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from nightjar.actors.draft import DraftBuffers, DraftExecutor
from nightjar.actors.gamma_allocator import layer_counts
from nightjar.actors.verifier import Verifier
from nightjar.actors.weights import DraftSlot
from nightjar.kernel.messages import (
    BlocksReserved,
    RequestAdmitted,
    SamplingSpec,
    StepDrafted,
    StepScheduled,
    TokensCommitted,
)
from nightjar.kvpool.blocks import BlockAllocator
from nightjar.kvpool.cache import KVCache
from tests.actors.test_model_actors_handle import BS, CFG, agreed, greedy
from tests.conftest import perturbed, random_model

ROWS = 7
NUM_BLOCKS = 96
PROMPTS = [tuple((7 * r + 3 * i + 1) % 60 + 2 for i in range(3 + r)) for r in range(ROWS)]


@pytest.fixture(scope="module")
def models():
    """The pair of test_model_actors_handle: a tiny random fp32 target and a lightly perturbed draft."""
    target = random_model(CFG, seed=1)
    return target, perturbed(target, 0.02, 2)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny forwards: one intra-op thread is ~10x faster than two on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class MixedRig:
    """Draft executor + verifier with seven requests in decode at a fixed context."""

    def __init__(self, target, draft, gamma_max: int):
        self.G = gamma_max
        self.buffers = DraftBuffers()
        self.alloc = BlockAllocator(NUM_BLOCKS, BS)
        cache = KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BS, NUM_BLOCKS, torch.float32)
        self.verifier = Verifier(target, cache, BS, self.buffers, seed=0)
        dcache = KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BS, NUM_BLOCKS, torch.float32)
        self.drafter = DraftExecutor(DraftSlot(draft, dcache, torch.device("cpu")), BlockAllocator(NUM_BLOCKS, BS),
                                     self.buffers, seed=0)
        self.rids = tuple(range(1, ROWS + 1))
        self.step = 0
        for rid, p in zip(self.rids, PROMPTS):
            self._send(RequestAdmitted(req_id=rid, prompt_ids=p, sampling=SamplingSpec(max_tokens=64)))
        self.tokens = {rid: list(p) for rid, p in zip(self.rids, PROMPTS)}
        first = self._prefill()
        self._send(TokensCommitted(step=1, req_ids=self.rids, counts=(1,) * ROWS, tokens=tuple(first),
                                   num_computed=tuple(len(p) for p in PROMPTS), finish=(0,) * ROWS))
        for rid, t in zip(self.rids, first):
            self.tokens[rid].append(t)
        self.dc = {rid: 0 for rid in self.rids}
        self.run((gamma_max,) * ROWS)                     # the draft catches up every prompt once
        self.dc = {rid: len(self.tokens[rid]) - 1 for rid in self.rids}     # lag 1 from now on
        self.want_target = {r: greedy(target, self.tokens[r], gamma_max + 1) for r in self.rids}
        self.want_draft = {r: greedy(draft, self.tokens[r], gamma_max) for r in self.rids}

    def _send(self, msg):
        d = self.drafter.handle(msg, 0.0) if type(msg) in DraftExecutor.subscribes else None
        v = self.verifier.handle(msg, 0.0) if type(msg) in Verifier.subscribes else None
        return d, v

    def _prefill(self) -> list[int]:
        self.step += 1
        starts = (0,) * ROWS
        for rid, p in zip(self.rids, PROMPTS):
            self.alloc.reserve(rid, len(p) + self.G + 2)
        sched = StepScheduled(step=self.step, req_ids=self.rids, starts=starts, chunk_ids=tuple(PROMPTS), num_decode=0,
                              draft_computed=(), speculate=(), prefill_done=(True,) * ROWS)
        self._send(sched)
        _, out = self._send(BlocksReserved(step=self.step, gamma=0, block_tables=self._tables(), num_free=0,
                                           num_total=NUM_BLOCKS))
        return list(out[0].tokens)

    def _tables(self):
        return tuple(self.alloc.block_table(r) for r in self.rids)

    def run(self, gammas: tuple[int, ...]):
        """One decode step over the seven rows with these γ_i: (StepDrafted or None, StepVerified, StepTimed)."""
        self.step += 1
        toks = self.tokens
        sched = StepScheduled(step=self.step, req_ids=self.rids, starts=tuple(len(toks[r]) - 1 for r in self.rids),
                              chunk_ids=tuple((toks[r][-1],) for r in self.rids), num_decode=ROWS,
                              draft_computed=tuple(self.dc[r] for r in self.rids), speculate=(True,) * ROWS,
                              prefill_done=(), max_draft_lag=max(len(toks[r]) - 1 - self.dc[r] for r in self.rids))
        self._send(sched)
        g = max(gammas)
        res = BlocksReserved(step=self.step, gamma=g, block_tables=self._tables(), num_free=0, num_total=NUM_BLOCKS,
                             gammas=gammas if g else ())
        drafted, out = self._send(res)
        if g:
            assert out is None and len(drafted) == 1
            drafted = drafted[0]
            _, out = self._send(drafted)
        else:
            drafted = None
        return drafted, out[0], out[1]

    def check(self, gammas: tuple[int, ...]) -> None:
        drafted, v, t = self.run(gammas)
        g = max(gammas)
        pos = 0
        for row, (rid, gi) in enumerate(zip(self.rids, gammas)):
            d = self.want_draft[rid][:gi]
            want = self.want_target[rid]
            k = agreed(d, want)
            if drafted is not None:
                assert isinstance(drafted, StepDrafted) and drafted.gammas == gammas
                assert list(drafted.draft_tokens[row * g: (row + 1) * g]) == d + [-1] * (g - gi), (gammas, row)
            assert v.accepted[row] == k, (gammas, row)
            assert list(v.tokens[pos: pos + v.counts[row]]) == want[:k + 1], (gammas, row)   # lossless
            pos += v.counts[row]
        assert v.gamma == g and v.gammas == (gammas if g else ())
        if g:
            assert t.drafted_per_pos == layer_counts(gammas, self.G)
            assert t.num_drafts == sum(1 for x in gammas if x)
            assert t.reached_per_pos == tuple(sum(1 for x, a in zip(gammas, v.accepted) if x > i and a >= i)
                                              for i in range(g))


def test_every_combination_of_gamma_0_to_2_over_seven_rows_is_greedy_exact(models):
    rig = MixedRig(*models, gamma_max=2)
    accepted_some = set()
    for combo in itertools.product(range(3), repeat=ROWS):         # 3^7 = 2187 steps
        rig.check(combo)
        accepted_some.add(combo)
    assert len(accepted_some) == 3 ** ROWS
    # the oracle is not trivial: some rows accept the drafts, some reject the first
    acc = [agreed(rig.want_draft[r], rig.want_target[r]) for r in rig.rids]
    assert max(acc) >= 1 and min(acc) < 2


def test_random_combinations_of_gamma_0_to_4_over_seven_rows_are_greedy_exact(models):
    rig = MixedRig(*models, gamma_max=4)
    rng = random.Random(17)
    combos = {tuple(rng.randint(0, 4) for _ in range(ROWS)) for _ in range(300)}
    combos |= {(k,) * ROWS for k in range(5)} | {tuple(range(5)) + (4, 0)}
    for combo in sorted(combos):
        rig.check(combo)


@pytest.mark.parametrize("gammas", [(0, 0, 3, 0, 0, 0, 1), (4, 0, 0, 0, 0, 0, 0), (1, 2, 3, 4, 3, 2, 1)])
def test_the_draft_runs_pass_k_only_on_rows_with_gamma_at_least_k(models, gammas, monkeypatch):
    rig = MixedRig(*models, gamma_max=4)
    import nightjar.actors.draft as draft_mod
    sizes = []
    real = draft_mod.run_chunks

    def spy(model, cache, bs, chunks, starts, tables, rows):
        sizes.append(len(chunks))
        return real(model, cache, bs, chunks, starts, tables, rows)

    monkeypatch.setattr(draft_mod, "run_chunks", spy)
    rig.check(gammas)
    assert sizes == list(layer_counts(gammas, 4))                # no catch-up (lag 1): only the draft passes
