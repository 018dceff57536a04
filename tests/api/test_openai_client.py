"""The official ``openai`` client against a real server: chat and completions, streaming or not,
stop strings, seeded sampling, usage, models, and the ``nightjar`` per-request extra."""
from __future__ import annotations

import openai
import pytest

from tests.api.api_support import API_KEY, MODEL

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three birds."}]


@pytest.fixture
async def client(serve):
    srv = await serve("off", api_key=API_KEY)
    async with openai.AsyncOpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0, timeout=30) as c:
        c.server = srv
        yield c


async def stream_chat(client, **kw):
    chunks = [c async for c in await client.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **kw)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


async def test_chat_completion_returns_an_assistant_message_with_usage(client):
    r = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL and r.created > 0
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_chat_stream_sends_role_first_then_the_same_text_as_non_streaming(client):
    full = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, temperature=0,
                                                extra_body={"ignore_eos": True})
    chunks, text = await stream_chat(client, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage is None


async def test_stream_include_usage_ends_with_a_usage_only_chunk(client):
    chunks, _ = await stream_chat(client, max_tokens=6, temperature=0, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert all(c.usage is None for c in chunks[:-1])


async def test_text_completion_streaming_and_not_agree(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    r = await client.completions.create(**kw)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    stream = await client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    ids = await client.completions.create(**{**kw, "prompt": [1, 504, 3437, 7030]})
    assert ids.usage.prompt_tokens == 4 and ids.choices[0].text


async def test_stop_string_truncates_text_and_reports_stop(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = (await client.completions.create(**kw)).choices[0].text
    assert len(full) > 8
    k = len(full) // 2
    stop = full[k: k + 3]
    cut = full.find(stop)
    r = await client.completions.create(stop=[stop, "never-appears"], **kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    chunks = [c async for c in await client.completions.create(stop=stop, stream=True, **kw)]
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_same_seed_gives_the_same_sampled_text(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a = (await client.chat.completions.create(**kw)).choices[0].message.content
    b = (await client.chat.completions.create(**kw)).choices[0].message.content
    _, c = await stream_chat(client, max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    assert a == b == c
    others = {(await client.chat.completions.create(**{**kw, "seed": s})).choices[0].message.content for s in (1, 2)}
    assert others != {a}


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL


async def test_per_request_speculation_opt_out_and_unsupported_policy(client):
    for extra in ({"speculate": False}, {"policy": "off"}, {"policy": "OFF", "speculate": False}):
        r = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4,
                                                 extra_body={"nightjar": extra})
        assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4,
                                             extra_body={"nightjar": {"policy": "nightjar"}})
    assert e.value.body["param"] == "nightjar.policy" and '"off"' in e.value.body["message"]


async def test_wrong_key_and_unsupported_fields_raise_typed_errors(client):
    async with openai.AsyncOpenAI(base_url=client.server.v1, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs are not supported"):
        await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, logprobs=True)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2)
