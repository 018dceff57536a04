"""WeightMover.handle() as a table: messages in, exact messages and state out, no event loop.

Covers the offload trigger (T_persist steps of low free blocks with speculation off), the reload trigger
(free blocks above the draft plus τ_low plus headroom, nothing waiting), every state of
RESIDENT -> OFFLOADING -> OFFLOADED -> SHRINKING -> RELOADING -> RESIDENT, failed copies, forced
OffloadDraft/ReloadDraft, and what is ignored. Transfers are fed as TransferFinished messages, as replay does
(transfer=None);
the last test runs the mover with a real DraftTransfer on a tiny model on a live loop.
(tests/actors/test_weights.py covers the reload rule's arithmetic and the idle reload on a last finish.)
"""
from __future__ import annotations

import asyncio
import functools

import torch

from nightjar.actors.weights import DraftSlot, Triggers, WeightMover
from nightjar.kernel.bus import Bus
from nightjar.kernel.clock import VirtualClock
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftOffloaded,
    DraftReloaded,
    DraftResidency,
    FinishReason,
    GrowPool,
    OffloadDraft,
    PoolResized,
    ReloadDraft,
    RequestAdmitted,
    SamplingSpec,
    ShrinkPool,
    StepScheduled,
    StepVerified,
    TokensCommitted,
    TransferFinished,
)
from nightjar.kvpool.cache import KVCache
from nightjar.transfer.weights import DraftTransfer
from tests.conftest import random_model, tiny_config

DRAFT = 10          # draft blocks; the base pool is 100 blocks, 110 while the draft is offloaded


@functools.cache
def tiny_slot() -> DraftSlot:
    """A real draft (tiny random model, 8-block KV) on the CPU; with transfer=None nothing moves it."""
    cfg = tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2, eos=())
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 8, torch.float32)
    return DraftSlot(random_model(cfg, seed=3), cache, torch.device("cpu"))


def mover(elastic=True, draft_blocks=DRAFT, persist=3, headroom=0, slot=None) -> WeightMover:
    trig = Triggers(draft_blocks=draft_blocks, low_free_frac=0.10, persist_steps=persist, headroom_blocks=headroom)
    return WeightMover(slot or tiny_slot(), trig, elastic=elastic)


def res(free: int, total: int = 100, gamma: int = 0, step: int = 1) -> BlocksReserved:
    return BlocksReserved(step=step, gamma=gamma, block_tables=(), num_free=free, num_total=total)


def sched(waiting: int, step: int = 1, to_finish: int = -1) -> StepScheduled:
    return StepScheduled(step=step, req_ids=(), starts=(), chunk_ids=(), num_decode=0, draft_computed=(),
                         speculate=(), prefill_done=(), num_waiting=waiting, blocks_to_finish=to_finish)


def admit(rid: int = 1) -> RequestAdmitted:
    return RequestAdmitted(req_id=rid, prompt_ids=(1,), sampling=SamplingSpec())


def verified(step: int = 1) -> StepVerified:
    return StepVerified(step=step, gamma=3, req_ids=(), counts=(), tokens=(), accepted=(), num_decode=0)


def state(name: str, resident: bool = False) -> DraftResidency:
    return DraftResidency(resident=resident, state=name)


OFF_DONE = TransferFinished(kind="offload", nbytes=4096, duration_s=0.25)
RE_DONE = TransferFinished(kind="reload", nbytes=4096, duration_s=0.125)
OFFLOADED = [DraftOffloaded(bytes_moved=4096, duration_s=0.25, freed_blocks=DRAFT), state("OFFLOADED"),
             GrowPool(num_blocks=DRAFT)]
SHRINK = [ShrinkPool(num_blocks=DRAFT), state("SHRINKING")]
SHRUNK = PoolResized(num_total=100, delta=-DRAFT, migrated=3, duration_s=0.01)
RELOADED = [DraftReloaded(bytes_moved=4096, duration_s=0.125), state("RESIDENT", True)]


