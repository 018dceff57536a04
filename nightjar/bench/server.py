"""Servers under test: a fresh ``python -m nightjar serve`` subprocess, or an in-process app on a loopback port.

Both are context managers that yield themselves once ``/health`` answers 200; ``.base_url`` is the root URL.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable


class ServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError(f"the server exited before {url}/health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = str(e)
        time.sleep(0.2)
    raise ServerError(f"{url}/health did not answer 200 within {timeout_s:.0f} s ({last})")


class SubprocessServer:
    """``python -m nightjar serve --policy P --host H --port FREE [--model M] <server_args>``; SIGTERM on exit.

    The server's output goes to ``log_path`` (a temp file by default); its tail is in the error on failure."""

    def __init__(self, policy: str, server_args: list[str] | str = (), model: str | None = None,
                 host: str = "127.0.0.1", python: str = sys.executable, startup_timeout_s: float = 600.0,
                 log_path: str | Path | None = None, env: dict[str, str] | None = None):
        self.policy, self.model, self.host = policy, model, host
        self.server_args = shlex.split(server_args) if isinstance(server_args, str) else list(server_args)
        self.python, self.timeout = python, startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        cmd = [self.python, "-m", "nightjar", "serve", "--policy", self.policy, "--host", self.host,
               "--port", str(self.port)]
        if self.model:
            cmd += ["--model", self.model]
        return cmd + self.server_args

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> "SubprocessServer":
        self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"nightjar-serve-{self.policy.replace(':', '_')}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "wb")
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            wait_healthy(self.base_url, self.timeout, lambda: self.proc.poll() is None)
        except BaseException as e:
            self.stop()
            if isinstance(e, ServerError):
                raise ServerError(f"{e}\ncommand: {shlex.join(self.command)}\nlog {self.log_path}:\n"
                                  f"{self.log_tail()}") from None
            raise
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __exit__(self, *exc) -> None:
        self.stop()


class InProcessServer:
    """``create_app(engine, model_name)`` served on a loopback port by a private event loop in a daemon thread,
    so the load generator's loop (the caller's) and the server's do not share a scheduler. The app owns the
    engine (starts and stops it). ``engine`` may be an Engine or a zero-argument factory."""

    def __init__(self, engine: Any, model_name: str = "nightjar", host: str = "127.0.0.1",
                 startup_timeout_s: float = 300.0):
        self._engine = engine
        self.model_name, self.host, self.timeout = model_name, host, startup_timeout_s
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        from aiohttp import web

        from nightjar.api.app import create_app

        engine = self._engine if hasattr(self._engine, "generate") else self._engine()
        self.engine = engine
        app = create_app(engine, self.model_name, served_engine_owned=True)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # reported to __enter__
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def __enter__(self) -> "InProcessServer":
        self._thread = threading.Thread(target=self._main, name="nightjar-bench-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.timeout) or self._error is not None:
            self.stop()
            raise ServerError(f"in-process server failed to start: {self._error!r}")
        wait_healthy(self.base_url, self.timeout, self._thread.is_alive)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(60)

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_factory_from_args(server_args: list[str] | str, policy: str, model: str | None = None):
    """An Engine factory from `nightjar serve`-style engine flags (parsed as the CLI parses them)."""
    import argparse

    from nightjar import engine_args

    args = shlex.split(server_args) if isinstance(server_args, str) else list(server_args)
    p = argparse.ArgumentParser(prog="--server-args", add_help=False)
    engine_args.add_engine_args(p, serve=True)          # as the launched server parses them
    p.add_argument("--host")
    p.add_argument("--port")
    a = p.parse_args(args)
    a.policy = policy
    if model:
        a.model = model
    kw = engine_args.engine_kwargs(a)

    def make():
        from nightjar.engine import Engine
        return Engine(**kw)
    return make, kw["model"]
