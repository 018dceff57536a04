"""Over HTTP with the official client: a seeded request gives the same text under ``off`` and under
speculation (``fixed:3``, ``nightjar``), streamed or not, alone or beside other requests."""
from __future__ import annotations

import asyncio

import openai

from tests.api.api_support import API_KEY, MODEL

MSGS = [{"role": "user", "content": "Write a short poem about the sea."}]
KW = dict(model=MODEL, messages=MSGS, max_tokens=16, temperature=0.9, top_p=0.95, seed=11,
          extra_body={"ignore_eos": True})


async def texts(srv) -> list[str]:
    async with openai.AsyncOpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0, timeout=30) as c:
        plain = (await c.chat.completions.create(**KW)).choices[0].message.content
        chunks = [x async for x in await c.chat.completions.create(stream=True, **KW)]
        streamed = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
        others = [c.chat.completions.create(**{**KW, "seed": s}) for s in range(5)]     # a batch around it
        batched, *_ = await asyncio.gather(c.chat.completions.create(**KW), *others)
        return [plain, streamed, batched.choices[0].message.content]


async def test_seeded_text_is_the_same_under_every_policy_streamed_or_not(serve):
    got = {p: await texts(await serve(p, api_key=API_KEY)) for p in ("off", "fixed:3", "nightjar")}
    ref = got["off"][0]
    assert ref and all(t == ref for ts in got.values() for t in ts), got
