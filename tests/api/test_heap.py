"""The server gives malloc's free memory back to the OS once the engine is idle after some work."""
from __future__ import annotations

import asyncio

from nightjar.api.heap import malloc_trim, rss_mib, trim_when_idle
from nightjar.sampling import SamplingParams


def test_glibc_malloc_trim_and_rss_are_available_here():
    assert malloc_trim() is not None and rss_mib() > 0


async def test_the_heap_is_trimmed_once_per_stretch_of_work_and_never_while_requests_run(make_engine):
    real, calls = malloc_trim(), []

    def counting_trim(pad):                  # the real malloc_trim, counted, with what was running
        calls.append(engine.batcher.num_running + engine.batcher.num_waiting)
        return real(pad)
    async with make_engine("off") as engine:
        task = asyncio.create_task(trim_when_idle(engine, period_s=0.02, trim=counting_trim))
        try:
            await asyncio.sleep(0.1)
            assert calls == []                                    # no work yet
            outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))]
            assert outs[-1].num_output_tokens == 200
            await asyncio.sleep(0.1)
            assert calls == [0]                                   # once, when idle
            await asyncio.sleep(0.1)
            assert calls == [0]                                   # not again without new work
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
