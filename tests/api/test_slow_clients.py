"""Slow and broken clients: read deadlines for the request head and body, the cap on open connections,
requests refused by aiohttp's own parser (one INFO line, no traceback), and big chat bodies templated off
the event loop. Raw sockets on loopback, against the guarded site ``nightjar serve`` runs."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import aiohttp
import pytest

from nightjar.api import ServerLimits
from nightjar.api.app import STATE, _prepare_prompt_size
from tests.api.api_support import MODEL, wait_until

FAST = ServerLimits(header_timeout_s=0.3, body_timeout_s=0.3)


async def connect(srv):
    return await asyncio.open_connection("127.0.0.1", srv.port)


async def closed_within(reader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (fails if it stays open)."""
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
        except (asyncio.TimeoutError, TimeoutError):
            break
        except ConnectionError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open for {seconds} s (got {data[:200]!r})")


def server_records(caplog, level=logging.INFO):
    return [r for r in caplog.records if r.levelno >= level and r.name.startswith(("nightjar", "aiohttp"))]


async def test_a_client_trickling_its_request_head_is_dropped_with_one_info_line(serve, caplog):
    caplog.set_level(logging.INFO)
    srv = await serve("off", limits=FAST)
    reader, writer = await connect(srv)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    async def trickle():
        for b in head:                       # one byte every 50 ms: the head never completes in time
            writer.write(bytes([b]))
            await asyncio.sleep(0.05)
    task = asyncio.create_task(trickle())
    try:
        assert await closed_within(reader, 3.0) == b""
    finally:
        task.cancel()
        writer.close()
    dropped = [r for r in server_records(caplog) if "dropped client" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.INFO and "request head" in dropped[0].getMessage()
    assert not [r for r in server_records(caplog) if r.levelno >= logging.WARNING or r.exc_info]
    async with aiohttp.ClientSession(srv.url) as s, s.get("/health") as r:
        assert r.status == 200


async def test_a_client_too_slow_with_its_body_gets_a_408_and_is_dropped(serve, caplog):
    caplog.set_level(logging.INFO)
    srv = await serve("off", limits=FAST)
    reader, writer = await connect(srv)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    try:
        reply = await closed_within(reader, 3.0)
    finally:
        writer.close()
    status, _, rest = reply.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    dropped = [r for r in server_records(caplog) if "dropped client" in r.getMessage()]
    assert len(dropped) == 1 and "body" in dropped[0].getMessage() and dropped[0].levelno == logging.INFO
    assert not [r for r in server_records(caplog) if r.levelno >= logging.WARNING or r.exc_info]


async def test_connections_over_the_cap_get_a_503_and_the_server_keeps_serving(serve, caplog):
    caplog.set_level(logging.INFO)
    srv = await serve("off", limits=ServerLimits(max_connections=3))
    idle = [await connect(srv) for _ in range(3)]
    assert await wait_until(lambda: len(srv.app[STATE].guard.open) == 3)
    reader, writer = await connect(srv)
    reply = await closed_within(reader, 3.0)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
    refused = [r for r in server_records(caplog) if "refused client" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.INFO
    for _, w in idle:
        w.close()
    assert await wait_until(lambda: not srv.app[STATE].guard.open)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with aiohttp.ClientSession(srv.url) as s, s.post("/v1/completions", json=body) as r:
        assert r.status == 200


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
    b"Content-Length: 5\r\n\r\nabcde",
], ids=["1MB-header", "transfer-encoding-and-content-length", "gzip-body-that-does-not-decode"])
async def test_a_request_refused_by_the_http_parser_logs_one_line_without_traceback(serve, caplog, request_bytes):
    caplog.set_level(logging.DEBUG)
    srv = await serve("off")
    caplog.clear()
    reader, writer = await connect(srv)
    try:
        writer.write(request_bytes)
        await writer.drain()
    except ConnectionError:
        pass                                  # the server may answer and close before the 1 MB is sent
    reply = await closed_within(reader, 3.0)
    writer.close()
    assert reply.split(b" ")[1] == b"400", reply[:200]
    records = [r for r in server_records(caplog) if r.levelno >= logging.INFO]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.INFO and "rejected a malformed request" in records[0].getMessage()
    assert not any(r.exc_info for r in server_records(caplog, logging.DEBUG))
    async with aiohttp.ClientSession(srv.url) as s, s.get("/health") as r:
        assert r.status == 200


