"""DraftExecutor.handle() and Verifier.handle() driven directly (no event loop, no batcher) on a tiny
random fp32 target and a lightly perturbed copy as the draft.

Each test feeds the messages the bus would deliver (RequestAdmitted, StepScheduled, BlocksReserved,
StepDrafted, TokensCommitted) and checks the exact messages returned against an oracle: the models'
argmax continuations, recomputed from the whole prefix for every token. Only measured times are
checked loosely (positive, and the step time covers the draft time).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from nightjar.actors.draft import DraftBuffers, DraftExecutor
from nightjar.actors.verifier import Verifier
from nightjar.actors.weights import DraftSlot
from nightjar.kernel.messages import (
    BlocksReserved,
    FinishReason,
    RequestAdmitted,
    RequestsPreempted,
    SamplingSpec,
    StepDrafted,
    StepScheduled,
    StepTimed,
    StepVerified,
    TokensCommitted,
)
from nightjar.kvpool.blocks import BlockAllocator
from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from tests.conftest import perturbed, random_model, tiny_config

BS, NUM_BLOCKS = 4, 64
CFG = tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2, eos=())
# With these prompts the draft agrees with the target for 4, 2 and 3 tokens after the first output token.
PROMPTS = {1: (3, 7, 1, 4, 9, 2, 5), 2: (40, 2, 33, 8, 8, 19, 50, 1, 6, 23), 3: (11, 12, 13),
           4: (20, 21, 22, 23, 24, 25)}


@pytest.fixture(scope="module")
def models():
    target = random_model(CFG, seed=1)
    return target, perturbed(target, 0.02, 2)


def greedy(model, tokens, n: int) -> list[int]:
    """The oracle: ``n`` argmax tokens after ``tokens``, each from a fresh forward over the whole prefix."""
    toks = tuple(tokens)
    for _ in range(n):
        toks += (next_token(model, toks),)
    return list(toks[len(tokens):])


@functools.cache
def next_token(model, prefix: tuple[int, ...]) -> int:
    nb = -(-len(prefix) // BS)
    cache = KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BS, nb, torch.float32)
    lay = build_layout([list(prefix)], [0], [tuple(range(nb))], BS, [1])
    return int(model(lay, cache)[0].argmax())


def agreed(drafts: list[int], target: list[int]) -> int:
    k = 0
    while k < len(drafts) and drafts[k] == target[k]:
        k += 1
    return k


@dataclass
class Rig:
    """The two model actors plus the bookkeeping the batcher and KV pool would do for them."""
    target: torch.nn.Module
    draft: torch.nn.Module
    tokens: dict[int, list[int]] = field(default_factory=dict)
    computed: dict[int, int] = field(default_factory=dict)          # tokens in the target KV
    dcomp: dict[int, int] = field(default_factory=dict)             # tokens in the draft KV

    def __post_init__(self):
        self.buffers = DraftBuffers()
        self.alloc = BlockAllocator(NUM_BLOCKS, BS)                   # target block tables (the KV pool's job)
        cache = KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BS, NUM_BLOCKS, torch.float32)
        self.verifier = Verifier(self.target, cache, BS, self.buffers, seed=0)
        dcache = KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BS, NUM_BLOCKS, torch.float32)
        self.draft_alloc = BlockAllocator(NUM_BLOCKS, BS)
        self.drafter = DraftExecutor(DraftSlot(self.draft, dcache, torch.device("cpu")), self.draft_alloc,
                                     self.buffers, seed=0)

    def send(self, msg):
        """Deliver ``msg`` as the bus would: (draft executor's result, verifier's result); "-" if not subscribed."""
        d = self.drafter.handle(msg, 0.0) if type(msg) in DraftExecutor.subscribes else "-"
        v = self.verifier.handle(msg, 0.0) if type(msg) in Verifier.subscribes else "-"
        return d, v

    def admit(self, *rids: int, **sampling) -> None:
        for rid in rids:
            msg = RequestAdmitted(req_id=rid, prompt_ids=PROMPTS[rid], sampling=SamplingSpec(max_tokens=64, **sampling))
            assert self.send(msg) == (None, None)
            self.tokens[rid], self.computed[rid], self.dcomp[rid] = list(PROMPTS[rid]), 0, 0

    def schedule(self, step: int, decode=(), prefill=(), gamma: int = 0) -> tuple[StepScheduled, BlocksReserved]:
        """decode: [(rid, speculate)]; prefill: [(rid, end)] feeds prompt[computed:end]."""
        rids = [r for r, _ in decode] + [r for r, _ in prefill]
        chunks = [(self.tokens[r][-1],) for r, _ in decode] + [PROMPTS[r][self.computed[r]:end] for r, end in prefill]
        starts = [self.computed[r] for r in rids]
        for r, s, c, row in zip(rids, starts, chunks, range(len(rids))):
            self.alloc.reserve(r, s + len(c) + (gamma if row < len(decode) else 0))
        lags = [len(self.tokens[r]) - 1 - self.dcomp[r] for r, spec in decode if spec]
        sched = StepScheduled(step=step, req_ids=tuple(rids), starts=tuple(starts), chunk_ids=tuple(chunks),
                              num_decode=len(decode), draft_computed=tuple(self.dcomp[r] for r, _ in decode),
                              speculate=tuple(s for _, s in decode),
                              prefill_done=tuple(end == len(PROMPTS[r]) for r, end in prefill),
                              max_draft_lag=max(lags, default=0))
        res = BlocksReserved(step=step, gamma=gamma, block_tables=tuple(self.alloc.block_table(r) for r in rids),
                             num_free=self.alloc.num_free, num_total=NUM_BLOCKS)
        return sched, res

    def expect(self, sched: StepScheduled, gamma: int):
        """The oracle's (draft tokens, emitted tokens per row, accepted per row) for a scheduled step."""
        drafts, emitted, accepted = [], [], []
        for row, rid in enumerate(sched.req_ids):
            if row < sched.num_decode:
                d = greedy(self.draft, self.tokens[rid], gamma) if sched.speculate[row] else []
                g = greedy(self.target, self.tokens[rid], gamma + 1)
                k = agreed(d, g)
                drafts += d or [-1] * gamma
                emitted.append(g[:k + 1])
                accepted.append(k)
            else:
                done = sched.prefill_done[row - sched.num_decode]
                emitted.append(greedy(self.target, PROMPTS[rid], 1) if done else [])
                accepted.append(0)
        return drafts, emitted, accepted

    def commit(self, sched: StepScheduled, v: StepVerified, finish=()) -> TokensCommitted:
        """Apply a verified step as the batcher does (its counter rules) and build its TokensCommitted."""
        pos, done = 0, dict(finish)
        for row, (rid, n, a) in enumerate(zip(v.req_ids, v.counts, v.accepted)):
            if row < sched.num_decode:
                before = len(self.tokens[rid])
                self.computed[rid] = before + a
                if v.gamma > 0 and sched.speculate[row]:
                    self.dcomp[rid] = before + min(a, v.gamma - 1)
            else:
                self.computed[rid] = sched.starts[row] + len(sched.chunk_ids[row])
            self.tokens[rid] += v.tokens[pos:pos + n]
            pos += n
        return TokensCommitted(step=v.step, req_ids=v.req_ids, counts=v.counts, tokens=v.tokens,
                               num_computed=tuple(self.computed[r] for r in v.req_ids),
                               finish=tuple(int(done.get(r, FinishReason.NONE)) for r in v.req_ids))


