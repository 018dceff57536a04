"""Fixtures for the HTTP tests: a real aiohttp server on a loopback port, serving an engine built on
the tiny random model (SmolLM2 tokenizer and chat template)."""
from __future__ import annotations

import pytest

from tests.api.api_support import Server, start_server


@pytest.fixture
async def serve(make_engine):
    """``await serve(policy, api_key=..., max_body_bytes=..., limits=ServerLimits(...), **engine_kwargs)``
    -> Server."""
    servers: list[Server] = []

    async def start(policy: str = "off", *, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                    limits=None, **kw):
        kw.setdefault("num_blocks", 256)
        kw.setdefault("max_model_len", 1024)
        srv = await start_server(make_engine(policy, **kw), api_key=api_key, max_body_bytes=max_body_bytes,
                                 limits=limits)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        await srv.runner.cleanup()
