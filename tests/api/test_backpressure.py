"""Disconnects abort and free KV; a burst over the queue bound gets 429s; limits map to HTTP codes."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from nightjar.kernel.messages import AbortRequest, FinishReason
from tests.api.api_support import MODEL, wait_until

CHAT = "/v1/chat/completions"


def long_chat(stream: bool, max_tokens: int = 900):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "temperature": 0}


def pool_is_idle(engine) -> bool:
    return engine.allocator.num_free == engine.allocator.num_total and engine.batcher.num_running == 0


async def test_a_client_that_disconnects_mid_stream_frees_its_blocks(serve):
    srv = await serve("off")
    engine = srv.engine
    aborts = []
    engine.bus.add_tap(lambda env: aborts.append(env.msg) if isinstance(env.msg, AbortRequest) else None)
    async with aiohttp.ClientSession(srv.url) as s:
        resp = await s.post(CHAT, json=long_chat(stream=True))
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        lines = []
        while len(lines) < 3:
            line = (await resp.content.readline()).strip()
            if line.startswith(b"data: "):
                lines.append(line)
        assert engine.allocator.num_free < engine.allocator.num_total      # the request holds blocks
        resp.close()                                                         # drop the connection
        assert await wait_until(lambda: pool_is_idle(engine), timeout=2.0)
    assert engine.stats.tokens_emitted < 900                                # it was aborted, not finished
    assert [a.reason for a in aborts] == [FinishReason.ABORT]
    assert engine.healthy


async def test_a_client_that_gives_up_on_a_non_streaming_request_frees_its_blocks(serve):
    srv = await serve("off")
    engine = srv.engine
    async with aiohttp.ClientSession(srv.url) as s:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(s.post(CHAT, json=long_chat(stream=False)), timeout=0.3)
        assert await wait_until(lambda: pool_is_idle(engine), timeout=2.0)
        async with s.post(CHAT, json=long_chat(stream=False, max_tokens=3)) as resp:   # and it still serves
            assert resp.status == 200
    assert engine.stats.tokens_emitted < 900


async def test_a_burst_over_the_queue_bound_gets_429_and_the_admitted_requests_complete(serve):
    srv = await serve("off", max_queue=4)
    body = {"model": MODEL, "prompt": "Count with me:", "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    async def one(s):
        async with s.post("/v1/completions", json=body) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()

    async with aiohttp.ClientSession(srv.url, connector=aiohttp.TCPConnector(limit=0)) as s:
        results = await asyncio.gather(*(one(s) for _ in range(16)))
        ok = [b for st, _, b in results if st == 200]
        busy = [(ra, b) for st, ra, b in results if st == 429]
        assert len(ok) + len(busy) == 16, [st for st, _, _ in results]
        assert busy and len(ok) >= 4
        for retry_after, b in busy:
            assert int(retry_after) >= 1
            assert b["error"]["type"] == "rate_limit_error" and b["error"]["code"] == "rate_limit_exceeded"
        for b in ok:
            assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 24
        assert await wait_until(lambda: pool_is_idle(srv.engine))
        async with s.post("/v1/completions", json=body) as r:                  # the bound was released
            assert r.status == 200
        async with s.get("/metrics") as r:
            assert 'nightjar:requests_rejected_total{status="429"} %d.0' % len(busy) in await r.text()


async def test_a_prompt_longer_than_the_context_is_a_400(serve):
    srv = await serve("off", max_model_len=64)
    async with aiohttp.ClientSession(srv.url) as s:
        for body in ({"model": MODEL, "prompt": "word " * 200, "max_tokens": 2},
                     {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]}):
            path = "/v1/completions" if "prompt" in body else CHAT
            async with s.post(path, json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and "context" in err["message"], err
                assert err["code"] == "context_length_exceeded" and err["param"] == ("prompt" if "prompt" in body
                                                                                    else "messages")
        async with s.get("/health") as r:
            assert r.status == 200


async def test_health_is_503_once_the_engine_stops(serve):
    srv = await serve("off")
    async with aiohttp.ClientSession(srv.url) as s:
        async with s.get("/health") as r:
            assert r.status == 200
        await srv.engine.stop()
        async with s.get("/health") as r:
            assert r.status == 503 and (await r.json())["error"]["type"] == "service_unavailable"
        async with s.post(CHAT, json=long_chat(stream=False, max_tokens=2)) as r:
            assert r.status == 503 and "error" in await r.json()