def play(m: WeightMover, rows) -> None:
    """rows: (message, expected result of handle, expected state after it)."""
    for i, (msg, want, st) in enumerate(rows):
        assert (m.handle(msg, float(i)), m.state) == (want, st), (i, msg)


# ---- the cycle and its triggers -----------------------------------------------------------------
def test_a_full_cycle_driven_by_the_triggers():
    m = mover()
    assert m.on_start(0.0) == [state("RESIDENT", True)] and m.elastic
    play(m, [
        (admit(), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),                        # 9 < τ_low·100 with γ = 0: streak 1
        (res(9), None, "RESIDENT"),                        # streak 2
        (res(9), [state("OFFLOADING")], "OFFLOADING"),     # T_persist = 3
        (res(0), None, "OFFLOADING"),                      # no trigger runs while a move is under way
        (OFF_DONE, OFFLOADED, "OFFLOADED"),                # no γ>0 step in flight: release and grow at once
        (PoolResized(num_total=110, delta=DRAFT), None, "OFFLOADED"),
        (res(21, 110), None, "OFFLOADED"),                 # 21 > 10 + 0.1·100 + 0 headroom: streak 1
        (res(21, 110), None, "OFFLOADED"),
        (res(21, 110), SHRINK, "SHRINKING"),
        (res(110, 110), None, "SHRINKING"),
        (SHRUNK, [state("RELOADING")], "RELOADING"),
        (RE_DONE, RELOADED, "RESIDENT"),
    ])
    assert (m.num_offloads, m.num_reloads, m.host) == (1, 1, None)
    slot = tiny_slot()                                     # with no transfer (replay) no tensor is released
    assert slot.cache.nbytes == 2 * 2 * 8 * 4 * 2 * 8 * 4 and all(p.numel() for p in slot.model.parameters())