def test_the_off_loop_threshold_counts_chat_messages_not_only_their_characters():
    empty = [{"role": "user", "content": ""}] * 30_000
    assert _prepare_prompt_size(empty) > 16_384 * 10
    assert _prepare_prompt_size([{"role": "user", "content": "hi"}]) < 16_384
    assert _prepare_prompt_size(list(range(20_000))) > 16_384          # token ids count too


async def test_many_empty_messages_are_templated_off_the_loop_and_more_than_the_context_not_at_all(serve):
    srv = await serve("off")                  # the context is 1024 tokens
    engine = srv.engine
    encode, threads = engine.encode, []

    def spy(prompt):                          # the real encode, recording where chat templating runs
        if prompt and isinstance(prompt[0], dict):
            threads.append(threading.current_thread())
        return encode(prompt)
    engine.encode = spy
    health = []

    async def ping(s):
        while True:
            async with s.get("/health") as r:
                health.append(r.status)
            await asyncio.sleep(0.01)
    async with aiohttp.ClientSession(srv.url) as s:
        pinger = asyncio.create_task(ping(s))
        errors = []
        for n in (1000, 30_000):
            body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * n, "max_tokens": 2}
            async with s.post("/v1/chat/completions", json=body) as r:
                errors.append((r.status, (await r.json())["error"]))
        pinger.cancel()
        await asyncio.gather(pinger, return_exceptions=True)
    assert [(st, e["code"]) for st, e in errors] == [(400, "context_length_exceeded")] * 2
    assert "30000 messages cannot fit the context of 1024 tokens" in errors[1][1]["message"]
    assert len(threads) == 1 and threads[0] is not threading.main_thread()     # only the 1000 were templated
    assert health and set(health) == {200}


async def test_the_head_deadline_spares_a_long_request_and_an_idle_kept_alive_connection(serve, caplog):
    caplog.set_level(logging.INFO)
    srv = await serve("off", limits=FAST)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
    conn = aiohttp.TCPConnector(limit=1)               # one connection, kept alive across the requests
    async with aiohttp.ClientSession(srv.url, connector=conn) as s:
        t0 = time.monotonic()
        async with s.post("/v1/completions", json=body) as r:
            events = [e for e in (await r.text()).split("\n\n") if e]
        assert r.status == 200 and events[-1] == "data: [DONE]"
        assert time.monotonic() - t0 > FAST.header_timeout_s            # outlived the head deadline
        await asyncio.sleep(2 * FAST.header_timeout_s)                  # idle, kept alive
        async with s.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False}) as r:
            assert r.status == 200
        assert len(srv.app[STATE].guard.open) == 1
    assert not [r for r in server_records(caplog) if "dropped client" in r.getMessage()]


def test_server_limits_refuse_nonpositive_values():
    for kw in ({"header_timeout_s": 0}, {"body_timeout_s": -1}, {"keepalive_timeout_s": 0}, {"max_connections": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ServerLimits(**kw)


async def test_non_http_bytes_on_a_new_connection_get_a_400_and_no_line_above_debug(serve, caplog):
    caplog.set_level(logging.DEBUG)
    srv = await serve("off")
    caplog.clear()
    reader, writer = await connect(srv)
    writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40)      # a TLS ClientHello start
    reply = await closed_within(reader, 3.0)
    writer.close()
    assert reply.split(b" ")[1] == b"400", reply[:200]
    assert not [r for r in server_records(caplog) if r.levelno >= logging.INFO]
