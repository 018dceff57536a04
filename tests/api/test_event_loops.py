"""The server on uvloop, with aiohttp's default runner (no handler cancellation): streaming works and
a mid-stream disconnect is still noticed at the next write, which aborts the request."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from nightjar.api import create_app
from tests.api.api_support import MODEL, wait_until

uvloop = pytest.importorskip("uvloop")


def test_streaming_and_disconnect_on_uvloop_without_handler_cancellation(make_engine):
    engine = make_engine("fixed:2", num_blocks=128)

    async def main():
        assert "uvloop" in type(asyncio.get_running_loop()).__module__
        runner = web.AppRunner(create_app(engine, MODEL, served_engine_owned=True))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "stream": True, "ignore_eos": True}
        try:
            async with aiohttp.ClientSession(url) as s:
                async with s.post("/v1/completions", json=body) as r:
                    events = [ln for ln in (await r.text()).split("\n\n") if ln]
                assert events[-1] == "data: [DONE]" and len(events) >= 2
                r = await s.post("/v1/completions", json={**body, "max_tokens": 900})
                await r.content.readline()
                r.close()
                assert await wait_until(lambda: engine.allocator.num_free == engine.allocator.num_total)
                assert engine.stats.tokens_emitted < 900
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
