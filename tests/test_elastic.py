"""Elastic draft memory end to end (fp32, greedy): forced and automatic offload -> grow -> shrink ->
reload -> catch-up cycles with requests in flight stay token-exact and keep the pool consistent."""
from __future__ import annotations

import asyncio

from nightjar.kernel.messages import DraftResidency, OffloadDraft, PoolResized, ReloadDraft
from nightjar.sampling import SamplingParams
from tests.test_engine import assert_pool_clean, generate_with, pool_settled, prompts_of_mixed_length, run_all


async def wait_state(eng, state, timeout=10.0):
    await wait_for(lambda: eng.weights.state == state, timeout, f"weights state {state}")


async def wait_for(predicate, timeout=10.0, what="condition"):
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def resident_again(eng, num_blocks: int, timeout: float = 5.0) -> bool:
    try:
        await wait_for(lambda: eng.weights.state == "RESIDENT" and eng.allocator.num_total == num_blocks,
                       timeout, "reload")
        return True
    except AssertionError:
        return False


def events_of(eng, types):
    seen = []
    eng.bus.add_tap(lambda env: seen.append(env.msg) if isinstance(env.msg, types) else None)
    return seen


async def wait_steps(eng, n, timeout=30.0):
    for _ in range(int(timeout / 0.005)):
        if eng.stats.steps >= n or not eng.batcher.seqs:
            return
        await asyncio.sleep(0.005)


def test_forced_offload_and_reload_cycles_keep_greedy_tokens_and_move_exact_bytes(make_engine, smol_tokenizer):
    from nightjar.kernel.messages import StepTimed

    prompts = prompts_of_mixed_length(smol_tokenizer, 10)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def cycled():
        async with make_engine("fixed:3", num_blocks=64, block_size=8, max_num_seqs=3) as eng:
            resized = events_of(eng, (PoolResized,))
            timed = events_of(eng, (StepTimed,))
            before = eng.device_bytes()
            assert before["draft_weights"] == eng.memory.draft_bytes > 0      # what the budget counted
            block = eng.memory.block_bytes
            n_draft = eng.memory.draft_footprint // block
            job = asyncio.ensure_future(run_all(eng, prompts, params, stagger=0.002))
            for _ in range(2):
                await wait_steps(eng, eng.stats.steps + 8)
                eng.bus.publish("test", [OffloadDraft(reason="test")])
                await wait_state(eng, "OFFLOADED")
                # OFFLOADED is set when the copy finishes; the pool grows when the KV actor handles GrowPool.
                await wait_for(lambda: eng.allocator.num_total == 64 + n_draft, what="pool growth")
                mid = eng.device_bytes()
                assert mid["draft_weights"] == 0 and mid["draft_kv"] == 0
                assert mid["kv_pool"] - before["kv_pool"] == n_draft * block
                assert n_draft * block <= before["draft_weights"] + before["draft_kv"] < (n_draft + 1) * block
                assert eng.allocator.num_total == 64 + n_draft
                eng.allocator.check_integrity()
                await wait_steps(eng, eng.stats.steps + 6)           # γ = 0 steps: the draft falls behind
                eng.bus.publish("test", [ReloadDraft(reason="test")])
                await wait_state(eng, "RESIDENT")
                assert eng.device_bytes() == before
                eng.allocator.check_integrity()
            out = await job
            assert [m.delta for m in resized if m.delta] == [n_draft, -n_draft] * 2
            assert eng.stats.accepted_tokens > 0
            assert sum(1 for t in timed if t.catchup_tokens > 0) >= 2    # the draft caught up after reloads
            await pool_settled(eng)
            assert_pool_clean(eng)
            return out
    assert asyncio.run(cycled()) == generate_with(make_engine, "off", prompts, params)[0]


def test_the_event_loop_keeps_serving_while_a_transfer_is_in_flight(make_engine, smol_tokenizer):
    import time

    from nightjar.transfer import weights as tw

    async def main():
        async with make_engine("fixed:2") as eng:
            real = tw.DraftTransfer._offload

            def slow(self, slot):
                time.sleep(0.3)                      # a slow copy on the transfer worker
                return real(self, slot)
            tw.DraftTransfer._offload = slow
            try:
                eng.bus.publish("test", [OffloadDraft()])
                ticks, t0 = 0, time.perf_counter()
                ids = smol_tokenizer.encode("hello")
                outs = [o async for o in eng.generate(ids, SamplingParams(max_tokens=4))]
                while eng.weights.state != "OFFLOADED":
                    await asyncio.sleep(0.01)
                    ticks += 1
                assert outs[-1].finish_reason == "length"
                assert ticks >= 5 and time.perf_counter() - t0 >= 0.25
            finally:
                tw.DraftTransfer._offload = real
    asyncio.run(main())


