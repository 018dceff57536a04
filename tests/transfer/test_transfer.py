"""DraftTransfer and release_draft (transfer/weights.py) on a tiny random fp32 draft and its paged KV cache:
offload -> release -> reload gives back the draft's weights and KV bytes exactly (and the same logits),
``done`` runs on the event loop's thread, and release_draft frees exactly what it reports.

The draft lives on CUDA when there is one (DraftTransfer then takes its side-stream path), else on the CPU."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from nightjar.actors.weights import DraftSlot
from nightjar.kvpool.blocks import BlockAllocator
from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from nightjar.transfer import weights as transfer_mod
from nightjar.transfer.weights import DraftTransfer, HostCopy, release_draft
from tests.conftest import random_model, tiny_config

BLOCK = 4
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TIMEOUT = 10.0


def make_slot(num_blocks: int = 6, extra_segment: int = 0) -> DraftSlot:
    cfg = tiny_config(vocab=96, hidden=32, layers=2, heads=4, kv=2, eos=())
    model = random_model(cfg, seed=5).to(DEV)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, num_blocks, torch.float32, DEV)
    if extra_segment:
        cache.add_segment(extra_segment)
    g = torch.Generator().manual_seed(9)
    for seg in cache.segments:                       # every byte of the KV is distinct random data
        seg.data.copy_(torch.randn(seg.data.shape, generator=g))
    return DraftSlot(model, cache, DEV)


def snapshot(slot: DraftSlot):
    weights = {n: p.detach().clone() for n, p in slot.model.named_parameters()}
    kv = [seg.data.clone() for seg in slot.cache.segments]
    return weights, kv


def logits_of(slot: DraftSlot) -> torch.Tensor:
    """Decode one token at position 5 of a sequence whose first 5 positions sit in blocks 0-1 (random KV)."""
    lay = build_layout([[7, 3]], [5], [(0, 1)], BLOCK, [2], device=DEV)
    return slot.model(lay, slot.cache)                                   # [2, V]


async def round_trip(slot) -> int:
    """Offload the slot's draft, release it, reload it; returns the bytes the release freed."""
    tr = DraftTransfer(asyncio.get_running_loop())
    try:
        host, _, _ = await offload(tr, slot)
        freed = release_draft(slot)
        await reload(tr, slot, host)
    finally:
        tr.shutdown()
    return freed


async def offload(tr: DraftTransfer, slot) -> tuple[HostCopy, float, int]:
    fut = asyncio.get_running_loop().create_future()
    tr.offload(slot, lambda host, s: fut.set_result((host, s, threading.get_ident())))
    return await asyncio.wait_for(fut, TIMEOUT)


async def reload(tr: DraftTransfer, slot, host) -> tuple[int, float, int]:
    fut = asyncio.get_running_loop().create_future()
    tr.reload(slot, host, lambda n, s: fut.set_result((n, s, threading.get_ident())))
    return await asyncio.wait_for(fut, TIMEOUT)


@pytest.mark.parametrize("extra_segment", [0, 3], ids=["one-kv-segment", "two-kv-segments"])
async def test_offload_release_reload_round_trips_weights_and_kv_bytes_exactly(extra_segment):
    slot = make_slot(extra_segment=extra_segment)
    before = logits_of(slot)                         # (writes positions 5-6 into the KV: snapshot after it)
    weights, kv = snapshot(slot)
    weight_bytes, kv_bytes = slot.model.weight_bytes(), slot.cache.nbytes
    tr = DraftTransfer(asyncio.get_running_loop())
    try:
        host, secs, _ = await offload(tr, slot)
        assert secs > 0
        assert [t.shape for t in host.kv] == [t.shape for t in kv] and all(t.device.type == "cpu" for t in host.kv)
        assert host.buffer.device.type == "cpu"
        assert host.nbytes == host.buffer.numel() + kv_bytes and host.buffer.numel() >= weight_bytes
        assert release_draft(slot) == weight_bytes + kv_bytes
        n, secs, _ = await reload(tr, slot, host)
        assert n == host.nbytes and secs > 0
    finally:
        tr.shutdown()
    got = dict(slot.model.named_parameters())
    assert got.keys() == weights.keys()
    for name, w in weights.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    assert slot.model.lm_head.weight is slot.model.embed_tokens.weight          # still tied
    assert len(slot.cache.segments) == len(kv)
    for seg, ref in zip(slot.cache.segments, kv):
        assert torch.equal(seg.data, ref)
    assert slot.cache.nbytes == kv_bytes and slot.model.weight_bytes() == weight_bytes
    assert torch.equal(logits_of(slot), before)


async def test_the_host_copy_does_not_alias_the_draft_s_tensors():
    slot = make_slot()
    weights, kv = snapshot(slot)
    tr = DraftTransfer(asyncio.get_running_loop())
    try:
        host, _, _ = await offload(tr, slot)
        with torch.no_grad():                      # scribble over the device copy after the offload
            for p in slot.model.parameters():
                p.zero_()
        for seg in slot.cache.segments:
            seg.data.zero_()
        await reload(tr, slot, host)
    finally:
        tr.shutdown()
    assert all(torch.equal(p, weights[n]) for n, p in slot.model.named_parameters())
    assert torch.equal(slot.cache.segments[0].data, kv[0])


