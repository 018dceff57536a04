"""The fused CPU ops (nightjar/models/cpu_fused.cpp) against the torch ops they replace."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout, cpu_fused, cpu_linear, quant
from nightjar.models.llama import apply_rope_signed, paged_attention, set_cpu_fused, signed_sin
from nightjar.models.quant import quantize_model
from tests.conftest import random_model, tiny_config

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the fused CPU ops cannot be built here", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def ops():
    assert cpu_fused.available(), "the fused CPU ops did not build (see the log line)"
    return torch.ops.nightjar_cpu


def close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    err = (a.float() - b.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, b.float().abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [64, 50])
def test_norms_and_silu_mul_match_torch(ops, dtype, h):
    g = torch.Generator().manual_seed(0)
    x, a = (torch.randn(5, h, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (h,), w.float(), 1e-5), dtype)
    s, n = ops.add_rms_norm(a, x, w, 1e-5)
    assert torch.equal(s, x + a)                                   # the sum rounds to the dtype first
    close(n, F.rms_norm((x + a).float(), (h,), w.float(), 1e-5), dtype)
    gu = torch.randn(3, 2 * h, generator=g).to(dtype) * 4         # exp over a wide range
    gate, up = gu.float().chunk(2, dim=-1)
    close(ops.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_q_and_k_and_writes_k_and_v_to_their_slots(ops, dtype):
    T, nh, nkv, d, bs = 3, 4, 2, 16, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g).to(dtype)
    pos = torch.tensor([5, 6, 11])
    freqs = pos.float()[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]           # [T, 1, d]
    cos, sin = emb.cos().to(dtype), signed_sin(emb.sin().to(dtype))
    cache = KVCache(2, nkv, d, bs, 6, dtype)
    slots = torch.tensor([9, 2, 17])
    q = ops.rope_store(qkv, cos, sin, cache.layer_slots(1), slots, nh)
    heads = qkv.view(T, nh + 2 * nkv, d)
    ref = apply_rope_signed(heads[:, : nh + nkv].float(), cos.float(), sin.float())
    close(q, ref[:, :nh], dtype)
    k, v = cache.layer_slots(1)                                   # [nkv, S, d] each
    close(k[:, slots].transpose(0, 1), ref[:, nh:], dtype)
    assert torch.equal(v[:, slots].transpose(0, 1), heads[:, nh + nkv:])
    assert not cache.layer_slots(0).any()                          # other layers untouched


def _random_cache(nkv, d, bs, nblocks, dtype, reserve=0):
    cache = KVCache(2, nkv, d, bs, nblocks, dtype, reserve_blocks=reserve)
    with torch.no_grad():
        data = cache.segments[0].data
        data.copy_(torch.randn(data.shape, generator=torch.Generator().manual_seed(3)))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 16), (9, 3, 64), (6, 6, 40), (2, 1, 8), (6, 2, 128)])
def test_paged_attention_matches_the_torch_reference_on_varlen_causal_rows(ops, dtype, nh, nkv, d):
    bs = 4
    # decode, verify and short prefill rows; past 128 positions a row is attended in parts, combined after
    # (the row at 127 has a query that sees none of its second part)
    qlens, starts = [1, 4, 3, 16, 3, 1], [0, 9, 22, 5, 127, 300]
    need = [-(-(s + q) // bs) for s, q in zip(starts, qlens)]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(4)).tolist()
    tables, o = [], 0
    for n in need:
        tables.append(tuple(perm[o: o + n]))
        o += n
    lay = build_layout([[7] * q for q in qlens], starts, tables, bs, qlens)
    cache = _random_cache(nkv, d, bs, sum(need) + 3, dtype)
    q = torch.randn(lay.num_tokens, nh, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = 1 / math.sqrt(d)
    got = ops.paged_attention(q, cache.layer_slots(1), lay.block_tables, lay.query_start_loc, lay.seq_lens, bs,
                              scale, 16)
    close(got, paged_attention(q.float(), _as_float(cache), 1, lay, scale), dtype)


@pytest.mark.parametrize("d", [64, 40])                  # the unrolled kernel (d = 64) and the general one
def test_paged_attention_gives_a_query_the_same_bits_whatever_its_step(ops, d):
    """A query's numbers depend on its own row's positions only (fixed chunks of 64 positions, merged in order):
    not on how many queries its row verifies, the other rows of the step, or the thread count."""
    bs, nh, nkv = 16, 9, 3
    cache = _random_cache(nkv, d, bs, 40, torch.bfloat16)
    tables = [tuple(range(20)), tuple(range(20, 40))]
    q = torch.randn(5, nh, d, generator=torch.Generator().manual_seed(6)).bfloat16()

    def run(qlens, starts, rows):
        lay = build_layout([[7] * n for n in qlens], starts, [tables[r] for r in rows], bs, qlens)
        return ops.paged_attention(q[:lay.num_tokens].contiguous(), cache.layer_slots(0), lay.block_tables,
                                   lay.query_start_loc, lay.seq_lens, bs, 0.125, 16)

    verify = run([4], [200], [0])                        # positions 200..203 over chunks [0, 64) .. [192, 256)
    assert torch.equal(run([1], [200], [0])[0], verify[0])          # its first query as a decode row
    assert torch.equal(run([4, 1], [200, 90], [0, 1])[:4], verify)  # beside another row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run([4], [200], [0]), verify)
    finally:
        torch.set_num_threads(threads)


def _as_float(cache: KVCache) -> KVCache:
    f = KVCache(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.block_size, cache.num_blocks,
                torch.float32)
    f.segments[0].data.copy_(cache.segments[0].data.float())
    return f


def test_paged_attention_reads_a_cache_that_is_a_view_of_a_larger_reserve(ops):
    cache = _random_cache(2, 16, 4, 5, torch.float32, reserve=7)   # one segment, narrowed out of the store
    assert not cache.layer_slots(0).is_contiguous()
    lay = build_layout([[1, 2]], [9], [(4, 0, 2)], 4, [2])
    q = torch.randn(2, 4, 16)
    got = ops.paged_attention(q, cache.layer_slots(0), lay.block_tables, lay.query_start_loc, lay.seq_lens, 4, 0.25, 16)
    close(got, paged_attention(q, cache, 0, lay, 0.25), torch.float32)


def test_bad_slots_and_tables_raise_one_clear_error_instead_of_writing_out_of_bounds(ops):
    cache = KVCache(1, 2, 16, 4, 3, torch.float32)
    qkv, cs = torch.randn(1, 8 * 16), torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match="cache slot out of range"):
        ops.rope_store(qkv, cs, cs, cache.layer_slots(0), torch.tensor([12]), 4)
    lay = build_layout([[1]], [5], [(0, 9)], 4, [1])
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(torch.randn(1, 4, 16), cache.layer_slots(0), lay.block_tables, lay.query_start_loc,
                            lay.seq_lens, 4, 0.25, 16)


def _run(model, dtype, on: bool) -> list[torch.Tensor]:
    """Prefill (torch attention over a long row, fused rope/store/norms/MLP), then decode and verify steps."""
    bs, prompt = 4, list(range(3, 40))
    cache, table = KVCache(3, 2, 16, bs, 24, dtype), [tuple(range(24))]
    set_cpu_fused(model, on)
    steps = [([prompt], [0], [1]), ([[5]], [37], [1]), ([[6, 7, 8, 9]], [38], [4]), ([[10]], [42], [1])]
    return [model(build_layout(c, s, table, bs, n), cache) for c, s, n in steps] + [cache.segments[0].data]


def test_a_model_on_the_fused_ops_gives_the_logits_of_the_torch_ops(ops):
    model = random_model(tiny_config(vocab=96, hidden=64, layers=3), seed=6).fuse_projections()
    for a, b in zip(_run(model, torch.float32, True), _run(model, torch.float32, False)):
        close(a, b, torch.float32)


def test_in_bf16_the_fused_ops_are_as_close_to_fp32_as_the_torch_ops(ops):
    """bf16 rounds differently (once per op instead of once per aten call), so step by step either path
    can be the closer one: summed over seeds and steps, the fused ops are as close to fp32."""
    err = {True: 0.0, False: 0.0}
    for seed in range(4):
        model = random_model(tiny_config(vocab=96, hidden=64, layers=3), seed=seed, std=0.1).fuse_projections()
        ref = _run(model, torch.float32, False)
        model = model.to(torch.bfloat16)
        for on in (True, False):
            err[on] += sum((x.float() - r).abs().mean().item() for r, x in zip(ref, _run(model, torch.bfloat16, on)))
    assert err[True] <= 1.15 * err[False], err


def test_a_decode_row_gets_the_same_bf16_logits_with_or_without_a_prefill_row_beside_it(ops):
    """Decode rows take the fused attention, a long prefill row the torch one, in the same step: a row's
    numbers do not depend on what else the step holds (seeded sampling stays reproducible in bf16)."""
    model = random_model(tiny_config(vocab=96, hidden=64, layers=2), seed=9, std=0.1, dtype=torch.bfloat16)
    model.fuse_projections()
    set_cpu_fused(model, True)
    bs, table = 4, [tuple(range(12)), tuple(range(12, 24))]
    got = []
    for mixed in (False, True):
        cache = KVCache(2, 2, 16, bs, 24, torch.bfloat16)
        model(build_layout([list(range(3, 20))], [0], table[:1], bs, [1]), cache)        # row 0's prompt
        chunks, starts, tabs = [[21]], [17], table[:1]
        if mixed:
            chunks, starts, tabs = [[21], list(range(30, 50))], [17, 0], table
        got.append(model(build_layout(chunks, starts, tabs, bs, [1] * len(chunks)), cache)[0])
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("dtype,linears", [(torch.float32, "plain"), (torch.bfloat16, "packed"),
                                           (torch.bfloat16, "int8"), (torch.float32, "int4")])
def test_the_flat_layer_loop_computes_what_the_module_calls_compute(ops, dtype, linears):
    """``DecoderLayer.forward_fused`` (submodules by their forward, no nn.Module dispatch) runs the same ops as
    the layer's module calls: bit-identical logits and cache, whatever the linears are."""
    model = random_model(tiny_config(vocab=96, hidden=64, layers=3), seed=11, std=0.1, dtype=dtype)
    model.fuse_projections()
    if linears == "packed" and not model.pack_cpu_weights():
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    if linears in ("int8", "int4"):
        quantize_model(model, linears, group_size=32)
    model.select_kernels()
    cache = KVCache(3, 2, 16, 4, 4, dtype)
    with torch.inference_mode():
        assert model.fused_path(torch.zeros(2, 64, dtype=dtype), cache)       # the flat loop serves by default
    flat = _run(model, dtype, True)
    model.fused_path = lambda x, cache: False                                  # this instance: module calls
    for a, b in zip(flat, _run(model, dtype, True)):
        assert torch.equal(a, b)