def test_memory_pressure_offloads_and_low_load_reloads_automatically(make_engine, smol_tokenizer):
    prompts = prompts_of_mixed_length(smol_tokenizer, 14)
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def elastic():
        async with make_engine("fixed:0", elastic_memory=True, num_blocks=40, block_size=8, max_num_seqs=4,
                               max_num_batched_tokens=64, persist_steps=2) as eng:
            states = events_of(eng, (DraftResidency,))
            out = await run_all(eng, prompts, params, stagger=0)
            # low load: a lone request lets the reload trigger; the reload itself is asynchronous (a pool
            # shrink between steps, then a transfer worker), so wait for it to land (more requests if the box
            # was too slow for the trigger to persist during the first one)
            tail = await run_all(eng, prompts[:1], SamplingParams(max_tokens=20, ignore_eos=True))
            for _ in range(5):
                if await resident_again(eng, 40):
                    break
                await run_all(eng, prompts[1:2], SamplingParams(max_tokens=20, ignore_eos=True))
            seen = [m.state for m in states]
            assert "OFFLOADED" in seen and seen[-1] == "RESIDENT", seen
            await pool_settled(eng)
            assert_pool_clean(eng)
            assert eng.allocator.num_total == 40
            return out, tail
    out, _ = asyncio.run(elastic())
    assert out == generate_with(make_engine, "off", prompts, params)[0]


def test_the_draft_comes_back_after_a_burst_with_a_tiny_pool_and_default_limits(make_engine, smol_tokenizer):
    """Default max_num_seqs / max_num_batched_tokens / block size / T_persist: the configured reload headroom
    (2·64 + 512/16 = 160 blocks) is bigger than the whole 24-block pool, yet the draft is offloaded under
    the burst and resident again once the load falls, with no further request, and the tokens are exact."""
    from nightjar.kernel.config import EngineConfig

    prompts = prompts_of_mixed_length(smol_tokenizer, 14)
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def elastic():
        async with make_engine("fixed:0", elastic_memory=True, num_blocks=24) as eng:
            d = EngineConfig()
            c = eng.config
            assert (c.max_num_seqs, c.max_num_batched_tokens, c.block_size, c.persist_steps, c.low_free_frac) == \
                (d.max_num_seqs, d.max_num_batched_tokens, d.block_size, d.persist_steps, d.low_free_frac)
            assert eng.weights.triggers.headroom_blocks == 160 > 24
            states = events_of(eng, (DraftResidency,))
            out = await run_all(eng, prompts, params, stagger=0)
            assert await resident_again(eng, 24, timeout=10.0)
            seen = [m.state for m in states]
            assert "OFFLOADED" in seen and seen[-1] == "RESIDENT", seen
            assert eng.weights.num_offloads >= 1 and eng.weights.num_reloads == eng.weights.num_offloads
            await pool_settled(eng)
            assert_pool_clean(eng)
            assert eng.device_bytes()["draft_weights"] > 0
            return out
    assert asyncio.run(elastic()) == generate_with(make_engine, "off", prompts, params)[0]


def test_a_prompt_longer_than_the_base_pool_gets_a_400_naming_the_advertised_context(make_engine, smol_tokenizer):
    """The context the engine honours is max_model_len capped by the base pool (the pool with the draft
    resident): a prompt within it always runs; one at or over it is refused with that same number, even
    while the draft is offloaded and the pool is bigger."""
    from nightjar.sampling import RequestError

    async def main():
        async with make_engine("fixed:2", num_blocks=8, block_size=16, max_model_len=2048) as eng:
            assert eng.max_model_len == 128
            ok = [o async for o in eng.generate(list(range(5, 5 + 120)), SamplingParams(max_tokens=7, ignore_eos=True))]
            assert ok[-1].finish_reason == "length" and ok[-1].num_output_tokens == 7
            eng.bus.publish("test", [OffloadDraft(reason="test")])
            await wait_for(lambda: eng.allocator.num_total > 8, what="pool growth")
            for n in (128, 1000):
                try:
                    async for _ in eng.generate(list(range(5, 5 + n)), SamplingParams(max_tokens=1)):
                        pass
                    raise AssertionError("a prompt over the context was admitted")
                except RequestError as e:
                    assert e.status == 400 and "the context is 128" in str(e), str(e)
            await pool_settled(eng)
            assert_pool_clean(eng)
    asyncio.run(main())


def test_the_draft_comes_back_while_a_light_load_still_runs_with_default_limits(make_engine, smol_tokenizer):
    """Not only when idle: one long request outlives the burst, and the reload trigger (free blocks over
    draft + τ_low + the pool-capped headroom for T_persist steps) brings the draft back while it runs."""
    from nightjar.kernel.messages import DraftReloaded

    prompts = prompts_of_mixed_length(smol_tokenizer, 14)
    burst = SamplingParams(max_tokens=30, ignore_eos=True)

    async def main():
        async with make_engine("fixed:0", elastic_memory=True, num_blocks=24) as eng:
            live_at_reload = []
            eng.bus.add_tap(lambda env: live_at_reload.append(len(eng.weights.live))
                            if isinstance(env.msg, DraftReloaded) else None)
            long = asyncio.ensure_future(run_all(eng, [prompts[1]], SamplingParams(max_tokens=150, ignore_eos=True)))
            await asyncio.sleep(0.01)
            await run_all(eng, prompts, burst, stagger=0)
            (toks,) = await long
            assert len(toks) == 150
            assert eng.weights.num_offloads >= 1
            assert live_at_reload and live_at_reload[0] >= 1, live_at_reload     # reloaded under load
            await pool_settled(eng)
            assert_pool_clean(eng)
    asyncio.run(main())