def flat(rows):
    return tuple(t for r in rows for t in r)


def expected_results(sched, gamma, emitted, accepted, step_time, catchup=(0.0, 0), draft_time=0.0):
    num_dec = sched.num_decode
    verified = StepVerified(step=sched.step, gamma=gamma, req_ids=sched.req_ids, counts=tuple(map(len, emitted)),
                            tokens=flat(emitted), accepted=tuple(accepted), num_decode=num_dec)
    timed = StepTimed(step=sched.step, batch_size=num_dec, gamma=gamma, step_time_s=step_time,
                      tokens_emitted=sum(len(e) for e in emitted[:num_dec]), max_draft_lag=sched.max_draft_lag,
                      catchup_time_s=catchup[0], catchup_tokens=catchup[1],
                      accepted_per_pos=tuple(sum(a > i for a in accepted[:num_dec]) for i in range(gamma)),
                      num_drafts=sum(sched.speculate) if gamma else 0,
                      num_prefill_tokens=sum(len(c) for c in sched.chunk_ids[num_dec:]), draft_time_s=draft_time)
    return [verified, timed]


def run_prefill(rig: Rig, step: int, prefill) -> StepVerified:
    sched, res = rig.schedule(step, prefill=prefill)
    assert rig.send(sched) == (None, None)
    _, emitted, accepted = rig.expect(sched, 0)
    d, v = rig.send(res)
    assert d is None and v[1].step_time_s > 0
    assert v == expected_results(sched, 0, emitted, accepted, v[1].step_time_s)
    assert rig.send(rig.commit(sched, v[0])) == (None, None)
    return v[0]