def test_the_flat_layer_loop_needs_every_condition_of_the_fused_ops(ops):
    model = random_model(tiny_config(vocab=96, hidden=64), seed=12).fuse_projections()
    model.select_kernels()
    x, cache = torch.zeros(2, 64), KVCache(2, 2, 16, 4, 4, torch.float32)
    assert not model.fused_path(x, cache)                                      # autograd on: torch ops
    with torch.inference_mode():
        assert model.fused_path(x, cache)
        assert not model.fused_path(x.half(), cache)                           # a dtype they do not take
        assert not model.fused_path(torch.zeros(64, 2).t(), cache)             # not token-major contiguous
        assert not model.fused_path(x, KVCache(2, 2, 16, 4, 4, torch.float32, head_major=False))
        set_cpu_fused(model, False)
        assert not model.fused_path(x, cache)


def test_a_pool_that_grows_in_the_middle_of_a_forward_leaves_that_forward_on_its_first_views(ops):
    """The KV actor grows the pool on the event loop while a forward runs on the compute thread: a forward keeps
    the cache views it began with (it once failed at the next layer, which found no single-tensor view)."""
    model = random_model(tiny_config(vocab=96, hidden=64, layers=3), seed=13).fuse_projections()
    model.select_kernels()
    prompt, table = list(range(3, 20)), [tuple(range(8))]
    ref_cache = KVCache(3, 2, 16, 4, 8, torch.float32)
    ref = [model(build_layout([prompt], [0], table, 4, [1]), ref_cache),
           model(build_layout([[21]], [17], table, 4, [1]), ref_cache)]
    cache = KVCache(3, 2, 16, 4, 8, torch.float32)
    layer1 = model.layers[1].forward_fused

    def grow_then_run(*args):
        if len(cache.segments) == 1:
            cache.add_segment(4)                  # two segments, no reserve: no single-tensor view any more
        return layer1(*args)
    model.layers[1].forward_fused = grow_then_run
    got = [model(build_layout([prompt], [0], table, 4, [1]), cache)]
    assert len(cache.segments) == 2 and cache.slots_by_layer() is None
    got.append(model(build_layout([[21]], [17], table, 4, [1]), cache))     # now on the torch ops
    for a, b in zip(got, ref):
        close(a, b, torch.float32)