def test_a_failed_copy_leaves_the_draft_where_it_was_and_the_engine_serving(make_engine, smol_tokenizer, tiny_pair):
    from nightjar.kernel.messages import TransferFinished
    from nightjar.transfer import weights as tw
    from tests.offline.test_replay import private_pair

    def broken(self, *args):
        raise MemoryError("injected copy failure")

    async def main():
        async with make_engine("fixed:2", pair=private_pair(tiny_pair), num_blocks=64, block_size=8) as eng:
            failures = events_of(eng, (TransferFinished,))
            ids = smol_tokenizer.encode("hello")
            real_off, real_back = tw.DraftTransfer._offload, tw.DraftTransfer._reload
            tw.DraftTransfer._offload = broken
            try:
                eng.bus.publish("test", [OffloadDraft(reason="test")])
                await wait_for(lambda: any(f.error for f in failures), what="the failed offload")
                await wait_state(eng, "RESIDENT")                   # nothing was released: still resident
            finally:
                tw.DraftTransfer._offload = real_off
            eng.bus.publish("test", [OffloadDraft(reason="test")])
            await wait_state(eng, "OFFLOADED")
            await wait_for(lambda: eng.allocator.num_total > 64, what="pool growth")
            grown = eng.allocator.num_total
            tw.DraftTransfer._reload = broken
            try:
                eng.bus.publish("test", [ReloadDraft(reason="test")])
                await wait_for(lambda: sum(1 for f in failures if f.error) == 2, what="the failed reload")
                await wait_state(eng, "OFFLOADED")                  # the host copy is intact
                await wait_for(lambda: eng.allocator.num_total == grown, what="the pool growing back")
            finally:
                tw.DraftTransfer._reload = real_back
            eng.bus.publish("test", [ReloadDraft(reason="test")])
            await wait_state(eng, "RESIDENT")
            outs = [o async for o in eng.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))]
            assert outs[-1].num_output_tokens == 12 and eng.healthy and eng.stats.accepted_tokens > 0
            await pool_settled(eng)
            assert_pool_clean(eng)
    asyncio.run(main())


def test_torch_work_runs_on_the_compute_thread_or_on_threads_that_have_exited(make_engine, smol_tokenizer,
                                                                              monkeypatch):
    """kernel/threads.py: a live second thread that once ran torch's parallel CPU work makes every forward
    ~2x slower, so the build, the forwards, the pool's grow/shrink and the weight copies of an offload
    cycle never run on the event loop's thread, and only the compute thread is still alive afterwards."""
    import threading

    from nightjar.engine import Engine
    from nightjar.kvpool.cache import KVCache
    from nightjar.transfer import weights as tw

    ran: dict[str, set] = {}

    def spy(owner, name):
        real = getattr(owner, name)

        def wrapped(*a, **kw):
            ran.setdefault(name, set()).add(threading.current_thread())
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, wrapped)

    for owner, name in [(Engine, "_build"), (KVCache, "add_segment"), (KVCache, "migrate"),
                        (tw.DraftTransfer, "_offload"), (tw.DraftTransfer, "_reload")]:
        spy(owner, name)
    prompts = prompts_of_mixed_length(smol_tokenizer, 4)

    async def cycle():
        async with make_engine("fixed:2", num_blocks=64, block_size=8) as eng:
            spy(eng.target.model, "forward")
            loop_thread = threading.current_thread()
            job = asyncio.ensure_future(run_all(eng, prompts, SamplingParams(max_tokens=24, ignore_eos=True)))
            await wait_steps(eng, 4)
            eng.bus.publish("test", [OffloadDraft(reason="test")])
            await wait_for(lambda: eng.allocator.num_total > 64, what="pool growth")
            eng.bus.publish("test", [ReloadDraft(reason="test")])
            await wait_state(eng, "RESIDENT")
            await job
            compute = next(iter(ran["forward"]))
            return loop_thread, compute
    loop_thread, compute = asyncio.run(cycle())
    assert set(ran) == {"_build", "add_segment", "migrate", "_offload", "_reload", "forward"}
    assert ran["_build"] == ran["forward"] == {compute} and compute is not loop_thread
    others = set().union(*ran.values()) - {compute}
    assert loop_thread not in others and not any(t.is_alive() for t in others)