def run_speculative(rig: Rig, step: int, decode, prefill=(), gamma: int = 3):
    """One γ > 0 step through both actors; returns (StepDrafted, [StepVerified, StepTimed], accepted)."""
    sched, res = rig.schedule(step, decode=decode, prefill=prefill, gamma=gamma)
    assert rig.send(sched) == (None, None)
    drafts, emitted, accepted = rig.expect(sched, gamma)
    catchup = sum(len(rig.tokens[r]) - 1 - rig.dcomp[r] for r, spec in decode
                  if spec and len(rig.tokens[r]) - 1 - rig.dcomp[r] >= 2)
    (drafted,), waiting = rig.send(res)
    assert waiting is None                                   # the verifier waits for the drafts
    assert drafted.draft_time_s > 0 and (drafted.catchup_time_s > 0) == (catchup > 0)
    assert drafted == StepDrafted(step=step, gamma=gamma, draft_tokens=tuple(drafts), handle=step,
                                  draft_time_s=drafted.draft_time_s, catchup_time_s=drafted.catchup_time_s,
                                  catchup_tokens=catchup)
    d, out = rig.send(drafted)
    assert d == "-" and out[1].step_time_s > drafted.draft_time_s
    assert out == expected_results(sched, gamma, emitted, accepted, out[1].step_time_s,
                                   (drafted.catchup_time_s, catchup), drafted.draft_time_s)   # the draft's share
    assert rig.buffers._bufs == {}                           # the verifier took the step's draft buffer
    assert rig.send(rig.commit(sched, out[0])) == (None, None)
    return drafted, out, accepted


# ---- tests ------------------------------------------------------------------------------------
def test_a_prefill_step_emits_the_target_argmax_of_finished_prompts_and_nothing_for_partial_chunks(models):
    rig = Rig(*models)
    rig.admit(1, 2, 4)
    v = run_prefill(rig, 1, prefill=[(1, 7), (2, 10), (4, 3)])
    assert v.counts == (1, 1, 0) and v.tokens == (greedy(models[0], PROMPTS[1], 1)[0],
                                                  greedy(models[0], PROMPTS[2], 1)[0])
    assert rig.draft_alloc.seq_ids() == ()                   # the draft does no work on γ = 0 steps