def test_training_keeps_autograd_on_the_torch_ops(ops):
    model = random_model(tiny_config(vocab=96, hidden=64), seed=7)
    set_cpu_fused(model, True)
    norm, mlp = model.layers[0].input_layernorm, model.layers[0].mlp
    mlp.fuse()
    x = torch.randn(3, 64, requires_grad=True)
    mlp(norm(x)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_float16_model_keeps_the_torch_ops(ops):
    model = random_model(tiny_config(vocab=96, hidden=64), seed=8, dtype=torch.float16).fuse_projections()
    model.select_kernels()
    assert not model.layers[0].self_attn.cpu_fused
    set_cpu_fused(model, True)                 # even when switched on, fp16 tensors take the torch ops
    cache = KVCache(2, 2, 16, 4, 4, torch.float16)
    assert model(build_layout([[3, 4, 5]], [0], [(0, 1, 2, 3)], 4, [1]), cache).isfinite().all()


def test_the_switch_off_keeps_the_torch_ops(monkeypatch):
    monkeypatch.setenv("NIGHTJAR_CPU_FUSED", "0")
    assert not cpu_fused.available()
    model = random_model(tiny_config(vocab=96, hidden=64), seed=8)
    model.select_kernels()
    assert not model.layers[0].self_attn.cpu_fused and not model.norm.cpu_fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 64, 40])            # 40: neither 32- nor 16-aligned (the generic path's tails)