async def test_a_cpu_draft_on_a_machine_with_a_gpu_takes_the_cpu_copy_path(monkeypatch):
    """The copy path follows the draft's device, not whether the machine has CUDA (a CUDA stream wait on
    CPU tensors raises). Only the choice is checked here: this build has no CUDA to copy with."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tr = DraftTransfer(asyncio.get_running_loop(), device=torch.device("cpu"))
    assert not tr.cuda and tr.stream is None and tr.pool is None


async def test_done_callbacks_run_on_the_loop_thread_and_the_copies_on_the_transfer_worker(monkeypatch):
    slot = make_slot()
    copy_threads: list[str] = []
    threads: list[threading.Thread] = []

    def watched(fn):
        def run(*args):
            copy_threads.append(threading.current_thread().name)
            threads.append(threading.current_thread())
            return fn(*args)
        return run

    monkeypatch.setattr(transfer_mod, "pack_tensors", watched(transfer_mod.pack_tensors))
    monkeypatch.setattr(transfer_mod, "unpack_tensors", watched(transfer_mod.unpack_tensors))
    loop_thread = threading.get_ident()
    tr = DraftTransfer(asyncio.get_running_loop())
    try:
        host, _, t_off = await offload(tr, slot)
        release_draft(slot)
        _, _, t_re = await reload(tr, slot, host)
    finally:
        tr.shutdown()
    assert t_off == loop_thread and t_re == loop_thread
    assert len(copy_threads) == 2 and all(n.startswith("nightjar-transfer") for n in copy_threads)
    if not torch.cuda.is_available():        # CPU copies: one thread per copy, gone afterwards (kernel/threads.py)
        assert threads[0] is not threads[1] and not any(t.is_alive() for t in threads)


def test_release_draft_frees_every_weight_and_kv_tensor_and_reports_their_bytes():
    slot = make_slot(extra_segment=2)
    cfg = slot.model.cfg
    expect_w = 4 * (cfg.vocab_size * cfg.hidden_size                                # tied embedding, once
                    + cfg.hidden_size                                               # final norm
                    + cfg.num_layers * (2 * cfg.hidden_size                         # two norms per layer
                                        + 2 * cfg.hidden_size * cfg.hidden_size     # q, o
                                        + 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim   # k, v
                                        + 3 * cfg.hidden_size * cfg.intermediate_size))           # mlp
    expect_kv = 4 * 2 * cfg.num_layers * (6 + 2) * BLOCK * cfg.num_kv_heads * cfg.head_dim
    assert slot.model.weight_bytes() == expect_w and slot.cache.nbytes == expect_kv
    assert release_draft(slot) == expect_w + expect_kv
    assert all(p.numel() == 0 and p.dtype == torch.float32 for p in slot.model.parameters())
    assert all(seg.data.numel() == 0 for seg in slot.cache.segments) and slot.cache.nbytes == 0
    assert slot.cache.num_blocks == 8                       # the block layout stays; only storage is dropped
    assert release_draft(slot) == 0                         # nothing left to free


def test_a_reloaded_draft_decodes_like_the_original_on_a_fresh_allocation():
    """After a round trip the draft keeps working with an allocator over its restored cache."""
    slot = make_slot()
    alloc = BlockAllocator(6, BLOCK)
    alloc.reserve(1, 9)
    lay = build_layout([[5, 6, 7, 8, 9, 10, 11, 12, 13]], [0], [alloc.block_table(1)], BLOCK, [1], device=DEV)
    ref = slot.model(lay, slot.cache)                                   # [1, V]

    asyncio.run(round_trip(slot))
    again = build_layout([[5, 6, 7, 8, 9, 10, 11, 12, 13]], [0], [alloc.block_table(1)], BLOCK, [1], device=DEV)
    assert torch.equal(slot.model(again, slot.cache), ref)


async def test_a_failed_copy_is_not_lost(monkeypatch):
    slot = make_slot()

    def broken(tensors):
        raise MemoryError("host allocation failed")

    monkeypatch.setattr(transfer_mod, "pack_tensors", broken)
    loop = asyncio.get_running_loop()
    reported: list[object] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx.get("exception")))
    tr = DraftTransfer(loop)
    tr.offload(slot, lambda host, s: reported.append(host))
    await asyncio.to_thread(tr.shutdown)            # the copy has run (and failed) once this returns
    for _ in range(3):
        await asyncio.sleep(0)                      # let any call_soon_threadsafe callback run
    loop.set_exception_handler(None)
    assert reported, "the failure reached neither done() nor the event loop"


async def test_a_failed_copy_reaches_the_failed_callback_on_the_loop_thread(monkeypatch):
    import threading

    slot = make_slot()
    monkeypatch.setattr(transfer_mod, "pack_tensors", lambda tensors: (_ for _ in ()).throw(MemoryError("no host")))
    got: list[tuple] = []
    tr = DraftTransfer(asyncio.get_running_loop(),
                       failed=lambda kind, err, s: got.append((kind, type(err), threading.current_thread())))
    tr.offload(slot, lambda host, s: got.append(("done",)))
    await asyncio.to_thread(tr.shutdown)
    for _ in range(3):
        await asyncio.sleep(0)
    assert got == [("offload", MemoryError, threading.current_thread())]