def test_greedy_speculative_steps_emit_exactly_the_target_argmax_continuation(models):
    target, draft = models
    rig = Rig(target, draft)
    rig.admit(1, 2, 3, 4)
    run_prefill(rig, 1, prefill=[(1, 7), (2, 10), (3, 3), (4, 3)])
    # step 2: three decode rows (row 3 does not speculate) and the rest of prompt 4; γ = 4
    drafted, _, acc = run_speculative(rig, 2, decode=[(1, True), (2, True), (3, False)], prefill=[(4, 6)], gamma=4)
    assert acc == [4, 2, 0, 0] and drafted.draft_tokens[8:] == (-1,) * 4     # full, partial, none
    assert drafted.catchup_tokens == 7 + 10                  # both drafting rows' prompts, once
    assert rig.draft_alloc.num_committed(1) == 7 + 1 + 3     # prompt, first token, d1..d3 in the draft KV
    # step 3: rejected drafts roll back, accepted ones are reused; row 4 starts drafting (catches up); γ = 2
    _, _, acc3 = run_speculative(rig, 3, decode=[(1, True), (2, True), (3, True), (4, True)], gamma=2)
    for rid, prompt in PROMPTS.items():                      # lossless: the plain greedy decode
        out_toks = rig.tokens[rid][len(prompt):]
        assert out_toks == greedy(target, prompt, len(out_toks)), rid
    before3 = [1 + 5, 1 + 3, 1 + 1, 0 + 1]                   # outputs of steps 1 and 2
    assert [len(rig.tokens[r]) - len(PROMPTS[r]) for r in (1, 2, 3, 4)] == [
        n + a + 1 for n, a in zip(before3, acc3)]


def test_gamma_zero_decode_is_verified_without_the_draft(models):
    rig = Rig(*models)
    rig.admit(1, 3)
    run_prefill(rig, 1, prefill=[(1, 7), (3, 3)])
    sched, res = rig.schedule(2, decode=[(1, True), (3, True)], gamma=0)
    assert rig.send(sched) == (None, None)
    _, emitted, accepted = rig.expect(sched, 0)
    d, v = rig.send(res)
    assert d is None and rig.buffers._bufs == {}
    assert v == expected_results(sched, 0, emitted, accepted, v[1].step_time_s)
    assert v[0].tokens == (greedy(models[0], rig.tokens[1], 1)[0], greedy(models[0], rig.tokens[3], 1)[0])
    assert v[1].accepted_per_pos == () and v[1].num_drafts == 0 and v[1].tokens_emitted == 2


def test_messages_of_another_step_or_out_of_order_are_ignored(models):
    rig = Rig(*models)
    rig.admit(1)
    sched, res = rig.schedule(1, prefill=[(1, 7)])
    assert rig.send(res) == (None, None)                                       # before any schedule
    assert rig.send(sched) == (None, None)
    assert rig.send(msgspec.structs.replace(res, step=2)) == (None, None)       # another step's blocks
    stray = StepDrafted(step=1, gamma=2, draft_tokens=(), handle=1, draft_time_s=0.0)
    assert rig.send(stray) == ("-", None)                                      # drafts before the blocks
    d, v = rig.send(res)
    assert d is None and [type(m) for m in v] == [StepVerified, StepTimed]


def test_finished_and_preempted_requests_free_the_draft_s_blocks_and_mirrors(models):
    rig = Rig(*models)
    rig.admit(1, 2)
    run_prefill(rig, 1, prefill=[(1, 7), (2, 10)])
    run_speculative(rig, 2, decode=[(1, True), (2, True)], gamma=2)
    assert set(rig.draft_alloc.seq_ids()) == {1, 2} and rig.draft_alloc.num_free < NUM_BLOCKS
    assert rig.send(RequestsPreempted(req_ids=(2,))) == (None, "-")
    assert rig.draft_alloc.seq_ids() == (1,)
    fin = TokensCommitted(step=3, req_ids=(1,), counts=(1,), tokens=(5,), num_computed=(0,),
                          finish=(int(FinishReason.STOP),))
    assert rig.send(fin) == (None, None)
    assert rig.draft_alloc.seq_ids() == () and rig.draft_alloc.num_free == NUM_BLOCKS
    assert 1 not in rig.drafter.mirrors.reqs and 1 not in rig.verifier.mirrors.reqs
    assert 2 in rig.verifier.mirrors.reqs                    # preemption keeps the request (it is re-run)
