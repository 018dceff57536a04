"""The CUDA graph runner (models/cuda_graph.py).

On CPU the runner runs in no-capture mode: the same bucketing, static buffers, padding (sink row, slot
-1, empty rows) and invalidation, with the model's Triton path under the interpreter instead of a graph
replay; its logits must equal the eager forward's and its padding must write no KV. The gpu-marked tests
capture and replay real graphs (skipped without CUDA; bench/gpu_check.sh runs them).
"""
from __future__ import annotations

import argparse
import copy
import random

import numpy as np
import pytest
import torch

from nightjar.actors.common import run_chunks
from nightjar.actors.weights import DraftSlot
from nightjar.config_check import check_config
from nightjar.engine_args import add_engine_args, engine_kwargs
from nightjar.kernel.config import EngineConfig
from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from nightjar.models.cuda_graph import (
    GraphKey,
    GraphRunner,
    StaticPlan,
    attach_graphs,
    batch_buckets,
    choose_key,
    pack,
    weights_moved,
)
from nightjar.sampling import ConfigError
from nightjar.transfer.weights import release_draft
from tests.conftest import random_model, tiny_config

BS = 4                 # block size
ROW_BLOCKS = 6         # blocks reserved per sequence (24 tokens)
MAX_BATCH, MAX_Q, MAX_LEN = 9, 3, 20     # buckets 1, 2, 4, 8, 9
DEV = "cuda" if torch.cuda.is_available() else "cpu"     # CPU: the Triton interpreter; CUDA: compiled, no capture
TOL = dict(atol=1e-5, rtol=1e-5) if DEV == "cpu" else dict(atol=1e-4, rtol=1e-4)


def tiny(device=DEV):
    model = random_model(tiny_config(vocab=64, hidden=32, layers=2, heads=4, kv=2), seed=3, std=0.3).to(device)
    model.select_kernels(True)          # the Triton path: the only one graphs capture (interpreted on CPU)
    return model


def prefilled(model, lens: list[int], seed: int = 0):
    """A cache holding len[b] tokens of sequence b; tables are shuffled blocks. -> cache, tables, tokens."""
    c, g = model.cfg, random.Random(seed)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, BS, ROW_BLOCKS * len(lens) + 2, torch.float32,
                    model.device, head_major=False)            # the kernels' layout
    blocks = list(range(1, cache.num_blocks))                  # block 0 stays a canary
    g.shuffle(blocks)
    tables = [tuple(blocks[b * ROW_BLOCKS:(b + 1) * ROW_BLOCKS]) for b in range(len(lens))]
    toks = [[g.randrange(64) for _ in range(n)] for n in lens]
    model(build_layout(toks, [0] * len(lens), tables, BS, [1] * len(lens), model.device), cache)
    return cache, tables, toks


def eager(model, cache, chunks, starts, tables, logits_rows):
    return model(build_layout(chunks, starts, tables, BS, logits_rows, model.device), cache)