def test_the_offload_streak_needs_consecutive_short_steps_with_speculation_off():
    m = mover()
    play(m, [
        (admit(), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (res(10), None, "RESIDENT"),                       # 10 is not below 10% of 100: the streak resets
        (res(9), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (res(0, gamma=2), None, "RESIDENT"),               # speculation on (γ > 0): resets too
        (res(9), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (sched(waiting=3), None, "RESIDENT"),
        (res(50), [state("OFFLOADING")], "OFFLOADING"),    # plenty free, but requests wait: short as well
    ])


def test_low_free_blocks_that_the_running_requests_cannot_outgrow_do_not_offload():
    m = mover()
    play(m, [
        (admit(), None, "RESIDENT"),
        (sched(waiting=0, to_finish=9), None, "RESIDENT"),  # every running request's max_len fits in 9
        (res(9), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (sched(waiting=0, to_finish=12), None, "RESIDENT"),  # now they may need 12 of the 9 free
        (res(9), None, "RESIDENT"),
        (res(9), None, "RESIDENT"),
        (res(9), [state("OFFLOADING")], "OFFLOADING"),
    ])


def test_the_reload_streak_needs_room_and_an_empty_queue():
    m = mover(headroom=5)
    play(m, [(admit(), None, "RESIDENT"), (OffloadDraft(), [state("OFFLOADING")], "OFFLOADING"),
             (OFF_DONE, OFFLOADED, "OFFLOADED")])
    room = DRAFT + 0.10 * 100 + 5                          # 25 blocks
    play(m, [
        (res(int(room), 110), None, "OFFLOADED"),          # 25 is not above 25
        (res(26, 110), None, "OFFLOADED"),
        (sched(waiting=1), None, "OFFLOADED"),
        (res(110, 110), None, "OFFLOADED"),                # a queue blocks the reload and resets the streak
        (sched(waiting=0), None, "OFFLOADED"),
        (res(26, 110), None, "OFFLOADED"),
        (res(26, 110, gamma=0), None, "OFFLOADED"),
        (res(26, 110), SHRINK, "SHRINKING"),
    ])


def test_an_offload_copy_that_finishes_during_a_speculative_step_waits_for_its_verification():
    m = mover()
    play(m, [
        (admit(), None, "RESIDENT"),
        (res(50, gamma=3), None, "RESIDENT"),              # a γ = 3 step is in flight
        (OffloadDraft(reason="test"), [state("OFFLOADING")], "OFFLOADING"),
        (OFF_DONE, None, "OFFLOADING"),                    # the draft is still in use: not released yet
        (verified(), OFFLOADED, "OFFLOADED"),
        (verified(), None, "OFFLOADED"),
    ])
    assert m.num_offloads == 1


def test_an_offload_that_finishes_with_no_request_in_flight_reloads_at_once():
    m = mover()
    play(m, [(OffloadDraft(), [state("OFFLOADING")], "OFFLOADING"),
             (OFF_DONE, OFFLOADED + SHRINK, "SHRINKING")])


def test_a_failed_copy_leaves_the_draft_where_it_was():
    m = mover()
    off_failed = TransferFinished(kind="offload", nbytes=0, duration_s=0.5, error="MemoryError: no host")
    re_failed = TransferFinished(kind="reload", nbytes=0, duration_s=0.5, error="RuntimeError: copy")
    play(m, [
        (admit(), None, "RESIDENT"),
        (OffloadDraft(), [state("OFFLOADING")], "OFFLOADING"),
        (off_failed, [state("RESIDENT", True)], "RESIDENT"),        # nothing was released: speculate again
        (verified(), None, "RESIDENT"),
        (re_failed, None, "RESIDENT"),                               # not reloading: ignored
        (OffloadDraft(), [state("OFFLOADING")], "OFFLOADING"),
        (OFF_DONE, OFFLOADED, "OFFLOADED"),
        (off_failed, None, "OFFLOADED"),
        (ReloadDraft(), SHRINK, "SHRINKING"),
        (SHRUNK, [state("RELOADING")], "RELOADING"),
        (re_failed, [state("OFFLOADED"), GrowPool(num_blocks=DRAFT)], "OFFLOADED"),   # the pool grows back
        (ReloadDraft(), SHRINK, "SHRINKING"),                        # and the host copy can be tried again
        (SHRUNK, [state("RELOADING")], "RELOADING"),
        (RE_DONE, RELOADED, "RESIDENT"),
    ])
    assert (m.num_offloads, m.num_reloads) == (1, 1)


# ---- commands ----------------------------------------------------------------------------------
def test_forced_commands_work_without_elastic_memory_and_a_forced_reload_retries_until_the_pool_shrinks():
    m = mover(elastic=False)
    assert not m.elastic
    play(m, [
        (admit(), None, "RESIDENT"),
        (res(0), None, "RESIDENT"),                        # no trigger without elastic memory
        (res(0), None, "RESIDENT"),
        (res(0), None, "RESIDENT"),
        (ReloadDraft(), None, "RESIDENT"),                 # nothing to reload
        (OffloadDraft(), [state("OFFLOADING")], "OFFLOADING"),
        (OffloadDraft(), None, "OFFLOADING"),              # already moving
        (ReloadDraft(), None, "OFFLOADING"),               # only an offloaded draft can be reloaded
        (OFF_DONE, OFFLOADED, "OFFLOADED"),
        (ReloadDraft(reason="test"), SHRINK, "SHRINKING"),
        (PoolResized(num_total=110, delta=0), [state("OFFLOADED")], "OFFLOADED"),   # live blocks in the way
        (res(0, 110), SHRINK, "SHRINKING"),                # the forced reload retries on the next step
        (SHRUNK, [state("RELOADING")], "RELOADING"),
        (RE_DONE, RELOADED, "RESIDENT"),
        (res(0), None, "RESIDENT"),                        # the force is spent
    ])
    assert not m.reload_forced


def test_messages_out_of_their_state_are_ignored():
    m = mover()
    play(m, [
        (admit(), None, "RESIDENT"),
        (RE_DONE, None, "RESIDENT"),
        (OFF_DONE, None, "RESIDENT"),
        (SHRUNK, None, "RESIDENT"),
        (verified(), None, "RESIDENT"),
        (OffloadDraft(), [state("OFFLOADING")], "OFFLOADING"),
        (RE_DONE, None, "OFFLOADING"),
        (OFF_DONE, OFFLOADED, "OFFLOADED"),
        (OFF_DONE, None, "OFFLOADED"),                     # a second copy report changes nothing
        (SHRUNK, None, "OFFLOADED"),                       # no shrink was asked for
        (ReloadDraft(), SHRINK, "SHRINKING"),
        (PoolResized(num_total=120, delta=DRAFT), None, "SHRINKING"),   # a grow report is not the shrink
        (RE_DONE, None, "SHRINKING"),
    ])
    assert m.num_offloads == 1 and m.num_reloads == 0


def test_without_a_draft_or_draft_blocks_nothing_moves_by_itself():
    none = WeightMover(None, Triggers(draft_blocks=DRAFT), elastic=True)
    assert none.on_start(0.0) == [state("NONE")] and not none.elastic
    play(none, [(res(0), None, "NONE"), (res(0), None, "NONE"), (res(0), None, "NONE"),
                (OffloadDraft(), None, "NONE"), (ReloadDraft(), None, "NONE")])
    zero = mover(draft_blocks=0)
    assert not zero.elastic
    play(zero, [(res(0), None, "RESIDENT")] * 4)


# ---- with a real transfer on a live loop --------------------------------------------------------
async def test_a_mover_with_a_real_transfer_releases_the_draft_after_the_copy_and_restores_it():
    cfg = tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2, eos=())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(cfg, seed=3).to(dev)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 8, torch.float32, dev)
    seg = cache.segments[0].data
    seg.copy_(torch.randn(seg.shape, generator=torch.Generator().manual_seed(4)))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    kv = cache.segments[0].data.clone()
    nbytes = model.weight_bytes()

    m = mover(slot=DraftSlot(model, cache, dev))
    bus = Bus(VirtualClock())
    box: list = []
    bus.add_tap(lambda env: box.append(env) if isinstance(env.msg, TransferFinished) else None)
    m.attach(bus)
    m.transfer = DraftTransfer(asyncio.get_running_loop())

    async def finished(kind: str) -> TransferFinished:
        for _ in range(2500):
            if box:
                env = box.pop()
                assert env.src == "transfer" and env.msg.kind == kind
                return env.msg
            await asyncio.sleep(0.002)
        raise AssertionError(f"no TransferFinished({kind})")

    try:
        m.handle(admit(), 0.0)
        assert m.handle(OffloadDraft(), 0.0) == [state("OFFLOADING")]
        off = await finished("offload")
        assert off.nbytes == m.host.nbytes >= nbytes + kv.numel() * 4 and off.duration_s > 0
        offloaded = DraftOffloaded(bytes_moved=off.nbytes, duration_s=off.duration_s, freed_blocks=DRAFT)
        assert m.handle(off, 0.0) == [offloaded, state("OFFLOADED"), GrowPool(num_blocks=DRAFT)]
        assert all(p.numel() == 0 for p in model.parameters()) and cache.nbytes == 0      # released
        assert m.handle(ReloadDraft(), 0.0) == SHRINK
        assert m.handle(SHRUNK, 0.0) == [state("RELOADING")]
        re = await finished("reload")
        assert re.nbytes == off.nbytes
        assert m.handle(re, 0.0) == [DraftReloaded(bytes_moved=re.nbytes, duration_s=re.duration_s),
                                     state("RESIDENT", True)]
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
        assert torch.equal(cache.segments[0].data, kv)
        # shutdown while offloaded: restore_now puts the draft back synchronously
        m.handle(OffloadDraft(), 0.0)
        m.handle(await finished("offload"), 0.0)
        assert m.state == "OFFLOADED" and cache.nbytes == 0
        m.restore_now()
        assert m.state == "RESIDENT" and m.host is None
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
        assert torch.equal(cache.segments[0].data, kv)
    finally:
        m.transfer.shutdown()
    done = TokensCommitted(step=1, req_ids=(1,), counts=(0,), tokens=(), num_computed=(0,),
                           finish=(int(FinishReason.STOP),))
    assert m.handle(done, 0.0) is None                     # resident: an idle engine has nothing to reload


class RecordingTransfer:
    """Records offload calls (the copy itself is never run)."""

    def __init__(self):
        self.offloads = 0

    def offload(self, slot, done):
        self.offloads += 1


def test_with_a_live_draft_executor_the_copy_waits_for_its_draft_quiesced():
    """A draft head writes its cache after every verified step: the copy (and so the release) starts only once
    the draft executor has handled the offload's DraftResidency and said so (DraftQuiesced)."""
    from nightjar.kernel.messages import DraftQuiesced

    m = mover()
    m.transfer, m.await_quiesced = RecordingTransfer(), True
    assert m.handle(OffloadDraft(), 0.0) == [DraftResidency(resident=False, state="OFFLOADING")]
    assert m.transfer.offloads == 0 and m.state == "OFFLOADING"
    assert m.handle(DraftQuiesced(), 0.0) is None
    assert m.transfer.offloads == 1
    assert m.handle(DraftQuiesced(), 0.0) is None and m.transfer.offloads == 1     # a stray one: no second copy
    plain = mover()
    plain.transfer = RecordingTransfer()                   # no live draft executor (simulation): at once
    plain.handle(OffloadDraft(), 0.0)
    assert plain.transfer.offloads == 1


def test_the_draft_executor_says_it_is_quiesced_only_when_an_offload_starts():
    from nightjar.actors.draft import DraftBuffers, DraftExecutor
    from nightjar.kernel.messages import DraftQuiesced
    from nightjar.kvpool.blocks import BlockAllocator

    ex = DraftExecutor(tiny_slot(), BlockAllocator(8, 4), DraftBuffers(), seed=0)
    assert ex.handle(DraftResidency(resident=False, state="OFFLOADING"), 0.0) == [DraftQuiesced()]
    assert not ex.resident
    for state in ("OFFLOADED", "SHRINKING", "RELOADING"):
        assert ex.handle(DraftResidency(resident=False, state=state), 0.0) is None
    assert ex.handle(DraftResidency(resident=True, state="RESIDENT"), 0.0) is None and ex.resident


def test_what_the_mover_leaves_quiet_would_answer_with_nothing_in_every_state():
    """The contract of a quiet message (kernel/actor.py): whatever ``stays_quiet`` lets wait in the mailbox must
    output nothing when handled, in each state of a trigger-driven cycle (elastic) and a command-driven one."""
    import copy

    fin = TokensCommitted(step=1, req_ids=(1,), counts=(0,), tokens=(), num_computed=(0,),
                          finish=(int(FinishReason.LENGTH),), num_prompt=(1,))
    probes = [sched(0), admit(2), res(9), res(90, 110), res(5, gamma=2), verified(), fin]
    triggered = [admit(), res(9), res(9), res(9), OFF_DONE, PoolResized(num_total=110, delta=DRAFT), res(21, 110),
                 res(21, 110), res(21, 110), SHRUNK, RE_DONE]
    commanded = [admit(), OffloadDraft(), verified(), OFF_DONE, ReloadDraft(), SHRUNK, RE_DONE]
    for elastic, rows in ((True, triggered), (False, commanded)):
        m, quiet = mover(elastic=elastic), 0
        for msg in rows:
            for p in probes:
                if m.stays_quiet(p):
                    quiet += 1
                    assert copy.deepcopy(m).handle(p, 0.0) is None, (m.state, p)
            m.handle(msg, 0.0)
        assert m.state == "RESIDENT" and quiet > len(rows) * 2
