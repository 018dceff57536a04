"""Helpers shared by the HTTP tests (imported by basename: pytest puts this folder on sys.path)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from nightjar.api import ServerLimits, create_app, start_guarded

MODEL = "nightjar-tiny"
API_KEY = "sk-nightjar-test"


@dataclass
class Server:
    engine: object
    app: web.Application
    runner: web.AppRunner
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


async def start_server(engine, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                       limits: ServerLimits | None = None) -> Server:
    """A real server on a free loopback port, inside the running loop, on the guarded site ``serve()`` uses
    (connection cap, read deadlines); the app owns the engine."""
    app = create_app(engine, MODEL, api_key=api_key, max_body_bytes=max_body_bytes, served_engine_owned=True,
                     limits=limits)
    runner, _ = await start_guarded(app, "127.0.0.1", 0)
    return Server(engine, app, runner, runner.addresses[0][1])


async def wait_until(cond, timeout: float = 2.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(interval)
    return cond()
