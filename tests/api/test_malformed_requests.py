"""Malformed requests each get a 4xx OpenAI-shaped error, and the server stays healthy."""
from __future__ import annotations

import json

import aiohttp
import pytest
import pytest_asyncio

from nightjar.engine import Engine
from tests.api.api_support import API_KEY, MODEL, start_server

module_loop = pytest.mark.asyncio(loop_scope="module")

LIMIT = 64 * 1024
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}


def comp(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}


def drop(d, key):
    return {k: v for k, v in d.items() if k != key}


# (id, path, body (dict -> JSON, bytes/str -> raw), extra headers, expected status, expected param or None)
CASES = [
    # body and JSON
    ("bad-json", CHAT, b'{"messages": [', {}, 400, None),
    ("json-array", CHAT, b"[]", {}, 400, None),
    ("json-string", CHAT, b'"hello"', {}, 400, None),
    ("json-null", CHAT, b"null", {}, 400, None),
    ("empty-body", CHAT, b"", {}, 400, None),
    ("whitespace-body", CHAT, b"   \n", {}, 400, None),
    ("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {}, 400, None),
    ("nan-literal", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', {}, 400, None),
    ("trailing-garbage", CHAT, json.dumps(chat()).encode() + b"}", {}, 400, None),
    ("deep-nesting", COMP, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, None),
    # messages
    ("missing-messages", CHAT, drop(chat(), "messages"), {}, 400, None),
    ("empty-messages", CHAT, chat(messages=[]), {}, 400, "messages"),
    ("messages-string", CHAT, chat(messages="hi"), {}, 400, "messages"),
    ("message-no-role", CHAT, chat(messages=[{"content": "hi"}]), {}, 400, None),
    ("message-bad-role", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), {}, 400, "messages[0].role"),
    ("message-int-content", CHAT, chat(messages=[{"role": "user", "content": 5}]), {}, 400, "messages[0].content"),
    ("message-unknown-field", CHAT, chat(messages=[{"role": "user", "content": "hi", "mood": "x"}]), {}, 400,
     "messages[0].mood"),
    ("message-null-user-content", CHAT, chat(messages=[{"role": "user", "content": None}]), {}, 400,
     "messages[0].content"),
    ("image-part", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     {}, 400, "messages[0].content[0]"),
    ("text-part-without-text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), {}, 400,
     "messages[0].content[0]"),
    ("tool-message", CHAT, chat(messages=[{"role": "tool", "content": "42", "tool_call_id": "c1"}]), {}, 400,
     "messages[0].role"),
    ("prompt-on-chat", CHAT, chat(prompt="hi"), {}, 400, "prompt"),
    # token budgets
    ("max-tokens-negative", CHAT, chat(max_tokens=-1), {}, 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), {}, 400, "max_tokens"),
    ("max-tokens-string", CHAT, chat(max_tokens="10"), {}, 400, "max_tokens"),
    ("max-tokens-float", CHAT, chat(max_tokens=1.5), {}, 400, "max_tokens"),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), {}, 400, "max_tokens"),
    ("max-tokens-over-context", CHAT, chat(max_tokens=10**6), {}, 400, "max_tokens"),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**30), {}, 400, "max_tokens"),
    ("max-completion-tokens-negative", CHAT, chat(max_completion_tokens=-5), {}, 400, "max_completion_tokens"),
    ("min-tokens-negative", CHAT, chat(min_tokens=-1), {}, 400, "min_tokens"),
    ("min-tokens-over-max", CHAT, chat(min_tokens=10), {}, 400, "min_tokens"),
    # sampling
    ("temperature-negative", CHAT, chat(temperature=-0.1), {}, 400, "temperature"),
    ("temperature-too-high", CHAT, chat(temperature=3), {}, 400, "temperature"),
    ("temperature-string", CHAT, chat(temperature="hot"), {}, 400, "temperature"),
    ("top-p-zero", CHAT, chat(top_p=0), {}, 400, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), {}, 400, "top_p"),
    ("top-k-below-minus-one", CHAT, chat(top_k=-2), {}, 400, "top_k"),
    ("seed-negative", CHAT, chat(seed=-1), {}, 400, "seed"),
    ("seed-too-big", CHAT, chat(seed=2**64), {}, 400, "seed"),
    ("seed-string", CHAT, chat(seed="abc"), {}, 400, "seed"),
    ("stop-five-strings", CHAT, chat(stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
    ("stop-int", CHAT, chat(stop=5), {}, 400, "stop"),
    ("stop-list-with-int", CHAT, chat(stop=["a", 1]), {}, 400, "stop[1]"),
    ("stop-token-ids-negative", CHAT, chat(stop_token_ids=[-1]), {}, 400, "stop_token_ids[0]"),
    ("stop-token-ids-out-of-vocab", CHAT, chat(stop_token_ids=[10**9]), {}, 400, None),
    ("ignore-eos-string", CHAT, chat(ignore_eos="yes"), {}, 400, "ignore_eos"),
    # streaming
    ("stream-string", CHAT, chat(stream="yes"), {}, 400, "stream"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), {}, 400, "stream_options"),
    ("stream-options-unknown", CHAT, chat(stream=True, stream_options={"include_usage": True, "x": 1}), {}, 400,
     "stream_options.x"),
    # unsupported OpenAI features
    ("n-two", CHAT, chat(n=2), {}, 400, "n"),
    ("n-zero", CHAT, chat(n=0), {}, 400, "n"),
    ("logprobs", CHAT, chat(logprobs=True), {}, 400, "logprobs"),
    ("top-logprobs", CHAT, chat(top_logprobs=3), {}, 400, "top_logprobs"),
    ("presence-penalty", CHAT, chat(presence_penalty=0.5), {}, 400, "presence_penalty"),
    ("frequency-penalty", CHAT, chat(frequency_penalty=1), {}, 400, "frequency_penalty"),
    ("logit-bias", CHAT, chat(logit_bias={"5": 10}), {}, 400, "logit_bias"),
    ("response-format-json", CHAT, chat(response_format={"type": "json_object"}), {}, 400, "response_format"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400, "tools"),
    ("tool-choice", CHAT, chat(tool_choice="auto"), {}, 400, "tool_choice"),
    ("unknown-top-level-field", CHAT, chat(temprature=0.5), {}, 400, "temprature"),
    ("user-not-string", CHAT, chat(user=5), {}, 400, "user"),
    # the nightjar extra
    ("nightjar-policy-ucb", CHAT, chat(nightjar={"policy": "ucb"}), {}, 400, "nightjar.policy"),
    ("nightjar-unknown-field", CHAT, chat(nightjar={"gamma": 3}), {}, 400, "nightjar.gamma"),
    ("nightjar-speculate-string", CHAT, chat(nightjar={"speculate": "no"}), {}, 400, "nightjar.speculate"),
    ("nightjar-contradiction", CHAT, chat(nightjar={"policy": "off", "speculate": True}), {}, 400,
     "nightjar.speculate"),
    ("nightjar-not-object", CHAT, chat(nightjar="off"), {}, 400, "nightjar"),
    # model, routing, content type, auth
    ("unknown-model", CHAT, chat(model="gpt-4"), {}, 404, "model"),
    ("text-plain", CHAT, json.dumps(chat()).encode(), {"Content-Type": "text/plain"}, 415, None),
    ("form-urlencoded", CHAT, b"messages=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    ("missing-auth", CHAT, chat(), {"Authorization": ""}, 401, None),
    ("wrong-key", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("basic-auth", CHAT, chat(), {"Authorization": f"Basic {API_KEY}"}, 401, None),
    ("models-without-auth", "GET /v1/models", None, {"Authorization": ""}, 401, None),
    ("unknown-route", "/v1/engines", chat(), {}, 404, None),
    ("get-on-post-route", f"GET {CHAT}", None, {}, 405, None),
    ("oversized-body", CHAT, chat(messages=[{"role": "user", "content": "x" * (LIMIT + 10)}]), {}, 413, None),
    # completions
    ("completion-missing-prompt", COMP, drop(comp(), "prompt"), {}, 400, None),
    ("completion-prompt-int", COMP, comp(prompt=5), {}, 400, "prompt"),
    ("completion-prompt-empty", COMP, comp(prompt=""), {}, 400, "prompt"),
    ("completion-prompt-empty-list", COMP, comp(prompt=[]), {}, 400, "prompt"),
    ("completion-two-prompts", COMP, comp(prompt=["a", "b"]), {}, 400, "prompt"),
    ("completion-mixed-list", COMP, comp(prompt=["a", 1]), {}, 400, "prompt"),
    ("completion-negative-token-id", COMP, comp(prompt=[1, -5]), {}, 400, "prompt"),
    ("completion-token-id-out-of-vocab", COMP, comp(prompt=[1, 10**7]), {}, 400, None),
    ("completion-prompt-longer-than-context", COMP, comp(prompt=list(range(1, 300))), {}, 400, None),
    ("completion-echo", COMP, comp(echo=True), {}, 400, "echo"),
    ("completion-best-of", COMP, comp(best_of=2), {}, 400, "best_of"),
    ("completion-logprobs", COMP, comp(logprobs=1), {}, 400, "logprobs"),
    ("completion-suffix", COMP, comp(suffix="end"), {}, 400, "suffix"),
    ("completion-messages", COMP, comp(messages=MSG), {}, 400, "messages"),
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tiny_pair):
    engine = Engine(policy="off", loaded=tiny_pair, dtype="float32", num_blocks=64, max_model_len=256)
    srv = await start_server(engine, api_key=API_KEY, max_body_bytes=LIMIT)
    async with aiohttp.ClientSession(srv.url) as session:
        srv.session = session
        yield srv
    await srv.runner.cleanup()


def test_the_table_has_at_least_fifty_distinct_cases():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


@module_loop
@pytest.mark.parametrize("name,target,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
async def test_malformed_request_gets_an_openai_shaped_4xx(server, name, target, body, headers, status, param):
    method, _, path = target.rpartition(" ")
    hdrs = {**AUTH, **headers}
    hdrs = {k: v for k, v in hdrs.items() if v}
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs.setdefault("Content-Type", "application/json")
    async with server.session.request(method or "POST", path, data=data, headers=hdrs) as resp:
        payload = await resp.json(content_type=None)
        assert resp.status == status, payload
        assert resp.content_type == "application/json"
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert resp.headers.get("WWW-Authenticate") == "Bearer"
    async with server.session.get("/health") as h:
        assert h.status == 200


@module_loop
async def test_a_chunked_body_over_the_limit_gets_413(server):
    async def gen():
        for _ in range(LIMIT // 1024 + 8):
            yield b" " * 1024
    async with server.session.post(CHAT, data=gen(), headers={**AUTH, "Content-Type": "application/json"}) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


@module_loop
async def test_the_server_still_serves_after_all_the_bad_requests(server):
    async with server.session.post(CHAT, json=chat(max_tokens=3), headers=AUTH) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert server.engine.healthy
    assert server.engine.allocator.num_free == server.engine.allocator.num_total
