"""What the server promises about context and text: /v1/models advertises the context every request gets
(max_model_len capped by the base KV pool), and an answer cut at max_tokens inside a multi-byte character
ends without U+FFFD, streamed or not."""
from __future__ import annotations

import json

import aiohttp

from nightjar.sampling import SamplingParams
from tests.api.api_support import MODEL


async def post(s, path, body):
    async with s.post(path, json=body) as r:
        return r.status, await r.json()


async def test_models_advertise_the_context_a_tight_pool_always_honours(serve):
    srv = await serve("fixed:2", num_blocks=8, max_model_len=2048)      # 8 blocks x 16 tokens
    async with aiohttp.ClientSession(srv.url) as s:
        async with s.get("/v1/models") as r:
            advertised = (await r.json())["data"][0]["max_model_len"]
        assert advertised == srv.engine.max_model_len == 128
        status, body = await post(s, "/v1/completions", {"model": MODEL, "prompt": [5] * 127, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 1                   # the rest of the advertised context
        status, body = await post(s, "/v1/completions", {"model": MODEL, "prompt": [5] * 100, "max_tokens": 28,
                                                         "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 28
        for prompt, extra in (([5] * 128, {}), ([5] * 100, {"max_tokens": 29})):
            status, body = await post(s, "/v1/completions", {"model": MODEL, "prompt": prompt, **extra})
            assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
            assert "128" in body["error"]["message"]
    assert srv.engine.allocator.num_free == srv.engine.allocator.num_total


PROMPT = "日本語の文章を書きます。"


async def test_an_answer_cut_inside_a_character_by_max_tokens_has_no_replacement_character(serve):
    srv = await serve("off")
    tok = srv.engine.tokenizer
    ids = []
    async for out in srv.engine.generate(PROMPT, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)):
        ids += out.token_ids
    cuts = [k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "the tiny model's greedy answer should split a character somewhere in 200 tokens"
    k = cuts[0]
    expected = tok.decode(ids[:k])[:-1]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": k, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(srv.url) as s:
        status, whole = await post(s, "/v1/completions", body)
        assert status == 200 and whole["choices"][0]["finish_reason"] == "length"
        assert whole["choices"][0]["text"] == expected and "\ufffd" not in expected
        async with s.post("/v1/completions", json={**body, "stream": True}) as r:
            events = [e[len("data: "):] for e in (await r.text()).split("\n\n") if e]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in chunks) == expected
