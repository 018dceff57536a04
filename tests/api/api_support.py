"""Helpers shared by the HTTP tests (imported by basename: pytest puts this folder on sys.path)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from nightjar.api import create_app

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


async def start_server(engine, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> Server:
    """A real server on a free loopback port, inside the running loop; the app owns the engine."""
    app = create_app(engine, MODEL, api_key=api_key, max_body_bytes=max_body_bytes, served_engine_owned=True)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return Server(engine, app, runner, runner.addresses[0][1])


async def wait_until(cond, timeout: float = 2.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(interval)
    return cond()