def test_int8_linear_matches_the_dequantized_weight_and_a_row_never_depends_on_the_step(ops, dtype, k):
    g = torch.Generator().manual_seed(0)
    n, m = 203, 9                                       # neither a multiple of the 4 x 4 tile
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=g).to(dtype)
    y = ops.int8_linear(x, q, s)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for rows in (1, 2, 3, 4, 5):                        # every tile shape: a row gets the full step's bits
        for start in range(0, m - rows + 1, 2):
            assert torch.equal(ops.int8_linear(x[start:start + rows].contiguous(), q, s), y[start:start + rows])
    sb = s.bfloat16()                                   # bf16 scales are read as the fp32 values they hold
    assert torch.equal(ops.int8_linear(x, q, sb), ops.int8_linear(x, q, sb.float()))


@pytest.mark.parametrize("n, k", [(203, 64), (32, 40), (5, 576)])   # n: a part panel; k: no alignment needed
def test_bf16_linear_matches_the_weight_and_a_row_never_depends_on_the_step(ops, n, k):
    """bf16 panels (CPUs without bf16 arithmetic): every tile of 1-6 rows and a 13-row step agree with fp32
    arithmetic on the bf16 values within the output's rounding, and a row gets the same bits whatever rows
    run beside it; fp32 inputs give fp32 outputs; the panels unpack to the weight exactly."""
    from nightjar.models.cpu_linear import PANELS, PackedLinear

    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g).bfloat16()
    p = ops.bf16_panels(w)
    assert p.shape == (-(-n // 16), k, 16)
    x = torch.randn(13, k, generator=g).bfloat16()
    y = ops.bf16_linear(x, p, n)                                       # [13, n] bf16
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and (y.double() - ref).abs().max() <= 8e-3 * ref.abs().max()
    for rows in (1, 2, 3, 4, 5, 6, 7):
        for start in range(0, 13 - rows + 1, 3):
            assert torch.equal(ops.bf16_linear(x[start:start + rows].contiguous(), p, n), y[start:start + rows])
    y32 = ops.bf16_linear(x.float(), p, n)
    assert y32.dtype == torch.float32 and (y32.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    lin = PackedLinear(w, PANELS)
    assert torch.equal(lin.dense_weight(), w) and torch.equal(lin(x.view(1, 13, k)), y.view(1, 13, n))


def test_bf16_linear_rejects_what_it_cannot_compute(ops):
    w = torch.randn(20, 32).bfloat16()
    p = ops.bf16_panels(w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_panels(w.float())
    with pytest.raises(RuntimeError, match="panels must be"):
        ops.bf16_linear(torch.randn(2, 31).bfloat16(), p, 20)         # x's columns are not the weight's
    with pytest.raises(RuntimeError, match="panels must be"):
        ops.bf16_linear(torch.randn(2, 32).bfloat16(), p, 40)         # more outputs than the panels hold
    with pytest.raises(RuntimeError, match="float or bfloat16"):
        ops.bf16_linear(torch.randn(2, 32).half(), p, 20)


def _amx_present() -> bool:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return all(f in flags.split() for f in ("amx_tile", "amx_bf16", "avx512_bf16"))


@pytest.mark.parametrize("amx", [True, False])
def test_int8_linear_on_either_kernel_matches_and_keeps_rows_apart_past_one_tile(ops, amx):
    """bf16 calls run on AMX tiles where the machine has them (``use_amx``), else on the vector kernel: both match
    the dequantized weight, and a row's bits never depend on M (one tile of x is widened chunk by chunk, more
    tiles share one widened weight), with outputs past the last 32-row tile."""
    on = ops.use_amx(amx)
    try:
        assert on == (amx and _amx_present())
        g = torch.Generator().manual_seed(4)
        n, k, m = 203, 96, 40
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) * 0.01 + 1e-3
        x = torch.randn(m, k, generator=g).bfloat16()
        y = ops.int8_linear(x, q, s)
        ref = x.double() @ (q.double() * s.double()[:, None]).T
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        for start, rows in ((0, 1), (5, 16), (3, 17), (20, 17), (0, 33), (4, 5)):
            assert torch.equal(ops.int8_linear(x[start:start + rows].contiguous(), q, s), y[start:start + rows])
    finally:
        ops.use_amx(cpu_fused.amx_enabled())


def test_int8_linear_rejects_what_it_cannot_compute(ops):
    x, q, s = torch.randn(2, 32), torch.zeros(5, 32, dtype=torch.int8), torch.ones(5)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_linear(x, q.float(), s)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.int8_linear(x, q, torch.ones(4))
    with pytest.raises(RuntimeError, match="x must be"):
        ops.int8_linear(x.half(), q, s)
    assert ops.int8_linear(x[:0], q, s).shape == (0, 5)


def _check_a8_rows(op, x: torch.Tensor, y: torch.Tensor, exact: torch.Tensor) -> None:
    """An op that rounds x to int8 per group (y = op(x)): the rounding moved y off the exact product, within its
    bound; a row's bits never depend on the call's other rows (slices of 1-3 rows); a NaN makes only its row NaN.
    Writes a NaN into x."""
    assert 0 < (y.double() - exact).abs().max() <= 0.05 * exact.abs().max()
    for rows in range(1, 4):
        for start in range(0, x.shape[0] - rows + 1, 2):
            assert torch.equal(op(x[start:start + rows].contiguous()), y[start:start + rows])
    x[1, 7] = float("nan")
    y = op(x)
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, group", [(576, 32), (128, 64)])
def test_int8_linear_a8_multiplies_the_int8_weight_by_x_rounded_per_group(ops, dtype, k, group):
    """x rounded to int8 per group (quant.round_int8_groups) times the dequantized int8 rows (held in tiles of 4)
    in fp32; a row's bits never depend on the call's other rows (every tile shape); a NaN in x makes its row NaN;
    bad arguments fail."""
    from nightjar.models.quant import round_int8_groups, tile_int8_rows, untile_int8_rows

    g = torch.Generator().manual_seed(5)
    n, m = 203, 7                                       # neither a multiple of the 4-row weight tile
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    qt = tile_int8_rows(q)
    assert qt.shape == (204, k) and torch.equal(untile_int8_rows(qt, n), q) and not untile_int8_rows(qt, 204)[n:].any()
    flat = qt.view(-1)                                  # a tile: chunk c of row j at c * 128 + j * 32
    assert torch.equal(flat[32:64], q[1, :32]) and torch.equal(flat[128:160], q[0, 32:64])
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=g).to(dtype)
    x[2, :group] = 0                                    # an all-zero group
    y = ops.int8_linear_a8(x, qt, s, group)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    w = q.double() * s.double()[:, None]                                        # [n, k]
    ref = round_int8_groups(x, group).double() @ w.T
    assert ((y.double() - ref).abs() <= 1e-5 * ref.abs() + 1e-6 * ref.abs().max()).all()
    _check_a8_rows(lambda xs: ops.int8_linear_a8(xs, qt, s, group), x, y, x.double() @ w.T)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.int8_linear_a8(x.half(), qt, s, group)
    with pytest.raises(RuntimeError, match="group must be"):
        ops.int8_linear_a8(x, qt, s, 48)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.int8_linear_a8(x, qt, s.bfloat16(), group)
    with pytest.raises(RuntimeError, match="rounded up to 4"):
        ops.int8_linear_a8(x, q, s, group)                                      # rows not in tiles of 4
    assert ops.int8_linear_a8(x[:0], qt, s, group).shape == (0, n)


def test_a_w4a8_models_lm_head_rounds_x_as_its_layers_do(ops, monkeypatch):
    """quantize_model(w4a8) gives the LM head int8 activations (int8_linear_a8, codes in tiles of 4 rows); int4's
    head keeps x as it is and its codes in row order; without the op the head computes the same rounding in torch."""
    from nightjar.models.quant import QuantHead, quantize_int8, quantize_model, round_int8_groups

    model = random_model(tiny_config(vocab=98, hidden=64), seed=3)                 # 98 rows: a part tile
    w = model.lm_head.weight.detach().clone()
    quantize_model(model, "w4a8")
    head = model.lm_head
    assert isinstance(head, QuantHead) and head.act8 and "int8 activations" in repr(head)
    assert head.qweight.shape == (100, 64) and torch.equal(head.codes(), quantize_int8(w)[0])
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    y = head(x)
    assert y.shape == (2, 3, 98) and torch.equal(y.view(6, 98), ops.int8_linear_a8(x.view(6, 64), head.qweight,
                                                                                      head.scales, 32))
    ref = round_int8_groups(x.view(6, 64), 32) @ head.dequantize().T
    assert (y.view(6, 98) - ref).abs().max() <= 1e-5 * ref.abs().max()
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    assert torch.allclose(head(x).view(6, 98), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    plain = QuantHead.from_weight(w)                       # int4's head: x as it is
    assert not plain.act8 and torch.equal(plain.codes(), quantize_int8(w)[0])
    assert plain.tiled == (cpu_fused.lanes() == 8) and plain.qweight.shape == ((100, 64) if plain.tiled else (98, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_tiled_gives_int8_linears_numbers_from_tiles(ops, dtype):
    """int8_linear_tiled on codes in tiles of 4 rows returns int8_linear's fp32 path bit for bit (every row count
    up to 9, a part tile); where the ops have 8-lane vectors (that path is int8_linear's there) a head without act8
    holds its codes in tiles and runs it; bad arguments fail."""
    from nightjar.models.quant import QuantHead, fp32_head_tiles, quantize_int8, tile_int8_rows

    g = torch.Generator().manual_seed(6)
    n, k = 203, 96
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    qt = tile_int8_rows(q)
    x = torch.randn(9, k, generator=g).to(dtype)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    for m in range(10):
        y = ops.int8_linear_tiled(x[:m], qt, s)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - ref[:m]).abs() <= 1e-5 * ref.abs().max()).all()
        if cpu_fused.lanes() == 8:                         # int8_linear's fp32 path serves every dtype there
            assert torch.equal(y, ops.int8_linear(x[:m], q, s))
    assert fp32_head_tiles() == (cpu_fused.lanes() == 8)
    head = QuantHead.from_weight(q.float() * s[:, None])
    assert not head.act8 and head.tiled == fp32_head_tiles() and torch.equal(head.codes(), quantize_int8(
        q.float() * s[:, None])[0])
    with pytest.raises(RuntimeError, match="whole chunks of 32"):
        ops.int8_linear_tiled(x[:, :40].contiguous(), qt[:, :40].contiguous(), s)
    with pytest.raises(RuntimeError, match="rounded up to 4"):
        ops.int8_linear_tiled(x, q, s)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.int8_linear_tiled(x.half(), qt, s)


INT4_FUSED = pytest.mark.skipif(not quant._fused_int4_layout(), reason="the fused int4 ops do not build here, or read "
                                "blocks of another size than torch packs here")


def _int4_layer(n: int, k: int, group: int, dtype: torch.dtype):
    from nightjar.models.quant import QuantLinear

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    layer = QuantLinear.from_weight(w, "int4", group)
    layer.scales.data = layer.scales.data.to(dtype)
    return layer


@INT4_FUSED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group", [(192, 576, 32), (128, 256, 64)])
def test_int4_linear_matches_the_dequantized_weight_and_a_row_never_depends_on_the_step(ops, dtype, n, k, group):
    layer = _int4_layer(n, k, group, dtype)
    m = 13                                              # tiles of 6, 6 and 1 rows
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = ops.int4_linear(x, layer.qweight, layer.scales, group)
    assert y.dtype == dtype and y.shape == (m, n)
    sz = layer.scales.double().transpose(0, 1)                                  # [n, k/g, 2]
    w = (layer.codes().double().view(n, k // group, group) - 8) * sz[..., :1] + sz[..., 1:]
    ref = x.double() @ w.view(n, k).T                   # the weight unrounded, as the kernel forms it in fp32
    # fp32: accumulation order only; bf16: the output's one rounding (2^-9 relative) and fp32 sums of 128 + q
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert ((y.double() - ref).abs() <= rel * ref.abs() + 1e-5 * ref.abs().max()).all()
    for rows in range(1, 8):                            # every tile shape: a row gets the full step's bits
        for start in range(0, m - rows + 1, 3):
            assert torch.equal(ops.int4_linear(x[start:start + rows].contiguous(), layer.qweight, layer.scales, group),
                               y[start:start + rows])


@INT4_FUSED
@pytest.mark.parametrize("amx", [True, False])
def test_int4_linear_on_either_kernel_matches_and_keeps_rows_apart_past_one_tile(ops, amx):
    """bf16 calls run on AMX tiles where the machine has them (``use_amx``), else on the vector kernel; both match
    the dequantized weight, and a row's bits never depend on M, also past one 16-row tile (a zero-padded last
    tile) and for groups of two tile widths."""
    on = ops.use_amx(amx)
    try:
        assert on == (amx and _amx_present())
        for n, k, group in ((192, 576, 32), (128, 256, 64)):
            layer = _int4_layer(n, k, group, torch.bfloat16)
            x = torch.randn(37, k, generator=torch.Generator().manual_seed(7)).bfloat16()
            y = ops.int4_linear(x, layer.qweight, layer.scales, group)
            sz = layer.scales.double().transpose(0, 1)
            w = (layer.codes().double().view(n, k // group, group) - 8) * sz[..., :1] + sz[..., 1:]
            ref = x.double() @ w.view(n, k).T
            assert ((y.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max()).all()
            for start, rows in ((0, 1), (5, 16), (3, 17), (20, 17), (0, 33), (4, 5)):
                part = ops.int4_linear(x[start:start + rows].contiguous(), layer.qweight, layer.scales, group)
                assert torch.equal(part, y[start:start + rows])
    finally:
        ops.use_amx(cpu_fused.amx_enabled())


@INT4_FUSED
def test_int4_linear_serves_quantized_layers_and_agrees_with_torchs_kernel(ops):
    layer = _int4_layer(192, 576, 32, torch.bfloat16)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    y = layer(x)                                        # the fused op
    layer.use_fused = False
    y_torch = layer(x)                                  # aten._weight_int4pack_mm_for_cpu
    assert torch.equal(y, ops.int4_linear(x, layer.qweight, layer.scales, 32))
    assert (y.float() - y_torch.float()).abs().max() <= 2e-2 * y_torch.float().abs().max()


@INT4_FUSED
def test_a_quantized_layer_picks_its_kernel_by_rows_and_follows_a_cast(ops):
    """int4_linear serves 2-D inputs up to FUSED_INT4_MAX_ROWS rows (also past the packed kernel's 48), a 3-D
    input through the same op, longer inputs the dense GEMM (bf16 ones the op too, where torch has no bf16 GEMM);
    a cast to float16 turns the op off, back on."""
    from nightjar.models.quant import FUSED_INT4_MAX_ROWS, cast_floats

    layer = _int4_layer(128, 64, 32, torch.float32)
    g = torch.Generator().manual_seed(5)
    for m in (1, 60, FUSED_INT4_MAX_ROWS):
        x = torch.randn(m, 64, generator=g)
        assert torch.equal(layer(x), ops.int4_linear(x, layer.qweight, layer.scales, 32))
    x3 = torch.randn(2, 3, 64, generator=g)
    assert torch.equal(layer(x3), ops.int4_linear(x3.view(6, 64), layer.qweight, layer.scales, 32).view(2, 3, 128))
    long = torch.randn(FUSED_INT4_MAX_ROWS + 1, 64, generator=g)
    assert torch.equal(layer(long), layer.dense_mm(long))
    half = _int4_layer(128, 64, 32, torch.bfloat16)                     # bf16: the op for every length where torch
    expect = ops.int4_linear(long.bfloat16(), half.qweight, half.scales, 32)   # has no bf16 GEMM (AVX2)
    assert torch.equal(half(long.bfloat16()), expect if half.fused_any_rows else half.dense_mm(long.bfloat16()))
    assert layer.to(torch.float16).fused_int4 is False and layer.to(torch.float32).fused_int4 is True
    assert cast_floats(layer, torch.float16).fused_int4 is False and cast_floats(layer, torch.bfloat16).fused_int4


@INT4_FUSED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group", [(192, 576, 32), (128, 256, 64)])
def test_int4_linear_a8_multiplies_the_dequantized_weight_by_x_rounded_per_group(ops, dtype, n, k, group):
    """x rounded to int8 per group (quant.round_int8_groups) times the weight the codes stand for; a row's bits
    never depend on the call's other rows; a NaN in a group makes its row's outputs NaN."""
    from nightjar.models.quant import round_int8_groups

    layer = _int4_layer(n, k, group, dtype)
    qa8 = ops.int4_a8_pack(layer.qweight)               # the same bytes in the order the op reads
    sa8 = layer.scales.view(k // group, n // 8, 8, 2).transpose(2, 3).contiguous().view(layer.scales.shape)
    assert qa8.shape == layer.qweight.shape and torch.equal(qa8.flatten().sort().values,
                                                            layer.qweight.flatten().sort().values)
    m = 7
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    x[3, :group] = 0                                    # an all-zero group
    y = ops.int4_linear_a8(x, qa8, sa8, group)
    assert y.dtype == dtype and y.shape == (m, n)
    sz = layer.scales.double().transpose(0, 1)                                  # [n, k/g, 2]
    w = (layer.codes().double().view(n, k // group, group) - 8) * sz[..., :1] + sz[..., 1:]
    ref = round_int8_groups(x, group).double() @ w.view(n, k).T
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -8     # fp32 ordering; bf16: the output's one rounding
    assert ((y.double() - ref).abs() <= rel * ref.abs() + 1e-5 * ref.abs().max()).all()
    _check_a8_rows(lambda xs: ops.int4_linear_a8(xs, qa8, sa8, group), x, y, x.double() @ w.view(n, k).T)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.int4_linear_a8(x.half(), qa8, sa8, group)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.int4_linear_a8(x, qa8, sa8, group * 2)


@INT4_FUSED
def test_a_w4a8_layer_runs_int4_linear_a8_for_every_length_and_torch_where_the_op_cannot():
    from nightjar.models.quant import FUSED_INT4_MAX_ROWS, QuantLinear, round_int8_groups

    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(6)) * 0.05
    layer = QuantLinear.from_weight(w, "w4a8")
    assert layer.mode == "int4" and layer.act8 and "int8 activations" in repr(layer)
    int4 = QuantLinear.from_weight(w, "int4")                      # the codes are int4's, in the op's order
    assert layer.a8_layout and not torch.equal(layer.qweight, int4.qweight)
    assert torch.equal(layer.torch_packed(), int4.qweight) and torch.equal(layer.codes(), int4.codes())
    chunk = layer.scales[0, :8].flatten()                         # 8 rows: their 8 scales, then their 8 zeros
    assert torch.equal(chunk, torch.cat((int4.scales[0, :8, 0], int4.scales[0, :8, 1])))
    assert torch.equal(layer.torch_scales(), int4.scales)
    assert torch.equal(layer.dequantize(), int4.dequantize())
    assert torch.allclose(layer.weight_t(torch.float32), int4.weight_t(torch.float32), rtol=1e-6, atol=1e-7)
    g = torch.Generator().manual_seed(8)
    for m in (1, 5, FUSED_INT4_MAX_ROWS + 1):
        x = torch.randn(m, 64, generator=g)
        y = layer(x)
        assert torch.equal(y, torch.ops.nightjar_cpu.int4_linear_a8(x, layer.qweight, layer.scales, 32))
        layer.fused_int4 = False                       # a layer the op cannot serve: the same rounding in torch
        ref = layer(x)
        layer.fused_int4 = True
        assert torch.allclose(ref, round_int8_groups(x, 32) @ layer.dequantize(torch.float32).T, rtol=1e-5, atol=1e-6)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_round_int8_groups_keeps_each_input_within_half_a_step():
    from nightjar.models.quant import round_int8_groups

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)) * torch.tensor([1.0, 1e-3, 30.0])[:, None]
    x[2, 32:] = 0
    r = round_int8_groups(x, 32)
    step = x.view(3, 2, 32).abs().amax(-1, keepdim=True) / 127                 # [3, 2, 1]
    assert ((r - x).view(3, 2, 32).abs() <= step / 2 * 1.0001).all()
    assert torch.equal(r[2, 32:], x[2, 32:])                                   # zeros stay zeros
    q = (r.view(3, 2, 32) / step).nan_to_num()
    assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 127.001


def test_int4_linear_rejects_what_it_cannot_compute(ops):
    layer = _int4_layer(64, 64, 32, torch.float32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.int4_linear(x.half(), layer.qweight, layer.scales, 32)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.int4_linear(x, layer.qweight, layer.scales, 64)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.int4_linear(torch.randn(2, 32), layer.qweight, layer.scales, 32)
    assert ops.int4_linear(x[:0], layer.qweight, layer.scales, 32).shape == (0, 64)


def test_an_int8_layer_takes_int8_linear_on_amx_tiles_or_without_a_bf16_gemm(ops):
    """Where int8_linear runs on AMX tiles, a bf16 model's int8 layer uses it (in the layer's dtype, rows
    independent of the step) up to FUSED_INT8_MAX_ROWS rows; where torch has no bf16 GEMM (AVX2), for every
    row count; a mixed draft's int8 copies keep torch's kernel."""
    from nightjar.models.cpu_linear import ONEDNN, MirroredPackedLinear, cpu_format
    from nightjar.models.quant import FUSED_INT8_MAX_ROWS, QuantLinear, RowSplitLinear, mix_int8

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(8)) * 0.05
    layer = QuantLinear.from_weight(w, "int8").to(torch.bfloat16)
    assert layer.fused_any_rows == (not cpu_linear.onednn_bf16())
    assert layer.fused_int8 == (cpu_fused.uses_amx() or layer.fused_any_rows)
    assert not QuantLinear.from_weight(w, "int8").fused_int8                   # fp32 scales: torch's kernel
    x = torch.randn(FUSED_INT8_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = layer(x[:FUSED_INT8_MAX_ROWS])
    assert y.dtype == torch.bfloat16
    if layer.fused_int8:
        assert torch.equal(y, ops.int8_linear(x[:FUSED_INT8_MAX_ROWS], layer.qweight, layer.scales).bfloat16())
        assert torch.equal(layer(x[3:4]), y[3:4])
    if layer.fused_any_rows:                                            # past the limit: the op still
        assert torch.equal(layer(x), ops.int8_linear(x, layer.qweight, layer.scales).bfloat16())
    else:                                                               # dequantize + GEMM
        assert torch.equal(layer(x), layer.dense_mm(x))
    if cpu_format(torch.bfloat16, torch.device("cpu")) is ONEDNN:               # a mixed draft's layers (else panels)
        model = torch.nn.Sequential(MirroredPackedLinear(torch.nn.Parameter(w.bfloat16(), requires_grad=False)))
        assert mix_int8(model) == 1 and isinstance(model[0], RowSplitLinear) and model[0].small.use_fused is False