def live_slots(chunks, starts, tables) -> set[int]:
    return {tables[b][p // BS] * BS + p % BS for b, (c, s) in enumerate(zip(chunks, starts))
            for p in range(s, s + len(c))}


def kv_at(cache, slots: list[int]) -> torch.Tensor:
    d = cache.segments[0].data                                  # [L, 2, n, bs, nkv, d]
    return d.flatten(2, 3)[:, :, slots]                         # [L, 2, S, nkv, d]


def runner_for(model, cache, capture=False) -> GraphRunner:
    return GraphRunner(model, cache, max_batch=MAX_BATCH, max_q=MAX_Q, max_model_len=MAX_LEN, capture=capture)


# ---- host-side rules (no model) ---------------------------------------------------------------------
def test_buckets_and_the_key_a_step_gets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(9) == [1, 2, 4, 8, 9] and batch_buckets(1) == [1] and batch_buckets(40) == [1, 2, 4, 8, 16,
                                                                                                     32, 40]
    bk = batch_buckets(9)
    key = lambda q, lr, s=None: choose_key(q, lr, s or [0] * len(q), bk, 3, 5, BS)  # noqa: E731
    assert key([1] * 3, [1] * 3) == GraphKey(4, 1, 1)                    # decode, padded 3 -> 4
    assert key([4, 4], [4, 4]) is None                                   # q > max_q (a prefill chunk)
    assert key([3, 1, 2], [3, 1, 1]) == GraphKey(4, 3, 3)                # verify rows of unequal γ_i + 1
    assert key([2, 1], [1, 1]) == GraphKey(2, 2, 1)                      # a draft pass (last token's logits)
    assert key([2, 2], [0, 1]) is None                                   # a row without logits (catch-up)
    assert key([1] * 10, [1] * 10) is None                               # past the largest bucket
    assert key([1], [1], [19]) == GraphKey(1, 1, 1) and key([2], [1], [19]) is None   # 20 tokens fit 5 blocks
    assert key([], []) is None


def test_pack_lays_out_live_rows_as_build_layout_and_pads_harmlessly():
    rng = random.Random(1)
    for _ in range(300):
        B = rng.randint(1, 9)
        qs = [rng.randint(1, 3) for _ in range(B)]
        lr = [rng.choice([1, q]) for q in qs]
        starts = [rng.randint(0, 16) for _ in range(B)]
        tables = [tuple(rng.sample(range(1, 99), 6)) for _ in range(B)]
        chunks = [[rng.randrange(64) for _ in range(q)] for q in qs]
        key = GraphKey(next(b for b in batch_buckets(9) if b >= B), max(qs), max(lr))
        plan = StaticPlan(key, width=6)
        out = np.full(plan.size, -7, dtype=np.int64)
        n = pack(plan, chunks, starts, tables, lr, BS, out)
        f = {k: out[a:b] for k, (a, b) in plan.spans().items()}
        lay = build_layout(chunks, starts, tables, BS, lr)
        T = lay.num_tokens
        assert n == lay.logits_index.numel()
        for name in ("input_ids", "positions", "slot_mapping"):
            assert f[name][:T].tolist() == getattr(lay, name).tolist()
        assert f["logits_index"][:n].tolist() == lay.logits_index.tolist()
        assert f["query_start_loc"][:B + 1].tolist() == lay.query_start_loc.tolist()
        assert f["seq_lens"][:B].tolist() == lay.seq_lens.tolist()
        bt = f["block_tables"].reshape(key.batch + 1, 6)
        assert (bt[:B, : lay.block_tables.shape[1]] == lay.block_tables.numpy()).all()
        # padding: the sink row (B) holds every padding token, stores nothing and reads no KV
        assert (f["slot_mapping"][T:] == -1).all() and (f["positions"][T:] == 0).all()
        assert f["query_start_loc"][B + 1:].tolist() == [key.tokens] * (key.batch + 1 - B)
        assert (f["seq_lens"][B:] == 0).all() and (bt[B:] == 0).all()
        assert ((f["logits_index"] >= 0) & (f["logits_index"] < key.tokens)).all()


# ---- the runner against the eager forward (Triton interpreter on CPU) ---------------------------------
def step_cases():
    """(live contexts, chunk lengths, logits rows): bucket edges, padded rows, unequal rows, draft passes."""
    return [([5], [1], [1]), ([7, 3], [3, 3], [3, 3]), ([4, 9, 2], [1, 1, 1], [1, 1, 1]),
            ([6, 2, 8, 5], [2, 1, 3, 1], [2, 1, 3, 1]), ([3, 5, 7, 9, 2], [2, 1, 2, 1, 1], [1, 1, 1, 1, 1]),
            ([2, 4, 6, 8, 10, 12, 14, 16], [1] * 8, [1] * 8), ([1 + b for b in range(9)], [2] * 9, [2] * 9)]


@pytest.mark.parametrize("case", range(7))
def test_runner_logits_equal_eager_and_padding_writes_no_kv(case):
    lens, qs, lr = step_cases()[case]
    model = tiny()
    cache, tables, _ = prefilled(model, lens, seed=case)
    ref_cache = copy.deepcopy(cache)
    before = cache.segments[0].data.clone()
    rng = random.Random(case)
    chunks = [[rng.randrange(64) for _ in range(q)] for q in qs]
    want = eager(model, ref_cache, chunks, lens, tables, lr)
    runner = runner_for(model, cache)
    got = runner.forward(chunks, lens, tables, lr)
    assert runner.stats["captures"] == 1 and len(runner.entries) == 1
    torch.testing.assert_close(got, want, **TOL)
    live = sorted(live_slots(chunks, lens, tables))
    torch.testing.assert_close(kv_at(cache, live), kv_at(ref_cache, live), **TOL)
    others = sorted(set(range(cache.num_blocks * BS)) - set(live))
    assert torch.equal(kv_at(cache, others), before.flatten(2, 3)[:, :, others])    # block 0 included


def test_a_decode_loop_through_run_chunks_replays_and_gives_eager_tokens():
    """Greedy decode of 5 rows, then 3 (bucket 8 -> 4): run_chunks takes the runner's path every step."""
    model = tiny()
    lens = [3, 6, 2, 5, 4]
    cache, tables, toks = prefilled(model, lens, seed=7)
    ref_cache = copy.deepcopy(cache)
    model.graph_runner = runner = runner_for(model, cache)
    try:
        last = [[t[-1]] for t in toks]
        out, ref = [list(x) for x in last], [list(x) for x in last]
        starts = list(lens)
        for step in range(5):
            rows = range(5) if step < 3 else range(3)
            ch = [[out[b][-1]] for b in rows]
            got = run_chunks(model, cache, BS, ch, [starts[b] for b in rows], [tables[b] for b in rows], [1] * len(ch))
            ch_ref = [[ref[b][-1]] for b in rows]
            want = eager(model, ref_cache, ch_ref, [starts[b] for b in rows], [tables[b] for b in rows], [1] * len(ch))
            torch.testing.assert_close(got, want, **TOL)
            for i, b in enumerate(rows):
                out[b].append(int(got[i].argmax()))
                ref[b].append(int(want[i].argmax()))
                starts[b] += 1
        assert out == ref
        assert runner.stats["captures"] == 2 and runner.stats["replays"] == 3 and runner.stats["eager"] == 0
    finally:
        del model.graph_runner


# ---- fallbacks and invalidation ----------------------------------------------------------------------
def test_eager_fallbacks_return_none():
    model = tiny()
    cache, tables, _ = prefilled(model, [4, 4], seed=2)
    runner = runner_for(model, cache)
    assert runner.forward([[1, 2, 3, 4], [5]], [4, 4], tables, [1, 1]) is None     # a prefill-length row
    assert runner.forward([[1, 2], [5]], [4, 4], tables, [0, 1]) is None            # a row without logits
    model.select_kernels(False)                                                      # the torch (CPU) path
    assert runner.forward([[1], [5]], [4, 4], tables, [1, 1]) is None
    model.select_kernels(True)
    cache.add_segment(4)
    cache.add_segment(4)                                   # past the kernels' segment table: the torch path
    assert runner.forward([[1], [5]], [4, 4], tables, [1, 1]) is None
    assert runner.stats["eager"] == 4 and not runner.entries


def test_a_grown_or_shrunk_pool_recaptures_and_a_moved_segment_drops_the_graphs():
    model = tiny()
    cache, tables, _ = prefilled(model, [4, 4], seed=3)
    runner = runner_for(model, cache)
    step = lambda: runner.forward([[1], [5]], [4, 4], tables, [1, 1])  # noqa: E731
    assert step() is not None and len(runner.entries) == 1
    cache.add_segment(4)                                   # grown: captured again, with the segment table
    assert step() is not None and runner.stats["resets"] == 1 and runner.stats["captures"] == 2
    assert step() is not None and runner.stats["replays"] == 1
    cache.drop_last_segment()                              # shrunk: captured again
    assert step() is not None and runner.stats["resets"] == 2 and runner.stats["captures"] == 3
    old = cache.segments[0].data                           # held: the restored copy gets a new address
    cache.restore(cache.to_host())
    assert cache.segments[0].data.data_ptr() != old.data_ptr()
    assert step() is not None and runner.stats["resets"] == 3 and runner.stats["captures"] == 4


def test_weight_moves_drop_the_graphs_and_the_runner_stays_exact():
    model = tiny()
    cache, tables, _ = prefilled(model, [5, 3], seed=4)
    ref_cache = copy.deepcopy(cache)
    model.graph_runner = runner = runner_for(model, cache)
    try:
        runner.forward([[1], [2]], [5, 3], tables, [1, 1])
        eager(model, ref_cache, [[1], [2]], [5, 3], tables, [1, 1])
        for p in model.parameters():                       # what a reload does: new tensors, same values
            p.data = p.data.clone()
        weights_moved(model)
        assert not runner.entries and runner.stats["resets"] == 1
        got = runner.forward([[3], [4]], [6, 4], tables, [1, 1])
        torch.testing.assert_close(got, eager(model, ref_cache, [[3], [4]], [6, 4], tables, [1, 1]),
                                   **TOL)
        assert runner.stats["captures"] == 2
    finally:
        del model.graph_runner


def test_draft_release_drops_its_graphs():
    model = tiny()
    cache, tables, _ = prefilled(model, [4], seed=5)
    model.graph_runner = runner = runner_for(model, cache)
    runner.forward([[1]], [4], tables, [1])
    assert runner.entries
    release_draft(DraftSlot(model, cache, model.device))
    assert not runner.entries and runner.stats["resets"] == 1


def test_a_failed_capture_leaves_the_model_eager(monkeypatch, caplog):
    model = tiny()
    cache, tables, _ = prefilled(model, [4, 4], seed=8)
    runner = runner_for(model, cache)
    runner.capture = True                                  # as on CUDA, with a capture that raises

    def broken(entry):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(runner, "_capture", broken)
    assert runner.forward([[1], [5]], [4, 4], tables, [1, 1]) is None
    assert runner.failed and not runner.entries and "capture failed" in caplog.text
    assert runner.forward([[2], [6]], [5, 5], tables, [1, 1]) is None
    assert runner.stats["eager"] == 1 and runner.stats["captures"] == 0


def test_graphs_are_never_attached_on_cpu_and_enforce_eager_is_a_flag():
    model = tiny("cpu")
    c = model.cfg
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, BS, 4, torch.float32)
    assert attach_graphs(model, cache, max_batch=4, max_q=2, max_model_len=16) is None
    assert getattr(model, "graph_runner", None) is None
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(model, cache, max_batch=4, max_q=2, max_model_len=16, capture=True)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["enforce_eager"] is False
    assert engine_kwargs(p.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    with pytest.raises(ConfigError, match="enforce_eager"):
        check_config(EngineConfig(enforce_eager="yes"), models=False)


# ---- real graphs (CUDA only) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", range(7))
def test_captured_graphs_replay_the_eager_logits_cuda(case):
    lens, qs, lr = step_cases()[case]
    model = tiny("cuda")
    cache, tables, _ = prefilled(model, lens, seed=case)
    ref_cache = copy.deepcopy(cache)
    runner = runner_for(model, cache, capture=True)
    rng = random.Random(case)
    starts = list(lens)
    for i in range(3):                                     # capture, then two replays with new contents
        chunks = [[rng.randrange(64) for _ in range(q)] for q in qs]
        got = runner.forward(chunks, starts, tables, lr)
        want = eager(model, ref_cache, chunks, starts, tables, lr)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        starts = [s + q for s, q in zip(starts, qs)]
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 2
    # the whole cache, block 0 included: live writes match eager, padding wrote nothing
    torch.testing.assert_close(cache.segments[0].data, ref_cache.segments[0].data, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_graphs_recapture_after_the_weights_move_cuda():
    model = tiny("cuda")
    cache, tables, _ = prefilled(model, [5, 3], seed=4)
    ref_cache = copy.deepcopy(cache)
    model.graph_runner = runner = runner_for(model, cache, capture=True)
    try:
        runner.forward([[1], [2]], [5, 3], tables, [1, 1])
        eager(model, ref_cache, [[1], [2]], [5, 3], tables, [1, 1])
        for p in model.parameters():                       # new addresses, new values: a stale graph would
            p.data = p.data * 1.5                          # still read the old tensors
        weights_moved(model)
        got = runner.forward([[3], [4]], [6, 4], tables, [1, 1])
        torch.testing.assert_close(got, eager(model, ref_cache, [[3], [4]], [6, 4], tables, [1, 1]),
                                   atol=1e-4, rtol=1e-4)
        assert runner.stats["captures"] == 2
    finally:
        del model.graph_runner


@pytest.mark.gpu
def test_engine_greedy_tokens_are_the_same_with_and_without_graphs_cuda():
    import asyncio

    from nightjar.engine import Engine
    from nightjar.models import LoadedModel
    from nightjar.sampling import SamplingParams
    from tests.conftest import perturbed

    cfg = tiny_config(vocab=512, hidden=64, layers=2, heads=4, kv=2, eos=())
    target = random_model(cfg, seed=1).cuda()
    draft = perturbed(target, 0.02, 2)
    for m in (target, draft):
        m.select_kernels()
    pair = (LoadedModel(target, None, "t"), LoadedModel(draft, None, "d"))
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]

    async def run(eager_only: bool):
        async with Engine(policy="fixed:3", loaded=pair, dtype="float32", device="cuda", num_blocks=256,
                          enforce_eager=eager_only) as eng:
            sp = SamplingParams(max_tokens=24, ignore_eos=True)

            async def one(p):
                return [t for o in [o async for o in eng.generate(p, sp)] for t in o.token_ids]
            out = await asyncio.gather(*[one(p) for p in prompts])
            runner = getattr(target, "graph_runner", None)
            return out, (dict(runner.stats) if runner else {})

    ref, none = asyncio.run(run(True))
    got, stats = asyncio.run(run(False))
    assert none == {} and got == ref
    assert stats.get("replays", 0) > 0


# ---- the engine through the runner (no capture on CPU) -------------------------------------------------
def engine_run(pair, prompts, policy: str, runners: bool, monkeypatch, cycle: bool = False):
    """Greedy outputs of an engine whose models run the Triton path; with ``runners`` every model gets a
    runner (capturing on CUDA, not on CPU). ``cycle`` forces one draft offload/reload mid-run."""
    import asyncio

    from nightjar import engine as engine_mod
    from nightjar.engine import Engine
    from nightjar.kernel.messages import OffloadDraft, ReloadDraft
    from nightjar.sampling import SamplingParams
    from tests.test_elastic import wait_for, wait_state, wait_steps

    def attach(model, cache, **kw):
        model.graph_runner = GraphRunner(model, cache, capture=DEV == "cuda", **kw)
        return model.graph_runner
    monkeypatch.setattr(engine_mod, "attach_graphs", attach)

    async def main():
        async with Engine(policy=policy, loaded=pair, dtype="float32", device=DEV, num_blocks=48, block_size=4,
                          max_num_seqs=3, gamma_max=3, enforce_eager=not runners) as eng:
            sp = SamplingParams(max_tokens=24, ignore_eos=True)   # shapes repeat (replays) under any timing

            async def one(p):
                return [t for o in [o async for o in eng.generate(p, sp)] for t in o.token_ids]
            job = asyncio.gather(*[one(p) for p in prompts])
            if cycle:
                await wait_for(lambda: pair[1].model.graph_runner.entries, what="a draft graph")
                eng.bus.publish("test", [OffloadDraft(reason="test")])
                await wait_state(eng, "OFFLOADED")
                await wait_steps(eng, eng.stats.steps + 3)
                eng.bus.publish("test", [ReloadDraft(reason="test")])
                await wait_for(lambda: eng.weights.state == "RESIDENT", what="reload")
            out = await job
            stats = [dict(getattr(m.model, "graph_runner").stats) if runners else {} for m in pair]
            assert eng.weights.num_reloads == (1 if cycle else 0)
            return out, stats
    return asyncio.run(main())


def test_engine_greedy_tokens_through_the_runner_equal_eager_with_an_offload_cycle(monkeypatch):
    """off, fixed:3 with a draft offload/reload cycle, and per-request γ_i (verify rows of unequal length)."""
    from nightjar.models import LoadedModel
    from tests.conftest import perturbed

    target = random_model(tiny_config(vocab=256, hidden=32, layers=2, heads=4, kv=2, eos=()), seed=1).to(DEV)
    draft = perturbed(target, 0.05, 2)
    for m in (target, draft):
        m.select_kernels(True)
    pair = (LoadedModel(target, None, "t"), LoadedModel(draft, None, "d"))
    prompts = [[(11 * i + j) % 250 + 3 for j in range(3 + 4 * i)] for i in range(3)]
    ref, _ = engine_run(pair, prompts, "off", runners=False, monkeypatch=monkeypatch)
    plain, _ = engine_run(pair, prompts, "off", runners=True, monkeypatch=monkeypatch)
    spec, (t_stats, d_stats) = engine_run(pair, prompts, "fixed:3", runners=True, monkeypatch=monkeypatch,
                                          cycle=True)
    per_row, (t_rows, _) = engine_run(pair, prompts, "nightjar:per-request", runners=True, monkeypatch=monkeypatch)
    assert plain == ref and spec == ref and per_row == ref
    assert t_stats["replays"] > 0 and d_stats["replays"] > 0
    assert d_stats["resets"] >= 1                          # the offload dropped the draft's graphs
    assert t_rows["replays"] > 0


# ---- the planner's profile times what the engine runs ----------------------------------------------------
def test_the_profile_bench_attaches_graphs_only_on_cuda_and_detaches_them():
    from nightjar.offline.profile import _Bench

    model = tiny()
    with _Bench(model, 16, 4, 32) as bench:
        bench.forward(2, 3)                                # B = 2, q = 3: a verify-shaped step
        on_cuda = DEV == "cuda"
        assert (bench.graphs is not None) == on_cuda and (getattr(model, "graph_runner", None) is not None) == on_cuda
        if on_cuda:
            bench.forward(2, 3)
            assert bench.graphs.stats["captures"] == 1 and bench.graphs.stats["replays"] == 1
    assert getattr(model, "graph_runner", None) is None and bench.graphs is None
